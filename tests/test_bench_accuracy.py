"""What the accuracy and cost tables (tools/bench_accuracy.py, tools/bench_prefill.py --smoothing) do
without a GPU: the inputs by source, MiniLM's padding to D 64, the call variants per smoothing and
the tables made from records."""
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from qattn.bench import sources
from qattn.bench.prefill import call_variants, fp16_on_device, impl_name
from qattn.check import emulate

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import bench_accuracy  # noqa: E402
import bench_prefill  # noqa: E402


def test_minilm_source_keeps_its_shape_and_scale():
    x = sources.inputs("minilm", ctx=4096, queries=4096, heads=8, kv_heads=2)
    assert x["q"].shape == (1, 1, 256, 32) and x["k"].shape == x["v"].shape == (1, 1, 4096, 32)
    with np.load(sources.MINILM) as f:
        np.testing.assert_array_equal(x["q"], f["q"])  # every row, in order
        np.testing.assert_array_equal(x["k"], f["k"][..., -4096:, :])
        assert x["scale"] == pytest.approx(32 ** -0.5)
    assert sources.inputs("minilm", ctx=1024, queries=100, seed=3)["q"].shape == (1, 1, 100, 32)
    with pytest.raises(ValueError, match="source: unknown source 'gauss'"):
        sources.inputs("gauss", ctx=1024, queries=8)


def test_preset_source_is_the_preset():
    x = sources.inputs("rope_massive", ctx=512, queries=16, heads=4, kv_heads=2, head_dim=64, seed=5)
    y = sources.inputs("rope_massive", ctx=512, queries=16, heads=4, kv_heads=2, head_dim=64, seed=5)
    assert x["q"].shape == (1, 4, 16, 64) and x["k"].shape == (1, 2, 512, 64) and "scale" not in x
    np.testing.assert_array_equal(x["k"], y["k"])


@pytest.fixture
def host_cupy(monkeypatch):
    """fp16_on_device on the host: NumPy stands in for CuPy."""
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(asarray=np.asarray, float16=np.float16))


def test_minilm_runs_padded_to_d64_at_its_own_scale(host_cupy):
    # The zero channels change nothing the int8-QK formats compute: each format's emulator on the
    # padded inputs at 1/√64 gives what it gives on the first 32 channels at 1/√64 too (q carries √2).
    x = sources.inputs("minilm", ctx=1024, queries=64, seed=0)
    q, k, v = fp16_on_device(x)
    assert q.dtype == np.float16 and q.shape == (1, 1, 64, 64) and k.shape == (1, 1, 1024, 64)
    assert not q[..., 32:].any() and not k[..., 32:].any() and not v[..., 32:].any()
    scores = q[..., :32].astype(np.float64) @ k[..., :32].astype(np.float64).swapaxes(-1, -2) / 8
    expected = x["scale"] * x["q"].astype(np.float64) @ x["k"].astype(np.float64).swapaxes(-1, -2)
    np.testing.assert_allclose(scores, expected, rtol=2e-3, atol=2e-3 * np.abs(expected).max())
    for fmt in ("i8-f16", "i8-f8"):
        for smoothing in ("mean", "mean+balance"):
            padded = emulate.emulate(fmt, q, k, v, smoothing=smoothing, alpha_rule="outliers")
            cut = emulate.emulate(fmt, q[..., :32], k[..., :32], v[..., :32], scale=1 / 8, smoothing=smoothing,
                                  alpha_rule="outliers")
            np.testing.assert_allclose(padded[..., :32], cut, rtol=1e-5, atol=1e-6)
            assert not padded[..., 32:].any()


def test_preset_inputs_are_only_cast(host_cupy):
    x = sources.inputs("normal", ctx=256, queries=8, heads=2)
    q, k, v = fp16_on_device(x)
    np.testing.assert_array_equal(q, x["q"].astype(np.float16))
    np.testing.assert_array_equal(v, x["v"].astype(np.float16))


def test_int8qk_formats_run_once_per_smoothing():
    assert call_variants("i8-f8", ("mean", "mean+balance")) == [{"smoothing": "mean"}, {"smoothing": "mean+balance"}]
    assert call_variants("i8-f8", ()) == [{}]
    assert call_variants("f16", ("mean", None)) == [{}]  # takes no smoothing: its default call alone
    assert impl_name("i8-f8@mma.sync", {"smoothing": "mean+balance"}) == "qattn:i8-f8@mma.sync/mean+balance"
    assert impl_name("i8-i8", {"smoothing": None}) == "qattn:i8-i8/none"
    assert impl_name("f16", {}) == "qattn:f16"


def _accuracy_records():
    base = {"source": "outliers_scale", "ctx": 32768, "queries": 4096, "causal": False}
    return [dict(base, impl="qattn:i8-f8/mean", format="i8-f8", smoothing="mean", rel_l2=0.2),
            dict(base, impl="qattn:i8-f8/mean+balance", format="i8-f8", smoothing="mean+balance", rel_l2=0.05),
            dict(base, impl="qattn:i8-i8/mean", format="i8-i8", smoothing="mean", rel_l2=0.4),
            dict(base, impl="qattn:i8-i8/mean+balance", format="i8-i8", smoothing="mean+balance", error="boom"),
            dict(base, impl="sdpa_cudnn", rel_l2=3e-4),
            dict(base, impl="sageattn2", error="unsupported"),
            dict(base, ctx=700, queries=700, causal=True, impl="qattn:i8-f8/mean", format="i8-f8", smoothing="mean",
                 rel_l2=0.03)]


def test_accuracy_table_has_a_column_per_smoothing_its_ratio_and_the_peers():
    lines = bench_accuracy.table(_accuracy_records()).splitlines()
    assert lines[0] == ("| source | keys | queries | causal | format | mean | mean+balance | mean+balance / mean "
                        "| sdpa_cudnn | sageattn2 |")
    assert lines[2] == "| outliers_scale | 32K | 4096 | no | i8-f8 | 2.00e-01 | 5.00e-02 | 0.25 | 3.00e-04 | - |"
    assert lines[3] == "| outliers_scale | 32K | 4096 | no | i8-i8 | 4.00e-01 | - | - | 3.00e-04 | - |"
    assert lines[4] == "| outliers_scale | 700 | 700 | yes | i8-f8 | 3.00e-02 | - | - | - | - |"
    assert len(lines) == 5


def test_accuracy_table_of_default_calls_has_one_column():
    records = [{"source": "normal", "ctx": 4096, "queries": 4096, "causal": False, "impl": "qattn:i8-f8",
                "format": "i8-f8", "rel_l2": 0.0388}]
    assert bench_accuracy.table(records).splitlines()[0] == "| source | keys | queries | causal | format | rel_l2 |"


def test_cost_table_divides_by_the_first_smoothing_of_the_same_kernel():
    base = {"batch": 4, "heads": 32, "seq": 4096, "head_dim": 128, "causal": True}
    records = [dict(base, impl="sdpa_cudnn", ms=1.0),
               dict(base, impl="qattn:i8-f8/mean", kernel="k_f8", smoothing="mean", ms=2.0, quant_ms=0.25),
               dict(base, impl="qattn:i8-f16/mean", kernel="k_f16", smoothing="mean", ms=4.0, quant_ms=0.25),
               dict(base, impl="qattn:i8-f8/mean+balance", kernel="k_f8", smoothing="mean+balance", ms=2.1,
                    quant_ms=0.3),
               dict(base, impl="qattn:i8-f16/mean+balance", kernel="k_f16", smoothing="mean+balance", error="boom")]
    lines = bench_prefill.smoothing_costs(records).splitlines()
    assert lines[0] == "| kernel | shape | causal | smoothing | ms | / mean | quant ms | quant − mean |"
    assert lines[2:] == ["| k_f8 | B4 H32 L4096 D128 | yes | mean | 2.000 | 1.000 | 0.250 | +0.000 |",
                         "| k_f16 | B4 H32 L4096 D128 | yes | mean | 4.000 | 1.000 | 0.250 | +0.000 |",
                         "| k_f8 | B4 H32 L4096 D128 | yes | mean+balance | 2.100 | 1.050 | 0.300 | +0.050 |"]


@pytest.mark.parametrize("tool,args,message", [
    ("bench_accuracy.py", ["--smoothing", "max"], "invalid choice: 'max'"),
    ("bench_accuracy.py", ["--preset", "gauss"], "invalid choice: 'gauss'"),
    ("bench_accuracy.py", ["--kv-heads", "0"], "expected a positive integer, got 0"),
    ("bench_prefill.py", ["--smoothing", "balance"], "invalid choice: 'balance'")])
def test_tools_refuse_bad_smoothings_and_sources(tool, args, message):
    result = subprocess.run([sys.executable, str(ROOT / "tools" / tool), *args], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and message in result.stderr


def test_accuracy_records_on_the_host(monkeypatch):
    # accuracy_against_fp64 with NumPy for CuPy and the emulator for the kernels: a record per
    # source, context, causal and smoothing; MiniLM's 256 rows query every context; balancing
    # beats mean-only on scale-type outliers.
    import qattn.api

    monkeypatch.setitem(sys.modules, "cupy", np)
    monkeypatch.setattr(qattn.api, "attention", lambda q, k, v, *, format, causal, **options: emulate.emulate(
        format, q, k, v, causal=causal, **options))
    from qattn.bench.prefill import accuracy_against_fp64

    records = accuracy_against_fp64(("outliers_scale", "minilm"), (256, 1024), ("i8-f8", "f16"),
                                    smoothings=("mean", "mean+balance"), peers=(), heads=2, kv_heads=1, head_dim=64,
                                    max_queries=256)
    impls = ["qattn:i8-f8/mean", "qattn:i8-f8/mean+balance", "qattn:f16"]  # f16 takes no smoothing
    inputs = [(source, *x) for source in ("outliers_scale", "minilm")
              for x in ((256, 256, False), (256, 256, True), (1024, 256, False))]
    assert [(r["source"], r["ctx"], r["queries"], r["causal"], r["impl"]) for r in records] == \
        [(*x, impl) for x in inputs for impl in impls]
    assert not any("error" in r for r in records)
    errors = {(r["source"], r["ctx"], r["causal"], r.get("smoothing")): r["rel_l2"] for r in records}
    assert errors["outliers_scale", 1024, False, "mean+balance"] < 0.5 * errors["outliers_scale", 1024, False, "mean"]
    assert all(0 < e < 0.1 for key, e in errors.items() if key[0] == "minilm")
    assert all(e < 1e-3 for key, e in errors.items() if key[3] is None)  # f16
    assert {(r["heads"], r["kv_heads"], r["head_dim"]) for r in records} == {(2, 1, 64), (1, 1, 64)}
