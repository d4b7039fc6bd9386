"""Quantizers of the low-precision attention formats, exactly as DESIGN §2 defines them.

Every function works on NumPy arrays laid out BHSD ([batch, heads, seq, head_dim]); the
sequence axis is -2 and the channel axis -1. Scales are float32 and are returned expanded to
one value per row ([..., seq, 1]) or per channel ([..., 1, head_dim]) so that callers can
multiply without knowing the granularity.

Granularities of the int8 Q/K scales (``quantize_int8``), along the sequence axis:

- ``"block"``: one scale per ``block`` consecutive rows (a CTA's tile: BLOCK_M query rows or
  BLOCK_N keys).
- ``"warp"``: one scale per ``block // warps`` consecutive rows (the rows one warp owns).
- ``"thread"``: SageAttention2's per-thread groups, the rows whose scores one thread holds in
  an ``mma m16n8`` accumulator fragment. For ``operand="q"`` each warp's rows are split by
  ``row % 8`` (a thread holds rows r and r + 8, r = lane // 4), giving 8 groups per warp. For
  ``operand="k"`` each block's keys are split by ``(key % 8) // 2`` (a thread holds columns
  2·(lane % 4) and 2·(lane % 4) + 1 of every 8), giving 4 groups per block.

Rounding is round-half-to-even (``np.rint``) everywhere; e4m3 goes through
``ml_dtypes.float8_e4m3fn`` after clipping to ±448, so it is RNE and saturating.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import ml_dtypes
import numpy as np

LOG2E = 1.4426950408889634
INT8_MAX = 127
E4M3_MAX = 448.0
E4M3 = ml_dtypes.float8_e4m3fn
# The 3-way split represents x (|x| <= 127) as X = rint(x * SPLIT_ONE), 24 bits.
SPLIT_ONE = 65536
SPLIT_MAX = INT8_MAX * SPLIT_ONE
# An int32 accumulator converts to float32 exactly (cvt.rn.f32.s32) below this magnitude.
F32_EXACT_INT = 2 ** 24
GRANULARITIES = ("block", "warp", "thread")


class Quantized(NamedTuple):
    """Integer or e4m3 codes and the float32 scale that multiplies them back (broadcastable)."""

    codes: np.ndarray
    scale: np.ndarray

    def dequantize(self) -> np.ndarray:
        return self.codes.astype(np.float64) * self.scale.astype(np.float64)


def smooth_k(k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """K smoothing: K̄ = mean of K over the key axis per (batch, kv head, channel); returns
    (K - K̄, K̄), in float32 (float64 stays float64). Softmax is unchanged by it: each row's
    scores all move by the same q·K̄."""
    k = np.asarray(k)
    dtype = np.float64 if k.dtype == np.float64 else np.float32
    mean = k.astype(np.float64).mean(axis=-2, keepdims=True).astype(dtype)
    return k.astype(dtype) - mean, mean


def fold_softmax_scale(q: np.ndarray, scale: float) -> np.ndarray:
    """q̃ = q·τ·log2 e in float32: scores come out in the exp2 domain."""
    return np.asarray(q, dtype=np.float32) * np.float32(scale * LOG2E)


def _symmetric_int8(x: np.ndarray, absmax: np.ndarray) -> Quantized:
    """codes = rint(x / s) clipped to ±127 with s = absmax / 127 (float32); s = 0 gives codes 0."""
    scale = (absmax / np.float32(INT8_MAX)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    codes = np.clip(np.rint(x / safe), -INT8_MAX, INT8_MAX).astype(np.int8)
    return Quantized(codes, scale)


def _group_absmax(blocks: np.ndarray, block: int, granularity: str, warps: int, operand: str) -> np.ndarray:
    """Absmax of each scale group of blocks [..., n_blocks, block, D], expanded back to
    [..., n_blocks, block, 1]."""
    lead = blocks.shape[:-2]
    d = blocks.shape[-1]
    if granularity == "block":
        return np.broadcast_to(np.abs(blocks).max(axis=(-2, -1), keepdims=True), lead + (block, 1))
    if granularity == "warp":
        if block % warps:
            raise ValueError(f"warps: block {block} is not divisible by {warps} warps")
        g = np.abs(blocks.reshape(lead + (warps, block // warps, d))).max(axis=(-2, -1), keepdims=True)
        return np.broadcast_to(g, lead + (warps, block // warps, 1)).reshape(lead + (block, 1))
    if operand == "q":
        rows = block // warps
        if block % warps or rows % 8:
            raise ValueError(f"block: per-thread Q groups need block/warps to be a multiple of 8, got {block}/{warps}")
        g = np.abs(blocks.reshape(lead + (warps, rows // 8, 8, d))).max(axis=(-3, -1), keepdims=True)
        return np.broadcast_to(g, lead + (warps, rows // 8, 8, 1)).reshape(lead + (block, 1))
    if block % 8:
        raise ValueError(f"block: per-thread K groups need a multiple of 8 keys, got {block}")
    g = np.abs(blocks.reshape(lead + (block // 8, 4, 2, d))).max(axis=(-4, -2, -1), keepdims=True)
    return np.broadcast_to(g, lead + (block // 8, 4, 2, 1)).reshape(lead + (block, 1))


def quantize_int8(x: np.ndarray, block: int, *, granularity: str = "block", warps: int = 4,
                  operand: str = "q") -> Quantized:
    """Symmetric int8 along the sequence axis: s = max|x| / 127 over each scale group (see the
    module docstring for the groups), codes = rint(x / s). Returns codes int8 [..., L, D] and
    scale float32 [..., L, 1] (each row's group scale). A trailing partial block is its own
    group."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity: expected one of {GRANULARITIES}, got {granularity!r}")
    if operand not in ("q", "k"):
        raise ValueError(f"operand: expected 'q' or 'k', got {operand!r}")
    if block < 1:
        raise ValueError(f"block: expected a positive number of rows, got {block}")
    x = np.asarray(x, dtype=np.float32)
    length = x.shape[-2]
    n_blocks = -(-length // block)
    pad = [(0, 0)] * (x.ndim - 2) + [(0, n_blocks * block - length), (0, 0)]
    blocks = np.pad(x, pad).reshape(x.shape[:-2] + (n_blocks, block, x.shape[-1]))  # zero rows leave absmax alone
    absmax = _group_absmax(blocks, block, granularity, warps, operand)
    absmax = absmax.reshape(x.shape[:-2] + (n_blocks * block, 1))[..., :length, :]
    return _symmetric_int8(x, absmax)


def quantize_v_int8(v: np.ndarray) -> Quantized:
    """Per-channel int8 V: s_V = max over keys |V_c| / 127 per (batch, kv head, channel)."""
    v = np.asarray(v, dtype=np.float32)
    return _symmetric_int8(v, np.abs(v).max(axis=-2, keepdims=True))


def to_e4m3(x: np.ndarray) -> np.ndarray:
    """Round to e4m3 (round-to-nearest-even, saturating at ±448); returns float8_e4m3fn."""
    return np.clip(np.asarray(x, dtype=np.float32), -E4M3_MAX, E4M3_MAX).astype(E4M3)


def quantize_v_e4m3(v: np.ndarray) -> Quantized:
    """Per-channel e4m3 V: s_V = max over keys |V_c| / 448, codes = e4m3(V / s_V)."""
    v = np.asarray(v, dtype=np.float32)
    scale = (np.abs(v).max(axis=-2, keepdims=True) / np.float32(E4M3_MAX)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    return Quantized(to_e4m3(v / safe), scale)


def quantize_p_int8(p: np.ndarray) -> np.ndarray:
    """P8 = rint(127·p) with the static scale 127 (0 <= p <= 1); flushes p < 0.5/127 to zero."""
    return np.rint(np.asarray(p, dtype=np.float32) * np.float32(INT8_MAX)).astype(np.int8)


def quantize_p_e4m3(p: np.ndarray) -> np.ndarray:
    """P8 = e4m3(448·p) with the static scale 448; the smallest nonzero p is 2⁻⁹/448 ≈ 4.4e-6."""
    return to_e4m3(np.asarray(p, dtype=np.float32) * np.float32(E4M3_MAX))


@dataclass(frozen=True)
class Int8Cache:
    """An int8 KV cache as stored: codes int8 [B, Hkv, L, D] and one float32 scale per
    (batch, kv head, token) [B, Hkv, L], value = code × scale."""

    codes: np.ndarray
    scales: np.ndarray

    def __post_init__(self):
        if self.codes.dtype != np.int8 or self.codes.ndim != 4:
            raise ValueError(f"codes: expected int8 [B, Hkv, L, D], got {self.codes.dtype} {self.codes.shape}")
        if self.scales.dtype != np.float32 or self.scales.shape != self.codes.shape[:3]:
            raise ValueError(f"scales: expected float32 {self.codes.shape[:3]}, "
                             f"got {self.scales.dtype} {self.scales.shape}")

    @property
    def shape(self) -> tuple[int, ...]:
        return self.codes.shape

    def dequantize(self, dtype=np.float64) -> np.ndarray:
        """codes × scale, computed in dtype (float64 is exact; float32 rounds as a kernel does)."""
        return self.codes.astype(dtype) * self.scales.astype(dtype)[..., None]


def quantize_kv_cache(x: np.ndarray) -> Int8Cache:
    """Write K or V [B, Hkv, L, D] into an int8 cache: scale = max|x| / 127 per (token, kv head)."""
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 4:
        raise ValueError(f"x: expected [B, Hkv, L, D], got shape {x.shape}")
    q = _symmetric_int8(x, np.abs(x).max(axis=-1, keepdims=True))
    return Int8Cache(q.codes, q.scale[..., 0])


def split3(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Exact 3-way byte split of x with |x| <= 127: X = rint(x·65536) clipped to ±127·65536,
    X = h·65536 + l·256 + m with h, l int8 and m uint8. Returns (h, l, m)."""
    big = np.clip(np.rint(np.asarray(x, dtype=np.float64) * SPLIT_ONE), -SPLIT_MAX, SPLIT_MAX).astype(np.int64)
    m = big & 0xFF  # two's complement: the low byte, unsigned
    rest = (big - m) >> 8
    low = ((rest + 128) & 0xFF) - 128  # the middle byte, signed
    high = (rest - low) >> 8
    return high.astype(np.int8), low.astype(np.int8), m.astype(np.uint8)


def join3(h: np.ndarray, l: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Exact inverse of split3: X = h·65536 + l·256 + m as int64."""
    return h.astype(np.int64) * SPLIT_ONE + l.astype(np.int64) * 256 + m.astype(np.int64)


def partial_sum_bound(terms: int) -> int:
    """The largest magnitude an exact integer sum of ``terms`` byte products can reach: an 8-bit
    operand part (|h|, |l| <= 128, m <= 255) times an int8 code (|c| <= 128). The kernels'
    int32 sums — Q8·K8 over head_dim, the split parts times K8 over a channel group, times V8 over
    a chunk of keys — are all bounded by it."""
    if terms < 1:
        raise ValueError(f"terms: expected a positive number of products, got {terms}")
    return 255 * 128 * int(terms)


def split_f16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fp16 hi + lo split: hi = fp16(x), lo = fp16(x - hi) (the difference exact in float32)."""
    x = np.asarray(x, dtype=np.float32)
    hi = x.astype(np.float16)
    return hi, (x - hi.astype(np.float32)).astype(np.float16)
