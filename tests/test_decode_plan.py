"""qattn plan decode weighs Q/K channel balancing for an i8 K: on K with scale-type outlier channels the
balanced i8 cache passes a gate its plain form fails, and a tie in time keeps the plain format."""
import numpy as np

from qattn.formats.decode import plan


HEADS, KV_HEADS = 32, 8


def _npz(tmp_path, rng, gains):
    """q, k, v [1, H, L, D] with K's channels scaled by gains (scale-type: the sign varies by token). The plan
    scores one query per head, so 32 heads keep the error estimate from hanging on a few near one-hot rows."""
    heads, kv_heads, ctx, d = HEADS, KV_HEADS, 2048, 64
    path = tmp_path / "qkv.npz"
    np.savez(path, q=rng.standard_normal((1, heads, 4, d)), k=rng.standard_normal((1, kv_heads, ctx, d)) * gains,
             v=rng.standard_normal((1, kv_heads, ctx, d)))
    return path


def test_balanced_i8_variants_follow_their_plain_formats():
    names = [c.name for c in plan.candidates(with_bias=True)]
    for base in ("i8-i8", "i8-i8/int8", "i8-f16", "i8-f16/int8"):
        assert names.index(f"{base} +k_balance") > names.index(base)
    assert not any(n.startswith("e4m3") and "k_balance" in n for n in names)  # e4m3 K gains nothing
    assert plan.Candidate("i8-i8", "int8", k_balance=True).timed_as == "i8-i8/int8"


def test_plan_takes_balancing_where_the_plain_i8_cache_fails_the_gate(tmp_path, rng):
    gains = np.ones(64)
    gains[[5, 21, 40]] = [50.0, 120.0, 200.0]
    errors = plan.format_errors(npz=_npz(tmp_path, rng, gains), heads=HEADS, kv_heads=KV_HEADS, head_dim=64)
    assert errors["i8-i8 +k_balance"] < errors["i8-i8"] / 2.5, errors  # 3.1x at the least over 100 seeds
    gate = 2 * errors["i8-i8 +k_balance"]
    assert errors["i8-i8"] > gate and errors["i8-i8/int8"] > gate
    # among the i8 K caches and the 16-bit K ones, the balanced i8-i8 is the fastest within the gate
    weighed = {name: err for name, err in errors.items() if name.startswith(("i8-i8", "f16-"))}
    chosen, _ = plan.choose(weighed, plan.table_times(weighed), gate)
    assert chosen.startswith("i8-i8") and chosen.endswith("+k_balance"), (chosen, weighed)


def test_without_outliers_balancing_changes_nothing_and_the_plain_format_is_chosen(tmp_path, rng):
    errors = plan.format_errors(npz=_npz(tmp_path, rng, np.ones(64)), heads=HEADS, kv_heads=KV_HEADS, head_dim=64)
    assert errors["i8-i8 +k_balance"] == errors["i8-i8"]  # every alpha is 1
    assert "+k_balance" not in plan.choose(errors, plan.table_times(errors), 0.05)[0]


def test_plan_decode_json(tmp_path):
    """--json writes the point, each candidate's error, time and gate, and the choice the table printed."""
    import json

    from click.testing import CliRunner

    from qattn.cli import main

    path = tmp_path / "plan.json"
    result = CliRunner().invoke(main, ["plan", "decode", "--ctx", "1024", "--heads", "8", "--kv-heads", "2",
                                       "--head-dim", "64", "--no-measure", "--json", str(path)])
    assert result.exit_code == 0, result.output
    record = json.loads(path.read_text())
    assert record["kind"] == "decode" and record["ctx"] == 1024 and record["time_unit"] == "x f16-f16"
    names = [c["name"] for c in record["candidates"]]
    assert names == [c.name for c in plan.candidates()] and record["chosen"] in names
    assert f"chosen: {record['chosen']} ({record['why']};" in result.output
    assert all(c["within_gate"] == (c["rel_l2"] <= record["max_rel_l2"]) for c in record["candidates"])
    assert next(c for c in record["candidates"] if c["name"] == "f16-f16")["time"] == 1.0
