"""The numeric primitives every format's quantizer and emulator share, in NumPy: the constants, the
symmetric int8 rounding, e4m3 rounding and the softmax scale folded into Q (DESIGN §2). A family's own
quantizers (block scales, caches, operand splits) live in its folder.

Rounding is round-half-to-even (``np.rint``) everywhere; e4m3 goes through
``ml_dtypes.float8_e4m3fn`` after clipping to ±448, so it is RNE and saturating.
"""
from __future__ import annotations

from typing import NamedTuple

import ml_dtypes
import numpy as np

LOG2E = 1.4426950408889634
INT8_MAX = 127
E4M3_MAX = 448.0
E4M3 = ml_dtypes.float8_e4m3fn
# An int32 accumulator converts to float32 exactly (cvt.rn.f32.s32) below this magnitude.
F32_EXACT_INT = 2 ** 24


class Quantized(NamedTuple):
    """Integer or e4m3 codes and the float32 scale that multiplies them back (broadcastable)."""

    codes: np.ndarray
    scale: np.ndarray

    def dequantize(self) -> np.ndarray:
        return self.codes.astype(np.float64) * self.scale.astype(np.float64)


def fold_softmax_scale(q: np.ndarray, scale: float) -> np.ndarray:
    """q̃ = q·τ·log2 e in float32: scores come out in the exp2 domain."""
    return np.asarray(q, dtype=np.float32) * np.float32(scale * LOG2E)


def symmetric_int8(x: np.ndarray, absmax: np.ndarray) -> Quantized:
    """codes = rint(x / s) clipped to ±127 with s = absmax / 127 (float32); s = 0 gives codes 0."""
    scale = (absmax / np.float32(INT8_MAX)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    codes = np.clip(np.rint(x / safe), -INT8_MAX, INT8_MAX).astype(np.int8)
    return Quantized(codes, scale)


def to_e4m3(x: np.ndarray) -> np.ndarray:
    """Round to e4m3 (round-to-nearest-even, saturating at ±448); returns float8_e4m3fn."""
    return np.clip(np.asarray(x, dtype=np.float32), -E4M3_MAX, E4M3_MAX).astype(E4M3)
