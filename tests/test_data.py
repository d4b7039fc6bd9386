"""The synthetic generators of qattn.data imitate the properties their docstrings name, and the
committed real tensors are what tests/data/README.md says."""
import math
from pathlib import Path

import numpy as np
import pytest

from qattn import data
from qattn.check import metrics
from qattn.formats.int8qk import quant as i8quant
from qattn.check.reference import softmax_rows

MINILM = Path(__file__).parent / "data" / "minilm_qkv.npz"


@pytest.fixture
def seed():
    """A fresh seed on every run, printed so that a failure can be replayed."""
    value = int(np.random.SeedSequence().entropy % 2 ** 31)
    print(f"seed {value}")
    return value


def _channel_ratios(k: np.ndarray) -> np.ndarray:
    absmax = np.abs(k).max(axis=-2)
    return absmax / np.median(absmax, axis=-1, keepdims=True)


@pytest.mark.parametrize("name", sorted(data.PRESETS))
def test_presets_shapes_dtypes_and_seeds(name, seed):
    d = data.preset(name, ctx=1030, queries=33, batch=2, heads=8, kv_heads=2, head_dim=64, seed=seed)
    assert d["q"].shape == (2, 8, 33, 64) and d["k"].shape == d["v"].shape == (2, 2, 1030, 64)
    assert all(x.dtype == np.float32 and np.isfinite(x).all() for x in d.values())
    again = data.preset(name, ctx=1030, queries=33, batch=2, heads=8, kv_heads=2, head_dim=64, seed=seed)
    other = data.preset(name, ctx=1030, queries=33, batch=2, heads=8, kv_heads=2, head_dim=64, seed=seed + 1)
    assert all(np.array_equal(d[n], again[n]) for n in d)
    assert not np.array_equal(d["k"], other["k"])


def test_outliers_match_the_measured_channels_and_smooth_away(seed):
    d = data.outliers(heads=4, kv_heads=4, ctx=2100, seed=seed)
    ratios = _channel_ratios(d["k"])  # [1, 4, 128]
    top5 = np.sort(ratios, axis=-1)[..., -5:]
    assert np.allclose(top5, data.OUTLIER_RATIOS, rtol=1e-4)
    assert np.sort(ratios, axis=-1)[..., -6].max() < 2  # the other channels are ordinary
    smoothed = _channel_ratios(i8quant.smooth_k(d["k"])[0])
    assert smoothed.max() <= 4.5


def test_token_varying_outliers_survive_smoothing(seed):
    d = data.outliers_token(ctx=2100, seed=seed)
    raw, smoothed = _channel_ratios(d["k"]).max(), _channel_ratios(i8quant.smooth_k(d["k"])[0]).max()
    assert abs(raw - 44) < 1e-3 and smoothed > 0.8 * raw


def test_scale_outliers_have_their_ratios_and_survive_smoothing(seed):
    d = data.outliers_scale(heads=4, kv_heads=2, ctx=2100, seed=seed)
    ratios = _channel_ratios(d["k"])  # [1, 2, 128]
    top5 = np.sort(ratios, axis=-1)[..., -5:]
    assert np.allclose(top5, data.SCALE_OUTLIER_RATIOS, rtol=1e-4) and max(data.SCALE_OUTLIER_RATIOS) == 200
    assert np.sort(ratios, axis=-1)[..., -6].max() < 2  # the other channels are ordinary
    smoothed = _channel_ratios(i8quant.smooth_k(d["k"])[0])
    assert np.allclose(np.sort(smoothed, axis=-1)[..., -5:], top5, rtol=0.05)  # zero mean: smoothing leaves them


def test_rope_massive_pair_peaks_at_its_ratio_and_turns_with_the_context(seed):
    """The pair D/2 − 1, D − 1 peaks at ~MASSIVE_RATIO× the median channel; over 1K keys it barely
    turns (an offset smoothing removes), over 32K it sweeps an arc smoothing cannot remove."""
    smoothed = {}
    for ctx in (1024, 32768):
        d = data.rope_massive(heads=2, kv_heads=2, ctx=ctx, queries=8, head_dim=64, seed=seed)
        ratios = _channel_ratios(d["k"])  # [1, 2, 64]
        assert np.delete(ratios, [31, 63], axis=-1).max() < 2  # every other channel is ordinary
        assert np.allclose(ratios.max(axis=-1), data.MASSIVE_RATIO, rtol=0.1)
        smoothed[ctx] = _channel_ratios(i8quant.smooth_k(d["k"])[0]).max()
    assert smoothed[1024] < 8 and smoothed[32768] > 0.6 * data.MASSIVE_RATIO, smoothed


def test_bias_is_tens_of_times_the_token_part(seed):
    d = data.bias(kv_heads=1, heads=2, ctx=1500, head_dim=128, seed=seed)
    smoothed, mean = i8quant.smooth_k(d["k"].astype(np.float64))
    ratio = np.linalg.norm(mean, axis=-1) / np.linalg.norm(smoothed, axis=-1).mean(axis=-1, keepdims=True)
    assert 20 < ratio.min() and ratio.max() < 40
    # the bias moves every score of a row by one constant: the probabilities ignore it
    assert np.abs(softmax_rows(d["q"], d["k"]) - softmax_rows(d["q"], smoothed)).max() < 1e-12


def test_rope_scores_depend_on_relative_position(seed):
    rng = np.random.default_rng(seed)
    x, y = rng.standard_normal((2, 1, 1, 1, 64), dtype=np.float32)
    shift = int(rng.integers(1, 5000))
    at = lambda v, p: data._rotate(v, np.array([p]), 10000.0)  # noqa: E731
    near = float((at(x, 100) * at(y, 90)).sum())
    assert abs(near - float((at(x, 100 + shift) * at(y, 90 + shift)).sum())) < 1e-3 * max(1, abs(near))
    assert np.allclose(np.linalg.norm(at(x, shift)), np.linalg.norm(x), rtol=1e-5)
    # the preset's shared Q/K mean sits mostly on the slowly rotating pairs (last in each half);
    # eight heads, eight draws of it, so one small draw cannot sink the average (300 seeds: >= 1.9x)
    d = data.rope(ctx=4000, queries=16, heads=8, head_dim=64, seed=seed)
    pair_norm = np.hypot(d["k"][..., :32], d["k"][..., 32:]).mean(axis=(0, 1, 2))
    assert pair_norm[-8:].mean() > 1.5 * pair_norm[:8].mean()


def test_diffuse_rows_spread_with_context(seed):
    below = {}
    for ctx in (4096, 32768):
        d = data.diffuse(ctx=ctx, queries=32, seed=seed)
        p = softmax_rows(d["q"], d["k"])
        below[ctx] = metrics.mass_below(p / p.max(axis=-1, keepdims=True), 0.5 / 127).mean()
    # 32 rows per context: bounds hold over hundreds of seeds (32K ranges 0.27..0.47 across them)
    assert 0.04 < below[4096] < 0.2 and 0.22 < below[32768] < 0.55
    assert below[32768] > 2 * below[4096]


@pytest.mark.parametrize("kwargs, field", [
    (dict(name="gauss", ctx=8), "preset"), (dict(name="normal", ctx=0), "ctx"),
    (dict(name="normal", ctx=8, heads=6, kv_heads=4), "heads"),
    (dict(name="outliers", ctx=8, head_dim=8), "head_dim"), (dict(name="rope", ctx=8, head_dim=7), "head_dim"),
])
def test_bad_arguments_name_the_argument(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        data.preset(**kwargs)


def test_minilm_tensors_are_as_documented():
    with np.load(MINILM) as f:
        stored = {name: f[name] for name in f.files}
    assert stored["q"].shape == (1, 1, 256, 32) and stored["k"].shape == stored["v"].shape == (1, 1, 32768, 32)
    assert all(stored[n].dtype == np.float16 and np.isfinite(stored[n]).all() for n in ("q", "k", "v"))
    assert (int(stored["layer"]), int(stored["head"]), int(stored["passage"])) == (4, 9, 256)
    assert math.isclose(float(stored["scale"]), 32 ** -0.5, rel_tol=1e-6)
    # every passage starts with [CLS] at position 0: those keys repeat every 256 keys
    k = stored["k"][0, 0].astype(np.float64)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    cls = k[::256]
    assert cls.shape == (128, 32) and (cls @ cls[0] > 0.999).all()
    assert (k[1::256] @ k[1] < 0.9).any()  # text tokens differ from passage to passage
