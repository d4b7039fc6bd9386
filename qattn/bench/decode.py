"""The decode benchmark: qattn's paged decode in each cache format beside torch SDPA's flash and cuDNN
backends on the same queries over the same K/V in fp16 (dense), and a plain copy for the bandwidth
ceiling, all in the same run in interleaved rounds (DESIGN §4). Bandwidth is the bytes that must
cross HBM once: K and V codes, their scales and the block table (qattn); fp16 K and V (the peers).
"""
from __future__ import annotations

import numpy as np

from .peers import peer
from .timing import time_cuda, time_interleaved, with_ratios

DECODE_PEERS = ("sdpa_flash", "sdpa_cudnn")


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """GB/s of a device-to-device copy of nbytes (read + write counted), the ceiling of this GPU."""
    import cupy

    src = cupy.ones(nbytes // 4, dtype=cupy.float32)
    dst = cupy.empty_like(src)
    ms = time_cuda(lambda: cupy.copyto(dst, src), runs=20, min_ms=200.0).median_ms
    return 2 * nbytes / (ms * 1e-3) / 1e9


def kv_bytes(fmt: str, batch: int, kv_heads: int, ctx: int, head_dim: int, page_size: int, scale: str) -> int:
    """Bytes a decode step must read: K and V codes, token scales of 8-bit sides, the block table."""
    k, v = fmt.split("-")
    per_token = sum((1 if side in ("e4m3", "i8") else 2) * head_dim + (4 if side in ("e4m3", "i8") and
                                                                        scale == "token" else 0) for side in (k, v))
    return batch * kv_heads * ctx * per_token + batch * -(-ctx // page_size) * 4


def _filled_cache(fmt, k, v, batch, ctx, kv_heads, head_dim, page_size, scale, rng):
    """A cache holding k, v [batch * ctx, kv_heads, head_dim] in shuffled pages; returns it and its table."""
    import cupy

    from ..formats.decode import PagedKVCache

    pages_per_seq = -(-ctx // page_size)
    num_pages = batch * pages_per_seq
    k_side, v_side = fmt.split("-")
    cache = PagedKVCache(num_pages, page_size, kv_heads, head_dim, k=k_side, v=v_side, scale=scale)
    table = rng.permutation(num_pages).reshape(batch, pages_per_seq).astype(np.int32)
    tokens = np.arange(ctx)
    slots = (table[:, tokens // page_size] * page_size + tokens % page_size).reshape(-1).astype(np.int64)
    cache.write(k, v, cupy.asarray(slots))
    return cache, cupy.asarray(table)


def bench_decode(shapes, formats=("f16-f16", "e4m3-e4m3", "i8-i8"), *, heads: int = 32, kv_heads: int = 8,
                 head_dim: int = 128, queries: int = 1, page_size: int = 32, scale: str = "token",
                 peers=DECODE_PEERS, rounds: int = 3, seed: int = 0, splits=None, tile=None) -> list[dict]:
    """One record per (shape, implementation): median ms, GB/s, the ratio to each peer and to the copy
    bandwidth, and rel_l2 against the fp16 SDPA answer on the same queries. shapes: (batch, ctx)."""
    import cupy

    from ..formats.decode import decode

    rng = np.random.default_rng(seed)
    crng = cupy.random.default_rng(seed)
    copy_gbs = copy_bandwidth()
    records = []
    for batch, ctx in shapes:
        base = {"batch": batch, "ctx": ctx, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
                "queries": queries, "page_size": page_size, "scale": scale, "copy_gbs": copy_gbs}
        k = crng.standard_normal((batch * ctx, kv_heads, head_dim), dtype=cupy.float32).astype(cupy.float16)
        v = crng.standard_normal((batch * ctx, kv_heads, head_dim), dtype=cupy.float32).astype(cupy.float16)
        q = crng.standard_normal((batch, heads, queries, head_dim), dtype=cupy.float32).astype(cupy.float16)
        lens = cupy.full(batch, ctx, dtype=cupy.int32)
        timed = []
        reference = None
        peer_fns = [(name, fn) for name in peers if (fn := peer(name)) is not None] if queries == 1 else []
        if peer_fns:
            import torch

            dense = [torch.from_dlpack(x.reshape(batch, ctx, kv_heads, head_dim).transpose(0, 2, 1, 3).copy())
                     for x in (k, v)]
            tq = torch.from_dlpack(q)
            for name, fn in peer_fns:
                try:
                    result = fn(tq, dense[0], dense[1], False)
                except Exception as exc:  # backend unavailable for this shape/GPU
                    records.append(dict(base, impl=name, error=str(exc).splitlines()[0]))
                    continue
                reference = cupy.from_dlpack(result.contiguous()) if reference is None else reference
                timed.append((dict(base, impl=name, bytes=2 * batch * kv_heads * ctx * head_dim * 2),
                              lambda fn=fn: fn(tq, dense[0], dense[1], False)))
        for fmt in formats:
            cache, table = _filled_cache(fmt, k, v, batch, ctx, kv_heads, head_dim, page_size, scale, rng)
            out = cupy.empty_like(q)
            decode(q, cache, table, lens, out=out, splits=splits, tile=tile)
            rec = dict(base, impl=f"qattn:{fmt}", bytes=kv_bytes(fmt, batch, kv_heads, ctx, head_dim, page_size, scale))
            if reference is not None:
                diff = out.astype(cupy.float64) - reference.astype(cupy.float64)
                rec["rel_l2_vs_fp16"] = float(cupy.linalg.norm(diff) / cupy.linalg.norm(reference.astype(cupy.float64)))
            timed.append((rec, lambda cache=cache, table=table, out=out: decode(q, cache, table, lens, out=out,
                                                                                 splits=splits, tile=tile)))
        per_round = time_interleaved([fn for _, fn in timed], rounds)
        for rec in with_ratios(timed, per_round, DECODE_PEERS):
            rec["gbs"] = rec["bytes"] / (rec["ms"] * 1e-3) / 1e9
            rec["of_copy"] = rec["gbs"] / copy_gbs
            records.append(rec)
    return records


def bench_write(tokens: int = 65536, formats=("e4m3-e4m3", "i8-i8", "f16-f16"), *, kv_heads: int = 8,
                head_dim: int = 128, page_size: int = 32, scale: str = "token", seed: int = 0) -> list[dict]:
    """The fused write of `tokens` new tokens against a plain copy of the same bytes (the fp16 K and V
    it reads and the codes and scales it writes), each timed alone. Two slot patterns per format: a
    prompt (pages shuffled, tokens in order within each page) and decode steps (every token on a page
    of its own, as one new token per sequence lands)."""
    import cupy

    from ..formats.decode import PagedKVCache

    crng = cupy.random.default_rng(seed)
    rng = np.random.default_rng(seed)
    k, v = (crng.standard_normal((tokens, kv_heads, head_dim), dtype=cupy.float32).astype(cupy.float16)
            for _ in range(2))
    pages = -(-tokens // page_size)
    prompt = (rng.permutation(pages)[np.arange(tokens) // page_size] * page_size + np.arange(tokens) % page_size)
    patterns = {"prompt": prompt, "steps": rng.permutation(tokens)}
    records = []
    for fmt in formats:
        k_side, v_side = fmt.split("-")
        cache = PagedKVCache(pages, page_size, kv_heads, head_dim, k=k_side, v=v_side, scale=scale)
        written = kv_bytes(fmt, 1, kv_heads, tokens, head_dim, page_size, scale) - pages * 4
        moved = 2 * k.nbytes + written  # read fp16 K and V, write codes and scales
        src = cupy.empty(moved // 2, dtype=cupy.uint8)
        dst = cupy.empty_like(src)
        copy_ms = time_cuda(lambda: cupy.copyto(dst, src)).median_ms
        for name, slots in patterns.items():
            slots_d = cupy.asarray(slots.astype(np.int64))
            write_ms = time_cuda(lambda: cache.write(k, v, slots_d)).median_ms
            records.append({"format": fmt, "slots": name, "tokens": tokens, "kv_heads": kv_heads,
                            "head_dim": head_dim, "bytes": moved, "write_ms": write_ms, "copy_ms": copy_ms,
                            "ratio": write_ms / copy_ms})
    return records
