"""The int8-QK formats' recipes and kernel families (DESIGN §2): i8-f16, i8-i8 and i8-f8, int8 QK
with exact K smoothing and PV in fp16, int8 or fp8 e4m3; CUDA (mma.sync, and warp-specialized wgmma
for i8-f8 and i8-f16 on sm_90a) and HIP (int8 MFMA / iu8 WMMA)."""
from __future__ import annotations

from typing import Callable

from ...engine.family import CUDA_ARCHS, HIP_ARCHS, Family, LaunchChoice, Recipe, Tolerance
from ...engine.tiling import (first_problem, padded_row_bytes, ring_problem, smem_problem, tile_pitch,
                              unpipelined_problem, warp_rows_problem, warpgroup_rows_problem, consumer_registers_problem,
                              wgmma_consumer_registers)
from ...engine.tile import Tile

# ---- CUDA: m16n8k32 s8 QK, PV in fp16, int8 or e4m3 ---------------------------------------------
# One module per spec also holds the quantization kernels (K mean, Q/K block codes, V codes).
# Q8 and K8 sit in smem as rows of D + 16 bytes; V either as fp16 rows (tile_pitch(2D)) or,
# for 8-bit PV, transposed: D channel rows of BN + 16 key bytes. The epilogue stages the
# 16-bit output rows (D + 8 elements) over the same memory after the key loop.

def _i8_v_tile_bytes(tile: Tile, d: int, pv_operand: str) -> int:
    return tile.block_n * tile_pitch(2 * d) if pv_operand == "f16" else d * (tile.block_n + 16)


def _i8_smem(pv_operand: str) -> Callable[[Tile, int], int]:
    def smem(tile: Tile, d: int) -> int:
        loop = (tile.block_m + tile.stages * tile.block_n) * (d + 16) + tile.stages * _i8_v_tile_bytes(tile, d, pv_operand)
        epilogue = tile.block_m * padded_row_bytes(d, 2)
        return max(loop, epilogue)

    return smem


def _i8_problem(pv_operand: str) -> Callable[[Tile, int], str | None]:
    def problem(tile: Tile, d: int) -> str | None:
        def blocks():
            if tile.block_m % 32:
                return f"block_m must be a multiple of 32 (rows per pass of the quantization kernels), got {tile.block_m}"
            if tile.block_n % 32 or not 32 <= tile.block_n <= 128:
                return f"block_n must be a multiple of 32 in [32, 128] (the int8 MMA's k step), got {tile.block_n}"
            return None

        return first_problem(lambda: warp_rows_problem(tile, d), blocks, lambda: ring_problem(tile),
                             lambda: smem_problem(_i8_smem(pv_operand)(tile, d), "cuda"))

    return problem


# Where ptxas spills a few bytes of the default tile (its 128-register target for 256 threads): a
# tile of the same scale blocks that stays in registers. On sm_90a: the fastest tile of a sweep on
# the H200 (m128n64 w8s3 / w8s2 / w4s2, m128n32 w4s2 / w4s3; B4 H32 L4096 and B1 H32 L32768 at
# d128, B4 H32 L8192 at d64, causal and not; docs/notes/int8qk.md). Four warps of 32 rows reuse each K
# and V fragment twice and win by 10-35% at d128 although ptxas spills a few bytes there.
_W4, _W8 = Tile(128, 64, 4, 2), Tile(128, 64, 8, 2)
_I8_TUNED = {
    "f16": {(128, False, "sm_90a"): _W4, (128, True, "sm_90a"): _W4, (64, True, "sm_90a"): _W4},
    "i8": {(128, False, "sm_90a"): _W4, (128, True, "sm_90a"): _W4, (64, True, "sm_90a"): _W8},
    "f8": {(64, True, "sm_100a"): Tile(128, 64, 4, 3), (128, True, "sm_100a"): _W8, (128, True, "sm_120"): _W8},
}
_I8_MEASURED_SPILLS = {
    "f16": {(128, True, "sm_90a")},
    "i8": {(128, False, "sm_90a")},
}
# On Hopper, ptxas lowers mma.sync e4m3 to fp16 HMMAs plus an unpack of both operands in every warp
# (the i8-f8 SASS holds two HMMA.16816 and five F2FP.F16.E4M3.UNPACK_B per e4m3 MMA). There the
# i8-f8 kernel carries the same e4m3 values in fp16 instead: V is stored as fp16 rows of its e4m3
# codes' values, P is rounded to e4m3 and widened in registers, and PV runs on m16n8k16 f16 MMAs.
# Every product of two e4m3 values is exact in fp32, so the format (and the emulator) is unchanged.
E4M3_IN_F16_ARCHS = ("sm_90", "sm_90a")
# Measured on the H200 (docs/notes/int8qk.md): four warps of 32 rows win at d128 non-causal (16 B spilled,
# 385 vs 302-326 TOPS for m128n64w8s3/w8s2, m128n32w4s2); elsewhere the default is as fast or faster.
_I8_TUNED["f8-in-f16"] = {(128, False, "sm_90a"): _W4}
_I8_MEASURED_SPILLS["f8-in-f16"] = {(128, False, "sm_90a")}


def _cuda_i8(pv: str, pv_operand: str | None = None) -> Family:
    """The int8-QK family for one PV format ("f16", "i8" or "f8"); pv_operand is the type PV's MMA
    runs on: pv itself, or "f16" for e4m3 values carried in fp16. The e4m3 MMA needs sm_89+."""
    pv_operand = pv_operand or pv
    variant = pv if pv_operand == pv else f"{pv}-in-{pv_operand}"
    archs = CUDA_ARCHS if pv != "f8" else tuple(a for a in CUDA_ARCHS if int(a[3:].rstrip("a")) >= 89)
    return Family(
        template="cuda/prefill_i8.cu.j2",
        head_dims=(64, 128),
        # 128 query rows per Q scale and 64 keys per K scale (the emulator's defaults). Eight warps
        # of 16 rows: with four warps of 32 rows ptxas spills at d128.
        default_tiles={64: Tile(128, 64, 8, 3), 128: Tile(128, 64, 8, 3)},
        tile_problem=_i8_problem(pv_operand),
        smem_bytes=_i8_smem(pv_operand),
        archs=archs,
        launcher="prefill_i8",
        main_entry="_f16",
        tuned=dict(_I8_TUNED.get(variant, {})),
        measured_spills=frozenset(_I8_MEASURED_SPILLS.get(variant, ())),
        values={"pv_operand": pv_operand, "mma_unit": "mma.sync"},
    )


CUDA_I8 = {pv: _cuda_i8(pv) for pv in ("f16", "i8", "f8")}
CUDA_I8_F8_IN_F16 = _cuda_i8("f8", "f16")


# ---- CUDA int8 QK prefill on Hopper warpgroup MMAs (i8-f8, i8-f16; sm_90a) ------------------------
# The shared warp-specialized pipeline (templates/cuda/wgmma_attention.cuh.j2): each consumer
# warpgroup (4 of tile.warps) owns 64 query rows; a producer warpgroup beside them fills the K and V
# rings: one bulk copy per tile the quantizer stores, K8 and V^T codes in wgmma's no-swizzle core-matrix
# layout (rows of D, or BN, bytes: no padding), i8-f16's fp16 V in 128-byte swizzled lines (as the
# dense kernel's TMA writes them). The output rows are staged in their own region (a warpgroup
# finishes while the other still reads K/V), and four mbarriers per ring slot follow.
# Registers the producer warpgroup keeps (attention_i8_wgmma.cuh.j2): setmaxnreg's least, 24 (one
# thread issues the copies).
_PRODUCER_REGS = 24


def _wgmma_smem(pv: str) -> Callable[[Tile, int], int]:
    def smem(tile: Tile, d: int) -> int:
        v_tile = tile.block_n * d * (2 if pv == "f16" else 1)
        loop = tile.block_m * d + tile.stages * (tile.block_n * d + v_tile)
        return loop + tile.block_m * padded_row_bytes(d, 2) + 4 * 8 * tile.stages

    return smem


def wgmma_blocks_per_sm(tile: Tile, d: int) -> int:
    """Blocks of the wgmma kernel an SM holds (BLOCKS_PER_SM in attention_i8_wgmma.cuh.j2)."""
    return 1 if tile.warps >= 8 else 3 if d + tile.block_n <= 128 else 2


def _wgmma_problem(pv: str) -> Callable[[Tile, int], str | None]:
    def problem(tile: Tile, d: int) -> str | None:
        def shape():
            if tile.block_n % 32 or not 64 <= tile.block_n <= 224:
                return f"block_n must be a multiple of 32 in [64, 224] (the s8 wgmma's k step), got {tile.block_n}"
            return None

        def registers():
            # fp16 PV: O, S and P (d / 2 + block_n / 2 + block_n / 4 a thread) and ~32 for addresses,
            # scales and statistics: m192n128w12 at d64 fits 160 without spills, causal or not. The e4m3
            # kernel holds O and S (d / 2 + block_n / 2) and ~24 more: S is issued beside PV only where
            # registers allow (S_BESIDE_PV), and the softmax packs P over S.
            need = d // 2 + 3 * tile.block_n // 4 + 32 if pv == "f16" else d // 2 + tile.block_n // 2 + 24
            return consumer_registers_problem(need, wgmma_consumer_registers(tile, wgmma_blocks_per_sm(tile, d),
                                                                             _PRODUCER_REGS))

        return first_problem(lambda: warpgroup_rows_problem(tile), shape, registers, lambda: ring_problem(tile),
                             lambda: smem_problem(_wgmma_smem(pv)(tile, d), "cuda"))

    return problem


def _cuda_i8_wgmma(pv: str, default_tiles: dict, measured_spills: frozenset = frozenset(),
                   option_defaults: dict | None = None) -> Family:
    """The int8-QK family on wgmma for one PV format ("f8": e4m3 V^T tiles; "f16": fp16 V tiles).
    Whatever the tile, one Q scale per query row and four K scales per key tile (values: quant's
    "thread" groups, the keys of one accumulator column quad), as fine as SageAttention2's
    per-thread scales and as cheap: a thread applies one scale per row and one per key tile. The key
    tile is the format's key block (keys per K scale block and per softmax step)."""
    return Family(
        template="cuda/prefill_i8.cu.j2",
        head_dims=(64, 128),
        default_tiles=default_tiles,
        measured_spills=measured_spills,
        tile_problem=_wgmma_problem(pv),
        smem_bytes=_wgmma_smem(pv),
        archs=("sm_90a",),
        producer_warps=4,
        launcher="prefill_i8",
        main_entry="_f16",
        values={"pv_operand": pv, "mma_unit": "wgmma", "q_scale_rows": 1, "k_scale_groups": 4},
        # fp16 PV issues S ahead of PV, so two or three consumer warpgroups can take turns issuing their
        # MMAs (wgmma_attention.cuh.j2, consumer_turns_begin); the e4m3 kernel adds PV partials with weights
        # persistent "on": as many blocks as the SMs hold, each taking work items in turn (causal: in pairs of a
        # heavy and a light query block; wgmma_attention.cuh.j2, work_item)
        # v_tiles (fp16 PV): "off" reads V by the TMA from the caller's rows (or, for bf16 V or strides the TMA cannot
        # address, from fp16 rows the quantizer writes); "on" has the quantizer copy V into the kernel's swizzled tiles
        options={**({"pingpong": ("off", "on"), "v_tiles": ("off", "on")} if pv == "f16" else {}),
                 "persistent": ("off", "on")},
        option_defaults=option_defaults or {},
    )


# Measured on the H200 (docs/notes/int8qk.md): 128-key blocks beat 64-key ones by 16-20% at d128 and
# 5-9% at d64; three consumer warpgroups of one 192-row block (three warps per scheduler where two
# 64-row blocks per SM give two) beat two 64-row blocks by 15% at d64 (causal 11%) and 13% at d128
# (S issued after the PV partial there), though ptxas spills a few bytes at their 160 registers. At d64 a third
# K/V slot spills less (16-28 B stored against 28-40) and took 0.96-0.985 of two slots' time from 2048 rows, causal
# and not (H100, two runs); at d128 it took 1.006-1.029.
CUDA_I8_F8_WGMMA = _cuda_i8_wgmma(
    "f8", {64: Tile(192, 128, 12, 3), 128: Tile(192, 128, 12, 2)},
    frozenset((d, causal, "sm_90a") for d in (64, 128) for causal in (False, True)))
# fp16 PV: O, S and P at once (S runs ahead of PV) on two consumer warpgroups' 240 registers. At d128
# 128-key blocks spill 32-36 B (the int32 S beside its floats) and, with the warpgroups in turns,
# measured 1.04-1.12x the spill-free 64-key blocks (H200, B1 L32768, B4 L4096, B16 L1024, causal and
# not; docs/notes/int8qk.md); the turns cost 4-6% at d64, which keeps them off.
CUDA_I8_F16_WGMMA = _cuda_i8_wgmma(
    "f16", {64: Tile(128, 128, 8, 2), 128: Tile(128, 128, 8, 2)},
    frozenset((128, causal, "sm_90a") for causal in (False, True)), option_defaults={128: {"pingpong": "on"}})


# Calls of fewer rows run i8-f8 on two 64-row blocks per SM (registry.launch_choice): at 1024 rows a
# sequence one block of 192 rows spends a large share of each query block on its start and end, which the
# SM's second block hides. H200, whole calls, time m64 / m192: d128 B16 L1024 0.96 non-causal and 0.91 causal
# (single calls from an idle GPU; 0.95 and 0.91 back to back), B8 L2048 1.06 non-causal and 0.91-0.99 causal,
# B4 L4096 causal 1.05; d64 0.98 / 0.89 at L1024, 1.01 / 0.96 at L2048.
I8_F8_SHORT_TILE = Tile(64, 128, 4, 2)
I8_F8_LONG_QUERIES = {False: 2048, True: 4096}  # by causal: from these rows the 192-row default again
# i8-f16 below 4096 rows at d128 runs persistent blocks (causal: in pairs of a heavy and a light query block):
# time 0.93-0.97 of a block per item at B16 L1024 and B8 L2048, causal and not; 0.99-1.03 from L4096.
I8_F16_PERSISTENT_BELOW = 4096
# From 8192 rows at d128, 192-key tiles (no spill; each softmax step's fixed costs spread over more keys): H100,
# same run, x cuDNN, default m128n128w8s2 / m128n192w8s2: B2 L8192 1.05 / 1.18 non-causal, 0.98 / 1.01 causal;
# B1 L16384 1.21 / 1.31 and 1.17 / 1.20 (docs/notes/int8qk.md). The K scale block follows the tile (192 keys).
I8_F16_WIDE = LaunchChoice(8192, Tile(128, 192, 8, 2))
# V by the TMA (v_tiles "off", the default) saves the quantizer's copy of V: 0.89 of the time at B16 L1024, 0.93 at B8
# L2048, 0.97 at B2 L8192, 0.91 at B2 L16384 (H100, same runs, causal alike). Non-causal from 32768 rows it measured
# 1.025 of the quantizer's tiles in two runs (B1 L32768), where the copy is 0.4% of the call: those calls keep the
# tiles.
I8_F16_LONG_V_TILES = LaunchChoice(32768, Tile(128, 192, 8, 2), options=(("v_tiles", "on"),), causal=False)
# i8-f16 at d64 from 2048 rows runs three consumer warpgroups (m192n128w12s2, a block an item). Non-causal, × cuDNN
# (H200): 1.14 against 0.92 for the two-warpgroup default at B4 L8192 and 0.84 against 0.72 at B8 L2048 (persistent
# blocks 1.04 and 0.80). Causal, time against the default (H100, same run): 0.94 at B8 L2048, 0.95 at B4 L2048,
# 0.91 at B4 L4096, 0.85 at B4 L8192 and 0.82 at B2 L16384; 1.04 at B16 L1024, which keeps the default.
I8_F16_D64_THREE_WARPGROUPS = LaunchChoice(2048, Tile(192, 128, 12, 2))
# Causal from 8192 rows on a third K/V slot: time against two slots (H100, three same-run rounds each, three runs)
# 0.985, 0.977, 0.955, 1.009, 0.995 at B4 L8192 and 1.000, 0.995, 0.988, 0.995 at B2 L16384; non-causal B4 L8192
# took 1.015, so it keeps two. Persistent blocks (their spill in the output rows' addresses) measured level and 1.02.
I8_F16_D64_CAUSAL_THREE_SLOTS = LaunchChoice(8192, Tile(192, 128, 12, 3), causal=True)


def _i8_f8_bands(d: int) -> tuple:
    default = CUDA_I8_F8_WGMMA.default_tiles[d]
    return tuple(choice for causal, least in I8_F8_LONG_QUERIES.items()
                 for choice in (LaunchChoice(1, I8_F8_SHORT_TILE, causal=causal),
                                LaunchChoice(least, default, causal=causal)))


def _i8_f16_bands(d: int) -> tuple:
    default = CUDA_I8_F16_WGMMA.default_tiles[d]
    return (LaunchChoice(1, default, options=(("persistent", "on"),)),
            LaunchChoice(I8_F16_PERSISTENT_BELOW, default), I8_F16_WIDE, I8_F16_LONG_V_TILES)


LAUNCH_TILES = {**{("i8-f8", d, "sm_90a"): _i8_f8_bands(d) for d in CUDA_I8_F8_WGMMA.head_dims},
                ("i8-f16", 128, "sm_90a"): _i8_f16_bands(128),
                ("i8-f16", 64, "sm_90a"): (I8_F16_D64_THREE_WARPGROUPS, I8_F16_D64_CAUSAL_THREE_SLOTS)}


# ---- HIP int8 QK prefill (i8-f16, i8-i8, i8-f8): int8 MFMA / iu8 WMMA QK, PV in fp16, int8 or e4m3 --
# Same tile rules as HIP_MATRIX (16 query rows per 32 lanes, no pipelining) and the CUDA module's
# entry points (attention + quantization kernels). K8 rows of D + 16 bytes in LDS; V as fp16 V^T
# (BN + 8 elements per channel) or as 8-bit V^T codes (BN + 16 bytes per channel); Q8 stays in
# registers. The output rows are staged over the same LDS after the key loop.

def _hip_i8(pv: str) -> Family:
    """The HIP int8-QK family for one PV format ("f16", "i8" or "f8"). e4m3 PV needs an fp8 matrix
    op: CDNA3 (gfx942, e4m3fnuz MFMA) and RDNA4 (gfx1201, e4m3 WMMA); gfx90a and RDNA3 (gfx1100)
    have none, so i8-f8 is not offered there."""
    archs = HIP_ARCHS if pv != "f8" else ("gfx942", "gfx1201")

    def smem(tile: Tile, d: int) -> int:
        v_tile = d * padded_row_bytes(tile.block_n, 2) if pv == "f16" else d * (tile.block_n + 16)
        return max(tile.block_n * (d + 16) + v_tile, tile.block_m * padded_row_bytes(d, 2))

    def problem(tile: Tile, d: int) -> str | None:
        if tile.warps % 2:
            return f"warps must be even (a 64-lane CDNA wave is two warps), got {tile.warps}"
        if tile.block_m != 16 * tile.warps:
            return f"block_m must be 16 rows per warp (16*warps), got {tile.block_m} with {tile.warps} warps"
        if tile.block_n not in (32, 64):
            return f"block_n must be 32 or 64 (whole 32-key steps of the 8-bit ops), got {tile.block_n}"
        return unpipelined_problem(tile, "HIP") or smem_problem(smem(tile, d), "hip")

    return Family(
        template="hip/prefill_i8.hip.j2",
        head_dims=(64, 128),
        # The emulator's scale blocks (128 query rows per Q scale, 64 keys per K scale), as on CUDA.
        default_tiles={64: Tile(128, 64, 8, 1), 128: Tile(128, 64, 8, 1)},
        tile_problem=problem,
        smem_bytes=smem,
        archs=archs,
        launcher="prefill_i8",
        main_entry="_f16",
        values={"pv_operand": pv},
    )


HIP_I8 = {pv: _hip_i8(pv) for pv in ("f16", "i8", "f8")}


# Their CUDA modules also quantize (ctype "pv" names the PV operand format; mma/cvt serve the fp16
# PV helpers).
RECIPES = (
    Recipe("i8-f16", "int8 QK with exact K smoothing, PV in fp16", ("float16", "bfloat16"),
           Tolerance(max_rel=1e-1, rel_l2=3e-2), {"cuda": CUDA_I8["f16"], "hip": HIP_I8["f16"]},
           {"mma": "f16", "cvt": "f16x2", "pv": "f16"}, {("cuda", "sm_90a"): (CUDA_I8_F16_WGMMA, CUDA_I8["f16"])}),
    Recipe("i8-i8", "int8 QK with exact K smoothing, PV in int8 (P static 127, V per channel)",
           ("float16", "bfloat16"), Tolerance(max_rel=2e-1, rel_l2=1e-1), {"cuda": CUDA_I8["i8"], "hip": HIP_I8["i8"]},
           {"mma": "f16", "cvt": "f16x2", "pv": "i8"}),
    Recipe("i8-f8", "int8 QK with exact K smoothing, PV in fp8 e4m3 (P static 448, V per channel)",
           ("float16", "bfloat16"), Tolerance(max_rel=2e-1, rel_l2=6e-2), {"cuda": CUDA_I8["f8"], "hip": HIP_I8["f8"]},
           {"mma": "f16", "cvt": "f16x2", "pv": "f8"},
           {("cuda", "sm_90"): (CUDA_I8_F8_IN_F16,), ("cuda", "sm_90a"): (CUDA_I8_F8_WGMMA, CUDA_I8_F8_IN_F16)}),
)
