"""The CUDA launches of an int8-QK call, planned once per input signature.

A QuantPlan holds the three quantization launches (column statistics of K and V per chunk of keys,
their finish into K̄ and s_V, one grid of Q, K and V codes; with smoothing="mean+balance" also Q's
column absmax and the balancing factors α) and where each operand lives in one
workspace allocation; attention_launch is the attention kernel's launch on operands named by
Pointers (workspace offsets in a whole call, the arrays of a QuantizedQKV otherwise). Plans are
cached on the kernel by the shapes, strides and options they were built for, so a repeated call
spends its host time on the launches alone (int8.py checks the arguments before a plan is built).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...engine.registry import recipe
from ...check import quant
from ...engine.grid import work_grid
from ...engine.packed import NULL, Blob, PackedLaunch, Pointer, element_strides, programmatic
from ...engine.tensormap import MAP_ALIGN, MAP_BYTES, MapEncoder, swizzled_rows
from .recipes import wgmma_blocks_per_sm

# Keys per partial column sum of the K-mean / V-absmax kernels (one fp64 partial per chunk;
# STATS_CHUNK in quantize_i8.cuh.j2).
COLSTATS_CHUNK = 256
# Threads of the quantization kernels (QT in quantize_i8.cuh.j2).
QUANT_THREADS = 256
# Channels per block of the kernel that finishes the column statistics.
FINISH_CHANNELS = 32
SUFFIX = {"float16": "f16", "bfloat16": "bf16"}


@dataclass(frozen=True)
class Buffer:
    offset: int  # bytes into the workspace
    shape: tuple
    dtype: str


# Query rows per block of the Q quantization where each row has its own scale (QBLOCK in prefill_i8.cu.j2).
ROW_SCALE_BLOCK = 64


def scale_blocks(spec) -> tuple[int, int]:
    """(query rows per Q scale, keys per K scale block and softmax step) of a kernel: its tile's
    block_m x block_n, unless its family fixes the rows (the wgmma kernels: one scale per row)."""
    values = spec.family.values
    return values.get("q_scale_rows", spec.tile.block_m), spec.tile.block_n


def k_scale_groups(spec) -> int:
    """K scales per key block: 1, or 4 (quant's "thread" groups, keys by (key % 8) // 2)."""
    return spec.family.values.get("k_scale_groups", 1)


def q_quant_rows(spec) -> int:
    """Query rows per block of the Q quantization launches: the Q scale block, or ROW_SCALE_BLOCK."""
    rows = scale_blocks(spec)[0]
    return rows if rows > 1 else ROW_SCALE_BLOCK


def scale_options(block_m: int, block_n: int, k_groups: int) -> dict:
    """emulate()'s options for Q scales of block_m rows and K scale blocks of block_n keys in
    k_groups groups (1 or 4)."""
    return {"block_m": block_m, "block_n": block_n, "k_granularity": "thread" if k_groups > 1 else "block"}


def describe_scales(block_m: int, block_n: int, k_groups: int) -> str:
    """Words for a scale layout, e.g. "Q scales per row, 4 K scales per 128 keys"."""
    rows = "per row" if block_m == 1 else f"per {block_m} rows"
    k = "one K scale" if k_groups == 1 else f"{k_groups} K scales"
    return f"Q scales {rows}, {k} per {block_n} keys"


def emulator_options(spec) -> dict:
    """The emulate() options under which the emulator computes what the kernel of spec computes."""
    return scale_options(*scale_blocks(spec), k_scale_groups(spec))


def inspect_fields(spec) -> dict:
    """What `qattn inspect` reports of an int8-QK kernel beside its resources: its scale blocks, the
    options under which the emulator computes what the kernel computes."""
    q_rows, keys = scale_blocks(spec)
    return {"scale_blocks": {"q_rows": q_rows, "k_keys": keys, "k_groups": k_scale_groups(spec),
                             "emulator": emulator_options(spec)}}


def tile_keys(spec) -> int:
    """Keys per K8 / V^T tile where the kernel reads them as wgmma tiles, else 0."""
    return spec.tile.block_n if spec.family.values["mma_unit"] == "wgmma" else 0


def v_by_tma(spec) -> bool:
    """Whether the kernel reads its fp16 V by the TMA from rows (the wgmma kernel with v_tiles "off")."""
    return spec.family.values.get("v_tiles") == "off"


def v_map_encoder(spec, shape, strides) -> MapEncoder | None:
    """The encoder of the TMA map over fp16 V rows of shape [B, Hkv, Lk, D] with byte strides, in boxes of the
    kernel's key tile; None where the TMA cannot address those strides."""
    try:
        return MapEncoder(swizzled_rows("v", shape, strides, "float16", spec.tile.block_n))
    except ValueError:
        return None


class QuantPlan:
    """The quantization launches for one signature: q [B, Hq, Lq, D], k and v [B, Hkv, Lk, D] with
    the given strides (bytes) and input dtype, under smoothing (quant.SMOOTHINGS: "mean", "mean+balance"
    or None). Launched with pointers q, k, v and ws (the workspace of nbytes); buffers names where each
    operand lies in it."""

    def __init__(self, kernel, dims, dtype: str, strides, scale: float, with_shift: bool, smoothing):
        spec = kernel.spec
        b, hq, hkv, lq, lk, d = dims
        q_st, k_st, v_st = (element_strides(s, 2) for s in strides)
        bn = spec.tile.block_n
        q_rows, k_keys = scale_blocks(spec)
        sfx = SUFFIX[dtype]
        v_stats = recipe(spec.recipe).ctype["pv"] != "f16"  # 8-bit PV: per-channel s_V
        k_tiles = tile_keys(spec) > 0  # K8 (and V) as block tiles of wgmma's layouts
        v_tma = v_by_tma(spec)
        v_shape = (b, hkv, lk, d)
        # the TMA's map of the caller's fp16 V, where it can address its strides
        self.v_map = v_map_encoder(spec, v_shape, strides[2]) if v_tma and dtype == "float16" else None
        # fp16 V passes through to the mma.sync fp16 PV and to the TMA's reads; the quantizer writes fp16 rows for
        # bf16 V (or strides the TMA cannot address), or swizzled tiles (v_tiles "on")
        v_job = v_stats or (self.v_map is None if v_tma else dtype != "float16" or k_tiles)
        smooth_k, balance = smoothing is not None, smoothing == "mean+balance"
        nchunks, q_chunks = -(-lk // COLSTATS_CHUNK), -(-lq // COLSTATS_CHUNK)
        nbk = -(-lk // bn)
        lk_pad = nbk * bn
        self.buffers: dict[str, Buffer] = {}
        self.nbytes = 0

        def place(name, shape, dtype_name):
            size = int(np.prod(shape)) * np.dtype(dtype_name).itemsize
            self.buffers[name] = Buffer(self.nbytes, tuple(shape), dtype_name)
            self.nbytes += -(-size // 256) * 256

        # K̄, s_V and s_V / P_SCALE side by side (one zero fill where nothing computes K̄)
        place("small", (3 if v_stats else 1, b, hkv, d), "float32")
        place("q8", (b, hq, lq, d), "int8")
        place("q_scale", (b, hq, -(-lq // q_rows)), "float32")
        if with_shift:
            place("shift", (b, hq, lq), "float32")
        place("k8", (b, hkv, lk_pad if k_tiles else lk, d), "int8")
        place("k_scale", (b, hkv, -(-lk // k_keys) * k_scale_groups(spec)), "float32")
        if v_job:
            if spec.family.values["pv_operand"] == "f16":  # fp16 rows or tiles (of V, or of its e4m3 codes' values)
                place("v_op", (b, hkv, lk_pad if k_tiles and not v_tma else lk, d), "float16")
            else:
                place("v_op", (b, hkv, d, lk_pad), "uint8")
        if smooth_k:
            place("part_sum", (b, hkv, nchunks, d), "float64")
        if v_stats:
            place("part_max", (b, hkv, nchunks, d), "float32")
        if balance:
            place("alpha", (b, hkv, d), "float32")
            place("part_range", (2, b, hkv, nchunks, d), "float32")  # K's column max and min per chunk
            place("part_qmax", (b, hq, q_chunks, d), "float32")
        self.v_stats, self.v_job, self.with_shift = v_stats, v_job, with_shift
        if v_tma and v_job:  # the TMA reads the quantizer's rows
            self.v_map = MapEncoder(swizzled_rows("v", v_shape, contiguous_strides(self.buffers["v_op"]), "float16",
                                                  bn))

        self._plane = plane = b * hkv * d * 4  # bytes of one of K̄, s_V, s_V / P_SCALE
        ws = self._pointer
        k_mean, v_scale = ws("small"), ws("small", plane) if v_stats else NULL
        self.zero_fill = None if smooth_k or v_stats else (self.buffers["small"].offset, plane)
        self.launches = []
        pdl = programmatic(spec)
        mul = np.float32(scale * quant.LOG2E)  # as quant.fold_softmax_scale
        if smooth_k or v_stats:
            stats = (Pointer("k") if smooth_k else NULL, *k_st, Pointer("v") if v_stats else NULL, *v_st, np.int32(lk),
                     ws("part_sum"), ws("part_max"))
            self.launches.append(PackedLaunch(
                kernel.function(("_stats_balance_" if balance else "_stats_") + sfx), (nchunks, hkv, b),
                QUANT_THREADS, 0, stats + ((ws("part_range"),) if balance else ()), pdl))
            if balance:  # Q's column absmax: the V absmax of stats_body, over Q's rows
                self.launches.append(PackedLaunch(
                    kernel.function("_stats_" + sfx), (q_chunks, hq, b), QUANT_THREADS, 0,
                    (NULL, *q_st, Pointer("q"), *q_st, np.int32(lq), NULL, ws("part_qmax")), pdl))
            self.launches.append(PackedLaunch(
                kernel.function("_stats_finish"), (-(-d // FINISH_CHANNELS), hkv, b), QUANT_THREADS, 0,
                (ws("part_sum"), ws("part_max"), np.int32(nchunks), np.int32(lk), k_mean, v_scale,
                 ws("small", 2 * plane) if v_stats else NULL), pdl))
        if balance:
            self.launches.append(PackedLaunch(
                kernel.function("_balance"), (hkv, b, 1), QUANT_THREADS, 0,
                (ws("part_range"), k_mean, ws("part_qmax"), np.int32(nchunks), np.int32(q_chunks),
                 np.int32(hq // hkv), mul, ws("alpha")), pdl))
        blocks = -(-lq // q_quant_rows(spec)) * hq * b + nbk * hkv * b * (2 if v_job else 1)
        self.launches.append(PackedLaunch(
            kernel.function(("_quant_qkv_balance_" if balance else "_quant_qkv_") + sfx), (blocks, 1, 1),
            QUANT_THREADS, 0,
            (Pointer("q"), *q_st, np.int32(lq), np.int32(hq), np.int32(hq // hkv), mul, ws("q8"), ws("q_scale"),
             ws("shift"), Pointer("k"), *k_st, Pointer("v"), *v_st, np.int32(lk), np.int32(hkv), np.int32(lk_pad),
             np.int32(b), k_mean, v_scale, ws("k8"), ws("k_scale"), ws("v_op")) + ((ws("alpha"),) if balance else ()),
            pdl))

    def launch(self, pointers: dict, stream_ptr: int) -> None:
        if self.zero_fill is not None:
            from cupy.cuda import runtime

            offset, size = self.zero_fill
            runtime.memsetAsync(pointers["ws"] + offset, 0, size, stream_ptr)
        for launch in self.launches:
            launch(pointers, stream_ptr)

    def v_map_bytes(self, pointers: dict) -> bytes:
        """The V map of a kernel that reads V by the TMA, over the caller's V or the quantizer's rows."""
        address = pointers["ws"] + self.buffers["v_op"].offset if self.v_job else pointers["v"]
        return self.v_map(address)

    def _pointer(self, name: str, skip: int = 0) -> Pointer:
        """Buffer name's place in the workspace (null where the plan has no such buffer)."""
        return Pointer("ws", self.buffers[name].offset + skip) if name in self.buffers else NULL

    def operands(self) -> dict:
        """Where the attention kernel finds each operand after launch(): Pointers into the workspace,
        or to V itself where it passes through unquantized."""
        ws = self._pointer
        return {"q8": ws("q8"), "k8": ws("k8"), "v": ws("v_op") if self.v_job else Pointer("v"),
                "q_scale": ws("q_scale"), "k_scale": ws("k_scale"),
                "v_out_scale": ws("small", 2 * self._plane) if self.v_stats else NULL, "shift": ws("shift")}

    def arrays(self, memory) -> dict:
        """CuPy views of the workspace memory (a cupy.cuda.MemoryPointer) per buffer."""
        import cupy

        return {name: cupy.ndarray(buf.shape, dtype=buf.dtype, memptr=memory + buf.offset)
                for name, buf in self.buffers.items()}


def attention_launch(kernel, dims, dtype: str, operands: dict, v_strides, out_strides, with_lse: bool,
                     device_id: int):
    """The attention kernel's launch (output dtype = input dtype) on operands (name -> Pointer: q8,
    k8, v, q_scale, k_scale, v_out_scale, shift) writing Pointer("out") and, with_lse, Pointer("lse"); a
    kernel that reads V by the TMA (v_by_tma) takes its map as the bytes of pointers["v_map"].
    v_strides: bytes of the V operand's first three axes; out_strides: the output's, in elements. The
    wgmma kernel's grid is flat over its work items (engine.grid), the mma.sync kernel's (query blocks,
    heads, batch); device_id: the GPU whose SMs a persistent grid fills."""
    spec = kernel.spec
    b, hq, hkv, lq, lk, d = dims
    args = (operands["q8"], operands["k8"], operands["v"], operands["q_scale"], operands["k_scale"],
            operands["v_out_scale"], Pointer("out"), Pointer("lse") if with_lse else NULL,
            operands["shift"] if with_lse else NULL, *(np.int64(s) for s in v_strides[:3]),
            *(np.int64(s) for s in out_strides[:3]), np.int32(b), np.int32(hq), np.int32(hq // hkv), np.int32(lq),
            np.int32(lk)) + ((Blob("v_map", MAP_BYTES, MAP_ALIGN),) if v_by_tma(spec) else ())
    qblocks = -(-lq // spec.tile.block_m)
    if spec.family.values.get("mma_unit") == "wgmma":
        grid = work_grid(spec, qblocks * hq * b, device_id, wgmma_blocks_per_sm(spec.tile, d))
    else:
        grid = (qblocks, hq, b)
    return PackedLaunch(kernel.function("_" + SUFFIX[dtype]), grid, kernel.threads, kernel.shared_bytes, args,
                        programmatic(spec))


def contiguous_strides(buffer: Buffer) -> tuple:
    """Byte strides of a workspace buffer (C order)."""
    itemsize = np.dtype(buffer.dtype).itemsize
    strides, step = [], itemsize
    for n in reversed(buffer.shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))
