"""The int8 KV cache and the exact operand splits of the kv8 formats in NumPy (DESIGN §2 "int8 KV
cache, exact kernels"): the cache as stored (codes and one fp32 scale per token and kv head), the
24-bit 3-way byte split of kv8-imma and the fp16 hi + lo split of kv8-split."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...check.quant import INT8_MAX, symmetric_int8

# The 3-way split represents x (|x| <= 127) as X = rint(x * SPLIT_ONE), 24 bits.
SPLIT_ONE = 65536
SPLIT_MAX = INT8_MAX * SPLIT_ONE


@dataclass(frozen=True)
class Int8Cache:
    """An int8 KV cache as stored: codes int8 [B, Hkv, L, D] and one float32 scale per
    (batch, kv head, token) [B, Hkv, L], value = code × scale."""

    codes: np.ndarray
    scales: np.ndarray

    def __post_init__(self):
        if self.codes.dtype != np.int8 or self.codes.ndim != 4:
            raise ValueError(f"codes: expected int8 [B, Hkv, L, D], got {self.codes.dtype} {self.codes.shape}")
        if self.scales.dtype != np.float32 or self.scales.shape != self.codes.shape[:3]:
            raise ValueError(f"scales: expected float32 {self.codes.shape[:3]}, "
                             f"got {self.scales.dtype} {self.scales.shape}")

    @property
    def shape(self) -> tuple[int, ...]:
        return self.codes.shape

    def dequantize(self, dtype=np.float64) -> np.ndarray:
        """codes × scale, computed in dtype (float64 is exact; float32 rounds as a kernel does)."""
        return self.codes.astype(dtype) * self.scales.astype(dtype)[..., None]


def quantize_kv_cache(x: np.ndarray) -> Int8Cache:
    """Write K or V [B, Hkv, L, D] into an int8 cache: scale = max|x| / 127 per (token, kv head)."""
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 4:
        raise ValueError(f"x: expected [B, Hkv, L, D], got shape {x.shape}")
    q = symmetric_int8(x, np.abs(x).max(axis=-1, keepdims=True))
    return Int8Cache(q.codes, q.scale[..., 0])


def split3(x: np.ndarray, signed_low: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Exact 3-way byte split of x with |x| <= 127: X = rint(x·65536) clipped to ±127·65536,
    X = h·65536 + l·256 + m with h, l int8 and m uint8. Returns (h, l, m). signed_low: m an int8 too
    (-128..127), the digits for matrix ops whose 8-bit operands are all signed (AMD's int8 MFMA); h and l
    then round accordingly (|h| <= 127 still)."""
    big = np.clip(np.rint(np.asarray(x, dtype=np.float64) * SPLIT_ONE), -SPLIT_MAX, SPLIT_MAX).astype(np.int64)
    m = ((big + 128) & 0xFF) - 128 if signed_low else big & 0xFF  # the low byte (two's complement: unsigned)
    rest = (big - m) >> 8
    low = ((rest + 128) & 0xFF) - 128  # the middle byte, signed
    high = (rest - low) >> 8
    return high.astype(np.int8), low.astype(np.int8), m.astype(np.int8 if signed_low else np.uint8)


def join3(h: np.ndarray, l: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Exact inverse of split3: X = h·65536 + l·256 + m as int64."""
    return h.astype(np.int64) * SPLIT_ONE + l.astype(np.int64) * 256 + m.astype(np.int64)


def partial_sum_bound(terms: int) -> int:
    """The largest magnitude an exact integer sum of ``terms`` byte products can reach: an 8-bit
    operand part (|h|, |l| <= 128, m <= 255) times an int8 code (|c| <= 128). The kernels'
    int32 sums — Q8·K8 over head_dim, the split parts times K8 over a channel group, times V8 over
    a chunk of keys — are all bounded by it."""
    if terms < 1:
        raise ValueError(f"terms: expected a positive number of products, got {terms}")
    return 255 * 128 * int(terms)


def split_f16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fp16 hi + lo split: hi = fp16(x), lo = fp16(x - hi) (the difference exact in float32)."""
    x = np.asarray(x, dtype=np.float32)
    hi = x.astype(np.float16)
    return hi, (x - hi.astype(np.float32)).astype(np.float16)
