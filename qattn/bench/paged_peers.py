"""The paged decode peers timed beside qattn's decode: FlashInfer's batch decode over a paged KV cache
(BatchDecodeWithPagedKVCacheWrapper, NHD pages), on fp16 K/V ("flashinfer") and on e4m3 K/V with
one scale per tensor, FlashInfer's fp8 cache ("flashinfer_e4m3"). Both read the same tokens in pages
of the same size as qattn's caches. The page table and the per-tensor scales are plain arrays
(page_table, e4m3_tensor_scale), so that what the peer is handed can be checked without a GPU."""
from __future__ import annotations

import numpy as np

PAGED_PEERS = ("flashinfer", "flashinfer_e4m3")
E4M3_MAX = 448.0
WORKSPACE_BYTES = 128 << 20  # FlashInfer's float workspace for split-KV partials


def page_table(batch: int, ctx: int, page_size: int, table=None):
    """FlashInfer's CSR page table of `batch` sequences of `ctx` tokens each: indptr [batch + 1], indices
    [pages], last_page_len [batch] (1 .. page_size), all int32. table: the page ids [batch, pages a
    sequence] (numpy; qattn's block table) where the pages are not in order."""
    if min(batch, ctx, page_size) < 1:
        raise ValueError(f"batch, ctx, page_size: expected positive sizes, got {batch}, {ctx}, {page_size}")
    pages = -(-ctx // page_size)
    indptr = np.arange(batch + 1, dtype=np.int32) * pages
    indices = np.arange(batch * pages, dtype=np.int32)
    if table is not None:
        if table.shape != (batch, pages):
            raise ValueError(f"table: expected [{batch}, {pages}] page ids, got {tuple(table.shape)}")
        indices = np.ascontiguousarray(table, dtype=np.int32).reshape(-1)
    last = np.full(batch, ctx - (pages - 1) * page_size, dtype=np.int32)
    return indptr, indices, last


def paged(x, batch: int, ctx: int, page_size: int, table=None):
    """x [batch * ctx, kv_heads, head_dim] (tokens of each sequence in order; an array module's array)
    as FlashInfer's NHD pages [batch * pages, page_size, kv_heads, head_dim], the last page of each
    sequence zero-padded; page j of sequence b at table[b, j] where a table is given (else in order)."""
    xp = _array_module(x)
    pages = -(-ctx // page_size)
    per_seq = x.reshape(batch, ctx, *x.shape[1:])
    if pages * page_size != ctx:
        pad = xp.zeros((batch, pages * page_size - ctx, *x.shape[1:]), dtype=x.dtype)
        per_seq = xp.concatenate([per_seq, pad], axis=1)
    in_order = per_seq.reshape(batch * pages, page_size, *x.shape[1:])
    if table is None:
        return xp.ascontiguousarray(in_order)
    placed = xp.empty_like(in_order)
    placed[xp.asarray(np.asarray(table).reshape(-1))] = in_order
    return placed


def e4m3_tensor_scale(x) -> float:
    """One scale for a whole K or V (FlashInfer's fp8 cache): its absmax over e4m3's largest finite
    value, so that codes = x / scale fill the format; 1 for an all-zero tensor."""
    absmax = float(abs(x).max())
    return absmax / E4M3_MAX if absmax > 0 else 1.0


def _array_module(x):
    import importlib

    return importlib.import_module("cupy") if type(x).__module__.startswith("cupy") else np


def paged_peer(name: str, q, k, v, *, batch: int, ctx: int, page_size: int, table=None):
    """(call, bytes read) of the named FlashInfer peer on q [batch, heads, 1, head_dim] (fp16, cupy) and
    k, v [batch * ctx, kv_heads, head_dim] (fp16, cupy) in the pages of `table` (numpy [batch, pages a
    sequence]; None: in order), or None where FlashInfer or torch is missing. call() returns the output [batch, heads, head_dim] as a torch tensor. The cache,
    page table and plan are built once, outside the timed call."""
    if name not in PAGED_PEERS:
        raise ValueError(f"peer: expected one of {', '.join(PAGED_PEERS)}, got {name!r}")
    try:
        import flashinfer
        import torch
    except ImportError:
        return None
    heads, kv_heads, head_dim = q.shape[1], k.shape[1], k.shape[2]
    pages = [torch.from_dlpack(paged(x, batch, ctx, page_size, table)) for x in (k, v)]
    scales = {}
    if name == "flashinfer_e4m3":
        scales = {"k_scale": e4m3_tensor_scale(k), "v_scale": e4m3_tensor_scale(v)}
        pages = [(p.float() / s).to(torch.float8_e4m3fn) for p, s in zip(pages, scales.values())]
    device = pages[0].device
    indptr, indices, last = (torch.from_numpy(a).to(device) for a in page_table(batch, ctx, page_size, table))
    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(indptr, indices, last, heads, kv_heads, head_dim, page_size, q_data_type=torch.float16,
                 kv_data_type=pages[0].dtype)
    tq = torch.from_dlpack(q.reshape(batch, heads, head_dim))
    cache = tuple(pages)
    nbytes = sum(p.numel() * p.element_size() for p in pages)
    return (lambda: wrapper.run(tq, cache, **scales)), nbytes
