"""K smoothing of the int8-QK recipes (DESIGN §2) and its smoothing=None switch, on the CPU
emulators: what subtracting K̄ buys on K with outlier channels (qattn.data.outliers) and a large
per-channel bias (qattn.data.bias), and how e4m3 PV compares with int8 PV at long contexts.

Measured on the emulators (one head, 128 query rows, seeds 0-19 and 100 more at 32K):
- outliers, i8-f8 rel_l2 vs FP64: ~0.041 with smoothing at 1K/4K/32K; without it 0.36 (1K),
  0.38 (4K), 0.44 (32K): 8.3x-10x worse. bias: 0.038-0.042 with, 0.17-0.21 without (>= 4.5x).
- outliers at 32K, i8-f8 cos: mean 0.99912 over 100 seeds, min 0.99899 (1 seed in 100 under
  0.999): e4m3 PV alone is at that level (the normal preset gives 0.9992), so the test below
  averages 3 seeds.
- i8-i8 / i8-f8 rel_l2: outliers 0.95-1.02 at 4K, 1.31-1.68 at 32K; bias 0.84-0.93 at 4K,
  1.25-1.41 at 32K. int8 PV is as good as e4m3 at 4K on these presets and worse at 32K.
"""
import numpy as np
import pytest

import qattn
from qattn import data
from qattn.check import emulate
from qattn.check import metrics
from qattn.check import quant

from qattn.formats.int8qk import quant as i8quant
I8 = ("i8-f16", "i8-i8", "i8-f8")


def _seed(rng):
    return int(rng.integers(1 << 30))


def _rel_l2(fmt, d, **opts):
    out = emulate.emulate(fmt, d["q"], d["k"], d["v"], **opts)
    return metrics.compare(out, emulate.reference(fmt, d["q"], d["k"], d["v"], causal=opts.get("causal", False)))


@pytest.mark.parametrize("fmt", I8)
def test_smoothing_none_quantizes_k_as_given(rng, fmt):
    """smoothing=None: the scores are the exact integer products of Q8 and K8 = rint(K / s_K)
    (no mean subtracted), and the LSE has no q·K̄ to add back."""
    q, k, v = (rng.standard_normal(s, dtype=np.float32) for s in ((1, 4, 150, 64), (1, 2, 200, 64), (1, 2, 200, 64)))
    k = k + 3 * rng.standard_normal((1, 2, 1, 64), dtype=np.float32)
    got = emulate.scores(fmt, q, k, v, smoothing=None)
    q8 = i8quant.quantize_int8(quant.fold_softmax_scale(q, 1 / 8), 128, operand="q")
    k8 = i8quant.quantize_int8(k, 64, operand="k")
    exact = np.einsum("bhqd,bhkd->bhqk", q8.codes.astype(np.int64), np.repeat(k8.codes.astype(np.int64), 2, axis=1))
    expected = exact.astype(np.float32) * q8.scale * np.repeat(k8.scale, 2, axis=1)[..., 0][:, :, None, :]
    assert np.array_equal(got, expected)
    assert not np.array_equal(got, emulate.scores(fmt, q, k, v))  # smoothing on quantizes K - K̄
    out, lse = emulate.emulate(fmt, q, k, v, causal=True, return_lse=True, smoothing=None)
    ref, ref_lse = emulate.reference(fmt, q, k, v, causal=True, return_lse=True)
    assert np.abs(lse - ref_lse).max() <= 2e-2 * np.abs(ref_lse).max()


@pytest.mark.parametrize("fmt", I8)
def test_smoothing_is_a_no_op_on_zero_mean_k(rng, fmt):
    """K whose channel means are exactly 0 (keys in ± pairs): both settings compute the same bits."""
    q = rng.standard_normal((1, 2, 70, 64), dtype=np.float32)
    half = rng.standard_normal((1, 1, 100, 64), dtype=np.float32)
    k = np.concatenate([half, -half], axis=2)
    v = rng.standard_normal(k.shape, dtype=np.float32)
    assert not i8quant.smooth_k(k)[1].any()
    on = emulate.emulate(fmt, q, k, v, causal=True, return_lse=True)
    off = emulate.emulate(fmt, q, k, v, causal=True, return_lse=True, smoothing=None)
    assert all(np.array_equal(a, b) for a, b in zip(on, off))


@pytest.mark.parametrize("preset, factor", [("outliers", 5.0), ("bias", 3.0)])
@pytest.mark.parametrize("ctx", [1024, 4096])
def test_smoothing_is_markedly_better(rng, preset, factor, ctx):
    """Without K̄ subtracted, the outlier channels' shared offset (or the bias) sets s_K and the
    part of K that moves the softmax gets a few codes: the error grows 5-10x (outliers, measured
    >= 8.3x) or 4-5x (bias, measured >= 4.5x). i8-f16 isolates the QK product."""
    d = data.preset(preset, ctx=ctx, queries=128, seed=_seed(rng))
    for fmt in ("i8-f16", "i8-f8"):
        on, off = _rel_l2(fmt, d, causal=True), _rel_l2(fmt, d, causal=True, smoothing=None)
        assert off.rel_l2 >= factor * on.rel_l2, (fmt, on, off)
        assert on.rel_l2 <= 0.05, (fmt, on)


def test_i8_f8_at_32k_on_outliers_and_int8_pv_falls_behind(rng):
    """Outliers at 32K, one head, 128 rows, 3 seeds: i8-f8 with smoothing keeps cos >= 0.999 (mean
    over the seeds; one seed in 100 lands at 0.99899, e4m3 PV's own level), without it ~0.92; i8-i8
    is about level with i8-f8 at 4K (0.95-1.02x its rel_l2) and clearly behind at 32K (1.31-1.68x)."""
    cos, ratio = [], {4096: [], 32768: []}
    for _ in range(3):
        seed = _seed(rng)
        for ctx in (4096, 32768):
            d = data.preset("outliers", ctx=ctx, queries=128, seed=seed)
            f8, i8 = _rel_l2("i8-f8", d), _rel_l2("i8-i8", d)
            ratio[ctx].append(i8.rel_l2 / f8.rel_l2)
            if ctx == 32768:
                cos.append(f8.cos)
                off = _rel_l2("i8-f8", d, smoothing=None)
                assert off.cos < 0.97 and off.rel_l2 >= 5 * f8.rel_l2, (f8, off)
    assert np.mean(cos) >= 0.999 and min(cos) >= 0.9985, cos
    assert min(ratio[32768]) >= 1.15, ratio
    assert np.mean(ratio[32768]) >= np.mean(ratio[4096]) + 0.2, ratio


@pytest.mark.parametrize("fmt", ["f16", "bf16", "f32", "kv8-f32", "kv8-split", "kv8-imma"])
def test_smooth_k_only_on_int8_qk_formats(rng, fmt):
    q, k, v = (rng.standard_normal((1, 2, 9, 16), dtype=np.float32) for _ in range(3))
    for value in (True, False):
        with pytest.raises(ValueError, match="^smooth_k: format"):
            emulate.emulate(fmt, q, k, v, smooth_k=value)
    with pytest.raises(ValueError, match="^smooth_k: format"):  # checked before q goes to the GPU
        qattn.attention(q.astype(np.float16), k.astype(np.float16), v.astype(np.float16), format=fmt, smooth_k=False)


@pytest.mark.parametrize("fmt", ["f16", "kv8-imma"])
def test_smoothing_only_on_int8_qk_formats(rng, fmt):
    q, k, v = (rng.standard_normal((1, 2, 9, 16), dtype=np.float32) for _ in range(3))
    with pytest.raises(ValueError, match="^smoothing: format .* only i8-f16, i8-i8, i8-f8 do"):
        emulate.emulate(fmt, q, k, v, smoothing="mean+balance")


@pytest.mark.parametrize("fmt", I8)
def test_smooth_k_is_a_deprecated_alias(rng, fmt):
    """smooth_k=True computes what smoothing="mean" does and smooth_k=False what smoothing=None does,
    with a DeprecationWarning; giving both is an error."""
    q, k, v = (rng.standard_normal(s, dtype=np.float32) for s in ((1, 2, 40, 32), (1, 1, 90, 32), (1, 1, 90, 32)))
    k = k + 2 * rng.standard_normal((1, 1, 1, 32), dtype=np.float32)
    for alias, smoothing in ((True, "mean"), (False, None)):
        with pytest.warns(DeprecationWarning, match="smooth_k is deprecated"):
            old = emulate.emulate(fmt, q, k, v, return_lse=True, smooth_k=alias)
        new = emulate.emulate(fmt, q, k, v, return_lse=True, smoothing=smoothing)
        assert all(np.array_equal(a, b) for a, b in zip(old, new))
    with pytest.raises(ValueError, match="^smooth_k: give smoothing or"):
        emulate.emulate(fmt, q, k, v, smoothing="mean", smooth_k=True)
    with pytest.raises(ValueError, match="^smoothing: expected 'mean', 'mean\\+balance' or None"):
        emulate.emulate(fmt, q, k, v, smoothing="balance")


def test_smooth_k_takes_a_bool(rng):
    from qattn.formats.int8qk import host as int8

    q, k, v = (rng.standard_normal((1, 2, 9, 16), dtype=np.float32) for _ in range(3))
    with pytest.raises(ValueError, match="^smooth_k: expected True or False"):
        emulate.emulate("i8-f8", q, k, v, smooth_k="no")
    with pytest.raises(ValueError, match="^smooth_k: expected True or False"):
        int8.quantize(q, k, v, format="i8-f8", smooth_k=0)
    with pytest.raises(ValueError, match="^smooth_k: format 'f16'"):  # the default format
        qattn.attention(q, k, v, smooth_k=True)


def test_the_default_smoothing_balances_from_32k_keys():
    assert i8quant.default_smoothing(i8quant.BALANCE_FROM_KEYS) == "mean+balance"
    assert i8quant.default_smoothing(i8quant.BALANCE_FROM_KEYS - 1) == "mean"
    assert i8quant.smoothing_option(default="mean+balance") == "mean+balance"
    assert i8quant.smoothing_option(None, default="mean+balance") is None  # an explicit None stays


@pytest.mark.parametrize("keys", [i8quant.BALANCE_FROM_KEYS - 64, i8quant.BALANCE_FROM_KEYS])
def test_the_emulator_follows_the_default_rule(rng, keys):
    x = data.preset("outliers_scale", ctx=keys, queries=16, heads=1, head_dim=64, seed=int(rng.integers(1 << 30)))
    q, k, v = (x[n].astype(np.float16) for n in "qkv")
    default = emulate.emulate("i8-f16", q, k, v)
    want = "mean+balance" if keys >= i8quant.BALANCE_FROM_KEYS else "mean"
    np.testing.assert_array_equal(default, emulate.emulate("i8-f16", q, k, v, smoothing=want))
    other = "mean" if want == "mean+balance" else "mean+balance"
    assert not np.array_equal(default, emulate.emulate("i8-f16", q, k, v, smoothing=other))  # the rule decides
