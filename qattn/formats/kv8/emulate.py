"""The kv8 recipes' emulator products (check/emulate.py runs the flash loop) over an int8 cache
(``quant.Int8Cache``): kv8-f32 dequantizes and runs the fp32 recipe; kv8-split applies DESIGN's
hi + lo split after a power-of-two range shift (``_fp16_shift``), which gives it the ~22 bits DESIGN
states (``fp16_shift=False`` models the split as written, whose lo part falls into fp16
subnormals); kv8-imma's 24-bit 3-way split runs three exact int8 products per operand, combined in
fp32 in the kernel's order. Every partial sum is at most ``quant.partial_sum_bound`` (255·128·256 <
2^24 for head_dim 256)."""
from __future__ import annotations

import numpy as np

from ...check import quant as common
from ...check.emulate import F32, Tiles, exact, f32_tiles
from ...check.reference import to_numpy
from . import quant

# kv8-imma scales q̃ per (query head, group of this many channels).
IMMA_GROUP = 64


def as_int8_cache(x, name: str = "k") -> quant.Int8Cache:
    """An int8 cache from a cache object, a (codes, scales) pair, or float K/V (quantized here)."""
    if isinstance(x, quant.Int8Cache):
        return x
    if isinstance(x, tuple):
        if len(x) != 2:
            raise ValueError(f"{name}: a cache pair must be (codes, scales), got {len(x)} items")
        return quant.Int8Cache(to_numpy(x[0]), to_numpy(x[1]))
    arr = to_numpy(x)
    if arr.dtype == np.int8:
        raise ValueError(f"{name}: int8 codes need their scales: pass an Int8Cache or (codes, scales)")
    return quant.quantize_kv_cache(arr)


def _kv8_f32_tiles(lay, q, k, v, scale, block_n):
    return f32_tiles(lay, q, k.dequantize(F32), v.dequantize(F32), scale, block_n)


def _fp16_shift(top: np.ndarray) -> np.ndarray:
    """The power of two 2^k that puts top·2^k in [2^14, 2^15). Applied to an operand before its
    fp16 hi+lo split (and undone after the product, exactly), it keeps lo out of fp16's
    subnormal range: without it, w = p·s_V ~ 1e-2 leaves lo only ~14 bits below hi."""
    _, exponent = np.frexp(top)
    return np.where(top > 0, np.ldexp(F32(1), 15 - exponent), F32(1)).astype(F32)


def _kv8_split_tiles(lay, q, k, v, scale, block_n, *, fp16_shift=True):
    q2 = common.fold_softmax_scale(q, scale)
    shift = _fp16_shift if fp16_shift else np.ones_like
    q_shift = shift(np.abs(q2).max(axis=(-2, -1), keepdims=True))  # per (batch, query head)
    hi, lo = (lay.q(x.astype(F32)) for x in quant.split_f16(q2 * q_shift))
    q_unshift = lay.q(F32(1) / q_shift)
    kc, ks = lay.kv(k.codes.astype(F32)), lay.kv(k.scales)
    v_shift = shift(v.scales.max(axis=-1, keepdims=True))  # per (batch, kv head)
    vc, vs = lay.kv(v.codes.astype(F32)), lay.kv(v.scales * v_shift)
    v_unshift = lay.kv(F32(1) / v_shift)[..., None]

    def scores(j0, j1):  # two fp16 MMAs into one fp32 accumulator; int8 codes are exact in fp16
        kt = kc[..., j0:j1, :].swapaxes(-1, -2)
        return (hi @ kt + lo @ kt) * q_unshift * ks[..., None, j0:j1]

    def pv(p, j0, j1):
        w_hi, w_lo = (x.astype(F32) for x in quant.split_f16(p * vs[..., None, j0:j1]))
        vt = vc[..., j0:j1, :]
        return (w_hi @ vt + w_lo @ vt) * v_unshift

    return Tiles(scores, pv)


# The kernel starts each int32 part sum at this value, so that its bits are those of the float
# bias + sum (imma.cuh.j2); the combination below rounds h·65536 + l·256 less it.
_IMMA_BIAS = 1.5 * 2 ** 23


def _combine3(sums: np.ndarray) -> np.ndarray:
    """Σh·65536 + Σl·256 + Σm in float32 from the three exact part sums stacked on axis 0, in the
    kernel's order: h·65536 + l·256 - bias rounded once (its two FMAs), plus bias + m (exact) rounded
    once more."""
    h, l, m = sums
    high = (h * F32(quant.SPLIT_ONE) + l * 256.0 - _IMMA_BIAS).astype(F32)  # exact in float64
    return high + (m + _IMMA_BIAS).astype(F32)


def _fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """a·b + c for float32 operands with one rounding, as the GPU's fused multiply-add. The product
    is exact in float64; the sum is rounded to odd there (TwoSum gives its error), which makes the
    final rounding to float32 the correctly rounded one."""
    p = np.asarray(a, np.float64) * np.asarray(b, np.float64)
    c = np.asarray(c, np.float64)
    s = p + c
    t = s - p
    err = (p - (s - t)) + (c - t)
    even = (s.view(np.int64) & 1) == 0
    s = np.where((err != 0) & even, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(F32)


def _split3_stack(x: np.ndarray, signed_low: bool) -> np.ndarray:
    return np.stack([exact(part) for part in quant.split3(x, signed_low)])


def _safe(scale: np.ndarray) -> np.ndarray:
    return np.where(scale > 0, scale, F32(1))


def _kv8_imma_tiles(lay, q, k, v, scale, block_n, *, signed_low=False):
    """signed_low: the split's low byte signed too (quant.split3), as the HIP kernel's signed-only int8 ops take it:
    the same X, other part sums, so the fp32 combination rounds otherwise."""
    if quant.partial_sum_bound(max(block_n, IMMA_GROUP)) >= 2 ** 31:
        raise ValueError(f"block_n: {block_n} keys per chunk can overflow kv8-imma's int32 sums")
    q2 = common.fold_softmax_scale(q, scale)
    d = q2.shape[-1]
    groups = -(-d // IMMA_GROUP)
    width = min(d, IMMA_GROUP)
    pad = [(0, 0)] * 3 + [(0, groups * width - d)]

    def by_group(x):  # [..., L, D] -> [..., G, L, width]
        x = np.pad(x, pad)
        return np.moveaxis(x.reshape(x.shape[:-1] + (groups, width)), -2, -3)

    qg = lay.q(by_group(q2))  # [B, Hkv, g, G, Lq, width]
    q_scale = (np.abs(qg).max(axis=(-2, -1), keepdims=True) / F32(common.INT8_MAX)).astype(F32)
    q_parts = _split3_stack(qg / _safe(q_scale), signed_low)  # [3, B, Hkv, g, G, Lq, width]
    q_unit = q_scale / F32(quant.SPLIT_ONE)
    kc = exact(lay.kv(by_group(k.codes.astype(F32))))  # [B, Hkv, 1, G, Lk, width]
    ks = lay.kv(k.scales)
    vc, vs = exact(lay.kv(v.codes)), lay.kv(v.scales)

    def scores(j0, j1):  # per group: three exact int8 products combined in fp32; groups joined by FMAs
        per_group = _combine3(q_parts @ kc[..., j0:j1, :].swapaxes(-1, -2))  # [B, Hkv, g, G, Lq, keys]
        s = per_group[..., 0, :, :] * q_unit[..., 0, :, :]
        for g in range(1, groups):
            s = _fma32(per_group[..., g, :, :], q_unit[..., g, :, :], s)
        return s * ks[..., None, j0:j1]

    def add_pv(acc, p, j0, j1):  # w scaled per (row, chunk of keys) to 127, split, three exact products
        w = p * vs[..., None, j0:j1]
        w_scale = (w.max(axis=-1, keepdims=True) / F32(common.INT8_MAX)).astype(F32)
        to_split = (F32(1) / _safe(w_scale)) * F32(quant.SPLIT_ONE)  # w to X = x·65536
        part_sums = _split3_stack((w * to_split).astype(np.float64) / quant.SPLIT_ONE, signed_low) @ vc[..., j0:j1, :]
        return _fma32(_combine3(part_sums), w_scale / F32(quant.SPLIT_ONE), acc)

    def pv(p, j0, j1):
        return add_pv(np.zeros(p.shape[:-1] + (vc.shape[-1],), F32), p, j0, j1)

    return Tiles(scores, pv, add_pv=add_pv)


EMULATORS = {"kv8-f32": _kv8_f32_tiles, "kv8-split": _kv8_split_tiles, "kv8-imma": _kv8_imma_tiles}
