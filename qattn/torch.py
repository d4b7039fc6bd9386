"""qattn as torch operators (the optional extra ``qattn[torch]``): ``torch.ops.qattn.attention``,
registered with ``torch.library.custom_op`` and given a fake (meta) implementation, so that
``torch.compile(fullgraph=True)`` and ``torch.export`` trace a model that calls it without a graph
break::

    import qattn.torch  # registers the operators

    @torch.compile(fullgraph=True)
    def block(q, k, v):
        return torch.ops.qattn.attention(q, k, v, causal=True)

The operator runs ``qattn.attention`` on the current CUDA stream and returns a new tensor of q's shape
and dtype; ``format`` defaults as there (f16, bf16 or f32 by q's dtype).

Decode reads a ``qattn.PagedKVCache``, which is not a tensor: ``qattn.torch.decode(q, cache, table,
lens)`` calls ``torch.ops.qattn.decode`` with the cache's integer handle (``cache.handle``), a constant
in a traced graph. Cache writes run eagerly (``cache.write``) or, under ``torch.compile``, outside the
compiled region, since they mutate the cache's CuPy memory that torch does not see.
"""
from __future__ import annotations

import torch

from .api import attention as _attention
from .formats.decode import PagedKVCache
from .formats.decode.cache import LIVE
from .formats.decode.host import decode as _decode


@torch.library.custom_op("qattn::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, format: str | None = None, causal: bool = False,
              scale: float | None = None) -> torch.Tensor:
    """softmax(q kᵀ·scale) v: qattn.attention on torch tensors (q [B, Hq, Lq, D], k, v [B, Hkv, Lk, D])."""
    return _attention(q, k, v, format=format, causal=causal, scale=scale)


@attention.register_fake
def _attention_fake(q, k, v, format=None, causal=False, scale=None):
    # qattn writes a new contiguous [B, Hq, Lq, D] output in q's dtype
    return q.new_empty(q.shape)


def _cache_of(handle: int) -> PagedKVCache:
    cache = LIVE.get(handle)
    if cache is None:
        raise ValueError(f"cache: no live qattn.PagedKVCache has handle {handle} (a cache's handle is cache.handle)")
    return cache


@torch.library.custom_op("qattn::decode", mutates_args=())
def _decode_op(q: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, cache: int, qk: str = "auto",
               scale: float | None = None) -> torch.Tensor:
    """qattn.decode on torch tensors, the cache given by its handle (cache.handle)."""
    return _decode(q, _cache_of(cache), block_table, seq_lens, qk=qk, scale=scale)


@_decode_op.register_fake
def _decode_fake(q, block_table, seq_lens, cache, qk="auto", scale=None):
    return q.new_empty(q.shape)  # a new [B, Hq, Lq, D] output in q's dtype


def decode(q: torch.Tensor, cache: PagedKVCache, block_table: torch.Tensor, seq_lens: torch.Tensor, *,
           qk: str = "auto", scale: float | None = None) -> torch.Tensor:
    """torch.ops.qattn.decode for a cache object: what a model calls (traceable by torch.compile)."""
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache: expected a qattn.PagedKVCache, got {type(cache).__name__}")
    return torch.ops.qattn.decode(q, block_table, seq_lens, cache.handle, qk, scale)


__all__ = ["attention", "decode"]
