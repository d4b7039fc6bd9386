"""The int8-KV-cache formats' recipes and kernel families (DESIGN §2 "int8 KV cache, exact
kernels"): ``kv8-f32`` (fp32 SIMT over codes dequantized on the way into shared memory), ``kv8-split``
(fp16 hi + lo split, two m16n8k16 MMAs) and ``kv8-imma`` (24-bit 3-way byte split, m16n8k32 int8 MMAs
on the codes as stored), each for CUDA and HIP (MFMA / WMMA; HIP_MMA below).

The tensor-core kernels share one template (prefill_kv8_mma.cu.j2): each warp owns 16 query rows
whose Q operand stays in registers; per pipeline slot shared memory holds the K and V codes of BN
keys (rows of D + 16 bytes) and their two scale rows; one more tile holds V transposed (D rows of
BN + 16 bytes, keys permuted within 16-key chunks). Their modules also hold a statistics kernel
(entry ``<name>_stat``) that the launcher runs first, and a merge kernel (entry ``<name>_merge``)
that it runs last when the key range is split over several blocks (kv8_merge.cuh.j2).

On sm_90a kv8-imma also builds on warpgroup MMAs (``IMMA_WGMMA``, matrix unit "wgmma"): the same
template and loop, K and V^T in wgmma's core-matrix layout, the Q parts in shared memory, and the
same fp32 operations in the same order, so its output bits are the mma.sync kernel's with the same
key block and splits.
"""
from __future__ import annotations

from typing import Callable

from ...engine.family import CUDA_ARCHS, HIP_ARCHS, Family, LaunchChoice, Recipe, Tolerance
from ...engine.tiling import ring_problem, simt_problem, simt_smem, smem_problem, tile_pitch, unpipelined_problem
from ...engine.tile import Tile

MMA_TEMPLATE = "cuda/prefill_kv8_mma.cu.j2"
SIMT_TEMPLATE = "common/prefill_kv8_f32.j2"  # extends the fp32 kernel of the backend (values["simt_base"])
LAUNCHER = "prefill_kv8"  # the registry key of host.prefill_kv8
STAT_ENTRY = "_stat"  # suffix of the statistics kernel in the tensor-core modules
MERGE_ENTRY = "_merge"  # suffix of the kernel that merges the splits over keys
HEAD_DIMS = (64, 128)  # multiples of kv8-imma's 64-channel Q scale group
MMA_FORMATS = ("kv8-split", "kv8-imma")


# kv8-imma at d128 on sm_90a runs three slots, which transpose V a block ahead and wait at one
# barrier a block instead of two: 2-10% faster at every seed shape on the H200 (docs/notes/kv8.md).
# It takes 108 KB of shared memory (two blocks per SM; 99 KB archs cannot hold it) and ptxas parks
# 64 B on the stack, which MEASURED_SPILLS admits.
IMMA_TUNED = {(128, causal, "sm_90a"): Tile(64, 64, 4, 3) for causal in (False, True)}
MEASURED_SPILLS = {"kv8-imma": frozenset(IMMA_TUNED), "kv8-split": frozenset()}

# Kernels that depend on the call's query count, which a spec does not know: LAUNCH_TILES[(format,
# head_dim, arch)] = (least query rows, tile, matrix unit or None for the arch's default), run by
# calls that name neither tile nor unit (registry.launch_choice). kv8-split, whose fp16 Q operand takes a
# third more shared memory than kv8-imma's bytes, would hold one 64-row block per SM on three
# slots; from LONG_QUERIES rows it runs 128-row blocks of three slots (one block's K/V tiles and V
# transpose serve eight warps; with fewer rows half the block idles). kv8-imma runs its wgmma
# kernel's 128-row blocks from WGMMA_QUERIES[head_dim] rows (measured on the H200, docs/notes/kv8.md:
# at d128 1.03-1.13x the mma.sync kernel from 256 queries, at d64 1.34-1.43x at 32768/2048 but
# 0.78-0.91x at 1500/1500, where its one block per SM fills the GPU worse; with 64 queries
# 0.6-0.7x at both).
LONG_QUERIES = 256
WGMMA_QUERIES = {128: LONG_QUERIES, 64: 2048}


LAUNCH_TILES: dict[tuple[str, int, str], LaunchChoice] = {
    ("kv8-split", 128, "sm_90a"): LaunchChoice(LONG_QUERIES, Tile(128, 64, 8, 3)),
    **{("kv8-imma", d, "sm_90a"): LaunchChoice(WGMMA_QUERIES[d], Tile(128, 64, 8, 3), "wgmma") for d in HEAD_DIMS},
}


# Bytes of Q operand per query element kept in shared memory: kv8-imma's three byte parts, or
# kv8-split's fp16 hi and lo.
Q_BYTES = {"kv8-imma": 3, "kv8-split": 4}


def kv8_mma_smem(fmt: str, unit: str = "mma.sync") -> Callable[[Tile, int], int]:
    """Bytes of dynamic shared memory: the transposed V tile (two from three stages: the next block's
    is built beside the current one's), STAGES slots of codes and scales, and the Q operand
    fragments of the block's rows. On wgmma the K and V^T tiles are core matrices (rows unpadded)."""
    core = unit == "wgmma"

    def smem(tile: Tile, d: int) -> int:
        k_row, vt_row = (d, tile.block_n) if core else (tile_pitch(d), tile.block_n + 16)
        slot = tile.block_n * (k_row + tile_pitch(d)) + 2 * tile.block_n * 4  # K, V codes; K, V scales
        vt_tiles = 2 if tile.stages >= 3 else 1
        return vt_tiles * d * vt_row + tile.stages * slot + Q_BYTES[fmt] * tile.block_m * d

    return smem


def kv8_mma_problem(fmt: str) -> Callable[[Tile, int], str | None]:
    def problem(tile: Tile, d: int) -> str | None:
        return _mma_problem(fmt, tile, d)

    return problem


def _mma_problem(fmt: str, tile: Tile, d: int) -> str | None:
    if tile.block_m != 16 * tile.warps:
        return f"block_m must be 16 rows per warp (16*warps), got {tile.block_m} with {tile.warps} warps"
    if not 1 <= tile.warps <= 8:
        return f"warps must be 1..8, got {tile.warps}"
    if tile.block_n not in (64, 128):
        return f"block_n must be 64 or 128 (whole ldmatrix.x4 loads of 64 keys), got {tile.block_n}"
    if d % 64:
        return f"head_dim must be a multiple of 64, got {d}"
    return ring_problem(tile) or smem_problem(kv8_mma_smem(fmt)(tile, d), "cuda")


def _mma_family(fmt: str) -> Family:
    """kv8-split or kv8-imma: one template, the products picked by the format (m16n8k32 s8/u8 and
    m16n8k16 f16 mma.sync, cp.async: sm_80 and later)."""
    if fmt not in MMA_FORMATS:
        raise ValueError(f"fmt: expected one of {MMA_FORMATS}, got {fmt!r}")
    return Family(
        template=MMA_TEMPLATE,
        head_dims=HEAD_DIMS,
        default_tiles={d: Tile(64, 64, 4, 2) for d in HEAD_DIMS},
        tuned=dict(IMMA_TUNED) if fmt == "kv8-imma" else {},
        measured_spills=MEASURED_SPILLS[fmt],
        tile_problem=kv8_mma_problem(fmt),
        smem_bytes=kv8_mma_smem(fmt),
        archs=CUDA_ARCHS,
        align_bytes=4,
        launcher=LAUNCHER,
        values={"mma_unit": "mma.sync"},
    )


# kv8-imma on warpgroup MMAs. A warpgroup owns 64 query rows; QK_N keys per S wgmma and PV_N
# channels per PV wgmma bound the part sums live at once (3 x n/2 registers a thread). Measured on
# the H200 (docs/notes/kv8.md): 64-key and 64-channel products beat 32-wide ones by 2-4% at d128; one
# 128-row block per SM (eight warps) beats two 64-row blocks by 10-20% at 32768/2048. It beats the
# mma.sync kernel only for many queries, so the default unit stays mma.sync and such calls run the
# wgmma kernel (LAUNCH_TILES).
WGMMA_VALUES = {"mma_unit": "wgmma", "qk_n": 64, "pv_n": 64}


def _wgmma_problem(tile: Tile, d: int) -> str | None:
    if tile.block_m not in (64, 128) or tile.block_m != 16 * tile.warps:
        return ("block_m must be 64 or 128, 64 rows per warpgroup of 4 warps (warps = block_m / 16), "
                f"got {tile.block_m}/{tile.warps}")
    if tile.block_n not in (64, 128):
        return f"block_n must be 64 or 128, got {tile.block_n}"
    if not 3 <= tile.stages <= 4:
        return f"stages must be 3 or 4 (V is transposed a block ahead), got {tile.stages}"
    return smem_problem(kv8_mma_smem("kv8-imma", "wgmma")(tile, d), "cuda")


def imma_wgmma_family(**values) -> Family:
    """kv8-imma on sm_90a's warpgroup MMAs; values override WGMMA_VALUES (qk_n, pv_n)."""
    return Family(
        template=MMA_TEMPLATE,
        head_dims=HEAD_DIMS,
        default_tiles={d: Tile(128, 64, 8, 3) for d in HEAD_DIMS},
        tile_problem=_wgmma_problem,
        smem_bytes=kv8_mma_smem("kv8-imma", "wgmma"),
        archs=("sm_90a",),
        align_bytes=4,
        launcher=LAUNCHER,
        values={**WGMMA_VALUES, **values},
    )


IMMA_WGMMA = imma_wgmma_family()


def _simt_family(backend: str = "cuda") -> Family:
    """kv8-f32: the fp32 SIMT kernel of the backend (the f32 recipe's tiling rules and shared-memory layout) with
    K and V dequantized on their way into shared memory."""
    return Family(
        template=SIMT_TEMPLATE,
        head_dims=HEAD_DIMS,
        default_tiles={d: Tile(32, 32, 4, 1) for d in HEAD_DIMS},
        tile_problem=lambda tile, d: simt_problem(tile, d, backend),
        smem_bytes=simt_smem,
        archs=CUDA_ARCHS if backend == "cuda" else HIP_ARCHS,
        align_bytes=4,
        launcher=LAUNCHER,
        values={"simt_base": "cuda/prefill_simt.cu.j2" if backend == "cuda" else "hip/prefill_simt.hip.j2"},
    )


# kv8-imma and kv8-split on the AMD matrix cores (hip/prefill_kv8_mma.hip.j2, the products from hip/kv8_imma.h.j2 or
# hip/kv8_split.h.j2): 16 query rows per 32 lanes (a wave64 holds two 16-row tiles), no pipelining, as the other HIP
# matrix kernels. LDS: the block's Q operand (kv8-imma: three byte planes of rows of D + 16 bytes; kv8-split: fp16 hi
# and lo planes of rows of D + 8 elements), the K tile and V^T tile (kv8-imma: codes as stored, rows of D + 16 and
# BN + 16 bytes; kv8-split: codes as fp16, rows of D + 8 and BN + 8 elements) and both token-scale rows.
HIP_MMA_TEMPLATE = "hip/prefill_kv8_mma.hip.j2"


def hip_mma_smem(fmt: str) -> Callable[[Tile, int], int]:
    def smem(tile: Tile, d: int) -> int:
        scales = 2 * tile.block_n * 4
        if fmt == "kv8-imma":
            return (3 * tile.block_m + tile.block_n) * (d + 16) + d * (tile.block_n + 16) + scales
        return 2 * ((2 * tile.block_m + tile.block_n) * (d + 8) + d * (tile.block_n + 8)) + scales

    return smem


def _hip_mma_family(fmt: str) -> Family:
    smem = hip_mma_smem(fmt)

    def problem(tile: Tile, d: int) -> str | None:
        if tile.warps % 2:
            return f"warps must be even (a 64-lane CDNA wave is two warps), got {tile.warps}"
        if tile.block_m != 16 * tile.warps:
            return f"block_m must be 16 rows per warp (16*warps), got {tile.block_m} with {tile.warps} warps"
        if tile.block_n not in (32, 64, 128):
            return f"block_n must be 32, 64 or 128 (whole 32-key steps; part sums below 2^22), got {tile.block_n}"
        return unpipelined_problem(tile, f"HIP {fmt}") or smem_problem(smem(tile, d), "hip")

    # The CUDA kernels' 64 keys a block (for kv8-imma the emulator's w-scale chunk), but for kv8-split at d128, whose
    # fp16 tiles take 71 KB of LDS with 64.
    defaults = {d: Tile(64, 64 if fmt == "kv8-imma" or d == 64 else 32, 4, 1) for d in HEAD_DIMS}
    return Family(
        template=HIP_MMA_TEMPLATE,
        head_dims=HEAD_DIMS,
        default_tiles=defaults,
        tile_problem=problem,
        smem_bytes=smem,
        archs=HIP_ARCHS,
        align_bytes=4,
        launcher=LAUNCHER,
    )


HIP_MMA = {fmt: _hip_mma_family(fmt) for fmt in MMA_FORMATS}


FAMILY_BUILDERS: dict[str, Callable[[], Family]] = {
    "kv8-f32": _simt_family,
    "kv8-split": lambda: _mma_family("kv8-split"),
    "kv8-imma": lambda: _mma_family("kv8-imma"),
}
FAMILIES: dict[str, Family] = {fmt: build() for fmt, build in FAMILY_BUILDERS.items()}


_EXACT = Tolerance(max_rel=1e-5, rel_l2=1e-5)
RECIPES = (
    Recipe("kv8-f32", "int8 KV cache dequantized to fp32, fp32 SIMT", ("float32",), _EXACT,
           {"cuda": FAMILIES["kv8-f32"], "hip": _simt_family("hip")}),
    Recipe("kv8-split", "int8 KV cache, fp16 hi+lo split of the other operand, two fp16 MMAs", ("float32",), _EXACT,
           {"cuda": FAMILIES["kv8-split"], "hip": HIP_MMA["kv8-split"]}),
    Recipe("kv8-imma", "int8 KV cache on int8 tensor cores, 24-bit 3-way split of the other operand", ("float32",),
           _EXACT, {"cuda": FAMILIES["kv8-imma"], "hip": HIP_MMA["kv8-imma"]}, arch_families={("cuda", "sm_90a"): (FAMILIES["kv8-imma"], IMMA_WGMMA)}),
)
