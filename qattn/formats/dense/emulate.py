"""The dense recipes' emulator products (check/emulate.py runs the flash loop): f16 and bf16 round
Q, K, V and P to the input type and accumulate in fp32; f32 is the shared fp32 recipe."""
from __future__ import annotations

import ml_dtypes
import numpy as np

from ...check import quant
from ...check.emulate import F32, Tiles, f32_tiles


def _half_tiles(dtype):
    def build(lay, q, k, v, scale, block_n):
        qh, kh, vh = (np.asarray(x, F32).astype(dtype).astype(F32) for x in (q, k, v))
        qh, kh, vh = lay.q(qh), lay.kv(kh), lay.kv(vh)
        log2_scale = F32(scale * quant.LOG2E)

        def scores(j0, j1):  # products of halves are exact in fp32; fp32 accumulation
            return (qh @ kh[..., j0:j1, :].swapaxes(-1, -2)) * log2_scale

        def pv(p, j0, j1):
            return p.astype(dtype).astype(F32) @ vh[..., j0:j1, :]

        return Tiles(scores, pv, out_dtype=dtype)

    return build


EMULATORS = {"f16": _half_tiles(np.float16), "bf16": _half_tiles(ml_dtypes.bfloat16), "f32": f32_tiles}
