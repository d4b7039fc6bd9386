"""CPU emulators: NumPy models of what each recipe's kernel computes (DESIGN §2, §3), and the flash
loop they share.

Every emulator runs the kernel's flash loop — tiles of ``block_n`` keys, an online softmax
with a running row max m and row sum l in float32, scores in the exp2 domain with τ·log2 e
folded in — and plugs in its recipe's two products, which the recipe's family builds (its
``emulate.py``, registered as ``FormatFamily.emulators``):

- ``scores(j0, j1)``: the float32 log2-domain scores of keys j0:j1, with the recipe's operand
  roundings and scales;
- ``pv(p, j0, j1)``: the float32 product of the tile's probabilities p with V, after the
  recipe rounds or quantizes p.

Integer products are exact: codes are held as float64 and multiplied with BLAS, which gives the
same sums as int64 NumPy (tests check it) at BLAS speed, because every partial sum is an integer
far below 2^53, then converted to float32 as a kernel converts its int32 accumulator.

Semantics match ``reference.attention``: BHSD, GQA (query head h reads kv head h // g),
bottom-right causal, any lengths, rows that see no key return zeros and an LSE of -inf.
Formats whose family stores K and V in a cache (``FormatFamily.kv_cache``: the kv8 formats) take
them as that cache or as float arrays written into it first; ``reference(fmt, ...)`` gives the FP64
answer each recipe is judged against (the dequantized cache there).
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..engine import registry
from . import quant
from .reference import attention as reference_attention
from .reference import check_shapes, to_numpy, visible_keys

F32 = np.float32


@dataclass
class Layout:
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
class Tiles:
    """A recipe's two products and how its output is finished."""

    scores: Callable[[int, int], np.ndarray]
    pv: Callable[[np.ndarray, int, int], np.ndarray]
    out_dtype: type = F32
    lse_shift: np.ndarray | None = None  # log2-domain row constant the scores left out (K smoothing)
    # (acc, p, j0, j1) -> acc with the tile's product added, for a recipe whose kernel fuses the
    # addition into its last rounding; None: acc + pv(p, j0, j1).
    add_pv: Callable[[np.ndarray, np.ndarray, int, int], np.ndarray] | None = None


def exp2_moved(s: np.ndarray, base: np.ndarray, ulps: int) -> np.ndarray:
    """exp2(s - base) of float32 scores s and row maxima base, the exponent moved by ulps float32 steps of
    the larger of |s| and |base| (toward +inf when positive). A kernel forms each exponent with one FMA
    from its unrounded score, where the emulator rounds the score and then subtracts: the two may differ
    by a step of the score's magnitude, and a key whose P lies near a rounding tie of an 8-bit P then
    rounds the other way. Emulating with ulps in -2..2 brackets it."""
    x = s - base
    if ulps:
        live = np.isfinite(x)  # masked keys (-inf) stay masked
        step = np.spacing(np.where(live, np.maximum(np.abs(s), np.abs(base)), F32(1)).astype(F32))
        x = np.where(live, x + F32(ulps) * step, x)
    return np.exp2(x)


def flash_loop(tiles: Tiles, lead: tuple, lq: int, lk: int, d: int, causal: bool, block_n: int,
               exp2_ulps: int = 0):
    """The online softmax over key tiles; returns (O [lead, Lq, D] float32, LSE₂ [lead, Lq]).
    exp2_ulps moves every exponent by that many float32 steps (exp2_moved)."""
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
        alpha = exp2_moved(m, base, exp2_ulps)
        p = exp2_moved(s, base[..., None], exp2_ulps)
        l = l * alpha + p.sum(axis=-1, dtype=F32)
        acc = acc * alpha[..., None]
        acc = tiles.add_pv(acc, p, j0, j1) if tiles.add_pv is not None else acc + tiles.pv(p, j0, j1)
        m = m_new
    live = l > 0
    out = np.where(live[..., None], acc / np.where(live, l, F32(1))[..., None], F32(0))
    with np.errstate(divide="ignore"):
        lse2 = np.where(live, m + np.log2(np.where(live, l, F32(1))), -np.inf).astype(F32)
    return out, lse2


def exact(a: np.ndarray) -> np.ndarray:
    """Integer codes as float64, the operand type of the exact BLAS products."""
    return np.asarray(a, dtype=np.float64)


def to_f32_acc(int_sum: np.ndarray) -> np.ndarray:
    """An exact integer sum converted to float32 (cvt.rn.f32.s32)."""
    return int_sum.astype(F32)


def f32_tiles(lay, q, k, v, scale, block_n):
    """The fp32 recipe's products (every product and sum an fp32 FMA): the f32 format's and, over a
    dequantized cache, kv8-f32's."""
    q2 = lay.q(quant.fold_softmax_scale(q, scale))
    k32, v32 = lay.kv(np.asarray(k, F32)), lay.kv(np.asarray(v, F32))

    def scores(j0, j1):
        return q2 @ k32[..., j0:j1, :].swapaxes(-1, -2)

    def pv(p, j0, j1):
        return p @ v32[..., j0:j1, :]

    return Tiles(scores, pv)


# --- the public surface -----------------------------------------------------------------------

def emulator(fmt: str) -> Callable:
    """The tiles builder of recipe fmt: builder(layout, q, k, v, scale, block_n, **options) -> Tiles."""
    if fmt not in registry.RECIPES:
        raise ValueError(f"fmt: unknown recipe {fmt!r}; expected one of {', '.join(formats())}")
    family = registry.family_of(fmt)
    if fmt not in family.emulators:
        raise ValueError(f"fmt: recipe {fmt!r} has no emulator; emulated: {', '.join(formats())}")
    return family.emulators[fmt]


def formats() -> list[str]:
    """Every registered recipe with an emulator."""
    return [name for family in registry.FAMILIES.values() for name in family.emulators]


def takes_option(fmt: str, option: str) -> bool:
    """Whether recipe fmt's emulator takes the keyword option (e.g. smoothing: the int8-QK recipes)."""
    return option in inspect.signature(emulator(fmt)).parameters


def _kv(fmt: str, k, v):
    """K and V as the recipe's kernel reads them: its family's cache where it has one, else float32."""
    to_cache = registry.family_of(fmt).kv_cache
    if to_cache is not None:
        return to_cache(k, "k"), to_cache(v, "v")
    return np.asarray(to_numpy(k), F32), np.asarray(to_numpy(v), F32)


def _prepare(fmt, q, k, v, scale, block_n, opts):
    """Validate the inputs and build the recipe's tiles; returns (tiles, (B, Hq, Hkv, Lq, Lk, D))."""
    build = emulator(fmt)
    if not isinstance(block_n, (int, np.integer)) or block_n < 1:
        raise ValueError(f"block_n: expected a positive number of keys per tile, got {block_n!r}")
    for option in opts:
        if not takes_option(fmt, option):
            takers = [name for name in formats() if takes_option(name, option)]
            raise ValueError(f"{option}: format {fmt!r} does not take it; only {', '.join(takers) or 'none'} do")
    q = np.asarray(to_numpy(q), F32)
    k, v = _kv(fmt, k, v)
    dims = check_shapes(q.shape, k.shape, v.shape)
    b, hq, hkv, lq, lk, d = dims
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    return build(Layout(b, hkv, hq // hkv), q, k, v, scale, block_n, **opts), dims


def emulate(fmt: str, q, k, v, *, causal: bool = False, scale: float | None = None, return_lse: bool = False,
            block_n: int = 64, exp2_ulps: int = 0, **opts):
    """Run the emulator of recipe fmt: out [B, Hq, Lq, D] (and LSE [B, Hq, Lq], natural log, when
    return_lse); same semantics as reference.attention, except that O is float32 (float16 / bfloat16
    for f16 / bf16) and LSE float32. Options are the recipe's (its family's emulate.py): the int8-QK
    recipes take block_m, q_granularity / k_granularity, warps, smoothing and alpha_rule (smooth_k, deprecated);
    kv8-split fp16_shift, kv8-imma signed_low. exp2_ulps (-2..2) moves every exponent of the softmax by that many float32
    steps, to bracket a kernel's own rounding of it (exp2_moved)."""
    if not isinstance(exp2_ulps, (int, np.integer)) or isinstance(exp2_ulps, bool) or abs(exp2_ulps) > 2:
        raise ValueError(f"exp2_ulps: expected an integer from -2 to 2, got {exp2_ulps!r}")
    tiles, (b, hq, hkv, lq, lk, d) = _prepare(fmt, q, k, v, scale, block_n, opts)
    out, lse2 = flash_loop(tiles, (b, hkv, hq // hkv), lq, lk, d, causal, block_n, int(exp2_ulps))
    out = out.reshape(b, hq, lq, d).astype(tiles.out_dtype)
    if not return_lse:
        return out
    if tiles.lse_shift is not None:
        lse2 = lse2 + tiles.lse_shift
    return out, (lse2 * F32(math.log(2.0))).reshape(b, hq, lq).astype(F32)


def scores(fmt: str, q, k, v, *, scale: float | None = None, block_n: int = 64, **opts) -> np.ndarray:
    """The float32 log2-domain scores S₂ [B, Hq, Lq, Lk] that recipe fmt's kernel feeds its
    softmax (without causal masking; K smoothing's row constant q·K̄ left out, as the kernel
    does; Q/K channel balancing changes them only by rounding). Materializes the whole matrix: for probes on sampled rows."""
    tiles, (b, hq, hkv, lq, lk, d) = _prepare(fmt, q, k, v, scale, block_n, opts)
    s = np.concatenate([tiles.scores(j0, min(lk, j0 + block_n)) for j0 in range(0, lk, block_n)], axis=-1)
    return s.reshape(b, hq, lq, lk)


def reference(fmt: str, q, k, v, *, causal: bool = False, scale: float | None = None, return_lse: bool = False):
    """The FP64 answer recipe fmt is judged against: reference.attention on the inputs as given,
    or, for recipes over a cache, on the dequantized cache (so the error is the kernel's arithmetic
    alone)."""
    emulator(fmt)
    if registry.family_of(fmt).kv_cache is not None:
        k, v = (c.dequantize() for c in _kv(fmt, k, v))
    return reference_attention(q, k, v, causal=causal, scale=scale, return_lse=return_lse)
