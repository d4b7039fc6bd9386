"""Shape classes of prefill calls: the buckets `qattn tune` stores its winning tiles under.

A class is (query length bucket, key length bucket, GQA or not, sequence-heads bucket). The length
buckets are <=1K, 1K-4K, 4K-16K and >16K tokens (bounds inclusive above: 4096 is 1K-4K). The
sequence-heads (batch x query heads) buckets are <64, 64-127, 128-511 and >=512. Why these: the
tile that wins moves with how many query blocks fill the GPU (Lq, and the sequence-heads they
repeat over), how long each block's key loop runs against its prologue and epilogue (Lk), and GQA
changes how often K/V tiles are re-read from L2. The sequence-head edges are the counts at which
the kernels calls run without a tuned table change (`LaunchChoice.least_heads`, measured on the
H100 and H200 between 512 and 1023 query rows; a test keeps every such count an edge), so that no class
holds calls that the built-in routes send to different kernels.
"""
from __future__ import annotations

from dataclasses import dataclass

LENGTH_EDGES = (1024, 4096, 16384)  # upper bounds of all but the last bucket
LENGTH_BUCKETS = ("<=1K", "1K-4K", "4K-16K", ">16K")
SEQUENCE_HEAD_EDGES = (64, 128, 512)  # lower bounds of all but the first bucket
SEQUENCE_HEAD_BUCKETS = ("<64", "64-127", "128-511", ">=512")


def length_bucket(tokens: int) -> str:
    """The bucket of a query or key length."""
    return LENGTH_BUCKETS[sum(tokens > edge for edge in LENGTH_EDGES)]


def sequence_heads_bucket(sequence_heads: int) -> str:
    """The bucket of a call's sequence-heads (batch x query heads)."""
    return SEQUENCE_HEAD_BUCKETS[sum(sequence_heads >= edge for edge in SEQUENCE_HEAD_EDGES)]


@dataclass(frozen=True)
class ShapeClass:
    queries: str  # bucket of Lq
    keys: str  # bucket of Lk
    gqa: bool  # Hq > Hkv
    sequence_heads: str  # bucket of batch x Hq

    def __post_init__(self):
        for name, buckets in (("queries", LENGTH_BUCKETS), ("keys", LENGTH_BUCKETS),
                              ("sequence_heads", SEQUENCE_HEAD_BUCKETS)):
            if getattr(self, name) not in buckets:
                raise ValueError(f"shape_class.{name}: expected one of {', '.join(buckets)}, "
                                 f"got {getattr(self, name)!r}")
        if not isinstance(self.gqa, bool):
            raise ValueError(f"shape_class.gqa: expected a bool, got {self.gqa!r}")

    @classmethod
    def of(cls, queries: int, keys: int, heads: int, kv_heads: int, *, batch: int) -> "ShapeClass":
        """The class of a call of `batch` sequences with Lq = queries, Lk = keys, Hq = heads and Hkv = kv_heads."""
        for name, value in (("queries", queries), ("keys", keys), ("heads", heads), ("kv_heads", kv_heads),
                            ("batch", batch)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        if heads % kv_heads:
            raise ValueError(f"heads: {heads} is not a multiple of kv_heads {kv_heads}")
        return cls(length_bucket(queries), length_bucket(keys), heads > kv_heads, sequence_heads_bucket(batch * heads))

    @property
    def name(self) -> str:
        return f"Lq {self.queries}, Lk {self.keys}, {'GQA' if self.gqa else 'MHA'}, {self.sequence_heads} seq-heads"

    @property
    def order(self) -> tuple:
        """A sort key: the buckets in their own order."""
        return (LENGTH_BUCKETS.index(self.queries), LENGTH_BUCKETS.index(self.keys), self.gqa,
                SEQUENCE_HEAD_BUCKETS.index(self.sequence_heads))
