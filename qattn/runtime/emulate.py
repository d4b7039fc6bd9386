"""CPU emulators: NumPy models of what each recipe's kernel computes (DESIGN §2, §3).

Every emulator runs the kernel's flash loop — tiles of ``block_n`` keys, an online softmax
with a running row max m and row sum l in float32, scores in the exp2 domain with τ·log2 e
folded in — and plugs in its recipe's two products:

- ``scores(j0, j1)``: the float32 log2-domain scores of keys j0:j1, with the recipe's operand
  roundings and scales;
- ``pv(p, j0, j1)``: the float32 product of the tile's probabilities p with V, after the
  recipe rounds or quantizes p.

Integer products are exact: codes are held as float64 and multiplied with BLAS, which gives the
same sums as int64 NumPy (tests check it) at BLAS speed, because every partial sum is an integer
far below 2^53 (at most ``quant.partial_sum_bound``: 255·128·256 < 2^24 for head_dim 256), then
converted to float32 as a kernel converts its int32 accumulator. e4m3·e4m3 tile products are exact
in float64 too (8-bit significands over 36 binades) and are rounded to float32 once per tile: the
two-level accumulation of DESIGN §2. e4m3 goes through ``ml_dtypes``; fp16/bf16 rounding through
NumPy/``ml_dtypes`` casts (RNE).

``kv8-split`` applies DESIGN's hi + lo split after a power-of-two range shift (``_fp16_shift``),
which is what gives it the ~22 bits DESIGN states; ``fp16_shift=False`` models the split as
written, whose lo part falls into fp16 subnormals.

Semantics match ``reference.attention``: BHSD, GQA (query head h reads kv head h // g),
bottom-right causal, any lengths, rows that see no key return zeros and an LSE of -inf.
The kv8 recipes take K and V as int8 caches (``quant.Int8Cache``, or a ``(codes, scales)``
pair); plain float arrays are written into a cache first. ``reference(fmt, ...)`` gives the
FP64 answer each recipe is judged against (the dequantized cache for kv8).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import ml_dtypes
import numpy as np

from . import quant
from .reference import attention as reference_attention
from .reference import check_shapes, to_numpy, visible_keys

F32 = np.float32
KV8_FORMATS = ("kv8-f32", "kv8-split", "kv8-imma")
# The int8-QK recipes: the ones with K smoothing (option smooth_k, default True).
I8_FORMATS = ("i8-f16", "i8-i8", "i8-f8")
# kv8-imma scales q̃ per (query head, group of this many channels).
IMMA_GROUP = 64


@dataclass
class _Layout:
    """GQA layout: query-side arrays become [B, Hkv, g, Lq, ...], key-side [B, Hkv, 1, Lk, ...],
    so that a query head's tile broadcasts against its kv head."""

    batch: int
    kv_heads: int
    group: int

    def q(self, x: np.ndarray) -> np.ndarray:
        return x.reshape((self.batch, self.kv_heads, self.group) + x.shape[2:])

    def kv(self, x: np.ndarray) -> np.ndarray:
        return np.expand_dims(x, 2)


@dataclass
class _Tiles:
    """A recipe's two products and how its output is finished."""

    scores: Callable[[int, int], np.ndarray]
    pv: Callable[[np.ndarray, int, int], np.ndarray]
    out_dtype: type = F32
    lse_shift: np.ndarray | None = None  # log2-domain row constant the scores left out (K smoothing)
    # (acc, p, j0, j1) -> acc with the tile's product added, for a recipe whose kernel fuses the
    # addition into its last rounding; None: acc + pv(p, j0, j1).
    add_pv: Callable[[np.ndarray, np.ndarray, int, int], np.ndarray] | None = None


def _flash_loop(tiles: _Tiles, lead: tuple, lq: int, lk: int, d: int, causal: bool, block_n: int):
    """The online softmax over key tiles; returns (O [lead, Lq, D] float32, LSE₂ [lead, Lq])."""
    seen = visible_keys(lq, lk, causal)
    m = np.full(lead + (lq,), -np.inf, F32)
    l = np.zeros(lead + (lq,), F32)
    acc = np.zeros(lead + (lq, d), F32)
    for j0 in range(0, int(seen.max()), block_n):  # tiles past every row's last key are skipped
        j1 = min(lk, j0 + block_n)
        s = tiles.scores(j0, j1)
        if causal:
            s = np.where(np.arange(j0, j1)[None, :] >= seen[:, None], F32(-np.inf), s)
        m_new = np.maximum(m, s.max(axis=-1))
        base = np.where(np.isfinite(m_new), m_new, F32(0))  # a row with no key yet keeps p = 0
        alpha = np.exp2(m - base)
        p = np.exp2(s - base[..., None])
        l = l * alpha + p.sum(axis=-1, dtype=F32)
        acc = acc * alpha[..., None]
        acc = tiles.add_pv(acc, p, j0, j1) if tiles.add_pv is not None else acc + tiles.pv(p, j0, j1)
        m = m_new
    live = l > 0
    out = np.where(live[..., None], acc / np.where(live, l, F32(1))[..., None], F32(0))
    with np.errstate(divide="ignore"):
        lse2 = np.where(live, m + np.log2(np.where(live, l, F32(1))), -np.inf).astype(F32)
    return out, lse2


def _exact(a: np.ndarray) -> np.ndarray:
    """Integer codes as float64, the operand type of the exact BLAS products."""
    return np.asarray(a, dtype=np.float64)


def _to_f32_acc(int_sum: np.ndarray) -> np.ndarray:
    """An exact integer sum converted to float32 (cvt.rn.f32.s32)."""
    return int_sum.astype(F32)


# --- recipes: each builds the _Tiles of one format -------------------------------------------

def _half_tiles(dtype):
    def build(lay, q, k, v, scale, block_n):
        qh, kh, vh = (np.asarray(x, F32).astype(dtype).astype(F32) for x in (q, k, v))
        qh, kh, vh = lay.q(qh), lay.kv(kh), lay.kv(vh)
        log2_scale = F32(scale * quant.LOG2E)

        def scores(j0, j1):  # products of halves are exact in fp32; fp32 accumulation
            return (qh @ kh[..., j0:j1, :].swapaxes(-1, -2)) * log2_scale

        def pv(p, j0, j1):
            return p.astype(dtype).astype(F32) @ vh[..., j0:j1, :]

        return _Tiles(scores, pv, out_dtype=dtype)

    return build


def _f32_tiles(lay, q, k, v, scale, block_n):
    q2 = lay.q(quant.fold_softmax_scale(q, scale))
    k32, v32 = lay.kv(np.asarray(k, F32)), lay.kv(np.asarray(v, F32))

    def scores(j0, j1):
        return q2 @ k32[..., j0:j1, :].swapaxes(-1, -2)

    def pv(p, j0, j1):
        return p @ v32[..., j0:j1, :]

    return _Tiles(scores, pv)


def _int8_qk(lay, q, k, scale, block_n, block_m, q_granularity, k_granularity, warps, smooth_k=True):
    """int8 QK with exact K smoothing (smooth_k False: K quantized as given, K̄ = 0): returns
    (scores, lse_shift)."""
    if smooth_k:
        k_smooth, k_mean = quant.smooth_k(np.asarray(k, F32))
    else:
        k_smooth = np.asarray(k, F32)
        k_mean = np.zeros(k_smooth.shape[:-2] + (1, k_smooth.shape[-1]), F32)
    q2 = quant.fold_softmax_scale(q, scale)
    q8 = quant.quantize_int8(q2, block_m, granularity=q_granularity, warps=warps, operand="q")
    k8 = quant.quantize_int8(k_smooth, block_n, granularity=k_granularity, warps=warps, operand="k")
    qc, qs = _exact(lay.q(q8.codes)), lay.q(q8.scale)
    kc, ks = _exact(lay.kv(k8.codes)), lay.kv(k8.scale)

    def scores(j0, j1):
        s_int = qc @ kc[..., j0:j1, :].swapaxes(-1, -2)
        return _to_f32_acc(s_int) * qs * ks[..., j0:j1, 0][..., None, :]

    shift = (lay.q(q2) @ lay.kv(k_mean).swapaxes(-1, -2))[..., 0]
    return scores, shift


def _int8_pv_tiles(pv_format):
    def build(lay, q, k, v, scale, block_n, *, block_m=128, q_granularity="block", k_granularity="block", warps=4,
              smooth_k=True):
        if not isinstance(smooth_k, (bool, np.bool_)):
            raise ValueError(f"smooth_k: expected True or False, got {smooth_k!r}")
        scores, shift = _int8_qk(lay, q, k, scale, block_n, block_m, q_granularity, k_granularity, warps,
                                 bool(smooth_k))
        if pv_format == "f16":
            v16 = lay.kv(np.asarray(v, F32).astype(np.float16).astype(F32))

            def pv(p, j0, j1):
                return p.astype(np.float16).astype(F32) @ v16[..., j0:j1, :]
        else:
            if pv_format == "i8":
                v8, p_scale, quantize_p = quant.quantize_v_int8(v), quant.INT8_MAX, quant.quantize_p_int8
            else:
                v8, p_scale, quantize_p = quant.quantize_v_e4m3(v), quant.E4M3_MAX, quant.quantize_p_e4m3
            vc = _exact(lay.kv(v8.codes))
            out_scale = (lay.kv(v8.scale) / F32(p_scale)).astype(F32)

            def pv(p, j0, j1):  # one tile's product in fp32, added to the fp32 accumulator
                return _to_f32_acc(_exact(quantize_p(p)) @ vc[..., j0:j1, :]) * out_scale

        return _Tiles(scores, pv, lse_shift=shift)

    return build


def _kv8_f32_tiles(lay, q, k, v, scale, block_n):
    return _f32_tiles(lay, q, k.dequantize(F32), v.dequantize(F32), scale, block_n)


def _fp16_shift(top: np.ndarray) -> np.ndarray:
    """The power of two 2^k that puts top·2^k in [2^14, 2^15). Applied to an operand before its
    fp16 hi+lo split (and undone after the product, exactly), it keeps lo out of fp16's
    subnormal range: without it, w = p·s_V ~ 1e-2 leaves lo only ~14 bits below hi."""
    _, exponent = np.frexp(top)
    return np.where(top > 0, np.ldexp(F32(1), 15 - exponent), F32(1)).astype(F32)


def _kv8_split_tiles(lay, q, k, v, scale, block_n, *, fp16_shift=True):
    q2 = quant.fold_softmax_scale(q, scale)
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

    return _Tiles(scores, pv)


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


def _split3_stack(x: np.ndarray) -> np.ndarray:
    return np.stack([_exact(part) for part in quant.split3(x)])


def _safe(scale: np.ndarray) -> np.ndarray:
    return np.where(scale > 0, scale, F32(1))


def _kv8_imma_tiles(lay, q, k, v, scale, block_n):
    if quant.partial_sum_bound(max(block_n, IMMA_GROUP)) >= 2 ** 31:
        raise ValueError(f"block_n: {block_n} keys per chunk can overflow kv8-imma's int32 sums")
    q2 = quant.fold_softmax_scale(q, scale)
    d = q2.shape[-1]
    groups = -(-d // IMMA_GROUP)
    width = min(d, IMMA_GROUP)
    pad = [(0, 0)] * 3 + [(0, groups * width - d)]

    def by_group(x):  # [..., L, D] -> [..., G, L, width]
        x = np.pad(x, pad)
        return np.moveaxis(x.reshape(x.shape[:-1] + (groups, width)), -2, -3)

    qg = lay.q(by_group(q2))  # [B, Hkv, g, G, Lq, width]
    q_scale = (np.abs(qg).max(axis=(-2, -1), keepdims=True) / F32(quant.INT8_MAX)).astype(F32)
    q_parts = _split3_stack(qg / _safe(q_scale))  # [3, B, Hkv, g, G, Lq, width]
    q_unit = q_scale / F32(quant.SPLIT_ONE)
    kc = _exact(lay.kv(by_group(k.codes.astype(F32))))  # [B, Hkv, 1, G, Lk, width]
    ks = lay.kv(k.scales)
    vc, vs = _exact(lay.kv(v.codes)), lay.kv(v.scales)

    def scores(j0, j1):  # per group: three exact int8 products combined in fp32; groups joined by FMAs
        per_group = _combine3(q_parts @ kc[..., j0:j1, :].swapaxes(-1, -2))  # [B, Hkv, g, G, Lq, keys]
        s = per_group[..., 0, :, :] * q_unit[..., 0, :, :]
        for g in range(1, groups):
            s = _fma32(per_group[..., g, :, :], q_unit[..., g, :, :], s)
        return s * ks[..., None, j0:j1]

    def add_pv(acc, p, j0, j1):  # w scaled per (row, chunk of keys) to 127, split, three exact products
        w = p * vs[..., None, j0:j1]
        w_scale = (w.max(axis=-1, keepdims=True) / F32(quant.INT8_MAX)).astype(F32)
        to_split = (F32(1) / _safe(w_scale)) * F32(quant.SPLIT_ONE)  # w to X = x·65536
        part_sums = _split3_stack((w * to_split).astype(np.float64) / quant.SPLIT_ONE) @ vc[..., j0:j1, :]
        return _fma32(_combine3(part_sums), w_scale / F32(quant.SPLIT_ONE), acc)

    def pv(p, j0, j1):
        return add_pv(np.zeros(p.shape[:-1] + (vc.shape[-1],), F32), p, j0, j1)

    return _Tiles(scores, pv, add_pv=add_pv)


_BUILDERS = {
    "f16": _half_tiles(np.float16),
    "bf16": _half_tiles(ml_dtypes.bfloat16),
    "f32": _f32_tiles,
    "i8-f16": _int8_pv_tiles("f16"),
    "i8-i8": _int8_pv_tiles("i8"),
    "i8-f8": _int8_pv_tiles("f8"),
    "kv8-f32": _kv8_f32_tiles,
    "kv8-split": _kv8_split_tiles,
    "kv8-imma": _kv8_imma_tiles,
}


# --- the public surface -----------------------------------------------------------------------

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


def _prepare(fmt, q, k, v, scale, block_n, opts):
    """Validate the inputs and build the recipe's tiles; returns (tiles, (B, Hq, Hkv, Lq, Lk, D))."""
    if not isinstance(block_n, (int, np.integer)) or block_n < 1:
        raise ValueError(f"block_n: expected a positive number of keys per tile, got {block_n!r}")
    if "smooth_k" in opts and fmt not in I8_FORMATS:
        raise ValueError(f"smooth_k: format {fmt!r} has no K smoothing; only {', '.join(I8_FORMATS)} take it")
    q = np.asarray(to_numpy(q), F32)
    if fmt in KV8_FORMATS:
        k, v = as_int8_cache(k, "k"), as_int8_cache(v, "v")
    else:
        k, v = np.asarray(to_numpy(k), F32), np.asarray(to_numpy(v), F32)
    dims = check_shapes(q.shape, k.shape, v.shape)
    b, hq, hkv, lq, lk, d = dims
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    return _BUILDERS[fmt](_Layout(b, hkv, hq // hkv), q, k, v, scale, block_n, **opts), dims


def _run(fmt, q, k, v, *, causal=False, scale=None, return_lse=False, block_n=64, **opts):
    tiles, (b, hq, hkv, lq, lk, d) = _prepare(fmt, q, k, v, scale, block_n, opts)
    out, lse2 = _flash_loop(tiles, (b, hkv, hq // hkv), lq, lk, d, causal, block_n)
    out = out.reshape(b, hq, lq, d).astype(tiles.out_dtype)
    if not return_lse:
        return out
    if tiles.lse_shift is not None:
        lse2 = lse2 + tiles.lse_shift
    return out, (lse2 * F32(math.log(2.0))).reshape(b, hq, lq).astype(F32)


def _emulator(fmt: str) -> Callable:
    def emulator(q, k, v, *, causal=False, scale=None, return_lse=False, block_n=64, **opts):
        return _run(fmt, q, k, v, causal=causal, scale=scale, return_lse=return_lse, block_n=block_n, **opts)

    emulator.__name__ = emulator.__qualname__ = fmt.replace("-", "_")
    emulator.__doc__ = (f"Emulate the {fmt} kernel: out [B, Hq, Lq, D] (and LSE [B, Hq, Lq], natural log, "
                        f"when return_lse); see the module docstring and DESIGN §2.")
    return emulator


EMULATORS: dict[str, Callable] = {fmt: _emulator(fmt) for fmt in _BUILDERS}
"""Recipe name -> emulator(q, k, v, *, causal, scale, return_lse, block_n, **opts). Options:
i8-* take block_m (query rows per Q scale block, 128), q_granularity / k_granularity
("block", "warp", "thread"; see quant), warps (4) and smooth_k (True; False quantizes K without
subtracting K̄, so the LSE has no q·K̄ to add back); kv8-split takes fp16_shift (True)."""


# One function per recipe, e.g. emulate.i8_f8(q, k, v, causal=True).
f16, bf16, f32, i8_f16, i8_i8, i8_f8, kv8_f32, kv8_split, kv8_imma = (EMULATORS[fmt] for fmt in (
    "f16", "bf16", "f32", "i8-f16", "i8-i8", "i8-f8", "kv8-f32", "kv8-split", "kv8-imma"))


def _check_format(fmt: str) -> None:
    if fmt not in EMULATORS:
        raise ValueError(f"fmt: unknown recipe {fmt!r}; expected one of {sorted(EMULATORS)}")


def emulate(fmt: str, q, k, v, *, causal: bool = False, scale: float | None = None, return_lse: bool = False,
            block_n: int = 64, **opts):
    """Run the emulator of recipe fmt; same semantics and return values as reference.attention,
    except that O is float32 (float16 / bfloat16 for f16 / bf16) and LSE float32."""
    _check_format(fmt)
    return EMULATORS[fmt](q, k, v, causal=causal, scale=scale, return_lse=return_lse, block_n=block_n, **opts)


def scores(fmt: str, q, k, v, *, scale: float | None = None, block_n: int = 64, **opts) -> np.ndarray:
    """The float32 log2-domain scores S₂ [B, Hq, Lq, Lk] that recipe fmt's kernel feeds its
    softmax (without causal masking; K smoothing's row constant q·K̄ left out, as the kernel
    does). Materializes the whole matrix: for probes on sampled rows."""
    _check_format(fmt)
    tiles, (b, hq, hkv, lq, lk, d) = _prepare(fmt, q, k, v, scale, block_n, opts)
    s = np.concatenate([tiles.scores(j0, min(lk, j0 + block_n)) for j0 in range(0, lk, block_n)], axis=-1)
    return s.reshape(b, hq, lq, lk)


def reference(fmt: str, q, k, v, *, causal: bool = False, scale: float | None = None, return_lse: bool = False):
    """The FP64 answer recipe fmt is judged against: reference.attention on the inputs as given,
    or, for kv8 recipes, on the dequantized cache (so the error is the kernel's arithmetic alone)."""
    _check_format(fmt)
    if fmt in KV8_FORMATS:
        k, v = as_int8_cache(k, "k").dequantize(), as_int8_cache(v, "v").dequantize()
    return reference_attention(q, k, v, causal=causal, scale=scale, return_lse=return_lse)
