"""The probe (qattn.check.probe and `qattn probe`): mass below the P grids' floors, K channel
statistics, per-format errors, JSON and the PNG."""
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from qattn import data
from qattn.cli import main
from qattn.check import probe

MINILM = Path(__file__).parent / "data" / "minilm_qkv.npz"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def seed():
    """A fresh seed on every run, printed so that a failure can be replayed."""
    value = int(np.random.SeedSequence().entropy % 2 ** 31)
    print(f"seed {value}")
    return value


def run_cli(*args):
    return CliRunner().invoke(main, ["probe", *args], catch_exceptions=False)


def test_outliers_preset_smooths_and_loses_more_mass_at_32k(seed):
    report = probe.run_probe(preset="outliers", ctx=(32768, 4096), formats=("i8-f8",), queries=32, seed=seed)
    short, long = report["contexts"]
    assert (short["ctx"], long["ctx"]) == (4096, 32768) and short["rows"] == 32
    for entry in (short, long):
        assert entry["k_channel_ratio"]["raw"] > 40 and entry["k_channel_ratio"]["smoothed"] < 5
        levels = entry["k_int8_levels"]
        assert levels["smoothed"]["per_tensor"] > 5 * levels["raw"]["per_tensor"]
        assert len(entry["k_channel_absmax"]["raw"]) == 128
        assert math.isclose(sum(entry["mass_by_decade"]), 1, rel_tol=1e-9)
    assert long["mass_below"]["int8"] > short["mass_below"]["int8"] > 0
    assert long["mass_below"]["e4m3"] <= long["mass_below"]["int8"]
    errors = long["errors"]["i8-f8"]
    assert set(errors) == {"max_rel", "rel_l2", "cos", "kl"}
    assert 0 < errors["rel_l2"] < 0.1 and errors["cos"] > 0.99 and errors["kl"] >= 0


def test_errors_under_each_smoothing_and_balanced_k(seed):
    """The int8-QK formats' errors come as FORMAT+SMOOTHING for each smoothing asked for, the plain
    FORMAT being "mean"'s; other formats once; the K statistics gain "balanced"."""
    tensors = {1500: data.preset("outliers_scale", ctx=1500, queries=32, head_dim=64, seed=seed)}
    report = probe.run_probe(tensors, formats=("i8-f8", "f16"), seed=seed)
    entry = report["contexts"][0]
    assert report["smoothings"] == ["mean", "mean+balance"]
    assert set(entry["errors"]) == {"i8-f8", "i8-f8+mean", "i8-f8+mean+balance", "f16"}
    assert entry["errors"]["i8-f8"] == entry["errors"]["i8-f8+mean"]
    # lower (the 0.6x target is tested at full size in test_balancing.py; 32 rows here are noisy)
    assert entry["errors"]["i8-f8+mean+balance"]["rel_l2"] < entry["errors"]["i8-f8"]["rel_l2"]
    ratio = entry["k_channel_ratio"]
    assert ratio["raw"] > 150 and ratio["smoothed"] > 150 and ratio["balanced"] < 0.25 * ratio["smoothed"]
    assert set(entry["k_int8_levels"]) == set(entry["k_channel_absmax"]) == {"raw", "smoothed", "balanced"}
    only = probe.run_probe(tensors, formats=("i8-f8",), smoothings=("mean+balance", None), seed=seed)
    assert only["smoothings"] == ["mean+balance", "none"]
    assert set(only["contexts"][0]["errors"]) == {"i8-f8+mean+balance", "i8-f8+none"}
    with pytest.raises(ValueError, match="^smoothing:"):
        probe.run_probe(tensors, smoothings=("balance",))
    with pytest.raises(ValueError, match="^smoothing:"):
        probe.run_probe(tensors, smoothings=())


def test_cli_smoothing_option(tmp_path, seed):
    out_json = tmp_path / "probe.json"
    result = run_cli("--preset", "outliers_scale", "--ctx", "600", "--queries", "8", "-f", "i8-f16",
                     "--smoothing", "mean+balance", "--smoothing", "none", "--seed", str(seed), "--json", str(out_json))
    assert result.exit_code == 0, result.output
    assert "i8-f16+mean+balance" in result.stdout and "i8-f16+none" in result.stdout
    errors = json.loads(out_json.read_text())["contexts"][0]["errors"]
    assert set(errors) == {"i8-f16+mean+balance", "i8-f16+none"}
    default = run_cli("--preset", "rope_massive", "--ctx", "600", "--queries", "8", "-f", "i8-f16")
    assert default.exit_code == 0, default.output
    assert "i8-f16+mean " in default.stdout and "i8-f16+mean+balance" in default.stdout
    bad = run_cli("--preset", "normal", "--smoothing", "balance")
    assert bad.exit_code == 2 and "--smoothing" in bad.output


def test_key_block_sets_the_emulators_blocks(seed):
    """--key-block reaches the emulators (the errors are emulate(..., block_n=key_block)'s) and the K
    statistics, and is reported; the mass figures do not depend on it."""
    from qattn.check import emulate
    from qattn.check import metrics

    tensors = {700: data.preset("outliers", ctx=700, queries=40, head_dim=64, seed=seed)}
    by_block = {kb: probe.run_probe(tensors, formats=("i8-f8",), key_block=kb, seed=seed) for kb in (64, 128)}
    for kb, report in by_block.items():
        assert report["key_block"] == kb
        x = tensors[700]
        want = metrics.compare(emulate.emulate("i8-f8", x["q"], x["k"], x["v"], block_n=kb),
                               emulate.reference("i8-f8", x["q"], x["k"], x["v"]))
        assert math.isclose(report["contexts"][0]["errors"]["i8-f8"]["rel_l2"], want.rel_l2, rel_tol=1e-12)
    e64, e128 = (by_block[kb]["contexts"][0] for kb in (64, 128))
    assert e64["errors"]["i8-f8"]["rel_l2"] != e128["errors"]["i8-f8"]["rel_l2"]
    assert e64["k_int8_levels"]["raw"]["per_block"] != e128["k_int8_levels"]["raw"]["per_block"]
    assert e64["mass_below"] == e128["mass_below"]
    result = run_cli("--preset", "normal", "--ctx", "300", "--queries", "8", "-f", "i8-f8", "--key-block", "128")
    assert result.exit_code == 0, result.output
    assert "per 128 keys" in result.output and "128 keys per K scale" in result.output
    bad = CliRunner().invoke(main, ["probe", "--preset", "normal", "--key-block", "0"])
    assert bad.exit_code == 2 and "--key-block" in bad.output


def test_mass_below_on_a_known_row():
    """Scores chosen so that the row's p = exp(s − max) is [1, 0.5, 2e-3, 3e-7]."""
    p = np.array([1.0, 0.5, 2e-3, 3e-7])
    k = np.log(p)[None, None, :, None]  # D = 1 and scale 1: s_j = q·k_j = log p_j
    tensors = {4: dict(q=np.ones((1, 1, 1, 1)), k=k, v=np.ones((1, 1, 4, 1)), scale=1.0)}
    entry = probe.run_probe(tensors, formats=(), grids={"half": 0.75})["contexts"][0]
    total = p.sum()
    assert math.isclose(entry["mass_below"]["int8"], (2e-3 + 3e-7) / total, rel_tol=1e-5)
    assert math.isclose(entry["mass_below"]["e4m3"], 3e-7 / total, rel_tol=1e-5)
    assert math.isclose(entry["mass_below"]["half"], (0.5 + 2e-3 + 3e-7) / total, rel_tol=1e-5)
    expected = np.zeros(9)
    expected[[2, 6, 8]] = np.array([3e-7, 2e-3, 1.5]) / total  # decades [1e-7, 1e-6), [1e-3, 1e-2), [0.1, 1]
    assert np.allclose(entry["mass_by_decade"], expected, rtol=1e-5, atol=0)


def test_grid_points():
    int8, e4m3 = probe.grid_points("int8"), probe.grid_points("e4m3")
    assert len(int8) == 127 and int8.min() == 1 / 127 and int8.max() == 1
    assert len(e4m3) == 126 and e4m3.min() == 2.0 ** -9 / 448 and e4m3.max() == 1
    assert probe.FLOORS["e4m3"] == e4m3.min() / 2 and probe.FLOORS["int8"] == int8.min() / 2
    with pytest.raises(ValueError, match="^grid:"):
        probe.grid_points("int4")


def test_cli_outliers_table_json_and_png(tmp_path, seed):
    out_json, out_png = tmp_path / "probe.json", tmp_path / "probe.png"
    result = run_cli("--preset", "outliers", "--ctx", "4096", "--ctx", "32768", "--queries", "16", "-f", "i8-i8,i8-f8",
                     "--grid", "int4=0.0714", "--seed", str(seed), "--json", str(out_json), "--plot", str(out_png))
    assert result.exit_code == 0, result.output
    for text in ("mass < int8", "mass < e4m3", "mass < int4", "44.0×", "i8-f8", "KL"):
        assert text in result.stdout
    report = json.loads(out_json.read_text())
    assert report["source"] == "preset:outliers" and report["formats"] == ["i8-i8", "i8-f8"]
    assert [c["ctx"] for c in report["contexts"]] == [4096, 32768]
    for entry in report["contexts"]:
        assert set(entry["mass_below"]) == {"int8", "e4m3", "int4"}
        assert all(0 <= x <= 1 for x in entry["mass_below"].values())
        assert set(entry["k_channel_ratio"]) == {"raw", "smoothed", "balanced"}
    png = out_png.read_bytes()
    assert png[:8] == PNG_SIGNATURE
    import matplotlib.image

    image = matplotlib.image.imread(out_png)
    assert image.ndim == 3 and image.shape[0] > 300 and image.shape[1] > 2 * image.shape[0] - 200
    assert image[..., :3].std() > 0.05  # something was drawn


def test_cli_npz_real_tensors(tmp_path):
    out_json = tmp_path / "minilm.json"
    result = run_cli("--npz", str(MINILM), "--queries", "32", "-f", "i8-f8", "--json", str(out_json))
    assert result.exit_code == 0, result.output
    report = json.loads(out_json.read_text())
    assert report["v"] == "given" and [c["ctx"] for c in report["contexts"]] == [4096, 32768]
    short, long = report["contexts"]
    assert long["mass_below"]["int8"] > short["mass_below"]["int8"] > 0.01
    assert long["errors"]["i8-f8"]["rel_l2"] < 0.05


def test_npz_without_v_and_any_bhsd_shape(tmp_path, seed):
    d = data.rope(batch=2, heads=4, kv_heads=2, queries=9, ctx=700, head_dim=64, seed=seed)
    path = tmp_path / "qk.npz"
    np.savez(path, q=d["q"], k=d["k"])
    report = probe.run_probe(npz=str(path), formats=("i8-f16",), queries=5)
    assert report["v"] == "random" and [c["ctx"] for c in report["contexts"]] == [700]
    assert report["contexts"][0]["rows"] == 5 and report["contexts"][0]["heads"] == 4
    with pytest.raises(ValueError, match="^ctx:"):
        probe.run_probe(npz=str(path), ctx=[701])
    np.savez(path, q=d["q"][..., :32], k=d["k"])
    with pytest.raises(ValueError, match="^npz:"):
        probe.run_probe(npz=str(path))
    np.savez(path, k=d["k"])
    with pytest.raises(ValueError, match="^npz:.*no q"):
        probe.run_probe(npz=str(path))


@pytest.mark.parametrize("kwargs, field", [
    (dict(), "npz"), (dict(preset="outliers", npz="x.npz"), "npz"), (dict(preset="gauss", ctx=[64]), "preset"),
    (dict(preset="normal", formats=("f64",)), "format"), (dict(preset="normal", queries=0), "queries"),
    (dict(preset="normal", grids={"x": 2.0}), "grid"), (dict(preset="normal", ctx=[0]), "ctx"),
    (dict(preset="normal", key_block=0), "key_block"),
])
def test_run_probe_bad_arguments(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        probe.run_probe(**kwargs)


@pytest.mark.parametrize("args, message", [
    ((), "exactly one of --npz"), (("--preset", "gauss"), "unknown preset"),
    (("--preset", "normal", "--grid", "int4"), "NAME=FLOOR"), (("--preset", "normal", "--grid", "x=0"), "NAME=FLOOR"),
    (("--preset", "normal", "-f", "f64"), "unknown format"),
])
def test_cli_user_errors(args, message):
    result = run_cli(*args)
    assert result.exit_code != 0 and message in result.output and "Traceback" not in result.output


def test_cli_plot_without_matplotlib(tmp_path, monkeypatch):
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    out_png = tmp_path / "probe.png"
    result = run_cli("--preset", "normal", "--ctx", "64", "--plot", str(out_png))
    assert result.exit_code != 0 and "pip install" in result.output and "matplotlib" in result.output
    assert "mass <" not in result.output and not out_png.exists()  # failed before any work
