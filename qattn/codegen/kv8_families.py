"""CUDA kernel families of the int8-KV-cache formats (DESIGN §2 "int8 KV cache, exact kernels"):
``kv8-f32`` (fp32 SIMT over codes dequantized on the way into shared memory), ``kv8-split`` (fp16
hi + lo split, two m16n8k16 MMAs) and ``kv8-imma`` (24-bit 3-way byte split, m16n8k32 int8 MMAs on
the codes as stored). ``register`` attaches them to the kv8 recipes of ``recipes.RECIPES``.

The tensor-core kernels share one template (prefill_kv8_mma.cu.j2): each warp owns 16 query rows
whose Q operand stays in registers; per pipeline slot shared memory holds the K and V codes of BN
keys (rows of D + 16 bytes) and their two scale rows; one more tile holds V transposed (D rows of
BN + 16 bytes, keys permuted within 16-key chunks). Their modules also hold a statistics kernel
(entry ``<name>_stat``) that the launcher runs first, and a merge kernel (entry ``<name>_merge``)
that it runs last when the key range is split over several blocks (kv8_merge.cuh.j2).
"""
from __future__ import annotations

from typing import Callable

from .recipes import CUDA_ARCHS, Family, _simt_problem, _simt_smem, ring_problem, smem_problem, tile_pitch
from .tile import Tile

MMA_TEMPLATE = "cuda/prefill_kv8_mma.cu.j2"
SIMT_TEMPLATE = "cuda/prefill_kv8_f32.cu.j2"
LAUNCHER = "prefill_kv8"  # key of runtime.launch.LAUNCHERS (runtime/kv8.py)
STAT_ENTRY = "_stat"  # suffix of the statistics kernel in the tensor-core modules
MERGE_ENTRY = "_merge"  # suffix of the kernel that merges the splits over keys
HEAD_DIMS = (64, 128)  # multiples of kv8-imma's 64-channel Q scale group
MMA_FORMATS = ("kv8-split", "kv8-imma")


# kv8-imma at d128 on sm_90a runs three slots, which transpose V a block ahead and wait at one
# barrier a block instead of two: 2-10% faster at every seed shape on the H200 (BENCHMARKS.md).
# It takes 108 KB of shared memory (two blocks per SM; 99 KB archs cannot hold it) and ptxas parks
# 64 B on the stack, which MEASURED_SPILLS admits.
IMMA_TUNED = {(128, causal, "sm_90a"): Tile(64, 64, 4, 3) for causal in (False, True)}
MEASURED_SPILLS = {"kv8-imma": frozenset(IMMA_TUNED), "kv8-split": frozenset()}

# Tiles that depend on the call's query count, which a spec does not know: LAUNCH_TILES[(format,
# head_dim, arch)] = (least query rows, tile), run by calls that name no tile (attention_kv8). kv8-split,
# whose fp16 Q operand takes a third more shared memory than kv8-imma's bytes, would hold one
# 64-row block per SM on three slots; from LONG_QUERIES rows it runs 128-row blocks of three slots
# (one block's K/V tiles and V transpose serve eight warps; with fewer rows half the block idles).
LONG_QUERIES = 256
LAUNCH_TILES: dict[tuple[str, int, str], tuple[int, Tile]] = {
    ("kv8-split", 128, "sm_90a"): (LONG_QUERIES, Tile(128, 64, 8, 3)),
}


def launch_tile(fmt: str, head_dim: int, arch: str, queries: int) -> Tile | None:
    """The tile a kv8 call of `queries` query rows that names none runs: LAUNCH_TILES's where it
    applies, else None (the family's default for the spec)."""
    least, tile = LAUNCH_TILES.get((fmt, head_dim, arch), (None, None))
    return tile if least is not None and queries >= least else None


# Bytes of Q operand per query element kept in shared memory: kv8-imma's three byte parts, or
# kv8-split's fp16 hi and lo.
Q_BYTES = {"kv8-imma": 3, "kv8-split": 4}


def kv8_mma_smem(fmt: str) -> Callable[[Tile, int], int]:
    """Bytes of dynamic shared memory: the transposed V tile (two from three stages: the next block's
    is built beside the current one's), STAGES slots of codes and scales, and the Q operand
    fragments of the block's rows."""
    def smem(tile: Tile, d: int) -> int:
        slot = 2 * tile.block_n * tile_pitch(d) + 2 * tile.block_n * 4
        vt_tiles = 2 if tile.stages >= 3 else 1
        return vt_tiles * d * (tile.block_n + 16) + tile.stages * slot + Q_BYTES[fmt] * tile.block_m * d

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
    )


def _simt_family() -> Family:
    """kv8-f32: the fp32 SIMT tiling rules of the f32 recipe (same shared-memory layout)."""
    return Family(
        template=SIMT_TEMPLATE,
        head_dims=HEAD_DIMS,
        default_tiles={d: Tile(32, 32, 4, 1) for d in HEAD_DIMS},
        tile_problem=_simt_problem,
        smem_bytes=_simt_smem,
        archs=CUDA_ARCHS,
        align_bytes=4,
        launcher=LAUNCHER,
    )


FAMILY_BUILDERS: dict[str, Callable[[], Family]] = {
    "kv8-f32": _simt_family,
    "kv8-split": lambda: _mma_family("kv8-split"),
    "kv8-imma": lambda: _mma_family("kv8-imma"),
}
FAMILIES: dict[str, Family] = {fmt: build() for fmt, build in FAMILY_BUILDERS.items()}


def register(recipes: dict) -> None:
    """Attach the CUDA families to the kv8 recipes (idempotent)."""
    for fmt, family in FAMILIES.items():
        recipes[fmt].families["cuda"] = family
