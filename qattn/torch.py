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
"""
from __future__ import annotations

import torch

from .api import attention as _attention


@torch.library.custom_op("qattn::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, format: str | None = None, causal: bool = False,
              scale: float | None = None) -> torch.Tensor:
    """softmax(q kᵀ·scale) v: qattn.attention on torch tensors (q [B, Hq, Lq, D], k, v [B, Hkv, Lk, D])."""
    return _attention(q, k, v, format=format, causal=causal, scale=scale)


@attention.register_fake
def _attention_fake(q, k, v, format=None, causal=False, scale=None):
    # qattn writes a new contiguous [B, Hq, Lq, D] output in q's dtype
    return q.new_empty(q.shape)


__all__ = ["attention"]
