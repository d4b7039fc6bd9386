"""`qattn plan prefill` (qattn.check.prefill_plan): the candidates of each input type, the error estimate's
heads and rows, the measured tables' lookup (by GPU), the choice, and the command. CPU only (the emulators)."""
from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from qattn.check import prefill_plan as plan
from qattn.cli import main


@pytest.fixture(autouse=True)
def no_local_gpu(monkeypatch):
    """The commands' table is the H200's unless a test names a GPU, whatever this machine has."""
    monkeypatch.setattr("qattn.engine.tuned.current_device", lambda: None)


def test_candidates_by_input_type():
    names = [c.name for c in plan.candidates("float16")]
    assert names == ["f16", "i8-f16", "i8-i8", "i8-f8", "i8-f16 +balance", "i8-i8 +balance", "i8-f8 +balance"]
    assert plan.candidates("bfloat16")[0].name == "bf16"
    assert plan.call_of("i8-f8 +balance") == 'format="i8-f8", smoothing="mean+balance"'
    assert plan.call_of("bf16") == 'format="bf16"'
    with pytest.raises(ValueError, match="^dtype: expected one of float16, bfloat16, got 'float32'"):
        plan.candidates("float32")


@pytest.mark.parametrize("heads, kv_heads, want", [(32, 8, (8, 2)), (32, 32, (8, 8)), (4, 4, (4, 4)),
                                                   (64, 2, (32, 1)), (8, 1, (8, 1))])
def test_error_heads_are_whole_groups(heads, kv_heads, want):
    assert plan.error_heads(heads, kv_heads) == want


def test_error_heads_refuse_a_broken_group():
    with pytest.raises(ValueError, match="^heads: 6 is not a positive multiple of kv_heads 4"):
        plan.error_heads(6, 4)


def test_errors_rank_the_formats_on_normal_data():
    errors = plan.format_errors(preset="normal", seq=600, heads=4, kv_heads=2, head_dim=64, causal=True, seed=3)
    assert list(errors) == [c.name for c in plan.candidates("float16")]
    assert errors["f16"] < 1e-3  # P rounded to fp16 alone
    assert 3e-3 < errors["i8-f16"] < errors["i8-f8"] < 0.06  # int8 QK; then fp8 PV on top
    assert all(np.isfinite(list(errors.values())))


def test_errors_on_captured_tensors(tmp_path):
    """An npz's own head layout is used (its first whole groups), its last keys and rows."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 6, 700, 64), dtype=np.float32)
    k, v = (rng.standard_normal((2, 3, 700, 64), dtype=np.float32) for _ in range(2))
    path = tmp_path / "qkv.npz"
    np.savez(path, q=q, k=k, v=v)
    qs, ks, vs = plan._tensors(path, "normal", 700, 32, 8, 64, 0)
    assert qs.shape == (1, 6, 256, 64) and ks.shape == vs.shape == (1, 3, 700, 64)
    np.testing.assert_array_equal(qs[0], q[0, :, -256:])
    errors = plan.format_errors(dtype="bfloat16", npz=path, seq=700, head_dim=64)
    assert errors["bf16"] < 2e-2 and "f16" not in errors
    np.savez(path, q=q, k=k[:, :, :500], v=v[:, :, :500])
    with pytest.raises(ValueError, match=r"^npz: expected q \[B, Hq, L, D\], k and v \[B, Hkv, L, D\]"):
        plan.format_errors(npz=path, head_dim=64)


def test_table_takes_the_nearest_measured_length():
    names = [c.name for c in plan.candidates("float16")]
    table = plan.VS_CUDNN["H200"]
    at_3000 = plan.table_times(names, head_dim=128, causal=False, seq=3000)  # nearer 4096 than 2048 in log2
    assert at_3000["i8-f8"] == pytest.approx(1 / table[128, False][4096]["i8-f8"])
    assert at_3000["f16"] == pytest.approx(1 / table[128, False][4096]["f16"])
    assert at_3000["i8-f8 +balance"] == at_3000["i8-f8"] and at_3000["i8-i8"] == pytest.approx(1 / 0.50)
    assert "i8-i8" not in plan.table_times(names, head_dim=128, causal=False, seq=1024)
    assert plan.table_times(names, head_dim=128, causal=True, seq=100_000)["i8-f8"] == \
        pytest.approx(1 / table[128, True][32768]["i8-f8"])
    assert plan.table_times(names, head_dim=128, causal=False, seq=1)["f16"] == \
        pytest.approx(1 / table[128, False][1024]["f16"])
    assert table[128, False][2048] != table[128, False][4096]  # the lookups above tell the rows apart
    assert plan.table_times(names, head_dim=96, causal=False, seq=4096) == {}
    assert "bf16" in plan.table_times(["bf16"], head_dim=64, causal=True, seq=8192)
    h100 = plan.table_times(names, head_dim=128, causal=True, seq=8192, gpu="H100")
    assert h100["i8-f8"] == pytest.approx(1 / plan.VS_CUDNN["H100"][128, True][8192]["i8-f8"])
    assert h100["i8-f8"] != plan.table_times(names, head_dim=128, causal=True, seq=8192)["i8-f8"]
    with pytest.raises(ValueError, match="^gpu: expected one of H200, H100, got 'A100'"):
        plan.table_times(names, head_dim=128, causal=False, seq=4096, gpu="A100")


@pytest.mark.parametrize("name,want", [("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H200", "H200"),
                                       ("NVIDIA H100 NVL", "H100"), ("NVIDIA A100-SXM4-80GB", "H200"), (None, "H200")])
def test_table_of_a_gpu_by_its_name(name, want):
    from qattn.cli_plan import table_gpu

    assert table_gpu(name) == want


def test_both_plans_have_a_table_of_each_gpu_the_option_names():
    from qattn.cli_plan import TABLE_GPUS
    from qattn.formats.decode import plan as decode_plan

    assert set(plan.VS_CUDNN) == set(decode_plan.RELATIVE_TIME) == set(TABLE_GPUS)


def test_every_table_times_each_16_bit_format_where_it_times_any():
    """A length a table lists must time both 16-bit formats, or the planner would weigh the int8-QK
    formats against no 16-bit time for one input type."""
    for gpu, table in plan.VS_CUDNN.items():
        for key, by_seq in table.items():
            for seq, ratios in by_seq.items():
                assert {"f16", "bf16"} <= set(ratios), (gpu, key, seq)
                assert all(0.3 < r < 2.0 for r in ratios.values()), (gpu, key, seq)


def test_choice():
    errors = {"f16": 3e-4, "i8-f16": 1.3e-2, "i8-f8": 3.9e-2, "i8-f8 +balance": 3.0e-2}
    times = {"f16": 0.94, "i8-f16": 0.85, "i8-f8": 0.70, "i8-f8 +balance": 0.72}
    assert plan.choose(errors, times, 5e-2) == ("i8-f8", "fastest within the gate")
    assert plan.choose(errors, times, 3.5e-2) == ("i8-f8 +balance", "fastest within the gate")
    assert plan.choose(errors, times, 2e-2) == ("i8-f16", "fastest within the gate")
    assert plan.choose(errors, {"i8-f8": 0.7}, 1e-2, "bfloat16") == \
        ("bf16", "no timed format within the gate: the 16-bit format")
    assert plan.choose(errors, {}, 1.0) == ("f16", "no speed data for this point: the 16-bit format")


def test_plan_prefill_command():
    result = CliRunner().invoke(main, ["plan", "prefill", "--seq", "32768", "--heads", "8", "--kv-heads", "2",
                                       "--head-dim", "64", "--causal", "--no-measure"])
    assert result.exit_code == 0, result.output
    assert "x cuDNN's" in result.output and "H200" in result.output
    chosen = [line for line in result.output.splitlines() if line.startswith("chosen: ")]
    assert len(chosen) == 1 and "qattn.attention(q, k, v, format=" in chosen[0] and chosen[0].endswith("causal=True)")
    tight = CliRunner().invoke(main, ["plan", "prefill", "--seq", "1024", "--head-dim", "64", "--max-rel-l2", "1e-3",
                                      "--no-measure"])
    assert tight.exit_code == 0 and 'chosen: f16 (fastest within the gate; gate rel_l2 <= 0.001): ' \
        'qattn.attention(q, k, v, format="f16")' in tight.output
    refused = CliRunner().invoke(main, ["plan", "prefill", "--heads", "6", "--kv-heads", "4", "--no-measure"])
    assert refused.exit_code == 2 and "--heads" in refused.output


def test_plan_prefill_table_of_the_local_or_named_gpu(monkeypatch):
    from qattn.engine.tuned import Device

    args = ["plan", "prefill", "--seq", "8192", "--heads", "8", "--kv-heads", "2", "--causal", "--no-measure"]
    monkeypatch.setattr("qattn.engine.tuned.current_device", lambda: Device("NVIDIA H100 80GB HBM3", "580"))
    local = CliRunner().invoke(main, args)
    assert local.exit_code == 0 and "as measured on the H100" in " ".join(local.output.split()), local.output
    named = CliRunner().invoke(main, args + ["--gpu", "h200"])
    assert named.exit_code == 0 and "as measured on the H200" in " ".join(named.output.split()), named.output
    monkeypatch.setattr("qattn.engine.tuned.current_device", lambda: None)
    implied = CliRunner().invoke(main, args[:-1] + ["--gpu", "H100"])  # --gpu without --no-measure
    assert implied.exit_code == 0 and "as measured on the H100" in " ".join(implied.output.split()), implied.output
    both = CliRunner().invoke(main, args[:-1] + ["--gpu", "H100", "--measure"])
    assert both.exit_code == 2 and "--gpu picks a measured table" in both.output


def test_plan_prefill_measure_needs_a_gpu(monkeypatch):
    monkeypatch.setattr("qattn.cli_plan.device_arch", lambda: None)
    result = CliRunner().invoke(main, ["plan", "prefill", "--measure", "--seq", "256", "--head-dim", "64"])
    assert result.exit_code == 1 and "no CUDA GPU found" in result.output


def test_plan_prefill_json(tmp_path):
    import json

    path = tmp_path / "plan.json"
    result = CliRunner().invoke(main, ["plan", "prefill", "--seq", "2048", "--heads", "8", "--kv-heads", "8",
                                       "--head-dim", "64", "--dtype", "bfloat16", "--no-measure", "--json", str(path)])
    assert result.exit_code == 0, result.output
    record = json.loads(path.read_text())
    assert (record["kind"], record["seq"], record["dtype"], record["time_unit"]) == ("prefill", 2048, "bfloat16",
                                                                                    "x cuDNN's")
    assert [c["name"] for c in record["candidates"]] == [c.name for c in plan.candidates("bfloat16")]
    assert record["call"] in result.output and record["chosen"] == "bf16"
    times = {c["name"]: c["time"] for c in record["candidates"]}
    assert times["bf16"] == pytest.approx(1 / plan.VS_CUDNN["H200"][(64, False)][2048]["bf16"])
    assert times["i8-i8"] is None  # not timed at 2K
    refused = CliRunner().invoke(main, ["plan", "prefill", "--no-measure", "--json", str(tmp_path / "no" / "x.json")])
    assert refused.exit_code == 2 and "does not exist" in refused.output
