"""Shape classes of prefill calls: the buckets `qattn tune` stores its winning tiles under.

A class is (query length bucket, key length bucket, GQA or not). The length buckets are
<=1K, 1K-4K, 4K-16K and >16K tokens (bounds inclusive above: 4096 is 1K-4K). Why these: the
tile that wins moves with how many query blocks fill the GPU (Lq) and how long each block's key
loop runs against its prologue and epilogue (Lk), and GQA changes how often K/V tiles are
re-read from L2. Batch and head counts are not part of the class: a class's winner was measured
at the batch and heads `qattn tune --shape/--heads` named.
"""
from __future__ import annotations

from dataclasses import dataclass

LENGTH_EDGES = (1024, 4096, 16384)  # upper bounds of all but the last bucket
LENGTH_BUCKETS = ("<=1K", "1K-4K", "4K-16K", ">16K")


def length_bucket(tokens: int) -> str:
    """The bucket of a query or key length."""
    return LENGTH_BUCKETS[sum(tokens > edge for edge in LENGTH_EDGES)]


@dataclass(frozen=True)
class ShapeClass:
    queries: str  # bucket of Lq
    keys: str  # bucket of Lk
    gqa: bool  # Hq > Hkv

    def __post_init__(self):
        for name in ("queries", "keys"):
            if getattr(self, name) not in LENGTH_BUCKETS:
                raise ValueError(f"shape_class.{name}: expected one of {', '.join(LENGTH_BUCKETS)}, "
                                 f"got {getattr(self, name)!r}")
        if not isinstance(self.gqa, bool):
            raise ValueError(f"shape_class.gqa: expected a bool, got {self.gqa!r}")

    @classmethod
    def of(cls, queries: int, keys: int, heads: int, kv_heads: int) -> "ShapeClass":
        """The class of a call with Lq = queries, Lk = keys, Hq = heads and Hkv = kv_heads."""
        for name, value in (("queries", queries), ("keys", keys), ("heads", heads), ("kv_heads", kv_heads)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        if heads % kv_heads:
            raise ValueError(f"heads: {heads} is not a multiple of kv_heads {kv_heads}")
        return cls(length_bucket(queries), length_bucket(keys), heads > kv_heads)

    @property
    def name(self) -> str:
        return f"Lq {self.queries}, Lk {self.keys}, {'GQA' if self.gqa else 'MHA'}"
