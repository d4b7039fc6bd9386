"""The CUDA launches of a kv8 call, planned once per call signature.

A Kv8Plan holds the statistics pass (the tensor-core formats' Q and V maxima), the attention
kernel (its key range split over several blocks or not) and, with splits, the merge; their scratch
(the statistics, the splits' partials) lies in one workspace allocation. Plans are cached on the
kernel by shapes, strides and options (packed.cached_plan), so a repeated call spends its host
time on one allocation and the launches, which are programmatic from sm_90 (packed.PackedLaunch).
"""
from __future__ import annotations

import math

import numpy as np

from .recipes import MERGE_ENTRY, MMA_FORMATS, STAT_ENTRY
from ...engine.packed import NULL, PackedLaunch, Pointer, programmatic

STAT_THREADS = 256  # threads of the statistics kernel (stat_body)
MERGE_THREADS = 256  # threads of the merge kernel (kv8_merge.cuh.j2's MERGE_THREADS)


class Kv8Plan:
    """The launches of one kv8 call: q [B, Hq, Lq, D] fp32 against a cache of Lk tokens, the output
    (and LSE, with_lse) fp32. strides: element strides of q, the K codes, K scales, V codes, V scales
    and the output. Launched with pointers q, kc, ks, vc, vs, out, lse (0 without) and ws (the
    workspace of nbytes; 0 when nbytes is 0)."""

    def __init__(self, kernel, dims, strides, with_lse: bool, scale_log2: float, splits: int):
        spec = kernel.spec
        b, hq, hkv, lq, lk, d = dims
        q_st, kc_st, ks_st, vc_st, vs_st, out_st = strides
        mma = spec.recipe in MMA_FORMATS
        self.splits = splits
        self.lse_shape = (b, hq, lq)
        self.nbytes = 0
        offsets = {}

        def place(name: str, floats: int) -> None:
            offsets[name] = self.nbytes
            self.nbytes += -(-floats * 4 // 256) * 256

        if mma:  # per (batch, query head): G group maxima of q̃ and the V-scale maximum
            place("stat", b * hq * (d // 64 + 1))
        if splits > 1:
            place("part_o", splits * b * hq * lq * d)
            place("part_ml", splits * b * hq * lq * 2)  # (row max, row sum) pairs

        def ws(name: str) -> Pointer:
            return Pointer("ws", offsets[name]) if name in offsets else NULL

        pdl = programmatic(spec)
        lse = Pointer("lse") if with_lse else NULL
        sizes = (np.int32(hq), np.int32(hq // hkv), np.int32(lq), np.int32(lk), np.float32(scale_log2))
        self.launches = []
        if mma:
            self.launches.append(PackedLaunch(
                kernel.function(STAT_ENTRY), (hq, b, 1), STAT_THREADS, 0,
                (Pointer("q"), *q_st, Pointer("vs"), *vs_st[:2], ws("stat"), *sizes), pdl))
        args = (Pointer("q"), *q_st, Pointer("kc"), *kc_st, Pointer("ks"), *ks_st[:2], Pointer("vc"), *vc_st,
                Pointer("vs"), *vs_st[:2], Pointer("out"), *out_st, lse, np.int64(lq), ws("stat"), *sizes)
        if mma:
            args += (np.int32(splits), ws("part_o"), ws("part_ml"))
        qblocks = math.ceil(lq / spec.tile.block_m)
        self.launches.append(PackedLaunch(kernel.function(), (qblocks * splits, hq, b), kernel.threads,
                                          kernel.shared_bytes, args, pdl))
        if splits > 1:
            bh_rows = b * hq * lq
            grid = math.ceil(bh_rows * (d // 4) / MERGE_THREADS)  # one thread per (row, 4 channels)
            self.launches.append(PackedLaunch(
                kernel.function(MERGE_ENTRY), (grid, 1, 1), MERGE_THREADS, 0,
                (ws("part_o"), ws("part_ml"), np.int32(splits), np.int64(bh_rows), np.int32(hq), np.int32(lq),
                 Pointer("out"), *out_st, lse, np.int64(lq)), pdl))

    def launch(self, pointers: dict, stream_ptr: int) -> None:
        for launch in self.launches:
            launch(pointers, stream_ptr)


def emulator_options(spec) -> dict:
    """The emulate() options under which the emulator models the kernel of spec: its key tile (the tile order, and
    kv8-imma's w-scale chunk), and on HIP kv8-imma's signed low byte (its int8 ops take signed operands only)."""
    options = {"block_n": spec.tile.block_n}
    if spec.recipe == "kv8-imma" and spec.backend == "hip":
        options["signed_low"] = True
    return options


def inspect_fields(spec) -> dict:
    """What `qattn inspect` reports of a kv8 kernel beside its resources: the emulator's options for it."""
    return {"emulator": emulator_options(spec)}
