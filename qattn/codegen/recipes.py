"""Operand formats (recipes) and the kernel families that implement them, per backend.

One table: adding a format means adding a Recipe here and, where it has a kernel, a template.
A Family describes one template: which head dims and tiles it supports and how much shared
memory and how many threads a tile needs. DESIGN §2 defines every format.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .tile import Tile

CUDA_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_90a", "sm_100a", "sm_120")
HIP_ARCHS = ("gfx90a", "gfx942", "gfx1100", "gfx1201")
BACKENDS = ("cuda", "hip")
KINDS = ("prefill",)
SMEM_LIMIT = {"cuda": 227 * 1024, "hip": 64 * 1024}  # the most any arch of the backend has
# Shared memory (LDS) one block may opt into, by arch: a tile over it cannot launch there.
SMEM_PER_BLOCK = {"sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_89": 99 * 1024, "sm_90": 227 * 1024,
                  "sm_90a": 227 * 1024, "sm_100a": 227 * 1024, "sm_120": 99 * 1024,
                  **{arch: 64 * 1024 for arch in HIP_ARCHS}}


@dataclass(frozen=True)
class Tolerance:
    """Pass thresholds against FP64: rows over max_rel count as failures; rel_l2 bounds the whole."""

    max_rel: float
    rel_l2: float


@dataclass(frozen=True)
class Family:
    """One kernel template and the tiles it can be specialised to."""

    template: str
    head_dims: tuple[int, ...]
    default_tiles: dict  # head_dim -> Tile
    tile_problem: Callable[[Tile, int], str | None]  # why a (tile, head_dim) does not fit, or None
    smem_bytes: Callable[[Tile, int], int]
    archs: tuple[str, ...]
    align_bytes: int = 16  # pointer and row-stride alignment the loads need (16: cp.async / vector)
    tuned: dict = field(default_factory=dict)  # (head_dim, causal, arch) -> Tile, where it beats the default
    # head_dim -> tiles to fall back on, in order, on archs with too little shared memory per block
    # for the default (unmeasured: chosen to fit, and to keep the default's shape where they can).
    smaller_tiles: dict = field(default_factory=dict)
    # (head_dim, causal, arch) whose default tile ptxas spills a little (<= 64 B; <= 96 B for the
    # wgmma kernels' 160-register consumers) but which measured faster than every spill-free tile
    # (BENCHMARKS.md); everywhere else defaults must not spill.
    measured_spills: frozenset = frozenset()
    producer_warps: int = 0  # warps beside tile.warps that only load (warp-specialized kernels)
    launcher: str = "prefill"  # key of runtime.launch.LAUNCHERS that runs this family's kernels
    # Suffix of the entry point (entry_name(spec) + suffix) whose ptxas figures a Kernel reports,
    # for templates whose module holds several kernels.
    main_entry: str = ""
    values: dict = field(default_factory=dict)  # extra template constants of this family

    def default_tile(self, head_dim: int, causal: bool, arch: str) -> Tile:
        """The tuned tile for (head_dim, causal, arch), else the head dim's default; where the arch
        has too little shared memory for it, the first of smaller_tiles that fits (or it, and the
        spec's check says so)."""
        tile = self.tuned.get((head_dim, causal, arch), self.default_tiles[head_dim])
        fits = [t for t in (tile, *self.smaller_tiles.get(head_dim, ()))
                if self.smem_bytes(t, head_dim) <= SMEM_PER_BLOCK[arch]]
        return fits[0] if fits else tile

    def threads(self, tile: Tile) -> int:
        return 32 * (tile.warps + self.producer_warps)


@dataclass(frozen=True)
class Recipe:
    name: str
    summary: str
    input_dtypes: tuple[str, ...]  # NumPy dtype names the kernel takes for q, k, v
    tolerance: Tolerance
    families: dict = field(default_factory=dict)  # backend -> Family, for kinds with a kernel
    ctype: dict = field(default_factory=dict)  # template values: element type names per backend
    # (backend, arch) -> the Families that arch builds the format with, the default first, where
    # it differs from families[backend] (another template variant or matrix unit)
    arch_families: dict = field(default_factory=dict)

    def arch_options(self, backend: str, arch: str | None) -> tuple:
        if backend not in self.families:
            have = ", ".join(self.families) or "none yet (emulator only)"
            raise ValueError(f"format {self.name!r}: no {backend} kernel; backends with a kernel: {have}")
        return self.arch_families.get((backend, arch), (self.families[backend],))

    def family(self, backend: str, arch: str | None = None, mma: str | None = None) -> Family:
        """The backend's family; with arch, the one that arch builds by default, or the one on the
        matrix unit mma names (Family.values["mma_unit"], e.g. "mma.sync" or "wgmma")."""
        options = self.arch_options(backend, arch)
        if mma is None:
            return options[0]
        units = [f.values.get("mma_unit") for f in options]
        if mma not in units:
            have = ", ".join(u for u in units if u) or "no choice of unit"
            raise ValueError(f"mma: {self.name} on {backend} {arch} builds with {have}, got {mma!r}")
        return options[units.index(mma)]


# ---- tile checks the families share (each returns why a tile does not fit, or None) ----------

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


def first_problem(*checks) -> str | None:
    """The first check that fails (checks are zero-argument callables, run in order)."""
    return next((p for p in (check() for check in checks) if p), None)


# ---- CUDA tensor-core prefill (f16, bf16): each warp owns 16 * MT query rows ----------------

def _padded_row_bytes(head_dim: int, elem_bytes: int) -> int:
    # One 16-byte pad per row makes 8 consecutive rows hit 8 distinct 16-byte bank groups,
    # so ldmatrix and cp.async are conflict-free for every head dim.
    return (head_dim + 16 // elem_bytes) * elem_bytes


def tile_pitch(row_bytes: int) -> int:
    """Smem pitch of a cp.async-filled CUDA tile (tile_offset in flash_mma.cuh.j2): the least
    multiple of 16 >= row_bytes that is 32 mod 64, so rows start 32-byte aligned."""
    return row_bytes + (96 - row_bytes % 64) % 64


def _mma_smem(tile: Tile, d: int) -> int:
    return (tile.block_m + 2 * tile.stages * tile.block_n) * tile_pitch(2 * d)


def _mma_problem(tile: Tile, d: int) -> str | None:
    def block_n():
        if tile.block_n % 16 or not 16 <= tile.block_n <= 128:
            return f"block_n must be a multiple of 16 in [16, 128], got {tile.block_n}"
        return None

    return first_problem(lambda: warp_rows_problem(tile, d), block_n, lambda: ring_problem(tile),
                         lambda: smem_problem(_mma_smem(tile, d), "cuda"))


CUDA_MMA = Family(
    template="cuda/prefill_mma.cu.j2",
    head_dims=(32, 64, 96, 128, 256),
    default_tiles={32: Tile(128, 64, 4, 2), 64: Tile(128, 64, 4, 2), 96: Tile(64, 64, 4, 2),
                   128: Tile(128, 64, 4, 2), 256: Tile(64, 64, 4, 2)},
    tile_problem=_mma_problem,
    smem_bytes=_mma_smem,
    archs=CUDA_ARCHS,
    # Causal d128 elsewhere keeps the narrower key tile (ptxas kept it in registers where m128n64
    # spilled); on sm_90a m128n64 measured 13% faster than m128n32 on the H200 (BENCHMARKS.md).
    tuned={(128, True, arch): Tile(128, 32, 4, 2) for arch in CUDA_ARCHS if arch != "sm_90a"},
    # d128 on sm_90a: the key loop's second, mask-free softmax copy costs ptxas a few bytes of
    # spill (4 B non-causal) and measured 1-5% faster than the spill-free single copy on the H200
    # (BENCHMARKS.md); sm_80 and sm_90 are allowed the same trade (same mma.sync code, unmeasured).
    measured_spills=frozenset({(128, True, "sm_90a")}
                              | {(128, False, arch) for arch in ("sm_80", "sm_90", "sm_90a")}),
    smaller_tiles={128: (Tile(128, 32, 4, 2),), 256: (Tile(64, 32, 4, 2), Tile(32, 32, 2, 2))},
)


# ---- CUDA fp32 SIMT prefill: TPR threads share a query row ---------------------------------

def _simt_smem(tile: Tile, d: int) -> int:
    return 4 * (tile.block_m * (d + 1) + tile.block_n * (d + 1) + tile.block_n * d + tile.block_m * (tile.block_n + 1))


def _simt_problem(tile: Tile, d: int) -> str | None:
    threads = 32 * tile.warps
    if threads % tile.block_m:
        return f"32*warps ({threads}) must be a multiple of block_m ({tile.block_m})"
    per_row = threads // tile.block_m
    if per_row not in (1, 2, 4, 8, 16, 32):
        return f"threads per query row must be a power of two <= 32, got {per_row}"
    if tile.block_n % per_row or d % per_row:
        return f"block_n ({tile.block_n}) and head_dim ({d}) must be multiples of threads per row ({per_row})"
    return unpipelined_problem(tile, "fp32 SIMT") or smem_problem(_simt_smem(tile, d), "cuda")


CUDA_SIMT = Family(
    template="cuda/prefill_simt.cu.j2",
    head_dims=(32, 64, 96, 128, 256),
    default_tiles={d: Tile(32, 32, 4, 1) for d in (32, 64, 96, 128, 256)},
    tile_problem=_simt_problem,
    smem_bytes=_simt_smem,
    archs=CUDA_ARCHS,
    align_bytes=4,
    smaller_tiles={256: (Tile(16, 32, 4, 1),)},
)


# ---- HIP matrix-core prefill (MFMA on CDNA, WMMA on RDNA); 16 query rows per 32 lanes ------
# `warps` counts 32-lane warps on every target, so a tile is the same work and the same block of
# 32*warps threads everywhere: on RDNA (wave32) each wave owns 16 query rows; on CDNA (wave64)
# each wave is two warps and owns 32 rows. Q and K sit row-major in LDS, V transposed.

def _hip_smem(tile: Tile, d: int) -> int:
    return (tile.block_m + tile.block_n) * _padded_row_bytes(d, 2) + d * _padded_row_bytes(tile.block_n, 2)


def _hip_problem(tile: Tile, d: int) -> str | None:
    if tile.warps % 2:
        return f"warps must be even (a 64-lane CDNA wave is two warps), got {tile.warps}"
    if tile.block_m != 16 * tile.warps:
        return f"block_m must be 16 rows per warp (16*warps), got {tile.block_m} with {tile.warps} warps"
    if tile.block_n % 16 or not 16 <= tile.block_n <= 64:
        return f"block_n must be a multiple of 16 in [16, 64], got {tile.block_n}"
    return unpipelined_problem(tile, "HIP") or smem_problem(_hip_smem(tile, d), "hip")


HIP_MATRIX = Family(
    template="hip/prefill_matrix.hip.j2",
    head_dims=(64, 128),
    default_tiles={64: Tile(64, 32, 4, 1), 128: Tile(64, 32, 4, 1)},
    tile_problem=_hip_problem,
    smem_bytes=_hip_smem,
    archs=HIP_ARCHS,
)


# ---- CUDA int8 QK prefill (i8-f16, i8-i8, i8-f8): m16n8k32 s8 QK, PV in fp16, int8 or e4m3 -----
# One module per spec also holds the quantization kernels (K mean, Q/K block codes, V codes).
# Q8 and K8 sit in smem as rows of D + 16 bytes; V either as fp16 rows (tile_pitch(2D)) or,
# for 8-bit PV, transposed: D channel rows of BN + 16 key bytes. The epilogue stages the
# 16-bit output rows (D + 8 elements) over the same memory after the key loop.

def _i8_v_tile_bytes(tile: Tile, d: int, pv_operand: str) -> int:
    return tile.block_n * tile_pitch(2 * d) if pv_operand == "f16" else d * (tile.block_n + 16)


def _i8_smem(pv_operand: str) -> Callable[[Tile, int], int]:
    def smem(tile: Tile, d: int) -> int:
        loop = (tile.block_m + tile.stages * tile.block_n) * (d + 16) + tile.stages * _i8_v_tile_bytes(tile, d, pv_operand)
        epilogue = tile.block_m * _padded_row_bytes(d, 2)
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
# d128, B4 H32 L8192 at d64, causal and not; BENCHMARKS.md). Four warps of 32 rows reuse each K
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
# Measured on the H200 (BENCHMARKS.md): four warps of 32 rows win at d128 non-causal (16 B spilled,
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


# ---- CUDA int8 QK prefill on Hopper warpgroup MMAs (i8-f8, sm_90a) --------------------------------
# Each consumer warpgroup (4 of tile.warps) owns 64 query rows; a producer warpgroup beside them
# fills the K and V^T rings with bulk copies. Q8, K8 and V^T codes sit in the no-swizzle
# core-matrix layout wgmma reads through descriptors (rows of D, or BN, bytes: no padding); the
# output rows are staged in their own region (a warpgroup finishes while the other still reads K/V),
# and four mbarriers per ring slot follow.

def _wgmma_smem(tile: Tile, d: int) -> int:
    loop = tile.block_m * d + tile.stages * 2 * tile.block_n * d
    return loop + tile.block_m * _padded_row_bytes(d, 2) + 4 * 8 * tile.stages


def _wgmma_problem(tile: Tile, d: int) -> str | None:
    def shape():
        if tile.block_m not in (64, 128, 192) or tile.block_m != 16 * tile.warps:
            return ("block_m must be 64, 128 or 192, 64 rows per consumer warpgroup of 4 warps "
                    f"(warps = block_m / 16), got {tile.block_m}/{tile.warps}")
        if tile.block_n not in (64, 128):
            return f"block_n must be 64 or 128 (the s8 wgmma's n), got {tile.block_n}"
        return None

    return first_problem(shape, lambda: ring_problem(tile), lambda: smem_problem(_wgmma_smem(tile, d), "cuda"))


CUDA_I8_F8_WGMMA = Family(
    template="cuda/prefill_i8.cu.j2",
    head_dims=(64, 128),
    # Whatever the tile, one Q scale per query row and four K scales per key tile (values: quant's
    # "thread" groups, the keys of one accumulator column quad), as fine as SageAttention2's
    # per-thread scales and as cheap: a thread applies one scale per row and one per key tile. The
    # key tile is the format's key block (keys per K scale block and per softmax step). Measured on the H200
    # (BENCHMARKS.md): 128-key blocks beat 64-key ones by 16-20% at d128 and 5-9% at d64; three
    # consumer warpgroups of one 192-row block (three warps per scheduler where two 64-row blocks
    # per SM give two) beat two 64-row blocks by 15% at d64 (causal 11%) and 13% at d128 (S issued
    # after the PV partial there), though ptxas spills a few bytes at their 160 registers.
    default_tiles={64: Tile(192, 128, 12, 2), 128: Tile(192, 128, 12, 2)},
    measured_spills=frozenset((d, causal, "sm_90a") for d in (64, 128) for causal in (False, True)),
    tile_problem=_wgmma_problem,
    smem_bytes=_wgmma_smem,
    archs=("sm_90a",),
    producer_warps=4,
    launcher="prefill_i8",
    main_entry="_f16",
    values={"pv_operand": "f8", "mma_unit": "wgmma", "q_scale_rows": 1, "k_scale_groups": 4},
)


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
        v_tile = d * _padded_row_bytes(tile.block_n, 2) if pv == "f16" else d * (tile.block_n + 16)
        return max(tile.block_n * (d + 16) + v_tile, tile.block_m * _padded_row_bytes(d, 2))

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


RECIPES: dict[str, Recipe] = {}


def _register(r: Recipe) -> None:
    RECIPES[r.name] = r


_register(Recipe("f16", "fp16 Q/K/V, fp32 accumulation, P rounded to fp16 (tensor cores)", ("float16",),
                 Tolerance(max_rel=2e-2, rel_l2=2e-3), {"cuda": CUDA_MMA, "hip": HIP_MATRIX},
                 {"mma": "f16", "cvt": "f16x2"}))
_register(Recipe("bf16", "bf16 Q/K/V, fp32 accumulation, P rounded to bf16 (tensor cores)", ("bfloat16",),
                 Tolerance(max_rel=1e-1, rel_l2=1e-2), {"cuda": CUDA_MMA},
                 {"mma": "bf16", "cvt": "bf16x2"}))
_register(Recipe("f32", "fp32 SIMT FMAs throughout: the noise floor for the exact formats", ("float32",),
                 Tolerance(max_rel=1e-5, rel_l2=1e-5), {"cuda": CUDA_SIMT}))
# Formats with a CPU emulator; their kernels arrive with their own families.
# int8 QK: their CUDA modules also quantize (ctype "pv" names the PV operand format; mma/cvt
# serve the fp16 PV helpers).
_register(Recipe("i8-f16", "int8 QK with exact K smoothing, PV in fp16", ("float16", "bfloat16"),
                 Tolerance(max_rel=1e-1, rel_l2=3e-2), {"cuda": CUDA_I8["f16"], "hip": HIP_I8["f16"]},
                 {"mma": "f16", "cvt": "f16x2", "pv": "f16"}))
_register(Recipe("i8-i8", "int8 QK with exact K smoothing, PV in int8 (P static 127, V per channel)",
                 ("float16", "bfloat16"), Tolerance(max_rel=2e-1, rel_l2=1e-1), {"cuda": CUDA_I8["i8"], "hip": HIP_I8["i8"]},
                 {"mma": "f16", "cvt": "f16x2", "pv": "i8"}))
_register(Recipe("i8-f8", "int8 QK with exact K smoothing, PV in fp8 e4m3 (P static 448, V per channel)",
                 ("float16", "bfloat16"), Tolerance(max_rel=2e-1, rel_l2=6e-2), {"cuda": CUDA_I8["f8"], "hip": HIP_I8["f8"]},
                 {"mma": "f16", "cvt": "f16x2", "pv": "f8"},
                 {("cuda", "sm_90"): (CUDA_I8_F8_IN_F16,), ("cuda", "sm_90a"): (CUDA_I8_F8_WGMMA, CUDA_I8_F8_IN_F16)}))
_register(Recipe("kv8-f32", "int8 KV cache dequantized to fp32, fp32 SIMT", ("float32",),
                 Tolerance(max_rel=1e-5, rel_l2=1e-5)))
_register(Recipe("kv8-split", "int8 KV cache, fp16 hi+lo split of the other operand, two fp16 MMAs",
                 ("float32",), Tolerance(max_rel=1e-5, rel_l2=1e-5)))
_register(Recipe("kv8-imma", "int8 KV cache on int8 tensor cores, 24-bit 3-way split of the other operand",
                 ("float32",), Tolerance(max_rel=1e-5, rel_l2=1e-5)))


def recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise ValueError(f"format: unknown {name!r}; known formats: {', '.join(RECIPES)}")
    return RECIPES[name]


# The int8-KV-cache kernels (kv8-f32, kv8-split, kv8-imma) are defined in kv8_families.py.
from .kv8_families import register as _register_kv8  # noqa: E402

_register_kv8(RECIPES)
