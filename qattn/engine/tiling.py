"""Tile rules several kernel families share: each check returns why a tile does not fit, or None;
the row pitches the templates' shared-memory layouts use."""
from __future__ import annotations

from .family import SMEM_LIMIT
from .tile import Tile


def ring_problem(tile: Tile) -> str | None:
    if not 2 <= tile.stages <= 4:
        return f"stages must be 2..4 (K/V slots in the cp.async ring), got {tile.stages}"
    return None


def unpipelined_problem(tile: Tile, kernel: str) -> str | None:
    return None if tile.stages == 1 else f"the {kernel} kernel is not pipelined: stages must be 1"


def smem_problem(need: int, backend: str) -> str | None:
    if need > SMEM_LIMIT[backend]:
        return f"needs {need} B of {'LDS' if backend == 'hip' else 'shared memory'}, over {SMEM_LIMIT[backend]}"
    return None


def warp_rows_problem(tile: Tile, d: int) -> str | None:
    """mma.sync kernels: 16 or 32 query rows per warp, and O and S accumulators that fit."""
    rows_per_warp = tile.block_m / tile.warps
    if rows_per_warp not in (16, 32):
        return f"block_m/warps must be 16 or 32 rows per warp, got {tile.block_m}/{tile.warps}"
    accum = int(rows_per_warp) // 16 * (d + tile.block_n) // 2  # fp32 accumulator registers per thread
    if accum > 192:
        return f"{accum} accumulator registers per thread (O and S) exceed 192; use fewer rows per warp or a narrower block_n"
    return None


def warpgroup_rows_problem(tile: Tile) -> str | None:
    """Warp-specialized wgmma kernels: one, two or three consumer warpgroups of 64 query rows each."""
    if tile.block_m not in (64, 128, 192) or tile.block_m != 16 * tile.warps:
        return ("block_m must be 64, 128 or 192, 64 rows per consumer warpgroup of 4 warps "
                f"(warps = block_m / 16), got {tile.block_m}/{tile.warps}")
    return None


def wgmma_launch_registers(tile: Tile, blocks_per_sm: int) -> int:
    """Registers a thread of a warp-specialized wgmma kernel (the consumer warps and one producer warpgroup)
    has at launch, blocks_per_sm blocks to an SM: what ptxas compiles it for."""
    return 65536 // ((32 * tile.warps + 128) * blocks_per_sm) // 8 * 8


def wgmma_consumer_registers(tile: Tile, blocks_per_sm: int, producer_regs: int) -> int:
    """Registers a consumer thread gets once the producer warpgroup keeps producer_regs a thread (setmaxnreg,
    in its steps of 8)."""
    threads = 32 * tile.warps + 128
    return (wgmma_launch_registers(tile, blocks_per_sm) * threads - producer_regs * 128) // (32 * tile.warps) // 8 * 8


def consumer_registers_problem(need: int, have: int) -> str | None:
    """A consumer thread's O, S and P (need registers, counted by its family) against what it gets (have)."""
    if need > have:
        return (f"O, S and P need about {need} registers a consumer thread, {have} are left: use fewer warps or a "
                "narrower block_n")
    return None


def first_problem(*checks) -> str | None:
    """The first check that fails (checks are zero-argument callables, run in order)."""
    return next((p for p in (check() for check in checks) if p), None)


def padded_row_bytes(head_dim: int, elem_bytes: int) -> int:
    # One 16-byte pad per row makes 8 consecutive rows hit 8 distinct 16-byte bank groups,
    # so ldmatrix and cp.async are conflict-free for every head dim.
    return (head_dim + 16 // elem_bytes) * elem_bytes


def tile_pitch(row_bytes: int) -> int:
    """Smem pitch of a cp.async-filled CUDA tile (tile_offset in flash_mma.cuh.j2): the least
    multiple of 16 >= row_bytes that is 32 mod 64, so rows start 32-byte aligned."""
    return row_bytes + (96 - row_bytes % 64) % 64



# The fp32 SIMT kernel (templates/common/prefill_simt.j2, for CUDA and HIP; kv8-f32 extends it): threads per
# query row share it; Q, K, V and S tiles in shared memory.
def simt_smem(tile: Tile, d: int) -> int:
    return 4 * (tile.block_m * (d + 1) + tile.block_n * (d + 1) + tile.block_n * d + tile.block_m * (tile.block_n + 1))


def simt_problem(tile: Tile, d: int, backend: str = "cuda") -> str | None:
    threads = 32 * tile.warps
    if threads % tile.block_m:
        return f"32*warps ({threads}) must be a multiple of block_m ({tile.block_m})"
    per_row = threads // tile.block_m
    if per_row not in (1, 2, 4, 8, 16, 32):
        return f"threads per query row must be a power of two <= 32, got {per_row}"
    if tile.block_n % per_row or d % per_row:
        return f"block_n ({tile.block_n}) and head_dim ({d}) must be multiples of threads per row ({per_row})"
    return unpipelined_problem(tile, "fp32 SIMT") or smem_problem(simt_smem(tile, d), backend)

