"""The quantizers of qattn.check.quant against DESIGN §2, on fresh random inputs."""
import math

import ml_dtypes
import numpy as np
import pytest

from qattn import data
from qattn.check import quant
from qattn.formats.int8qk import quant as i8quant
from qattn.formats.kv8 import quant as kvquant
from qattn.check.reference import attention

INT32_MAX = 2 ** 31 - 1


# ---- K smoothing -------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_smoothing_is_exact_in_fp64(rng, causal):
    """Subtracting K's mean over keys moves each row's scores by one constant: FP64 attention
    agrees to 1e-12, and the LSE moves by exactly q·K̄·τ."""
    d = data.outliers(batch=2, heads=4, kv_heads=2, queries=37, ctx=301, head_dim=64, seed=int(rng.integers(1 << 30)))
    q, k, v = (d[name].astype(np.float64) for name in ("q", "k", "v"))
    smoothed, mean = i8quant.smooth_k(k)
    assert smoothed.dtype == np.float64 and mean.shape == (2, 2, 1, 64)
    assert np.abs(smoothed.mean(axis=-2)).max() < 1e-12 * np.abs(k).max()
    out, lse = attention(q, k, v, causal=causal, return_lse=True)
    out_s, lse_s = attention(q, smoothed, v, causal=causal, return_lse=True)
    assert np.abs(out - out_s).max() <= 1e-12 * np.abs(out).max()
    shift = np.einsum("bhqd,bhd->bhq", q, np.repeat(mean[:, :, 0], 2, axis=1)) / math.sqrt(64)
    assert np.allclose(lse, lse_s + shift, rtol=0, atol=1e-11)


def test_smoothing_removes_a_shared_offset(rng):
    k = rng.standard_normal((1, 3, 129, 32), dtype=np.float32) + np.float32(40)
    smoothed, mean = i8quant.smooth_k(k)
    assert smoothed.dtype == np.float32
    assert np.allclose(mean, 40, atol=0.5) and np.abs(smoothed).max() < 6


def test_fold_softmax_scale(rng):
    q = rng.standard_normal((1, 2, 9, 16), dtype=np.float32)
    assert np.allclose(quant.fold_softmax_scale(q, 0.25), q * 0.25 * math.log2(math.e), rtol=1e-6)


# ---- int8 Q / K / V -----------------------------------------------------------------------------

def _groups(length: int, block: int, granularity: str, warps: int, operand: str) -> np.ndarray:
    """An independent statement of which scale group each row belongs to (module docstring)."""
    row = np.arange(length)
    b, r = row // block, row % block
    if granularity == "block":
        return b
    if granularity == "warp":
        return b * warps + r // (block // warps)
    if operand == "q":
        return (b * warps + r // (block // warps)) * 8 + r % 8
    return b * 4 + (r % 8) // 2


@pytest.mark.parametrize("granularity, operand, block, warps, length", [
    ("block", "q", 128, 4, 300), ("block", "k", 64, 4, 1500), ("warp", "q", 128, 4, 257),
    ("warp", "k", 64, 2, 130), ("thread", "q", 128, 4, 333), ("thread", "k", 64, 4, 201),
    ("thread", "q", 64, 2, 7),
])
def test_int8_scale_groups(rng, granularity, operand, block, warps, length):
    row_size = rng.uniform(0.1, 10, (2, 3, length, 1)).astype(np.float32)
    x = rng.standard_normal((2, 3, length, 32), dtype=np.float32) * row_size
    got = i8quant.quantize_int8(x, block, granularity=granularity, warps=warps, operand=operand)
    assert got.codes.dtype == np.int8 and got.scale.dtype == np.float32 and got.scale.shape == (2, 3, length, 1)
    assert np.abs(got.codes.astype(np.int32)).max() <= 127
    groups = _groups(length, block, granularity, warps, operand)
    for g in np.unique(groups):
        rows = groups == g
        expected = (np.abs(x[:, :, rows]).max(axis=(-2, -1)) / np.float32(127)).astype(np.float32)
        group_scale = got.scale[:, :, rows, 0]
        assert np.array_equal(group_scale, np.broadcast_to(expected[..., None], group_scale.shape))
        # each group's largest element lands on ±127
        assert (np.abs(got.codes[:, :, rows].astype(np.int32)).max(axis=(-2, -1)) == 127).all()
    assert (np.abs(got.dequantize() - x) <= 0.5001 * got.scale).all()


@pytest.mark.parametrize("kwargs, field", [
    (dict(block=64, granularity="row"), "granularity"), (dict(block=64, operand="v"), "operand"),
    (dict(block=0), "block"), (dict(block=64, granularity="warp", warps=3), "warps"),
    (dict(block=60, granularity="thread", operand="q", warps=1), "block"),
    (dict(block=12, granularity="thread", operand="k"), "block"),
])
def test_int8_bad_arguments_name_the_argument(rng, kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        i8quant.quantize_int8(rng.standard_normal((1, 1, 70, 8), dtype=np.float32), **kwargs)


def test_v_per_channel_int8_and_e4m3(rng):
    v = rng.standard_normal((2, 2, 777, 64), dtype=np.float32) * rng.uniform(0.01, 30, 64).astype(np.float32)
    absmax = np.abs(v).max(axis=-2, keepdims=True)
    v8 = i8quant.quantize_v_int8(v)
    assert v8.scale.shape == (2, 2, 1, 64) and np.array_equal(v8.scale, (absmax / np.float32(127)).astype(np.float32))
    assert (np.abs(v8.dequantize() - v) <= 0.5001 * v8.scale).all()
    f8 = i8quant.quantize_v_e4m3(v)
    assert f8.codes.dtype == quant.E4M3
    assert np.array_equal(f8.scale, (absmax / np.float32(448)).astype(np.float32))
    assert np.abs(f8.codes.astype(np.float32)).max() == 448
    # e4m3 keeps a constant relative error (3 mantissa bits) in its normal range
    normal = np.abs(v / f8.scale) >= 2.0 ** -6
    assert (np.abs(f8.dequantize() - v)[normal] <= 2.0 ** -4 * np.abs(v)[normal] * 1.0001).all()


# ---- e4m3 and the P grids ------------------------------------------------------------------------

def test_e4m3_grid():
    assert float(ml_dtypes.finfo(quant.E4M3).smallest_subnormal) == 2.0 ** -9
    e = lambda x: quant.to_e4m3(np.asarray(x, np.float32)).astype(np.float64)  # noqa: E731
    assert e(2.0 ** -9) == 2.0 ** -9 and e(448) == 448
    assert e(500) == 448 and e(1e9) == 448 and e(-1e9) == -448  # saturating, never NaN
    # round-to-nearest-even at ties: subnormal, normal and top binade
    assert e(2.0 ** -10) == 0 and e(3 * 2.0 ** -10) == 2.0 ** -8
    assert e(1 + 1 / 16) == 1 and e(1 + 3 / 16) == 1.25 and e(-(1 + 3 / 16)) == -1.25
    assert e(432) == 448 and e(400) == 384 and e(1 + 1 / 16 + 2.0 ** -20) == 1.125
    # every e4m3 value is a fixed point
    grid = np.arange(256, dtype=np.uint8).view(quant.E4M3).astype(np.float32)
    finite = grid[np.isfinite(grid)]
    assert np.array_equal(quant.to_e4m3(finite).astype(np.float32), finite)


def test_p_grids_floors():
    smallest = 2.0 ** -9 / 448
    assert abs(smallest - 4.4e-6) < 0.05e-6
    p = np.array([smallest, smallest * 0.51, smallest * 0.49, 1.0, 0.3], np.float32)
    f8 = i8quant.quantize_p_e4m3(p).astype(np.float64)
    assert f8[0] == 2.0 ** -9 and f8[1] == 2.0 ** -9 and f8[2] == 0 and f8[3] == 448
    i8 = i8quant.quantize_p_int8(np.array([1.0, 0.5 / 127 * 0.99, 0.5 / 127 * 1.01, 2.6 / 127, 0.0], np.float32))
    assert i8.dtype == np.int8 and i8.tolist() == [127, 0, 1, 3, 0]


# ---- the int8 KV cache --------------------------------------------------------------------------

def test_kv_cache_roundtrip(rng):
    token_size = rng.uniform(0.01, 5, (2, 3, 1025, 1)).astype(np.float32)
    x = rng.standard_normal((2, 3, 1025, 64), dtype=np.float32) * token_size
    cache = kvquant.quantize_kv_cache(x)
    assert cache.codes.dtype == np.int8 and cache.scales.dtype == np.float32 and cache.scales.shape == (2, 3, 1025)
    assert np.array_equal(cache.scales, (np.abs(x).max(axis=-1) / np.float32(127)).astype(np.float32))
    exact = cache.dequantize()
    assert exact.dtype == np.float64
    assert np.array_equal(exact, cache.codes.astype(np.float64) * cache.scales.astype(np.float64)[..., None])
    assert (np.abs(exact - x) <= 0.5001 * cache.scales[..., None]).all()
    assert cache.dequantize(np.float32).dtype == np.float32


def test_kv_cache_validates(rng):
    codes = rng.integers(-127, 128, (1, 2, 5, 8)).astype(np.int8)
    with pytest.raises(ValueError, match="^codes:"):
        kvquant.Int8Cache(codes.astype(np.int16), np.ones((1, 2, 5), np.float32))
    with pytest.raises(ValueError, match="^scales:"):
        kvquant.Int8Cache(codes, np.ones((1, 2, 6), np.float32))
    with pytest.raises(ValueError, match="^x:"):
        kvquant.quantize_kv_cache(np.ones((2, 5, 8), np.float32))


# ---- the exact 3-way split and the fp16 hi + lo split ---------------------------------------------

def _expected_big(x) -> np.ndarray:
    return np.clip(np.rint(np.asarray(x, np.float64) * 65536), -127 * 65536, 127 * 65536).astype(np.int64)


def _check_split(x):
    h, l, m = kvquant.split3(x)
    assert (h.dtype, l.dtype, m.dtype) == (np.int8, np.int8, np.uint8)
    assert np.array_equal(kvquant.join3(h, l, m), _expected_big(x))
    return h, l, m


def test_split3_reconstructs_random_values_exactly(rng):
    for x in (rng.uniform(-127, 127, 100_000), rng.uniform(-127, 127, 10_000).astype(np.float32),
              rng.standard_normal(10_000) * 1e-4):
        _check_split(x)


def test_split3_edge_values():
    one = 1 / 65536
    x = np.array([127, -127, 0, -0.0, 0.5 * one, -0.5 * one, 1.5 * one, -1.5 * one, 2.5 * one, -2.5 * one,
                  127 - one, -127 + one, 255 * one, 256 * one, -256 * one, 128 * 256 * one, -128 * 256 * one,
                  127.4, -200.0])
    h, l, m = _check_split(x)
    big = kvquant.join3(h, l, m)
    assert big[:4].tolist() == [127 * 65536, -127 * 65536, 0, 0]
    assert big[4:10].tolist() == [0, 0, 2, -2, 2, -2]  # rint rounds halves to even
    assert big[-2:].tolist() == [127 * 65536, -127 * 65536]  # beyond ±127 clamps
    assert (h[0], l[0], m[0]) == (127, 0, 0) and (h[1], l[1], m[1]) == (-127, 0, 0)
    assert (h[6], l[6], m[6]) == (0, 0, 2) and (h[7], l[7], m[7]) == (0, -1, 254)  # -2 = -256 + 254


def test_int32_partial_sums_stay_in_range():
    """Every exact integer sum the kernels form: Q8·K8 over head_dim ≤ 256, a split part times K8
    over a 64-channel group or D ≤ 256, and times V8 over a chunk of ≤ 128 keys. The bound holds,
    it fits int32 (and float32's exact-integer range, so cvt to f32 is exact), and the extreme
    operands reach it without overflow; float64 BLAS (the emulators) gives the int64 sums."""
    for terms in (32, 64, 128, 256):
        bound = kvquant.partial_sum_bound(terms)
        assert bound < quant.F32_EXACT_INT <= INT32_MAX
    worst = np.array([-127 * 65536 + 1, 127 * 65536 - 1, -127.0 * 65536, 127.0 * 65536]) / 65536
    parts = kvquant.split3(worst)
    assert max(np.abs(p.astype(np.int64)).max() for p in parts[:2]) <= 128 and parts[2].max() <= 255
    for terms in (128, 256):
        codes = np.array([-128, 127], np.int64)
        for part in parts:
            operand = np.repeat(part.astype(np.int64)[:, None], terms, axis=1)  # [4, terms]
            for code in codes:
                exact = operand @ np.full(terms, code)
                assert np.abs(exact).max() <= kvquant.partial_sum_bound(terms) <= INT32_MAX
                blas = operand.astype(np.float64) @ np.full(terms, float(code))
                assert np.array_equal(blas, exact.astype(np.float64))
        q8 = np.full(terms, -127, np.int64)
        assert abs(q8 @ np.full(terms, -128)) <= kvquant.partial_sum_bound(terms)
    with pytest.raises(ValueError, match="^terms:"):
        kvquant.partial_sum_bound(0)


def _split_error(x: np.ndarray) -> np.ndarray:
    hi, lo = kvquant.split_f16(x)
    assert hi.dtype == lo.dtype == np.float16 and np.array_equal(hi, x.astype(np.float16))
    return np.abs(hi.astype(np.float64) + lo.astype(np.float64) - x) / np.abs(x)


def test_split_f16_keeps_22_bits(rng):
    x = (rng.uniform(0.5, 1, 100_000) * 2.0 ** rng.integers(-1, 16, 100_000)).astype(np.float32)
    assert _split_error(x).max() <= 2.0 ** -22
    hi_error = np.abs(x.astype(np.float16).astype(np.float64) - x) / x
    assert hi_error.max() > 2.0 ** -14  # hi alone keeps ~11 bits
    # Below 2^-2, lo falls into fp16's subnormals and bits are lost: why kv8-split shifts its operands.
    small = (rng.uniform(0.5, 1, 10_000) * 2.0 ** -8).astype(np.float32)
    assert _split_error(small).max() > 2.0 ** -18
