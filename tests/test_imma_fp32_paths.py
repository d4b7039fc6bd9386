"""NumPy models of imma.cuh.j2's two fp32 shortcuts around the int8 MMAs, checked against the
definitions they replace on the CPU: the biased part sums converted by reinterpretation (combine3)
and the split of nonnegative weights by one fp32 addition (split3_pack4_nonneg)."""
import numpy as np

from qattn.runtime import quant

F32 = np.float32
BIAS = 0x4B400000  # QATTN_MAGIC_BITS: the bits of 1.5·2^23
BIAS_F = F32(12582912.0)


def _fma(a, b, c):
    # Every product and sum here is exact in float64 (integers below 2^53), so one rounding to float32
    # is the fused multiply-add's.
    return (a.astype(np.float64) * b + c).astype(F32)


def test_biased_combine3_equals_the_emulator_order():
    rng = np.random.default_rng(1)
    n = 200_000
    limit = 2 ** 22  # the part sums stay below it (QATTN_IMMA_MAX_TERMS products of 255·128)
    h, l = (rng.integers(-limit + 1, limit, n) for _ in range(2))
    m = rng.integers(0, limit, n)
    edges = np.array([-limit + 1, limit - 1, 0, 1, -1])
    h, l, m = (np.concatenate([x, e]) for x, e in ((h, edges), (l, edges[::-1]), (m, np.abs(edges))))
    want = (h.astype(F32) * F32(65536) + l.astype(F32) * F32(256)) + m.astype(F32)  # emulate._combine3's order
    as_float = lambda s: (s + BIAS).astype(np.int32).view(F32)  # what the MMA leaves in the register
    hl0 = _fma(as_float(h), 65536.0, -float(BIAS_F) * 65792.0)
    assert np.array_equal(hl0.astype(np.float64), h * 65536.0 - float(BIAS_F) * 256.0)  # exact
    got = _fma(as_float(l), 256.0, hl0) + (as_float(m) - BIAS_F)
    assert got.dtype == F32
    assert np.array_equal(got, want)


def test_nonneg_split_by_fp32_addition_equals_split3():
    rng = np.random.default_rng(2)
    x = np.concatenate([
        rng.uniform(0, 127, 200_000),
        rng.integers(0, 127 * 65536, 50_000) / 65536 + 0.5 / 65536,  # exact ties: rint rounds half to even
        np.array([0.0, 127.0, 127.00001, 126.999, 1e-30, 2.0 ** -17, 3 * 2.0 ** -17]),
    ]).astype(F32)
    h, l, m = quant.split3(x)
    y = (np.minimum(x * F32(65536), F32(quant.SPLIT_MAX)) + F32(8421376)).view(np.uint32)
    assert np.array_equal((y & 0xFF).astype(np.uint8), m)
    assert np.array_equal((((y >> 8) & 0xFF) ^ 0x80).astype(np.uint8).view(np.int8), l)
    assert np.array_equal(((y >> 16) & 0xFF).astype(np.uint8).view(np.int8), h)
