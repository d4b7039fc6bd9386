"""FP64 reference attention in NumPy: the answer every kernel and emulator is judged against.

Semantics (DESIGN §2): q [B, Hq, Lq, D], k and v [B, Hkv, Lk, D], Hq = g·Hkv with query head h
reading kv head h // g; scale defaults to 1/sqrt(D); causal masks are bottom-right aligned
(query i sees keys j <= i + Lk - Lq). A row that sees no key at all returns zeros and an LSE
of -inf.
"""
from __future__ import annotations

import math

import numpy as np

# Scores are materialised per chunk of query rows; this bounds one chunk to ~128 MB of FP64.
_CHUNK_ELEMENTS = 1 << 24


def to_numpy(x) -> np.ndarray:
    """Host copy of a NumPy, CuPy or DLPack/CUDA-array-interface array (torch tensors too)."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "get") and callable(x.get):  # CuPy
        return x.get()
    if hasattr(x, "__dlpack_device__") and int(x.__dlpack_device__()[0]) == 1:  # kDLCPU (torch CPU tensors)
        return np.asarray(x)
    if hasattr(x, "__cuda_array_interface__") or (hasattr(x, "__dlpack__") and hasattr(x, "device")):
        import cupy

        return cupy.asnumpy(cupy.asarray(x) if hasattr(x, "__cuda_array_interface__") else cupy.from_dlpack(x))
    return np.asarray(x)


def check_shapes(q_shape, k_shape, v_shape) -> tuple[int, int, int, int, int, int]:
    """Validate BHSD shapes; return (B, Hq, Hkv, Lq, Lk, D). Raises ValueError naming the argument."""
    for name, shape in (("q", q_shape), ("k", k_shape), ("v", v_shape)):
        if len(shape) != 4:
            raise ValueError(f"{name}: expected 4 dimensions [batch, heads, seq, head_dim], got shape {tuple(shape)}")
    b, hq, lq, d = q_shape
    bk, hkv, lk, dk = k_shape
    if tuple(v_shape) != tuple(k_shape):
        raise ValueError(f"v: expected the shape of k {tuple(k_shape)}, got {tuple(v_shape)}")
    if bk != b:
        raise ValueError(f"k: batch {bk} does not match q's batch {b}")
    if dk != d:
        raise ValueError(f"k: head_dim {dk} does not match q's head_dim {d}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"q: {hq} query heads is not a multiple of k's {hkv} kv heads (GQA needs Hq = g*Hkv)")
    if min(b, hq, lq, lk, d) < 1:
        raise ValueError(f"q/k: every dimension must be >= 1, got q {tuple(q_shape)}, k {tuple(k_shape)}")
    return b, hq, hkv, lq, lk, d


def visible_keys(lq: int, lk: int, causal: bool) -> np.ndarray:
    """Number of keys each query row sees (bottom-right causal alignment), shape [Lq]."""
    if not causal:
        return np.full(lq, lk, dtype=np.int64)
    return np.clip(np.arange(lq, dtype=np.int64) + (lk - lq) + 1, 0, lk)


def attention(q, k, v, *, causal: bool = False, scale: float | None = None, return_lse: bool = False):
    """Exact softmax(q kᵀ·scale) v in FP64. Returns out [B, Hq, Lq, D] (float64), and LSE
    [B, Hq, Lq] (natural log, float64) when return_lse."""
    q, k, v = (to_numpy(x).astype(np.float64, copy=False) for x in (q, k, v))
    b, hq, hkv, lq, lk, d = check_shapes(q.shape, k.shape, v.shape)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    group = hq // hkv
    out = np.zeros((b, hq, lq, d))
    lse = np.full((b, hq, lq), -np.inf)
    seen = visible_keys(lq, lk, causal)
    rows = max(1, _CHUNK_ELEMENTS // lk)
    for bi in range(b):
        for h in range(hq):
            kh, vh = k[bi, h // group], v[bi, h // group]
            for r0 in range(0, lq, rows):
                r1 = min(lq, r0 + rows)
                s = (q[bi, h, r0:r1] @ kh.T) * scale
                if causal:
                    s[np.arange(lk)[None, :] >= seen[r0:r1, None]] = -np.inf
                live = seen[r0:r1] > 0
                m = np.where(live, s.max(axis=1, initial=-np.inf), 0.0)
                p = np.exp(s - m[:, None])
                l = p.sum(axis=1)
                with np.errstate(divide="ignore", invalid="ignore"):
                    out[bi, h, r0:r1] = np.where(live[:, None], (p @ vh) / l[:, None], 0.0)
                    lse[bi, h, r0:r1] = np.where(live, m + np.log(l), -np.inf)
    return (out, lse) if return_lse else out


def softmax_rows(q, k, *, causal: bool = False, scale: float | None = None) -> np.ndarray:
    """FP64 probability rows P [B, Hq, Lq, Lk] (for the probe and KL metrics; small shapes only)."""
    q, k = (to_numpy(x).astype(np.float64, copy=False) for x in (q, k))
    b, hq, hkv, lq, lk, d = check_shapes(q.shape, k.shape, k.shape)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    kk = np.repeat(k, hq // hkv, axis=1)
    s = np.einsum("bhqd,bhkd->bhqk", q, kk) * scale
    if causal:
        s[..., np.arange(lk)[None, :] >= visible_keys(lq, lk, True)[:, None]] = -np.inf
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    with np.errstate(invalid="ignore"):
        return np.nan_to_num(p / p.sum(axis=-1, keepdims=True))
