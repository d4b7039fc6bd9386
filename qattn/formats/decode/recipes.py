"""The decode formats' recipes and CUDA kernel family (DESIGN §2 "FP8/INT8 KV-cache decode"): a
format is named K-V by its two cache dtypes, each 16-bit (f16 or bf16: the query's type) or 8-bit
(e4m3 or i8), e.g. e4m3-e4m3 (K8/V8), e4m3-f16 (K8/V16), f16-e4m3 (K16/V8), f16-f16 (K16/V16)."""
from __future__ import annotations

from ...engine.family import CUDA_ARCHS, HIP_ARCHS, Family, Recipe, Tolerance
from ...engine.tile import Tile
from ...engine.tiling import smem_problem

TEMPLATE = "cuda/decode_paged.cu.j2"
LAUNCHER = "decode"
HEAD_DIMS = (64, 128, 256)
PAGE_SIZES = (32, 16, 64, 128)  # the first is the default
SCALE_MODES = ("token", "head")  # one fp32 scale per (token, kv head), or one per kv head (static)
# How S = q K^T is computed over an 8-bit K: "transform" converts the K codes on chip to the query's
# type (fp16/bf16 MMA); "fp8" (e4m3 K) and "int8" (i8 K) quantize Q once per step (one scale per
# query row) and run the 8-bit MMA on the codes, the scales applied to S.
QK_PATHS = ("transform", "fp8", "int8")
QK_CODE = {"fp8": "e4m3", "int8": "i8"}  # the K code each 8-bit path reads
# An 8-bit K's channel mean (DESIGN §2): "off", or "page": the cache stores K - μ_page with one mean
# vector per (page, kv head), the running mean when the page was started, and the kernel adds q·μ_page
# back to the page's scores (exact for any μ).
K_MEANS = ("off", "page")
# Q/K channel balancing of an 8-bit K (DESIGN §2): "on": the cache stores K's residual divided by one
# α per (kv head, channel) and the kernel multiplies q by α at its load (q·k = Σ (q_c α_c)(k_c / α_c)).
K_BALANCES = ("off", "on")
# A pre-bias residual K under RoPE (DESIGN §2, decode.rope), b the K bias added before RoPE and p the key's
# position: "post" (post-RoPE keys): the cache stores K - R_p b and the kernel adds q·R_p b back per key;
# "pre" (pre-RoPE keys, transform path only): the cache stores k_pre - b and the kernel turns each key's codes
# by R_p on chip before QK, and adds q·R_p b.
K_ROPES = ("off", "post", "pre")
HALF = ("f16", "bf16")
EIGHT_BIT = ("e4m3", "i8")
QMAX = {"e4m3": 448.0, "i8": 127.0}
MAX_ROWS = 8  # packed query rows (query heads of a kv head x new tokens) per block: the n of the MMAs
TABLE_SLOTS = 512  # page ids of one split the kernel stages in shared memory (the host splits to fit)


def _formats() -> list[str]:
    names = []
    for half in HALF:
        names.append(f"{half}-{half}")
        for eight in EIGHT_BIT:
            names += [f"{eight}-{half}", f"{half}-{eight}"]
    return names + [f"{eight}-{eight}" for eight in EIGHT_BIT]


FORMATS = tuple(_formats())


def sides(fmt: str) -> tuple[str, str]:
    """(K dtype, V dtype) of a format name."""
    k, _, v = fmt.partition("-")
    return k, v


def qk_paths(fmt: str) -> tuple[str, ...]:
    """The QK paths of a format: the transform path, and the 8-bit MMA on its K code (8-bit K only)."""
    k = sides(fmt)[0]
    return ("transform",) + tuple(path for path, code in QK_CODE.items() if code == k)


# qk="auto" per arch and format, from the H200 measurements (docs/notes/decode.md): format -> (the 8-bit MMA
# path, the fewest packed query rows of a kv head it is picked for). On sm_90a the int8 path wins once a kv
# head's rows (GQA x new tokens) fill more than one block, each block converting the same K on the transform
# path; up to one block, the transform path on two warps is faster. Elsewhere, and on archs not measured, the
# transform path (it adds no rounding of Q).
AUTO_QK = {"sm_90a": {"i8-i8": ("int8", MAX_ROWS + 1)}}


def resolve_qk(fmt: str, arch: str | None, qk: str = "auto", rows: int = 1) -> str:
    """The QK path a call runs: qk itself when the format has it, or the pick for "auto" on arch with
    `rows` packed query rows per kv head (query heads per kv head x new tokens)."""
    paths = qk_paths(fmt)
    if qk == "auto":
        path, least = AUTO_QK.get(arch, {}).get(fmt, ("transform", 1))
        return path if rows >= least else "transform"
    if qk not in paths:
        raise ValueError(f"qk: {fmt} takes 'auto' or one of {', '.join(paths)}, got {qk!r}")
    return qk


def auto_paths(fmt: str, arch: str | None) -> tuple[str, ...]:
    """Every QK path "auto" picks on arch for some count of packed query rows: what calls may run."""
    least = AUTO_QK.get(arch, {}).get(fmt, ("transform", 1))[1]
    return tuple(dict.fromkeys(resolve_qk(fmt, arch, "auto", rows) for rows in (1, least)))


def query_dtypes(fmt: str) -> tuple[str, ...]:
    """NumPy dtype names a format's queries may have: a 16-bit side fixes it."""
    halves = {side for side in sides(fmt) if side in HALF}
    names = {"f16": "float16", "bf16": "bfloat16"}
    return tuple(names[h] for h in sorted(halves)) if halves else ("float16", "bfloat16")


def stage_bytes(fmt: str, tile: Tile, d: int) -> int:
    """One pipeline slot: K rows, V rows and the 8-bit sides' token scales."""
    k, v = sides(fmt)
    kb, vb = (2 if side in HALF else 1 for side in (k, v))
    k_padded = kb == 2 and 32 * tile.warps // (d * kb // 16) < 4  # as the template's K_PITCH
    v_padded = 32 * tile.warps // (d * vb // 16) < 4  # as its V_PITCH
    k_tile = tile.block_n * (d * kb + (32 if k_padded else 0))
    v_tile = tile.block_n * (d * vb + (16 if v_padded else 0))
    return k_tile + v_tile + 4 * tile.block_n * sum(side in EIGHT_BIT for side in (k, v))


def smem_bytes(fmt: str):
    def smem(tile: Tile, d: int) -> int:
        merge = tile.warps * MAX_ROWS * (d + 2) * 4  # the warps' O rows and (m, l) after the key loop
        return max(tile.stages * stage_bytes(fmt, tile, d) + 4 * TABLE_SLOTS, merge)

    return smem


def _problem(fmt: str):
    def problem(tile: Tile, d: int) -> str | None:
        if tile.block_m != MAX_ROWS:
            return f"block_m must be {MAX_ROWS} (packed query rows per block), got {tile.block_m}"
        # a step's keys are whole runs of a page (a power of two) and a thread's copies keep their stride
        if tile.warps not in (2, 4, 8) or tile.block_n != 16 * tile.warps:
            return (f"block_n must be 16 keys per warp (16*warps, warps 2, 4 or 8), got {tile.block_n} with "
                    f"{tile.warps} warps")
        if not 2 <= tile.stages <= 4:
            return f"stages must be 2..4 (K/V slots in the cp.async ring), got {tile.stages}"
        return smem_problem(smem_bytes(fmt)(tile, d), "cuda")

    return problem


def _options(fmt: str) -> dict:
    """A spec's choices: page size and scale granularity; where K is 8-bit, its channel mean, its channel
    balancing, its post-RoPE bias term and the QK path (a 16-bit K has only its own MMA and stores K as given)."""
    eight = sides(fmt)[0] in EIGHT_BIT
    return {"page_size": PAGE_SIZES, "scale_mode": SCALE_MODES,
            **({"k_mean": K_MEANS, "k_balance": K_BALANCES, "k_rope": K_ROPES, "qk": qk_paths(fmt)} if eight else {})}


def _pre_rope_problem(options: dict, arch: str, head_dim: int) -> str | None:
    """Pre-RoPE keys turn the codes on chip before the 16-bit MMA: the transform path only, and neither
    page means nor balancing (both act on channels that R_p mixes)."""
    if options.get("k_rope") != "pre":
        return None
    if options.get("qk", "transform") != "transform":
        return (f"qk: the pre-RoPE residual K turns each key's codes on chip before the 16-bit MMA: the transform "
                f"path only, got {options['qk']!r} (post-RoPE keys take every path)")
    for name in ("k_mean", "k_balance"):
        if options.get(name, "off") != "off":
            return f"{name}: the pre-RoPE residual K takes {name} 'off' (R_p mixes the channels it acts on)"
    return None


# The default tile by arch, format, QK path and page size, where measured faster than four warps of 16 keys and
# two slots (docs/notes/decode.md): on sm_90a a block of two warps streams 16-bit K/V, K16/V8 and K8/V16 faster on
# two slots (a smaller block in flight, more blocks per SM) on every page size (H200 on pages of 16 and 32; on pages
# of 64 and 128, where a step reads part of a page's rows, H100: 0.96-1.01x the time of four warps). K8/V8 on the
# transform path takes four warps at D128 (pages of 16: the same for e4m3, 2% for int8; 32: 0.98-0.99x the time of
# two warps on three slots; 64 and 128: 6% faster on the H200 with V^T, 1-2% with V stored as rows on the H100) and two warps on three
# slots at D64 on pages of 16 and 32 (15-17% faster: TWO_WARP_PAGES_AT). The 8-bit QK paths keep four warps, whose
# wgmma takes a warpgroup.
WGMMA_QK = {"sm_90a": ("fp8", "int8")}
SM90_TILES = {(16, 16): Tile(MAX_ROWS, 32, 2, 2), (16, 8): Tile(MAX_ROWS, 32, 2, 2), (8, 16): Tile(MAX_ROWS, 32, 2, 2),
              (8, 8): Tile(MAX_ROWS, 32, 2, 3)}
TWO_WARP_PAGES = {(16, 16): PAGE_SIZES, (16, 8): PAGE_SIZES, (8, 16): PAGE_SIZES, (8, 8): ()}
TWO_WARP_PAGES_AT = {((8, 8), 64): (16, 32)}  # (bits, head dim) whose pages differ from TWO_WARP_PAGES


def two_warp_pages(bits: tuple, head_dim: int) -> tuple:
    """The page sizes on which the sm_90a two-warp tile of a format of these (K, V) bits runs at head_dim."""
    return TWO_WARP_PAGES_AT.get((bits, head_dim), TWO_WARP_PAGES.get(bits, ()))


def tile_path_problem(tile: Tile, qk: str, arch: str) -> str | None:
    """Why a tile cannot run a QK path on arch (the wgmma paths take one warpgroup), or None."""
    if qk in WGMMA_QK.get(arch, ()) and tile.warps != 4:
        return f"tile: the {qk} QK path on {arch} runs wgmma over one warpgroup (4 warps), got {tile.name}"
    return None


def _option_tile(fmt: str):
    bits = tuple(8 if side in EIGHT_BIT else 16 for side in sides(fmt))

    def tile(head_dim: int, arch: str, options: dict) -> Tile | None:
        if (arch != "sm_90a" or options.get("qk", "transform") in WGMMA_QK[arch]
                or options.get("page_size", 32) not in two_warp_pages(bits, head_dim)):
            return None
        return SM90_TILES.get(bits)

    return tile


def family(fmt: str) -> Family:
    """The decode kernel family of a format; a spec picks its page size and scale granularity
    (KernelSpec.options: page_size, scale_mode)."""
    k, v = sides(fmt)
    e4m3 = "e4m3" in (k, v)
    return Family(
        template=TEMPLATE,
        head_dims=HEAD_DIMS,
        # Four warps of 16 keys a step, two slots: four blocks per SM at d128 (122-127 registers, 41-80
        # KB); on four warps three slots measured slower (e4m3-e4m3 at 64x4096 0.246 ms against 0.302). On
        # sm_90a the option tile (two warps) replaces it where the H200 measured that faster.
        default_tiles={d: Tile(MAX_ROWS, 64, 4, 2) for d in HEAD_DIMS},
        option_tile=_option_tile(fmt),
        tile_problem=_problem(fmt),
        smem_bytes=smem_bytes(fmt),
        # cvt.rn.f16x2.e4m3x2 needs sm_89
        archs=tuple(a for a in CUDA_ARCHS if not e4m3 or int(a[3:].rstrip("a")) >= 89),
        launcher=LAUNCHER,
        main_entry="_f16" if "bf16" not in (k, v) else "_bf16",
        values={"k_code": "16" if k in HALF else k, "v_code": "16" if v in HALF else v, "table_slots": TABLE_SLOTS,
                "qk": "transform", "k_mean": "off", "k_balance": "off", "k_rope": "off"},
        options=_options(fmt),
        option_problem=_pre_rope_problem,
    )


# ---- HIP (MFMA on CDNA, WMMA on RDNA), fp16 or bf16 queries: the transform path onto the 16-bit matrix ops of
# the queries' type, and the 8-bit QK paths onto the fp8 / int8 ones where the target has them -------------
HIP_TEMPLATE = "hip/decode_paged.hip.j2"
HIP_TILE = Tile(32, 32, 2, 1)  # 32 packed rows: two 32-lane warps (one wave64 on CDNA), 32 keys a tile
# The archs with each 8-bit QK path's matrix op: fp8 MFMA on CDNA3, fp8 WMMA on RDNA4 (none on CDNA2 or
# RDNA3); int8 MFMA / iu8 WMMA on all four.
HIP_QK_ARCHS = {"fp8": ("gfx942", "gfx1201"), "int8": HIP_ARCHS}


def _hip_lds(tile: Tile, d: int) -> int:
    """Static LDS: Q rows, the K tile, V^T (transposed from the pool's rows) and the token scales, 16-bit rows
    padded by 8 elements (the transform path's; the 8-bit paths hold Q and K as bytes, in less)."""
    return 2 * (tile.block_m * (d + 8) + tile.block_n * (d + 8) + d * (tile.block_n + 8)) + 8 * tile.block_n


def _hip_problem(tile: Tile, d: int) -> str | None:
    if tile != HIP_TILE:
        return f"the HIP decode kernel runs {HIP_TILE.name} only, got {tile.name}"
    return smem_problem(_hip_lds(tile, d), "hip")


# The most head dim the HIP kernel's RoPE term (post- and pre-RoPE keys) fits at: its query rows' terms take
# 4 x 32 x D bytes of LDS beside the transform path's tiles, over the 64 KiB at d256.
HIP_ROPE_HEAD_DIM = 128


def _hip_qk_problem(fmt: str):
    """The HIP family's option rule: an 8-bit QK path only where the target has its matrix op; RoPE keys up to
    HIP_ROPE_HEAD_DIM, pre-RoPE ones under CUDA's rule too (page means and balancing build as on CUDA)."""
    def problem(options: dict, arch: str, head_dim: int) -> str | None:
        rope = options.get("k_rope", "off")
        if rope != "off" and head_dim > HIP_ROPE_HEAD_DIM:
            return (f"k_rope: the HIP decode kernel's RoPE term needs head_dim <= {HIP_ROPE_HEAD_DIM} (LDS), got "
                    f"{head_dim}; k_rope '{rope}' builds at d{head_dim} for CUDA")
        pre = _pre_rope_problem(options, arch, head_dim)
        if pre:
            return pre
        qk = options.get("qk", "transform")
        if qk == "transform" or arch in HIP_QK_ARCHS[qk]:
            return None
        on_arch = ["transform"] + [path for path, archs in HIP_QK_ARCHS.items() if arch in archs]
        have = [path for path in qk_paths(fmt) if path in on_arch]
        return (f"qk: {arch} has no {qk} matrix op ({qk} builds on {', '.join(HIP_QK_ARCHS[qk])}; {arch} builds "
                f"{', '.join(on_arch)}): {fmt} on {arch} takes qk {', '.join(have)}, got {qk!r}")

    return problem


def hip_family(fmt: str) -> Family:
    """The HIP decode family of a format: a spec picks its page size, scale granularity and, for an 8-bit
    K, the QK path its arch has, page means and channel balancing. Its module has an attention and a merge
    entry for each query type the format takes (_f16, _bf16)."""
    k, v = sides(fmt)
    query_types = tuple("bf16" if dtype == "bfloat16" else "f16" for dtype in query_dtypes(fmt))
    return Family(
        template=HIP_TEMPLATE,
        head_dims=HEAD_DIMS,
        default_tiles={d: HIP_TILE for d in HEAD_DIMS},
        tile_problem=_hip_problem,
        smem_bytes=lambda tile, d: 0,  # static LDS (checked against the target by tile_problem)
        archs=HIP_ARCHS,
        launcher=LAUNCHER,
        main_entry=f"_{query_types[0]}",
        values={"k_code": "16" if k in HALF else k, "v_code": "16" if v in HALF else v, "qk": "transform",
                "k_mean": "off", "k_balance": "off", "k_rope": "off", "query_types": query_types},
        options=_options(fmt),
        option_problem=_hip_qk_problem(fmt),
    )


def _summary(fmt: str) -> str:
    k, v = sides(fmt)
    return f"paged decode, K cache {k}, V cache {v} (K{8 if k in EIGHT_BIT else 16}/V{8 if v in EIGHT_BIT else 16})"


# Against FP64 on the dequantized cache: what the kernel's arithmetic adds (P rounded to the query's
# type, V scaled per token into P); the cache's own rounding is measured against the fp16 K/V.
_TOLERANCE = {"float16": Tolerance(max_rel=2e-2, rel_l2=3e-3), "bfloat16": Tolerance(max_rel=1e-1, rel_l2=1.5e-2)}

# The 8-bit QK paths add Q's own rounding (one scale per query row): e4m3 carries 3 mantissa bits,
# int8 7 (measured by the emulator on N(0,1) at D128, GQA 4: rel_l2 2.5e-2 and 6.1e-3 against FP64
# on the cache, max_rel up to 4.9e-2 and 1.5e-2).
_QK_TOLERANCE = {"fp8": Tolerance(max_rel=1e-1, rel_l2=4e-2), "int8": Tolerance(max_rel=3e-2, rel_l2=1e-2)}


# A kernel's distance from its emulator (rel_l2). On sm_90a the fp8 path's e4m3 wgmma accumulates the
# products of one instruction in reduced precision, which the emulator's fp32 sums do not model: on K
# with channels 50-200x the rest it lands 2.8-3.0e-3 away (N(0,1) K stays within 1e-3).
EMULATOR_REL_L2 = 1e-3
FP8_WGMMA_EMULATOR_REL_L2 = 4e-3


def emulator_rel_l2(qk: str, arch: str) -> float:
    """How far (rel_l2) a decode kernel on this QK path and arch may land from its emulator."""
    return FP8_WGMMA_EMULATOR_REL_L2 if qk == "fp8" and arch == "sm_90a" else EMULATOR_REL_L2


def tolerance(fmt: str, qk: str = "transform") -> Tolerance:
    """The format's tolerance on a QK path: the looser of its own and the path's, field by field."""
    own = _TOLERANCE[query_dtypes(fmt)[0]]
    path = _QK_TOLERANCE.get(qk)
    return own if path is None else Tolerance(max_rel=max(own.max_rel, path.max_rel),
                                              rel_l2=max(own.rel_l2, path.rel_l2))


RECIPES = tuple(
    Recipe(fmt, _summary(fmt), query_dtypes(fmt), _TOLERANCE[query_dtypes(fmt)[0]],
           {"cuda": family(fmt), "hip": hip_family(fmt)}, kind="decode")
    for fmt in FORMATS)
