"""The decode kernels' CPU emulator and FP64 references (DESIGN §2, §3): NumPy that runs what the
transform-path kernel computes, key group by key group in the kernel's own partition, so that P is
rounded against the same running maxima.

Per split of keys_per_split keys and per warp (keys [16w, 16w + 16) of every step of 16 * warps keys):
S = (q · K codes) in fp32, times (s_K · τ·log2 e); an online softmax in fp32 (exp2); P times the
token's V scale in fp32, rounded to the query's type; O += that P · V codes in fp32. The warps' states
merge in warp order, the splits' in groups of every fourth split, the groups added in order; a head V scale multiplies O once. Causal masks are
bottom-right aligned within each sequence's Lq new tokens; rows that see no key come out as zeros.
The 8-bit QK paths ("fp8", "int8") quantize each query row as the cache writer quantizes a token
(s_q = max|q| / QMAX, codes of q / s_q) and take S = (q codes · K codes) in fp32 times
(s_K · (s_q · τ·log2 e)). With a pre-bias residual K (k_bias b), S of the stored residual plus
q·b (fp32, from the 16-bit query values) times τ·log2 e. With page means (k_mean), each key's score
also gains q·(its page's mean codes) (fp32, from the 16-bit query values) times (the record's scale ·
τ·log2 e), as the kernel adds it. With K balanced (the cache's α), the QK product takes q·α: fl(q x α)
in fp32 rounded to the query's type (transform path) or quantized (8-bit paths); q·b and q·μ_page take
q as given. With RoPE (post-RoPE keys: the cache holds K - R_p b), q·b of the non-rotary channels is the
row's constant and each key gains its table row p dotted with rope.score_terms (fp16 hi + lo parts of
the per-pair u_i, w_i), as the kernel's fp16 MMA sums it; with pre-RoPE keys (transform path only) the
K codes of key j are also turned by its table row (rope.rotated_codes) before the QK product.
"""
from __future__ import annotations

import math

import numpy as np

from ...check.quant import LOG2E
from ...check.reference import attention as reference_attention
from ...engine.arrays import numpy_dtype
from .quant import HostPagedCache, quantize_tokens
from .rope import constant_bias, rotated_codes, score_terms
from .recipes import QK_CODE

F32 = np.float32
GROUP = 16  # keys per warp per step


MERGE_GROUPS = 4  # the split merge kernel's groups of splits (split s in group s % 4)


def _weighted_sums(states, big):
    """Σ l·w and Σ acc·w over (m, l, acc) states in order, w = 2^(m - big) (0 where m = -inf)."""
    total_l = np.zeros_like(states[0][1])
    total = np.zeros_like(states[0][2])
    for m, l, acc in states:
        weight = np.where(m == -np.inf, F32(0), np.exp2(m - np.where(np.isfinite(big), big, F32(0)))).astype(F32)
        total_l = (total_l + l * weight).astype(F32)
        total = (total + acc * weight[..., None]).astype(F32)
    return total_l, total


def _merge(states):
    """Combine (m, l, acc) states in order (a block's warps): m, l [R], acc [R, D]."""
    big = np.max([m for m, _, _ in states], axis=0)
    return (big.astype(F32), *_weighted_sums(states, big))


def _merge_splits(states):
    """Combine the splits' states as the merge kernel does: every MERGE_GROUPS-th split summed in order
    per group, then the groups' sums added in group order."""
    big = np.max([m for m, _, _ in states], axis=0)
    total_l, total = np.zeros_like(states[0][1]), np.zeros_like(states[0][2])
    for g in range(min(MERGE_GROUPS, len(states))):
        part_l, part = _weighted_sums(states[g::MERGE_GROUPS], big)
        total_l, total = (total_l + part_l).astype(F32), (total + part).astype(F32)
    return big.astype(F32), total_l, total


def _warp_state(qv, row_scale, row_bias, key_bias, k, ks, v, vs, groups, limits, half):
    """One warp's online softmax over its key groups: qv [R, D] (the query values or codes the QK
    product takes), row_scale [R] (τ·log2 e, times s_q on the 8-bit paths), row_bias [R] (q·b·τ·log2 e,
    or zeros), key_bias [R, L] (q·μ_page·τ·log2 e and q·R_p b·τ·log2 e per key, or zeros), k, v [L, D]
    stored values, ks, vs [L] per-key scales (token) or scalars; returns (m, l, acc)."""
    rows, d = qv.shape
    m = np.full(rows, -np.inf, F32)
    l = np.zeros(rows, F32)
    acc = np.zeros((rows, d), F32)
    for j0, j1 in groups:
        keys = np.arange(j0, j1)
        raw = (qv.astype(np.float64) @ k[j0:j1].astype(np.float64).T).astype(F32)
        kscale = np.broadcast_to(np.asarray(ks, F32)[j0:j1] if np.ndim(ks) else F32(ks), (j1 - j0))
        x = ((raw * (kscale[None, :] * row_scale[:, None]).astype(F32)).astype(F32) + row_bias[:, None]).astype(F32)
        x = (x + key_bias[:, j0:j1]).astype(F32)
        x = np.where(keys[None, :] > limits[:, None], F32(-np.inf), x)
        m_new = np.maximum(m, x.max(axis=1))
        shift = np.where(m_new == -np.inf, F32(0), m_new)
        rescale = np.exp2(m - shift).astype(F32)
        p = np.exp2(x - shift[:, None]).astype(F32)
        l = (l * rescale + p.sum(axis=1, dtype=F32)).astype(F32)
        vscale = np.asarray(vs, F32)[j0:j1] if np.ndim(vs) else F32(1)
        w = np.where(p == 0, F32(0), p * vscale).astype(half).astype(np.float64)
        acc = (acc * rescale[:, None] + (w @ v[j0:j1].astype(np.float64)).astype(F32)).astype(F32)
        m = m_new.astype(F32)
    return m, l, acc


def emulate(q, cache: HostPagedCache, block_table, seq_lens, *, splits: int = 1, keys_per_split: int | None = None,
            warps: int = 4, warp_keys: int = GROUP, scale: float | None = None, return_lse: bool = False,
            qk: str = "transform"):
    """What the decode kernel computes on QK path qk: out [B, Hq, Lq, D] in q's dtype (and the
    natural-log LSE [B, Hq, Lq] when return_lse). q holds fp16/bf16 values (any float array; it is
    rounded to q.dtype's 16-bit type: float16 unless q is bfloat16). A step takes warps x warp_keys keys,
    warp_keys of them a warp (the CUDA kernels' 16; the HIP kernel runs one state over tiles of 32 keys)."""
    if qk != "transform" and QK_CODE.get(qk) != cache.fmt.split("-")[0]:
        raise ValueError(f"qk: {cache.fmt} has no {qk!r} path")
    if qk != "transform" and cache.pre_rope:
        raise ValueError(f"qk: a pre-RoPE cache turns its codes on chip: the transform path only, got {qk!r}")
    q = np.asarray(q)
    half = q.dtype if q.dtype in (np.float16, numpy_dtype("bfloat16")) else np.dtype(np.float16)
    b_count, hq, lq, d = q.shape
    hkv = cache.k.shape[1]
    group = hq // hkv
    table, lens = np.asarray(block_table), np.asarray(seq_lens)
    step = warp_keys * warps
    bound = table.shape[1] * cache.page_size
    kps = keys_per_split or -(-bound // splits // step) * step
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    scale_log2 = F32(scale * LOG2E)
    out = np.zeros((b_count, hq, lq, d), half)
    lse = np.full((b_count, hq, lq), -np.inf, F32)
    for b in range(b_count):
        length = int(lens[b])
        k_vals, k_scale = cache.gather("k", table[b], length)
        if cache.pre_rope:
            k_vals = rotated_codes(k_vals, cache.rope, cache.rope_table, half)
        v_vals, v_scale = cache.gather("v", table[b], length)
        for h in range(hkv):
            heads = q[b, h * group:(h + 1) * group].astype(half)  # [g, Lq, D]
            q16 = heads.reshape(group * lq, d)
            balanced = q16 if cache.alpha is None else (q16.astype(F32) * cache.alpha[h]).astype(F32)
            if qk == "transform":
                qv, row_scale = balanced.astype(half), np.full(group * lq, scale_log2, F32)
            else:
                codes = quantize_tokens(balanced.astype(F32), QK_CODE[qk])
                qv, row_scale = codes.codes.astype(np.float64), (codes.scale * scale_log2).astype(F32)
            row_bias = np.zeros(group * lq, F32)
            if cache.k_bias is not None:
                row_b = cache.k_bias[h] if cache.rope is None else constant_bias(cache.k_bias[h], cache.rope)
                qb = (q16.astype(np.float64) @ row_b.astype(np.float64)).astype(F32)
                row_bias = (qb * scale_log2).astype(F32)
            key_bias = np.zeros((group * lq, length), F32)
            if cache.k_mean is not None:
                codes, mean_scale = cache.k_mean.gather(table[b], length, cache.page_size)
                qm = (q16.astype(np.float64) @ codes[h].astype(np.float64).T).astype(F32)
                key_bias = (qm * (mean_scale[h] * scale_log2).astype(F32)[None, :]).astype(F32)
            if cache.rope is not None:
                rows = cache.rope_table[np.minimum(np.arange(length), cache.rope.max_positions - 1)].astype(np.float64)
                terms = score_terms(q16.astype(F32), cache.k_bias[h], cache.rope, scale_log2)
                key_bias = (key_bias + (terms @ rows.T).astype(F32)).astype(F32)
            limits = np.tile(length - lq + np.arange(lq), group)
            ks = 1.0 if k_scale is None else k_scale[h]  # [L] token scales, or the head's one
            vs = 1.0 if v_scale is None or v_scale.ndim == 1 else v_scale[h]
            split_states = []
            for s in range(splits):
                begin, end = s * kps, min(length, (s + 1) * kps)
                warp_states = []
                for w in range(warps):
                    groups = [(j, min(j + warp_keys, end)) for j in range(begin + warp_keys * w, end, step)]
                    warp_states.append(_warp_state(qv, row_scale, row_bias, key_bias, k_vals[h], ks, v_vals[h], vs,
                                                   groups, limits, half))
                m, l, acc = _merge(warp_states)
                if v_scale is not None and v_scale.ndim == 1:
                    acc = (acc * F32(v_scale[h])).astype(F32)
                split_states.append((m, l, acc))
            m, l, acc = _merge_splits(split_states) if splits > 1 else split_states[0]
            live = (l > 0) | np.isnan(l)  # a NaN sum stays NaN, as in the kernel
            with np.errstate(invalid="ignore"):
                value = np.where(live[:, None], acc / np.where(live, l, F32(1))[:, None], F32(0))
            out[b, h * group:(h + 1) * group] = value.reshape(group, lq, d).astype(half)
            with np.errstate(divide="ignore"):
                row_lse = np.where(live, (m + np.log2(np.where(live, l, F32(1)))) * F32(math.log(2.0)), -np.inf)
            lse[b, h * group:(h + 1) * group] = row_lse.reshape(group, lq)
    return (out, lse) if return_lse else out


def reference(q, cache: HostPagedCache, block_table, seq_lens, *, scale: float | None = None,
              return_lse: bool = False):
    """FP64 attention on the dequantized cache (stored value x scale, exactly): the kernel's
    arithmetic alone is measured against it."""
    table, lens = np.asarray(block_table), np.asarray(seq_lens)
    return _per_sequence(q, lambda b, name: cache.dequantize(name, table[b], int(lens[b])), scale, return_lse)


def reference_dense(q, k_seqs, v_seqs, *, scale: float | None = None, return_lse: bool = False):
    """FP64 attention on the original K and V (a list of [kv heads, L_b, D] per sequence): the
    format's own cost (the cache's rounding) is measured against it."""
    return _per_sequence(q, lambda b, name: np.asarray((k_seqs if name == "k" else v_seqs)[b], np.float64),
                         scale, return_lse)


def _per_sequence(q, side, scale, return_lse):
    q = np.asarray(q, np.float64)
    outs, lses = [], []
    for b in range(q.shape[0]):
        k, v = side(b, "k"), side(b, "v")
        if k.shape[1] == 0:
            outs.append(np.zeros(q.shape[1:]))
            lses.append(np.full(q.shape[1:3], -np.inf))
            continue
        result = reference_attention(q[b:b + 1], k[None], v[None], causal=True, scale=scale, return_lse=True)
        outs.append(result[0][0])
        lses.append(result[1][0])
    out, lse = np.stack(outs), np.stack(lses)
    return (out, lse) if return_lse else out
