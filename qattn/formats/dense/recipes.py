"""The dense formats' recipes and kernel families (DESIGN §2): fp16 and bf16 flash attention on
tensor cores (mma.sync m16n8k16 on CUDA, warp-specialized wgmma on sm_90a, MFMA/WMMA on HIP) and the
fp32 SIMT noise floor."""
from __future__ import annotations

from ...engine.family import CUDA_ARCHS, HIP_ARCHS, SMEM_PER_BLOCK, Family, LaunchChoice, Recipe, Tolerance
from ...engine.tiling import (first_problem, padded_row_bytes, ring_problem, simt_problem, simt_smem, smem_problem,
                              tile_pitch, unpipelined_problem, warp_rows_problem, warpgroup_rows_problem,
                              consumer_registers_problem, wgmma_consumer_registers, wgmma_launch_registers)
from ...engine.tile import Tile


# ---- CUDA tensor-core prefill (f16, bf16): each warp owns 16 * MT query rows ----------------

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
    # spilled); on sm_90a m128n64 measured 13% faster than m128n32 on the H200 (docs/notes/dense.md).
    tuned={(128, True, arch): Tile(128, 32, 4, 2) for arch in CUDA_ARCHS if arch != "sm_90a"},
    # d128 on sm_90a: the key loop's second, mask-free softmax copy costs ptxas a few bytes of
    # spill (4 B non-causal) and measured 1-5% faster than the spill-free single copy on the H200
    # (docs/notes/dense.md); sm_80 and sm_90 are allowed the same trade (same mma.sync code, unmeasured).
    measured_spills=frozenset({(128, True, "sm_90a")}
                              | {(128, False, arch) for arch in ("sm_80", "sm_90", "sm_90a")}),
    smaller_tiles={128: (Tile(128, 32, 4, 2),), 256: (Tile(64, 32, 4, 2), Tile(32, 32, 2, 2))},
    values={"mma_unit": "mma.sync"},
)


# ---- CUDA prefill on Hopper warpgroup MMAs (f16, bf16; sm_90a) ------------------------------------
# The shared warp-specialized pipeline (templates/cuda/wgmma_attention.cuh.j2): consumer warpgroups
# of 64 query rows each, a producer warpgroup filling a ring of `stages` K and V slots: one thread of
# it issues one TMA copy per K or V tile (a box of a tensor map the launch encodes,
# engine/tensormap.py), or, with the option kv_rows "on", the whole warpgroup gathers K and V rows with
# cp.async (the launch's fallback for strides the TMA cannot read: broadcast or negative; and the
# kernel the TMA producer is measured against). Q, K and V rows of 2D bytes, unpadded (wgmma's
# core-matrix layout; K and V chunk-major as the TMA writes them); the output rows staged in their
# own region, or over Q's where that region does not fit (wgmma_stages_over_q); four mbarriers per slot.

def _wgmma_loop_smem(tile: Tile, d: int) -> int:
    return tile.block_m * 2 * d + tile.stages * 2 * tile.block_n * 2 * d


def wgmma_stages_over_q(tile: Tile, d: int) -> bool:
    """Whether the wgmma kernel stages its output rows over each warp's own Q rows (swizzled rows of 2d
    bytes) instead of a region of their own: where that region does not fit beside Q and the K/V ring
    (STAGE_OVER_Q in wgmma_attention.cuh.j2), e.g. FlashAttention-3's 128 x 176 tiles at d128."""
    own = _wgmma_loop_smem(tile, d) + tile.block_m * padded_row_bytes(d, 2) + 4 * 8 * tile.stages
    return own > SMEM_PER_BLOCK["sm_90a"]


def wgmma_chains(tile: Tile, d: int, options: dict) -> bool:
    """Whether the wgmma kernel runs a persistent block's items back to back (option chain "on";
    wgmma_attention.cuh.j2, chain_step): where items follow in a block (persistent "on"), the output rows' own
    region can take every other item's Q rows (not wgmma_stages_over_q), and two consumer warpgroups beside the TMA
    producer (240 registers each) hold both items' state without spilling (ptxas 13.0 spills 44-250 bytes with
    three warpgroups' 160 or the cp.async producer's 224)."""
    return (options.get("chain") == "on" and options.get("persistent") == "on" and options.get("kv_rows") == "off"
            and tile.warps == 8 and not wgmma_stages_over_q(tile, d))


def _wgmma_settled(options: dict, tile: Tile, d: int) -> dict:
    """The TMA options and the split of the last round (tail) take effect only on chained items (wgmma_chains);
    out_tma's staged rows take the second Q region, so beside it Q comes by the consumers' cp.async (q_tma "off")
    (and the split is left out where its loop would spill)."""
    if not wgmma_chains(tile, d, options):
        return {**options, "out_tma": "off", "q_tma": "off", "tail": "off"}
    if options["out_tma"] == "on" or (d == 128 and options["q_tma"] == "off"):
        # the pieces' loop beside TMA stores, or beside d128's Q rows by the consumers, spills (ptxas 13.0: 52-60
        # and 4 bytes)
        options = {**options, "tail": "off"}
    if options["out_tma"] == "on":
        return {**options, "q_tma": "off"}
    return options


def _wgmma_smem(tile: Tile, d: int) -> int:
    stage = 0 if wgmma_stages_over_q(tile, d) else tile.block_m * padded_row_bytes(d, 2)
    return _wgmma_loop_smem(tile, d) + stage + 4 * 8 * tile.stages


# Registers the producer warpgroup keeps: setmaxnreg's least, 24, for TMA copies by one thread; 56
# for cp.async row loads (kv_rows "on": 16 a thread per tile at d128, unrolled, spill at 24-40 under
# ptxas 13.0).
_WGMMA_PRODUCER_REGS = 24
_WGMMA_ROWS_PRODUCER_REGS = 56


def _wgmma_blocks_per_sm(tile: Tile) -> int:
    """prefill_wgmma.cu.j2's BLOCKS_PER_SM: one block per SM, two for a single consumer warpgroup."""
    return 2 if tile.warps == 4 else 1


def _wgmma_problem(tile: Tile, d: int) -> str | None:
    def shape():
        if tile.block_n % 16 or not 64 <= tile.block_n <= 192:
            return f"block_n must be a multiple of 16 in [64, 192], got {tile.block_n}"
        return None

    def registers():
        # O, S and P (d / 2 + block_n / 2 + block_n / 4 a thread) and ~32 for addresses and statistics
        # (ptxas 13.0 fits m192n128w12 at d64 and m192n80w12 at d128 in 160 without spills)
        need = d // 2 + 3 * tile.block_n // 4 + 32
        have = wgmma_consumer_registers(tile, _wgmma_blocks_per_sm(tile), _WGMMA_PRODUCER_REGS)
        if problem := consumer_registers_problem(need, have):
            return problem
        # ptxas compiles the kernel for its launch registers (two blocks an SM with one consumer warpgroup:
        # 128), and one P V product holds O's d / 2 of them (at d256: C7602, too few to compile)
        launch = wgmma_launch_registers(tile, _wgmma_blocks_per_sm(tile))
        if d // 2 + 32 > launch:
            return (f"O needs {d // 2} registers a thread and a launch of {tile.warps} warps gives {launch}: use "
                    "two or more consumer warpgroups")
        return None

    return first_problem(lambda: warpgroup_rows_problem(tile), shape, registers, lambda: ring_problem(tile),
                         lambda: smem_problem(_wgmma_smem(tile, d), "cuda"))


CUDA_WGMMA = Family(
    template="cuda/prefill_wgmma.cu.j2",
    head_dims=(64, 128, 256),
    default_tiles={64: Tile(128, 128, 8, 2), 128: Tile(128, 128, 8, 2), 256: Tile(128, 64, 8, 2)},
    tile_problem=_wgmma_problem,
    smem_bytes=_wgmma_smem,
    archs=("sm_90a",),
    producer_warps=4,
    values={"mma_unit": "wgmma", "producer_regs": _WGMMA_PRODUCER_REGS,
            "rows_producer_regs": _WGMMA_ROWS_PRODUCER_REGS, "chains": wgmma_chains},
    # kv_rows "on": K and V rows gathered by the producer warpgroup with cp.async instead of TMA boxes
    # (the tile rules above count the TMA producer's registers); pingpong "on": two or three consumer
    # warpgroups issue their MMAs in turns (wgmma_attention.cuh.j2, consumer_turns_begin); persistent "on":
    # as many blocks as the SMs hold, each taking work items in turn (the launch's grid; one kernel); chain "on":
    # a persistent block runs its items back to back, an item's last P V beside the next one's first Q Kᵀ, where
    # wgmma_chains says it can (elsewhere, as on a block an item, the kernel is the one without it); out_tma "on":
    # those chained blocks write each warp's output rows by a TMA store of a map of `out`; q_tma "on": their producer
    # loads each item's Q rows as one TMA box (_wgmma_settled: where neither takes effect, the spec has it "off");
    # tail "split" (where items chain; "off" elsewhere): the launcher shares the grid's last round among the blocks by
    # key tiles (formats/dense/tail.py), which take their pieces after their items, and merges the split items' rows
    options={"kv_rows": ("off", "on"), "pingpong": ("off", "on"), "persistent": ("off", "on"), "chain": ("off", "on"),
             "out_tma": ("off", "on"), "q_tma": ("off", "on"), "tail": ("off", "split")},
    # turns at d128: 1.00-1.03x without them non-causal, 1.00-1.03x causal at 4096+ rows (H200,
    # docs/notes/dense.md); at d64 they change nothing measurable, so d64 keeps the simpler schedule.
    # Q by the producer's TMA on chained items, time against the consumers' cp.async in the same runs (H100,
    # docs/notes/dense.md): d128 0.96-0.99 at B16 L1024, 0.92-0.98 causal at L1024-2048, 0.97-1.00 at L2048-4096;
    # d64 causal 0.95-1.00 in three runs but 1.09 at B16 L1024 in a fourth, so d64 keeps the consumers' loads
    option_defaults={128: {"pingpong": "on", "q_tma": "on"}},
    settled_options=_wgmma_settled,
)


# The wgmma kernel for calls of 1024 query rows per sequence and more (registry.launch_choice; a spec
# does not know the call's rows): on the H200 (docs/notes/dense.md; K and V in 128-byte swizzled TMA
# lines) it measured 1.24-1.66x the mma.sync kernel from 1024 rows (B16 L1024 to B1 L32768 at d128,
# B4 L8192 at d64; causal and not), about even at 512 (0.89-1.12x) and 0.55-0.76x at 128-256 rows, where
# one block of 12 warps per SM and a short key loop leave the SMs less busy. With persistent blocks:
# - non-causal d128 calls of 512 to 4095 rows: 1.28x the mma.sync kernel at B32 L512 and 1.05x the
#   one-block-per-item grid at B16 L1024, even at L4096 and 0.97x at L32768 (so not from 4096 rows);
# - non-causal d64 calls from 1024 rows: 1.07x at B16 L1024, 1.04x at B8 L2048, 1.01-1.02x at B4 L8192 to B1
#   L32768;
# - causal calls from 1024 rows, their items in pairs of a heavy and a light query block (PAIRED in the
#   template): d128 1.10x at B16 L1024, 1.09x at B8 L2048, 1.06x at B4 L4096, 1.00x at B2 L8192 and B1
#   L32768; d64 1.06x at B16 L1024, 1.04x at B8 L2048 and B4 L8192.
# d64 at 512 rows keeps mma.sync (0.96x) on a block an item (chained items with many sequence-heads: below).
# At d64 three consumer warpgroups (m192n128w12s2: 192 query rows a block, one K/V tile read for
# three warpgroups' products) against m128n128w8s2, same run, x cuDNN: non-causal, persistent, 1.09 against
# 0.94 at B4 L8192, 1.00 against 0.92 at B8 L2048, 0.90 against 0.89 at B16 L1024; causal, a block an item,
# 1.06 against 0.94 at B4 L8192, but 0.88 against 0.86 at B8 L2048 and 0.70 against 0.80 at B16 L1024
# (persistent pairs of 192-row blocks lose there: 0.73 at L2048). So causal d64 calls change tile at 4096 rows.
# d256 (two consumer warpgroups, the output staged over Q's rows) against the mma.sync kernel's m64n64w4s2 on the
# H100, x cuDNN: 0.96-0.97 against 0.28 at B4 H16 L4096 (causal 0.91-0.96 against 0.32); 0.98-1.07 at B2 L8192;
# time over mma.sync's 0.37 at B8 L1024, 0.48 at B16 L512, 0.67 at B32 L256 (causal 0.47, 0.61, 0.81), but 1.03 at
# B64 L128 (causal 1.18). Causal calls in persistent pairs: 0.95 of a block an item at B8 L1024, 0.93 at B4 L2048,
# 0.99 at B2 L4096 (bf16 0.96 and 0.91); non-causal ones gain nothing that holds (0.99 at L1024, 1.05 at L2048, 1.08
# at L4096).
D256_WGMMA_QUERIES = 256
WGMMA_QUERIES = 1024
D64_THREE_WARPGROUPS = Tile(192, 128, 12, 2)
# Chained items (chain "on", wgmma_chains) in those persistent m128n128w8s2 blocks, against the same blocks without,
# same runs, H100: d128 non-causal 0.93x the time at B32 L512, 0.93-0.96x at B16 L1024, 0.97x at B8 L2048; causal
# 0.98-0.99x at B16 L1024, 0.98x at B8 L2048 and B4 L4096, 0.96-0.98x at B2 L8192, 0.99-1.00x at B1 L32768 (bf16
# and f16 alike); d64 causal 0.92x at B16 L1024, 0.96x at B8 L2048.
# Calls of 512-1023 rows with enough sequence-heads (batch x query heads) to fill the persistent grid, time over the
# mma.sync kernel's (H100, same runs, H32, f16; bf16 alike where measured):
# - causal d128, persistent blocks without chaining: 0.84 at B2 L768, 0.91 at B4, 0.86 at B8, 0.75 at B16 (chained:
#   0.80 at B16); at L512 mixed (0.87 at B8, 1.02 at B16, 0.90 at B32, 1.16 at B4, 1.40 at B1): from 768 rows and
#   64 sequence-heads;
# - non-causal d64, chained m128: 0.85 at B16 L512, 0.81-0.87 at B32 L512, 0.82 at B16 L768, 0.91 at B8 L768, but
#   1.11 at B8 L512, 1.35 at B4 L512, 1.26 at B2 L768: from 512 rows and 512 sequence-heads;
# - causal d64, chained m128: 0.96 at B4 L768, 0.91 at B8, 0.91 at B16, but 1.22 at B2 L768 and 1.10-1.34 at L512
#   below B32: from 768 rows and 128 sequence-heads.
_PERSISTENT = (("persistent", "on"),)
_CHAINED = (("persistent", "on"), ("chain", "on"))
WGMMA_BANDS = {
    128: (LaunchChoice(768, Tile(128, 128, 8, 2), "wgmma", _PERSISTENT, causal=True, least_heads=64),
          LaunchChoice(WGMMA_QUERIES, Tile(128, 128, 8, 2), "wgmma", _CHAINED, causal=True),
          LaunchChoice(512, Tile(128, 128, 8, 2), "wgmma", _CHAINED, causal=False),
          LaunchChoice(4096, Tile(128, 128, 8, 2), "wgmma", causal=False)),
    64: (LaunchChoice(768, Tile(128, 128, 8, 2), "wgmma", _CHAINED, causal=True, least_heads=128),
         LaunchChoice(512, Tile(128, 128, 8, 2), "wgmma", _CHAINED, causal=False, least_heads=512),
         LaunchChoice(WGMMA_QUERIES, Tile(128, 128, 8, 2), "wgmma", _CHAINED, causal=True),
         LaunchChoice(4096, D64_THREE_WARPGROUPS, "wgmma", causal=True),
         LaunchChoice(WGMMA_QUERIES, D64_THREE_WARPGROUPS, "wgmma", _PERSISTENT, causal=False)),
    256: (LaunchChoice(D256_WGMMA_QUERIES, Tile(128, 64, 8, 2), "wgmma", _PERSISTENT, causal=True),
          LaunchChoice(D256_WGMMA_QUERIES, Tile(128, 64, 8, 2), "wgmma", causal=False)),
}


LAUNCH_TILES = {(fmt, d, "sm_90a"): bands for fmt in ("f16", "bf16") for d, bands in WGMMA_BANDS.items()}


CUDA_SIMT = Family(
    template="cuda/prefill_simt.cu.j2",
    head_dims=(32, 64, 96, 128, 256),
    default_tiles={d: Tile(32, 32, 4, 1) for d in (32, 64, 96, 128, 256)},
    tile_problem=simt_problem,
    smem_bytes=simt_smem,
    archs=CUDA_ARCHS,
    align_bytes=4,
    smaller_tiles={256: (Tile(16, 32, 4, 1),)},
)


# The same fp32 SIMT kernel on HIP (templates/common/prefill_simt.j2): d256's Q, K, V and S tiles fit 64 KB of LDS
# at 16 rows and 16 keys.
HIP_SIMT = Family(
    template="hip/prefill_simt.hip.j2",
    head_dims=(32, 64, 96, 128, 256),
    default_tiles={**{d: Tile(32, 32, 4, 1) for d in (32, 64, 96, 128)}, 256: Tile(16, 16, 4, 1)},
    tile_problem=lambda tile, d: simt_problem(tile, d, "hip"),
    smem_bytes=simt_smem,
    archs=HIP_ARCHS,
    align_bytes=4,
)


# ---- HIP matrix-core prefill (MFMA on CDNA, WMMA on RDNA; fp16 or bf16); 16 query rows per 32 lanes
# `warps` counts 32-lane warps on every target, so a tile is the same work and the same block of
# 32*warps threads everywhere: on RDNA (wave32) each wave owns 16 query rows; on CDNA (wave64)
# each wave is two warps and owns 32 rows. Q and K sit row-major in LDS, V transposed.

def _hip_smem(tile: Tile, d: int) -> int:
    return (tile.block_m + tile.block_n) * padded_row_bytes(d, 2) + d * padded_row_bytes(tile.block_n, 2)


def _hip_problem(tile: Tile, d: int) -> str | None:
    if tile.warps % 2:
        return f"warps must be even (a 64-lane CDNA wave is two warps), got {tile.warps}"
    if tile.block_m != 16 * tile.warps:
        return f"block_m must be 16 rows per warp (16*warps), got {tile.block_m} with {tile.warps} warps"
    if tile.block_n % 16 or not 16 <= tile.block_n <= 64:
        return f"block_n must be a multiple of 16 in [16, 64], got {tile.block_n}"
    return unpipelined_problem(tile, "HIP") or smem_problem(_hip_smem(tile, d), "hip")


# d256: m64n32 needs 71 KB of LDS, and m32n32 spills on RDNA (O alone is 128 VGPRs a lane there); m32n16
# compiles with no scratch on every target (clang 19).
HIP_MATRIX = Family(
    template="hip/prefill_matrix.hip.j2",
    head_dims=(32, 64, 96, 128, 256),
    default_tiles={**{d: Tile(64, 32, 4, 1) for d in (32, 64, 96, 128)}, 256: Tile(32, 16, 2, 1)},
    tile_problem=_hip_problem,
    smem_bytes=_hip_smem,
    archs=HIP_ARCHS,
)


RECIPES = (
    Recipe("f16", "fp16 Q/K/V, fp32 accumulation, P rounded to fp16 (tensor cores)", ("float16",),
           Tolerance(max_rel=2e-2, rel_l2=2e-3), {"cuda": CUDA_MMA, "hip": HIP_MATRIX}, {"mma": "f16", "cvt": "f16x2"},
           {("cuda", "sm_90a"): (CUDA_MMA, CUDA_WGMMA)}),
    Recipe("bf16", "bf16 Q/K/V, fp32 accumulation, P rounded to bf16 (tensor cores)", ("bfloat16",),
           Tolerance(max_rel=1e-1, rel_l2=1e-2), {"cuda": CUDA_MMA, "hip": HIP_MATRIX},
           {"mma": "bf16", "cvt": "bf16x2"},
           {("cuda", "sm_90a"): (CUDA_MMA, CUDA_WGMMA)}),
    Recipe("f32", "fp32 SIMT FMAs throughout: the noise floor for the exact formats", ("float32",),
           Tolerance(max_rel=1e-5, rel_l2=1e-5), {"cuda": CUDA_SIMT, "hip": HIP_SIMT}),
)
