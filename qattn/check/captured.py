"""Q, K and V a model produced, as `tools/capture_qkv.py` writes them (an .npz of q, k and v, BHSD), for the checks
that run on captured tensors instead of N(0,1) or a qattn.data preset (`qattn parity --npz`, prefill and decode)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .reference import check_shapes


@dataclass(frozen=True)
class Captured:
    """The arrays of one file: a check of CTX/QUERIES takes the last ctx keys and, of those positions, the last
    queries rows (the queries close the context, bottom-right aligned: a prefill's last rows, or a decode step's
    new tokens)."""

    name: str
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray

    @classmethod
    def load(cls, path) -> "Captured":
        with np.load(path) as z:
            missing = [name for name in "qkv" if name not in z.files]
            if missing:
                raise ValueError(f"npz: {path} holds no {', '.join(missing)} (expected arrays q, k and v, BHSD)")
            q, k, v = (np.asarray(z[name], np.float32) for name in "qkv")
        try:
            check_shapes(q.shape, k.shape, v.shape)
        except ValueError as exc:
            raise ValueError(f"npz: {path}: {exc}") from None
        return cls(Path(path).name, q, k, v)

    @property
    def dims(self) -> dict:
        """batch, heads, kv_heads, head_dim, queries and keys of the file."""
        (batch, heads, queries, head_dim), kv_heads, keys = self.q.shape, self.k.shape[1], self.k.shape[2]
        return dict(batch=batch, heads=heads, kv_heads=kv_heads, head_dim=head_dim, queries=queries, keys=keys)

    def window(self, ctx: int, queries: int) -> list[np.ndarray]:
        """q [B, H, queries, D], k and v [B, Hkv, ctx, D]."""
        if ctx > self.k.shape[2] or queries > self.q.shape[2]:
            raise ValueError(f"shape: {ctx}/{queries} is more than the {self.k.shape[2]} keys / {self.q.shape[2]} "
                             f"queries in {self.name}")
        return [self.q[:, :, -queries:], self.k[:, :, -ctx:], self.v[:, :, -ctx:]]


def data_name(source) -> str:
    """How a record names its inputs: normal, a preset's name, or npz:FILE."""
    return "normal" if source is None else f"npz:{source.name}" if isinstance(source, Captured) else source
