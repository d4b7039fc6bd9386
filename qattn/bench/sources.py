"""The accuracy tables' inputs by name: the qattn.data presets and "minilm", Q, K and V captured from
MiniLM (tests/data/minilm_qkv.npz, written by tools/capture_qkv.py: one head, D = 32, 32768 keys and
the 256 query rows of the last passage)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .. import data

MINILM = Path(__file__).resolve().parents[2] / "tests" / "data" / "minilm_qkv.npz"
SOURCES = (*data.PRESETS, "minilm")


def inputs(source: str, *, ctx: int, queries: int, heads: int = 1, kv_heads: int | None = None,
           head_dim: int = 128, seed: int = 0) -> dict:
    """dict(q, k, v) of a source, BHSD: a preset's as data.preset makes them, or MiniLM's (its own
    head count and D, its last ctx keys, `queries` of its query rows drawn by the seed, in order;
    all of them when queries reaches their count) with its softmax scale under "scale"."""
    if source not in SOURCES:
        raise ValueError(f"source: unknown source {source!r}; expected one of {list(SOURCES)}")
    if source != "minilm":
        return data.preset(source, ctx=ctx, queries=queries, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                           seed=seed)
    with np.load(MINILM) as f:
        q, k, v, scale = f["q"], f["k"], f["v"], float(f["scale"])
    rows = np.sort(np.random.default_rng(seed).choice(q.shape[-2], min(queries, q.shape[-2]), replace=False))
    return dict(q=q[..., rows, :], k=k[..., -ctx:, :], v=v[..., -ctx:, :], scale=scale)
