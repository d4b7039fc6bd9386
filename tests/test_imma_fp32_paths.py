"""NumPy models of imma.cuh.j2's two fp32 shortcuts around the int8 MMAs, checked against the
definitions they replace on the CPU: the biased part sums converted by reinterpretation (combine3)
and the split of nonnegative weights by one fp32 addition (split3_pack4_nonneg); and emulate's model
of the fused multiply-add the kernel accumulates with."""
import numpy as np

from qattn.formats.kv8 import quant as kvquant
F32 = np.float32
BIAS = 0x4B400000  # QATTN_MAGIC_BITS: the bits of 1.5·2^23
BIAS_F = F32(12582912.0)


def _fma(a, b, c):
    # Every product and sum here is exact in float64 (integers below 2^53), so one rounding to float32
    # is the fused multiply-add's.
    return (a.astype(np.float64) * b + c).astype(F32)


def test_biased_combine3_equals_the_emulator_order():
    from qattn.formats.kv8.emulate import _combine3

    rng = np.random.default_rng(1)
    n = 200_000
    limit = 2 ** 22  # the part sums stay below it (QATTN_IMMA_MAX_TERMS products of 255·128)
    h, l = (rng.integers(-limit + 1, limit, n) for _ in range(2))
    m = rng.integers(0, limit, n)
    edges = np.array([-limit + 1, limit - 1, 0, 1, -1])
    h, l, m = (np.concatenate([x, e]) for x, e in ((h, edges), (l, edges[::-1]), (m, np.abs(edges))))
    want = _combine3(np.stack([h, l, m]).astype(np.float64))
    as_float = lambda s: (s + BIAS).astype(np.int32).view(F32)  # what the MMA leaves in the register
    h0 = _fma(as_float(h), 65536.0, -float(BIAS_F) * 65793.0)
    assert np.array_equal(h0.astype(np.float64), h * 65536.0 - float(BIAS_F) * 257.0)  # exact
    got = _fma(as_float(l), 256.0, h0) + as_float(m)
    assert got.dtype == F32
    assert np.array_equal(got, want)
    # one rounding of the high part and one of the sum: within 1.5 ulp of the exact total
    exact = h * 65536.0 + l * 256.0 + m
    assert np.all(np.abs(got - exact) <= 1.5 * np.spacing(np.abs(exact).astype(F32)) + 0.5)


def test_nonneg_split_by_fp32_addition_equals_split3():
    rng = np.random.default_rng(2)
    x = np.concatenate([
        rng.uniform(0, 127, 200_000),
        rng.integers(0, 127 * 65536, 50_000) / 65536 + 0.5 / 65536,  # exact ties: rint rounds half to even
        np.array([0.0, 127.0, 127.00001, 126.999, 1e-30, 2.0 ** -17, 3 * 2.0 ** -17]),
    ]).astype(F32)
    h, l, m = kvquant.split3(x)
    y = (np.minimum(x * F32(65536), F32(kvquant.SPLIT_MAX)) + F32(8421376)).view(np.uint32)  # X = x·65536 given
    assert np.array_equal((y & 0xFF).astype(np.uint8), m)
    assert np.array_equal((((y >> 8) & 0xFF) ^ 0x80).astype(np.uint8).view(np.int8), l)
    assert np.array_equal(((y >> 16) & 0xFF).astype(np.uint8).view(np.int8), h)


def test_fma32_rounds_once():
    from fractions import Fraction

    from qattn.formats.kv8.emulate import _fma32

    rng = np.random.default_rng(3)
    n = 4000
    a, b = (rng.standard_normal(n).astype(F32) for _ in range(2))
    # c near -a·b, so that the product's low bits decide the result, and c of far smaller magnitude
    c = np.concatenate([(-(a[: n // 2].astype(np.float64) * b[: n // 2])).astype(F32) * F32(1 + 2 ** -20),
                        rng.standard_normal(n - n // 2).astype(F32) * F32(2 ** -30)])
    # and sums a hair below a float32 midpoint, which float64 rounds onto it: (1 + 2^-23) +
    # 2^-24·(1 - 2^-36) must round down, where rounding twice goes up to the even neighbour
    scale = np.ldexp(F32(1), rng.integers(-20, 20, 64)) * rng.choice(F32([-1, 1]), 64)
    a = np.concatenate([a, (F32(2 ** -12 * (1 + 2 ** -18)) * scale).astype(F32)])
    b = np.concatenate([b, np.full(64, 2 ** -12 * (1 - 2 ** -18), F32)])
    c = np.concatenate([c, (F32(1 + 2 ** -23) * scale).astype(F32)])
    got = _fma32(a, b, c)
    for i in list(range(0, n, 23)) + list(range(n, n + 64)):
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        near = F32(float(exact))  # within one float32 step of the correctly rounded value
        candidates = [np.nextafter(near, F32(-np.inf)), near, np.nextafter(near, F32(np.inf))]
        best = min(candidates, key=lambda x: (abs(Fraction(float(x)) - exact), int(x.view(np.uint32)) & 1))
        assert got[i] == best, (i, a[i], b[i], c[i])
    twice = (a[n:].astype(np.float64) * b[n:] + c[n:]).astype(F32)
    assert np.all(twice != got[n:])  # the hard cases do tell one rounding from two
