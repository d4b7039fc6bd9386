"""The parity check of one decode format at one shape (`tools/parity --kind decode`): a paged cache
written from fp16 K/V (fresh N(0,1), a qattn.data preset, or captured tensors: the last keys and new tokens of an
.npz), decoded on the GPU kernel (into a
NaN-poisoned output, and timed) or on the CPU emulator, and compared with FP64 twice: on the
dequantized cache (the kernel's arithmetic, judged by the format's tolerance) and on the original
fp16 K/V (the format's own cost, reported as format_rel_l2). An 8-bit K is read on one QK path (qk:
"auto" resolves to the path a call runs on the GPU, or on the CPU to the arch given). With page means
(k_mean "page") the cache is written as an engine fills it, a prompt and then pieces (WRITE_PIECE
tokens of every sequence a write), so that later pages start from a running mean. With k_rope (the bias_rope
preset) the cache holds the residual K under RoPE: "post" writes the post-RoPE keys (K - R_p b stored, q·R_p b
added back per key), "pre" the keys before RoPE (k_pre - b stored, turned on chip); both are compared with the
post-RoPE K."""
from __future__ import annotations

import math

import numpy as np

from ...check import metrics
from ...check.captured import Captured, data_name
from ...engine.arrays import numpy_dtype
from ...engine.registry import recipe
from . import emulate
from .quant import HostPagedCache
from .recipes import resolve_qk, sides, tolerance
from .rope import RoPE

WRITE_PIECE = 256  # tokens per sequence of each write after the first, with page means


def _inputs(fmt, batch, heads, kv_heads, ctx, queries, head_dim, source, seed):
    """q [B, Hq, Lq, D] and the tokens k, v [B, L, Hkv, D] in the format's query type, the K
    bias of the data ([Hkv, D] fp32: a preset's own, else K's channel mean over every token) and the
    data's RoPE base and its K before RoPE ([B, L, Hkv, D]; None without RoPE). source: None (N(0,1)), a
    qattn.data preset's name or a Captured (its last ctx keys; q its last queries rows)."""
    dtype = numpy_dtype(recipe(fmt, "decode").input_dtypes[0])
    if source is None:
        rng = np.random.default_rng(seed)
        q = rng.standard_normal((batch, heads, queries, head_dim), dtype=np.float32)
        k, v = (rng.standard_normal((batch, ctx, kv_heads, head_dim), dtype=np.float32) for _ in range(2))
    elif isinstance(source, Captured):
        q, k, v = source.window(ctx, queries)
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    else:
        from ... import data

        x = data.preset(source, ctx=ctx, queries=queries, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                        batch=batch, seed=seed)
        q, k, v = x["q"], x["k"].transpose(0, 2, 1, 3), x["v"].transpose(0, 2, 1, 3)
        if "k_bias" in x:
            theta = float(x["rope_theta"]) if "rope_theta" in x else None
            k_pre = x["k_pre"].transpose(0, 2, 1, 3).astype(dtype) if "k_pre" in x else None
            return q.astype(dtype), k.astype(dtype), v.astype(dtype), x["k_bias"].astype(np.float32), theta, k_pre
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), k.astype(np.float32).mean(axis=(0, 1)), None, None


def check(fmt: str, ctx: int, queries: int, *, backend: str, batch: int = 1, heads: int = 8, kv_heads: int = 8,
          head_dim: int = 128, page_size: int = 32, scale: str = "token", source: str | Captured | None = None,
          seed: int = 0,
          time_it: bool = True, qk: str = "auto", arch: str | None = None, k_bias: bool = False,
          k_mean: str = "off", k_balance: bool = False, k_rope: str = "off") -> dict:
    """One record (JSON-ready apart from non-finite floats) for fmt at ctx cached tokens per sequence,
    the last `queries` of them new (bottom-right causal among them), on source's data (see _inputs). k_bias: a pre-bias residual K
    cache, given the data's K bias (see _inputs); k_mean: "page" for page means (an 8-bit K); k_balance:
    Q/K channel balancing of an 8-bit K, α calibrated from the first write; k_rope: "post" or "pre", the
    residual K under RoPE of post- or pre-RoPE keys (an 8-bit K; data with RoPE and a K bias: bias_rope)."""
    if queries > ctx:
        raise ValueError(f"shape: {queries} new tokens need at least as many cached ones, got ctx {ctx}")
    if backend == "cuda" and arch is None:
        from ...engine.spec import device_arch

        arch = device_arch()
    qk = resolve_qk(fmt, arch or "sm_90a", qk, heads // kv_heads * queries)
    if isinstance(source, Captured):
        dims = source.dims
        fixed = {"batch": batch, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}
        wrong = [f"{name} {value} (the file's: {dims[name]})" for name, value in fixed.items() if value != dims[name]]
        if wrong:
            raise ValueError(f"source: {source.name} fixes batch, heads, kv_heads and head_dim; got {', '.join(wrong)}")
    q, k, v, bias, theta, k_pre = _inputs(fmt, batch, heads, kv_heads, ctx, queries, head_dim, source, seed)
    if k_rope not in ("off", "post", "pre"):
        raise ValueError(f"k_rope: expected 'off', 'post' or 'pre', got {k_rope!r}")
    if k_rope != "off" and theta is None:
        raise ValueError(f"k_rope: the data ({data_name(source) if source is not None else 'N(0,1)'}) has no RoPE; "
                         "the bias_rope preset has")
    bias = bias if k_bias or k_rope != "off" else None
    balance = "calibrate" if k_balance else None
    rope = RoPE(theta=theta) if k_rope != "off" else None
    layout = "pre-rope" if k_rope == "pre" else "post-rope"
    stored = k_pre if k_rope == "pre" else k  # what the cache is written with
    pages_per_seq = -(-ctx // page_size)
    rng = np.random.default_rng([seed, 1])
    table = rng.permutation(batch * pages_per_seq).reshape(batch, pages_per_seq).astype(np.int32)
    tokens = np.arange(ctx)
    slots = (table[:, tokens // page_size] * page_size + tokens % page_size).astype(np.int64)
    lens = np.full(batch, ctx, np.int32)
    positions = np.broadcast_to(tokens, (batch, ctx))
    writes = [_write_tokens(x, ctx if k_mean == "off" else max(1, ctx // 4)) for x in (stored, v, slots, positions)]
    post = k_rope == "post"
    ms, kernel = None, None
    if backend == "cuda":
        out, ms, kernel, host = _run_cuda(fmt, q, writes, table, lens, page_size, scale, time_it, qk, bias, k_mean,
                                          balance, rope, layout)
    else:
        host = HostPagedCache.empty(fmt, batch * pages_per_seq, page_size, kv_heads, head_dim, scale, k_bias=bias,
                                    k_mean=k_mean, k_balance=balance, rope=rope, k_bias_layout=layout)
        for wk, wv, ws, wp in zip(*writes):
            host.write(wk, wv, ws, scale=scale, positions=wp if post else None)
        out = emulate.emulate(q, host, table, lens, qk=qk)
    ref = emulate.reference(q, host, table, lens)
    dense = emulate.reference_dense(q, [x.transpose(1, 0, 2) for x in k.astype(np.float64)],
                                    [x.transpose(1, 0, 2) for x in v.astype(np.float64)])
    out32 = np.asarray(out, np.float32)
    err = metrics.compare(out32, ref)
    tol = tolerance(fmt, qk)
    read = batch * kv_heads * ctx * sum((1 if s in ("e4m3", "i8") else 2) * head_dim + (4 if s in ("e4m3", "i8") and
                                         scale == "token" else 0) for s in sides(fmt)) + table.nbytes
    return {
        "kind": "decode", "format": fmt, "ctx": ctx, "queries": queries, "batch": batch, "heads": heads,
        "kv_heads": kv_heads, "head_dim": head_dim, "page_size": page_size, "scale": scale,
        "data": data_name(source), "backend": backend, "kernel": kernel, "qk": qk, "k_bias": bias is not None,
        "k_mean": k_mean, "k_balance": balance is not None, "k_rope": k_rope,
        "input_dtype": recipe(fmt, "decode").input_dtypes[0], "seed": seed,
        "max_rel": err.max_rel, "rel_l2": err.rel_l2, "cos": err.cos, "nonfinite": err.nonfinite,
        "worst_index": list(err.worst_index), "failures": metrics.failures(out32, ref, tol.max_rel),
        "format_rel_l2": metrics.compare(out32, dense).rel_l2,
        "tolerance": {"max_rel": tol.max_rel, "rel_l2": tol.rel_l2},
        "ms": ms, "gbs": read / (ms * 1e-3) / 1e9 if ms else None,
        "passed": bool(err.nonfinite == 0 and err.max_rel <= tol.max_rel and err.rel_l2 <= tol.rel_l2),
    }


def _write_tokens(x, first: int) -> list:
    """x [B, L, ...] as the writes that store it: tokens [0, first) of every sequence, then WRITE_PIECE
    more of each per write; each write's tokens [T, ...] sequence-major."""
    bounds = [0, first] + list(range(first + WRITE_PIECE, x.shape[1], WRITE_PIECE)) + [x.shape[1]]
    return [x[:, lo:hi].reshape(-1, *x.shape[2:]) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]


def _run_cuda(fmt, q, writes, table, lens, page_size, scale, time_it, qk, bias, k_mean, balance, rope, layout):
    import cupy

    from ...bench.timing import time_cuda
    from .cache import PagedKVCache
    from .host import decode

    k_side, v_side = sides(fmt)
    kv_heads, head_dim = writes[0][0].shape[1:]
    cache = PagedKVCache(int(table.size), page_size, kv_heads, head_dim, k=k_side, v=v_side, scale=scale,
                         k_bias=bias, k_mean=k_mean, k_balance=balance, rope=rope, k_bias_layout=layout)
    post = rope is not None and layout == "post-rope"
    for wk, wv, ws, wp in zip(*writes):
        cache.write(cupy.asarray(wk), cupy.asarray(wv), cupy.asarray(ws), positions=cupy.asarray(wp) if post else None)
    qd, td, ld = cupy.asarray(q), cupy.asarray(table), cupy.asarray(lens)
    out = cupy.full(q.shape, math.nan, dtype=qd.dtype)  # any element left unwritten stays NaN
    decode(qd, cache, td, ld, out=out, qk=qk)
    result = cupy.asnumpy(out)
    ms = time_cuda(lambda: decode(qd, cache, td, ld, out=out, qk=qk)).median_ms if time_it else None
    return result, ms, cache.spec(qk=qk).name, cache.host()
