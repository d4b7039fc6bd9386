"""The int8-QK formats' quantizers in NumPy, exactly as DESIGN §2 defines them: K smoothing and Q/K
channel balancing, int8 Q/K codes per scale group, V per channel (int8 or e4m3) and P with its
static scale.

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

import warnings

import numpy as np

from ...check.quant import E4M3_MAX, INT8_MAX, Quantized, symmetric_int8, to_e4m3

GRANULARITIES = ("block", "warp", "thread")
# What is done to Q and K before they are quantized: "mean" subtracts K̄ (K smoothing), "mean+balance"
# also moves part of each K channel's range into Q (balance_factors), None quantizes K as given.
SMOOTHINGS = ("mean", "mean+balance", None)
DEFAULT_SMOOTHING = "mean"
# An attention call's default from this many keys on: balancing measured never worse on any
# preset or the captured MiniLM tensors (ratio 1.00 where K has no outlier channel, 0.19-0.51 where it
# has) and cost 0-3% of the call at 32K keys on the H200, 3-9% at 4K (BENCHMARKS.md).
BALANCE_FROM_KEYS = 32768
# How a channel's balancing factor α is taken: "sqrt" as computed; "pow2" rounded to a power of two
# (then scaling by it is exact in floating point too); "outliers" as computed where it is at least 2 or
# at most 1/2 and 1 elsewhere. The default: balancing every channel moves ordinary channels by
# sampling noise and measured up to 1.5x worse on some inputs without outliers (docs/notes/balancing.md).
ALPHA_RULES = ("sqrt", "pow2", "outliers")
DEFAULT_ALPHA_RULE = "outliers"
OUTLIER_ALPHA = 2.0  # "outliers": the α from which a channel counts as one
UNSET = object()  # an option the caller did not give


def smooth_k(k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """K smoothing: K̄ = mean of K over the key axis per (batch, kv head, channel); returns
    (K - K̄, K̄), in float32 (float64 stays float64). Softmax is unchanged by it: each row's
    scores all move by the same q·K̄."""
    k = np.asarray(k)
    dtype = np.float64 if k.dtype == np.float64 else np.float32
    mean = k.astype(np.float64).mean(axis=-2, keepdims=True).astype(dtype)
    return k.astype(dtype) - mean, mean


def default_smoothing(keys: int) -> str:
    """The smoothing of an attention call that names none: "mean+balance" from BALANCE_FROM_KEYS keys on,
    "mean" below (on CUDA and HIP alike, so that a format's arithmetic does not depend on the backend)."""
    return "mean+balance" if keys >= BALANCE_FROM_KEYS else DEFAULT_SMOOTHING


def smoothing_option(smoothing=UNSET, smooth_k=None, default: str = DEFAULT_SMOOTHING):
    """The smoothing a call asks for (one of SMOOTHINGS), `default` where it gives none. smooth_k is
    its deprecated alias: True means "mean" and False None; giving both is an error."""
    if smooth_k is None:
        smoothing = default if smoothing is UNSET else smoothing
        if smoothing not in SMOOTHINGS:
            raise ValueError(f"smoothing: expected 'mean', 'mean+balance' or None, got {smoothing!r}")
        return smoothing
    if not isinstance(smooth_k, (bool, np.bool_)):
        raise ValueError(f"smooth_k: expected True or False, got {smooth_k!r}")
    if smoothing is not UNSET:
        raise ValueError("smooth_k: give smoothing or its deprecated alias smooth_k, not both")
    warnings.warn("smooth_k is deprecated: use smoothing='mean' (smooth_k=True) or smoothing=None (smooth_k=False)",
                  DeprecationWarning, stacklevel=2)
    return "mean" if smooth_k else None


def balance_factors(q: np.ndarray, k: np.ndarray, rule: str = DEFAULT_ALPHA_RULE) -> np.ndarray:
    """Q/K channel balancing: α [B, Hkv, 1, D] float32 with α_c = sqrt(max|k_c| / max|q_c|), the
    absmax of q taken over every query head of the kv head's GQA group and every row, of k over
    every key; normalized so that the median channel's α is 1 ("pow2": then rounded to the nearest
    power of two in log2; "outliers": then 1 where 1/2 < α < 2). q·k = Σ (q_c·α_c)(k_c/α_c) exactly, so quantizing q·α and k/α changes no
    score in real arithmetic; it moves half of a large K channel's range (in log scale) into Q, where
    it is shared with Q's own ranges instead of setting K's scale alone. A channel that is zero in q
    or in k contributes nothing to any score and keeps α = 1. q [B, Hq, Lq, D] (the softmax scale
    folded in or not: the normalization cancels it), k [B, Hkv, Lk, D] (after smoothing)."""
    b, hkv, d = k.shape[0], k.shape[1], k.shape[-1]
    q_absmax = np.abs(np.asarray(q, np.float64)).reshape(b, hkv, -1, d).max(axis=2)  # [B, Hkv, D]
    k_absmax = np.abs(np.asarray(k, np.float64)).max(axis=-2)
    return balance_from_absmax(q_absmax, k_absmax, rule)[..., None, :]


def balance_from_absmax(q_absmax, k_absmax, rule: str = DEFAULT_ALPHA_RULE, xp=np):
    """balance_factors' α [B, Hkv, D] float32 from each channel's absmax of q [B, Hkv, D] (over the kv head's
    GQA group) and of k [B, Hkv, D]; NumPy or CuPy arrays (xp their module)."""
    if rule not in ALPHA_RULES:
        raise ValueError(f"rule: expected one of {ALPHA_RULES}, got {rule!r}")
    q_absmax, k_absmax = q_absmax.astype(xp.float64), k_absmax.astype(xp.float64)
    live = (q_absmax > 0) & (k_absmax > 0)
    alpha = xp.where(live, xp.sqrt(xp.where(live, k_absmax, 1.0) / xp.where(live, q_absmax, 1.0)), xp.nan)
    with warnings.catch_warnings():  # a head with no live channel has no median: its α stays 1
        warnings.simplefilter("ignore", RuntimeWarning)
        median = xp.nanmedian(alpha, axis=-1, keepdims=True)
    alpha = xp.where(live, alpha / median, 1.0)
    if rule == "pow2":
        alpha = xp.exp2(xp.rint(xp.log2(alpha)))
    elif rule == "outliers":
        alpha = xp.where((alpha > 1 / OUTLIER_ALPHA) & (alpha < OUTLIER_ALPHA), 1.0, alpha)
    return alpha.astype(xp.float32)


def balance_from_ranges(q, k, k_mean, mul, rule: str = DEFAULT_ALPHA_RULE, xp=np):
    """balance_factors(RN(q·mul), K − K̄)[..., 0, :] from the raw fp16/bf16 q [B, Hq, Lq, D] and k [B, Hkv, Lk, D]
    without forming either: x ↦ RN(x·mul) (mul > 0) and x ↦ RN(x − K̄) are monotonic, so max|q̃| = RN(max|q|·mul)
    and max|K̃| = max(RN(max K − K̄), RN(K̄ − min K)) in fp32. k_mean: K̄ [B, Hkv, D] fp32; NumPy or CuPy arrays (xp
    their module), as the HIP kernels' host computes α."""
    b, hkv, d = k.shape[0], k.shape[1], k.shape[-1]
    q, k = (x if x.dtype == xp.float16 else x.astype(xp.float32) for x in (q, k))  # bf16 widened (exact) to reduce
    mul = xp.float32(mul)
    q_absmax = xp.abs(q).max(axis=2).reshape(b, hkv, -1, d).max(axis=2).astype(xp.float32) * mul
    k_mean = k_mean.astype(xp.float32)
    k_absmax = xp.maximum(k.max(axis=2).astype(xp.float32) - k_mean, k_mean - k.min(axis=2).astype(xp.float32))
    return balance_from_absmax(q_absmax, k_absmax, rule, xp)


def smooth(q: np.ndarray, k: np.ndarray, smoothing=DEFAULT_SMOOTHING, alpha_rule: str = DEFAULT_ALPHA_RULE):
    """Q and K as the int8-QK formats quantize them under a smoothing (one of SMOOTHINGS): returns
    (q·α, (K − K̄)/α, K̄), with K̄ = 0 when smoothing is None and α = 1 unless it is "mean+balance"
    (α from balance_factors, by alpha_rule). q [B, Hq, Lq, D] with the softmax scale folded in, k
    [B, Hkv, Lk, D]; float32 (float64 stays float64, for checks in real arithmetic)."""
    dtype = np.float64 if np.asarray(k).dtype == np.float64 else np.float32
    q, k = np.asarray(q, dtype), np.asarray(k, dtype)
    if smoothing is None:
        return q, k, np.zeros(k.shape[:-2] + (1, k.shape[-1]), dtype)
    k_smooth, k_mean = smooth_k(k)
    if smoothing != "mean+balance":
        return q, k_smooth, k_mean
    alpha = balance_factors(q, k_smooth, alpha_rule).astype(dtype)
    return q * np.repeat(alpha, q.shape[1] // k.shape[1], axis=1), k_smooth / alpha, k_mean


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
