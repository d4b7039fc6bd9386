"""Q/K channel balancing of the int8-QK recipes (smoothing="mean+balance", DESIGN §2) on the CPU
emulators: exact in real arithmetic, α per (batch, kv head, channel) over the GQA group, and what it
buys on scale-type K outliers (qattn.data.outliers_scale) without costing on the other presets.

Measured on the emulators with the default α rule, "outliers" (docs/notes/balancing.md), balanced
over mean-only rel_l2 at the tests' size (2K keys, 128 rows): outliers_scale (4 heads) 0.28–0.30 mean,
0.37 worst over 15 seeds; outliers_token 0.31–0.41, rope_massive 0.62–0.80 (2 heads, 10 seeds);
normal, outliers, bias, rope and diffuse have no channel with α outside (1/2, 2): exactly 1.
"""
import numpy as np
import pytest

from qattn import data
from qattn.check import emulate, metrics
from qattn.check import quant
from qattn.formats.int8qk import quant as i8quant

I8 = ("i8-f16", "i8-i8", "i8-f8")


def _seed(rng):
    return int(rng.integers(1 << 30))


def _scale_outlier_qk(rng, shape_q=(2, 6, 50, 64), shape_k=(2, 3, 300, 64)):
    """float64 Q and K whose K has scale-type channels, a channel offset and a channel Q never uses."""
    q = rng.standard_normal(shape_q)
    k = rng.standard_normal(shape_k) + 3 * rng.standard_normal(shape_k[:2] + (1, shape_k[-1]))
    k[..., :4] *= np.array([30.0, 60.0, 120.0, 200.0])
    q[..., 5] = 0
    return q, k


@pytest.mark.parametrize("rule", i8quant.ALPHA_RULES)
def test_balancing_is_exact_in_real_arithmetic(rng, rule):
    """In float64 without quantization the balanced operands give q·(K − K̄) on every score (and the
    shift q·K̄ puts back q·K): scaling Q's channels by α and K̃'s by 1/α changes no score."""
    q, k = _scale_outlier_qk(rng)
    qb, kb, k_mean = i8quant.smooth(q, k, "mean+balance", rule)
    assert qb.dtype == kb.dtype == np.float64
    group = q.shape[1] // k.shape[1]
    scores = qb @ np.repeat(kb, group, axis=1).swapaxes(-1, -2)
    plain = q @ np.repeat(k, group, axis=1).swapaxes(-1, -2)
    shift = q @ np.repeat(k_mean, group, axis=1).swapaxes(-1, -2)
    np.testing.assert_allclose(scores + shift, plain, rtol=0, atol=1e-11 * np.abs(plain).max())
    assert not np.allclose(kb, k - k_mean)  # it did balance


def test_alpha_shape_median_and_gqa_group(rng):
    """α is [B, Hkv, 1, D] with median 1 per (batch, kv head); q's column absmax is taken over every
    query head of the group (here the largest sits in the group's second head); a channel q never
    uses keeps α = 1; pow2 rounds log2 α to the nearest integer; outliers keeps α only outside
    (1/2, 2)."""
    q, k = _scale_outlier_qk(rng)
    q[0, 1, 7, 9] = 40.0  # kv head 0's group is query heads 0 and 1
    alpha = i8quant.balance_factors(q, k, "sqrt")
    assert alpha.shape == (2, 3, 1, 64) and alpha.dtype == np.float32
    np.testing.assert_allclose(np.median(alpha, axis=-1), 1.0, rtol=1e-6)
    k_absmax = np.abs(k).max(axis=-2)
    q_absmax = np.abs(q).reshape(2, 3, -1, 64).max(axis=2)
    raw = np.sqrt(k_absmax / np.where(q_absmax > 0, q_absmax, 1))
    live = np.arange(64) != 5
    want = raw / np.median(raw[..., live], axis=-1, keepdims=True)
    np.testing.assert_allclose(alpha[:, :, 0, live], want[..., live], rtol=1e-6)
    assert (alpha[..., 5] == 1).all()
    assert np.isclose(alpha[0, 0, 0, 9], want[0, 0, 9], rtol=1e-6) and want[0, 0, 9] < 0.5 * want[0, 1, 9]
    assert alpha[0, :, 0, :4].min() > 3  # the scale-type channels move into Q
    pow2 = i8quant.balance_factors(q, k, "pow2")
    np.testing.assert_array_equal(pow2, np.exp2(np.rint(np.log2(alpha.astype(np.float64)))).astype(np.float32))
    outliers = i8quant.balance_factors(q, k, "outliers")
    ordinary = (alpha > 0.5) & (alpha < 2)
    assert ordinary.mean() > 0.9 and (outliers[ordinary] == 1).all()
    np.testing.assert_array_equal(outliers[~ordinary], alpha[~ordinary])
    assert i8quant.DEFAULT_ALPHA_RULE == "outliers"
    with pytest.raises(ValueError, match="^rule:"):
        i8quant.balance_factors(q, k, "cube")


def test_alpha_of_a_head_without_live_channels_is_one():
    q = np.zeros((1, 2, 4, 8))
    k = np.ones((1, 1, 6, 8))
    assert (i8quant.balance_factors(q, k) == 1).all()


@pytest.mark.parametrize("fmt", I8)
def test_balanced_emulator_quantizes_the_balanced_operands_and_keeps_the_lse(rng, fmt):
    """The scores are the exact int32 products of Q8 = codes(q̃·α) and K8 = codes(K̃/α), and the LSE
    (q̃·K̄ added back) stays as close to FP64 as mean-only's."""
    q = rng.standard_normal((1, 4, 130, 64), dtype=np.float32)
    k = rng.standard_normal((1, 2, 200, 64), dtype=np.float32)
    k[..., :3] *= np.float32(80)
    v = rng.standard_normal(k.shape, dtype=np.float32)
    got = emulate.scores(fmt, q, k, v, smoothing="mean+balance")
    qb, kb, _ = i8quant.smooth(quant.fold_softmax_scale(q, 1 / 8), k, "mean+balance")
    q8 = i8quant.quantize_int8(qb, 128, operand="q")
    k8 = i8quant.quantize_int8(kb, 64, operand="k")
    exact = np.einsum("bhqd,bhkd->bhqk", q8.codes.astype(np.int64), np.repeat(k8.codes.astype(np.int64), 2, axis=1))
    expected = exact.astype(np.float32) * q8.scale * np.repeat(k8.scale, 2, axis=1)[..., 0][:, :, None, :]
    assert np.array_equal(got, expected)
    ref, ref_lse = emulate.reference(fmt, q, k, v, causal=True, return_lse=True)
    lse_error = {s: np.abs(emulate.emulate(fmt, q, k, v, causal=True, return_lse=True, smoothing=s)[1] - ref_lse).max()
                 for s in ("mean", "mean+balance")}
    assert lse_error["mean+balance"] <= 1.05 * lse_error["mean"], lse_error


def test_alpha_rule_is_checked(rng):
    q, k, v = (rng.standard_normal((1, 1, 9, 16), dtype=np.float32) for _ in range(3))
    with pytest.raises(ValueError, match="^alpha_rule: expected one of"):
        emulate.emulate("i8-f8", q, k, v, smoothing="mean+balance", alpha_rule="exact")


def _ratio(fmt, d):
    ref = emulate.reference(fmt, d["q"], d["k"], d["v"])
    mean, balanced = (metrics.compare(emulate.emulate(fmt, d["q"], d["k"], d["v"], smoothing=s), ref).rel_l2
                      for s in ("mean", "mean+balance"))
    return balanced / mean


@pytest.mark.parametrize("fmt, at_most", [("i8-f16", 0.4), ("i8-i8", 0.6), ("i8-f8", 0.6)])
def test_balancing_cuts_the_error_on_scale_outliers(rng, fmt, at_most):
    """The issue's targets on the scale-outlier preset: balanced at <= 0.4x (i8-f16) and <= 0.6x
    (i8-i8, i8-f8) of mean-only's rel_l2 (measured 0.27–0.36 at this size)."""
    d = data.preset("outliers_scale", ctx=2048, queries=128, heads=4, seed=_seed(rng))
    assert _ratio(fmt, d) <= at_most


@pytest.mark.parametrize("preset", ["normal", "outliers", "outliers_token", "bias", "rope", "rope_massive",
                                    "diffuse"])
def test_balancing_never_costs_more_than_5_percent(rng, preset):
    """On every other preset, balanced rel_l2 is at most 1.05x mean-only's for every format."""
    d = data.preset(preset, ctx=2048, queries=128, heads=2, seed=_seed(rng))
    ratios = {fmt: _ratio(fmt, d) for fmt in I8}
    assert max(ratios.values()) <= 1.05, ratios
