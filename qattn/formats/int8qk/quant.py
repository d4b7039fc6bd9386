"""The int8-QK formats' quantizers in NumPy, exactly as DESIGN §2 defines them: K smoothing, int8 Q/K
codes per scale group, V per channel (int8 or e4m3) and P with its static scale.

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
"""
from __future__ import annotations

import numpy as np

from ...check.quant import E4M3_MAX, INT8_MAX, Quantized, symmetric_int8, to_e4m3

GRANULARITIES = ("block", "warp", "thread")


def smooth_k(k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """K smoothing: K̄ = mean of K over the key axis per (batch, kv head, channel); returns
    (K - K̄, K̄), in float32 (float64 stays float64). Softmax is unchanged by it: each row's
    scores all move by the same q·K̄."""
    k = np.asarray(k)
    dtype = np.float64 if k.dtype == np.float64 else np.float32
    mean = k.astype(np.float64).mean(axis=-2, keepdims=True).astype(dtype)
    return k.astype(dtype) - mean, mean


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
    return symmetric_int8(x, absmax)


def quantize_v_int8(v: np.ndarray) -> Quantized:
    """Per-channel int8 V: s_V = max over keys |V_c| / 127 per (batch, kv head, channel)."""
    v = np.asarray(v, dtype=np.float32)
    return symmetric_int8(v, np.abs(v).max(axis=-2, keepdims=True))


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
