"""The int8-KV-cache kernels (kv8-f32, kv8-split, kv8-imma) and the cache writer on a machine with
no GPU: every spec renders and compiles with NVRTC, every entry point (attention, statistics,
merge of the splits over keys) stays in registers, the PTX holds the MMAs each format needs; NumPy
models of the fragment layouts (transcribed from the templates' index expressions, with PTX's
mma/ldmatrix fragment definitions) show that the permuted and packed operands give Q·Kᵀ and P·V;
the int32 sums stay exact; models of the split key ranges and of the merge; the choice and the
checking of the number of splits; the format dispatch. CPU only."""
from __future__ import annotations

import functools
import re

import numpy as np
import pytest
from conftest import check_grid_dependency

from qattn.formats.kv8 import recipes as kv8_families
from qattn.engine.fragments import pv_slot_key
from qattn.engine import registry
from qattn.engine.registry import RECIPES
from qattn.engine.family import SMEM_LIMIT
from qattn.engine.tiling import tile_pitch
from qattn.engine.render import entry_name, main_entry_name, render
from qattn.engine.spec import KernelSpec
from qattn.engine.tile import Tile
from qattn.engine import packed
from qattn.check import quant
from qattn.formats.kv8 import quant as kvquant
from qattn.engine.compile import compile_cuda, disassemble, entry_resources
from qattn.engine.inspect import warpgroup_mmas
from qattn.formats.kv8.emulate import IMMA_GROUP


FORMATS = ("kv8-f32", "kv8-split", "kv8-imma")
SPECS = [KernelSpec(recipe=f, head_dim=d, causal=c, arch=a)
         for f in FORMATS for a in ("sm_80", "sm_90a") for d in (64, 128) for c in (False, True)]
SAMPLED = [KernelSpec(recipe=f, head_dim=d, causal=c, arch=a)
           for a in ("sm_86", "sm_89", "sm_120")
           for f, d, c in (("kv8-imma", 128, True), ("kv8-split", 64, False), ("kv8-f32", 128, False))]


@functools.lru_cache(maxsize=None)
def _compiled(spec: KernelSpec):
    return compile_cuda(render(spec), spec.arch, spec.name, entry=main_entry_name(spec))  # as build_kernel


def _entry_resources(log: str, entry: str) -> dict:
    res = entry_resources(log, entry)
    assert res, f"{entry} not in the ptxas log"
    return res


def _entries(spec: KernelSpec) -> list[str]:
    base = entry_name(spec)
    if spec.recipe in kv8_families.MMA_FORMATS:
        return [base, base + kv8_families.STAT_ENTRY, base + kv8_families.MERGE_ENTRY]
    return [base]


def _ids(specs):
    return [s.name for s in specs]


# ---- families, specs, render ------------------------------------------------------------------

def test_families_registered_on_the_kv8_recipes():
    for fmt in FORMATS:
        fam = RECIPES[fmt].family("cuda")
        assert fam is kv8_families.FAMILIES[fmt]
        assert fam.launcher == kv8_families.LAUNCHER and fam.head_dims == (64, 128)
        assert RECIPES[fmt].input_dtypes == ("float32",)
        for d in fam.head_dims:
            tile = fam.default_tiles[d]
            assert fam.tile_problem(tile, d) is None
            assert fam.smem_bytes(tile, d) <= SMEM_LIMIT["cuda"]
            assert {"sm_80", "sm_86", "sm_89", "sm_90a", "sm_120"} <= set(fam.archs)
    # the emulator's chunk of keys (block_n) is the kernel's key tile: kv8-imma's w scale groups
    assert RECIPES["kv8-imma"].family("cuda").default_tiles[128].block_n == 64


def test_launcher_registered():
    from qattn.formats.kv8 import host as kv8
    assert registry.LAUNCHERS[kv8_families.LAUNCHER] is kv8.prefill_kv8 and callable(kv8.attention_kv8)


@pytest.mark.parametrize("tile, d, words", [
    (Tile(64, 32, 4, 2), 128, "block_n must be 64 or 128"),
    (Tile(128, 64, 4, 2), 128, "16 rows per warp"),
    (Tile(64, 64, 4, 1), 64, "stages must be 2..4"),
    (Tile(64, 128, 4, 4), 128, None),
])
def test_mma_tile_rules(tile, d, words):
    problem = RECIPES["kv8-imma"].family("cuda").tile_problem(tile, d)
    if words is None:
        assert problem is None
        KernelSpec(recipe="kv8-imma", head_dim=d, tile=tile, arch="sm_90a")
    else:
        assert words in problem
        with pytest.raises(ValueError, match=re.escape(words)):
            KernelSpec(recipe="kv8-imma", head_dim=d, tile=tile, arch="sm_90a")


def test_unsupported_head_dim_is_named():
    with pytest.raises(ValueError, match="kv8-split on cuda supports 64, 128"):
        KernelSpec(recipe="kv8-split", head_dim=96, arch="sm_90a")


@pytest.mark.parametrize("spec", SPECS[:12], ids=_ids(SPECS[:12]))
def test_render(spec):
    src = render(spec)
    for leftover in ("{{", "}}", "{%", "%}", "{#", "#}"):
        assert leftover not in src
    assert "#include" not in src
    assert "extern \"C\" __global__" in src and entry_name(spec) + "(" in src
    assert f"constexpr int D = {spec.head_dim};" in src and f"constexpr int BN = {spec.tile.block_n};" in src
    assert f"constexpr bool CAUSAL = {'true' if spec.causal else 'false'};" in src
    assert render(spec) == src
    if spec.recipe in kv8_families.MMA_FORMATS:
        from qattn.formats.kv8 import launch as kv8_launch

        assert entry_name(spec) + "_stat(" in src and entry_name(spec) + kv8_families.MERGE_ENTRY + "(" in src
        assert f"constexpr int MERGE_THREADS = {kv8_launch.MERGE_THREADS};" in src  # the launcher's merge block
        assert src.count("QATTN_DEVICE void store_partial(") == 1  # one merge include, both formats
        assert ("mma_split3" in src) == (spec.recipe == "kv8-imma")
        assert ("split_f16x2" in src) == (spec.recipe == "kv8-split")


# ---- NVRTC compile ----------------------------------------------------------------------------

def _check_compiled(spec: KernelSpec, spills_allowed: int = 0) -> None:
    """spills_allowed: bytes the main entry may spill each way (a tile measured faster than every
    spill-free one); the statistics and merge entries never spill."""
    binary = _compiled(spec)
    assert binary.data[:4] == b"\x7fELF"
    ptx = binary.ptx
    assert re.search(rf"\.target\s+{spec.arch}\b", ptx)
    for entry in _entries(spec):
        assert f".entry {entry}(" in ptx
        res = _entry_resources(binary.log, entry)
        assert 0 < res["registers"] <= 255, (entry, res)
        allowed = spills_allowed if entry == entry_name(spec) else 0
        assert res["spill_stores"] <= allowed and res["spill_loads"] <= allowed, (entry, res)
        check_grid_dependency(ptx, entry, packed.programmatic(spec))  # programmatic launches (kv8_launch)
    # the Kernel reports the attention kernel's figures (main_entry_name, whatever order ptxas uses)
    main = _entry_resources(binary.log, entry_name(spec))
    assert all(binary.resources[k] == main[k] for k in ("registers", "spill_stores", "spill_loads"))
    s8 = "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32"
    u8 = "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32"
    f16 = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
    wgmma = spec.family.values.get("mma_unit") == "wgmma"
    if wgmma:  # S and PV on warpgroup MMAs, s8 and u8, each from shared memory and from registers
        wg = warpgroup_mmas(ptx, disassemble(binary.data, "cuda"))
        assert wg["ptx"] == wg["sass"] > 0 and wg["placeholders"] == 0, wg  # ptxas dropped no product
        for kind in ("s8.s8", "u8.s8"):
            assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.s32\.{kind} ", ptx)
        assert "mma.sync" not in ptx and "ldmatrix" not in ptx and "fence.proxy.async.shared::cta" in ptx
        assert not re.search(r"C751[0-9]", binary.log), "ptxas injected warpgroup waits or serialized the wgmmas"
    elif spec.recipe == "kv8-imma":
        assert s8 in ptx and u8 in ptx and f16 not in ptx
        assert "cvt.rn.f16" not in ptx  # the codes are consumed as stored
    elif spec.recipe == "kv8-split":
        assert f16 in ptx and s8 not in ptx and u8 not in ptx
        assert "sub.f16x2" in ptx  # int8 -> fp16, exact
    else:
        assert "mma.sync" not in ptx
    if spec.recipe in kv8_families.MMA_FORMATS:
        assert "cp.async.cg.shared.global" in ptx and "cp.async.ca.shared.global" in ptx
        assert ("ldmatrix" in ptx) != wgmma
    assert not re.search(r"^\s*(atom|red)\.", ptx, re.M)  # deterministic: no atomics


def _measured_spills(spec: KernelSpec) -> int:
    # kv8-imma's three-slot default on sm_90a spills (64 B stored, 104 B reloaded) and still measured
    # 2-10% faster than the spill-free two-slot tile (docs/notes/kv8.md)
    return 112 if (spec.head_dim, spec.causal, spec.arch) in spec.family.measured_spills else 0


@pytest.mark.parametrize("spec", SPECS, ids=_ids(SPECS))
def test_compile(spec):
    _check_compiled(spec, spills_allowed=_measured_spills(spec))


@pytest.mark.parametrize("spec", SAMPLED, ids=_ids(SAMPLED))
def test_compile_other_archs(spec):
    _check_compiled(spec)


WGMMA_SPECS = [KernelSpec(recipe="kv8-imma", head_dim=d, causal=c, arch="sm_90a", mma="wgmma", tile=t)
               for d in (64, 128) for c in (False, True) for t in (None, Tile(64, 64, 4, 3))]


@pytest.mark.parametrize("spec", WGMMA_SPECS, ids=_ids(WGMMA_SPECS))
def test_wgmma_kernel_compiles(spec):
    """kv8-imma on sm_90a's warpgroup MMAs: the default 128-row tile and the 64-row one compile
    spill-free with every wgmma kept and none serialized."""
    _check_compiled(spec)


def test_wgmma_family_rules():
    """The wgmma family: sm_90a only, 64 rows a warpgroup, three or four slots (V transposed a
    block ahead), its shared memory counted as the template lays it out (the render asserts it)."""
    fam = RECIPES["kv8-imma"].family("cuda", "sm_90a", "wgmma")
    assert fam is kv8_families.IMMA_WGMMA and fam.archs == ("sm_90a",) and fam.values["mma_unit"] == "wgmma"
    assert RECIPES["kv8-imma"].family("cuda", "sm_90a").values["mma_unit"] == "mma.sync"  # the default unit
    for tile, words in ((Tile(64, 64, 4, 2), "stages must be 3 or 4"), (Tile(32, 64, 2, 3), "64 rows per warpgroup"),
                        (Tile(64, 32, 4, 3), "block_n must be 64 or 128")):
        assert words in fam.tile_problem(tile, 128)
    with pytest.raises(ValueError, match="mma: kv8-imma on cuda sm_80 builds with mma.sync, got .wgmma."):
        KernelSpec(recipe="kv8-imma", head_dim=128, arch="sm_80", mma="wgmma")
    spec = KernelSpec(recipe="kv8-imma", head_dim=128, arch="sm_90a", mma="wgmma")
    assert spec.tile == Tile(128, 64, 8, 3) and spec.name.endswith("_wgmma_sm90a")
    assert f"== {fam.smem_bytes(spec.tile, 128)}," in render(spec)


LAUNCH_SPECS = [KernelSpec(recipe=f, head_dim=d, causal=c, arch=a, tile=choice.tile, mma=choice.mma)
                for (f, d, a), choice in kv8_families.LAUNCH_TILES.items() for c in (False, True)]


@pytest.mark.parametrize("spec", LAUNCH_SPECS, ids=_ids(LAUNCH_SPECS))
def test_launch_tiles_compile(spec):
    _check_compiled(spec)


def test_tile_choice():
    """kv8-imma's default at d128 on sm_90a is the three-slot tile, for any query count; calls of
    many queries run the wgmma kernel's 128-row tile there (from WGMMA_QUERIES[head_dim] rows), and
    kv8-split its 128-row tile from LONG_QUERIES rows at d128;
    elsewhere the family default."""
    imma = RECIPES["kv8-imma"].family("cuda")
    for causal in (False, True):
        assert imma.default_tile(128, causal, "sm_90a") == Tile(64, 64, 4, 3)
        assert imma.default_tile(64, causal, "sm_90a") == imma.default_tile(128, causal, "sm_80") == Tile(64, 64, 4, 2)
        assert imma.default_tile(128, causal, "sm_89") == Tile(64, 64, 4, 2)  # 108 KB: over a 99 KB block
    assert KernelSpec(recipe="kv8-imma", head_dim=128, arch="sm_90a").tile.stages == 3
    split = kv8_families.LAUNCH_TILES[("kv8-split", 128, "sm_90a")].tile
    assert (split.block_m, split.stages) == (128, 3)
    choice = registry.launch_choice("kv8-split", 128, "sm_90a", kv8_families.LONG_QUERIES)
    assert choice.tile == split and choice.mma is None
    assert registry.launch_choice("kv8-split", 128, "sm_90a", kv8_families.LONG_QUERIES - 1) is None
    assert RECIPES["kv8-split"].family("cuda").default_tile(128, False, "sm_90a") == Tile(64, 64, 4, 2)
    for d, least in kv8_families.WGMMA_QUERIES.items():
        wgmma = registry.launch_choice("kv8-imma", d, "sm_90a", least)
        assert wgmma.tile == Tile(128, 64, 8, 3) and wgmma.mma == "wgmma"
        assert registry.launch_choice("kv8-imma", d, "sm_90a", least - 1) is None
    assert registry.launch_choice("kv8-split", 64, "sm_90a", 4096) is None  # no faster tile measured at d64
    for fmt in kv8_families.MMA_FORMATS:
        assert registry.launch_choice(fmt, 128, "sm_80", 4096) is None  # measured on the H200 only
    assert registry.launch_choice("kv8-f32", 128, "sm_90a", 4096) is None


def test_three_slots_need_the_second_vt_tile():
    """Three slots add a second transposed V tile to the shared memory the family reports."""
    fam = RECIPES["kv8-imma"].family("cuda")
    two, three = Tile(64, 64, 4, 2), Tile(64, 64, 4, 3)
    slot = 2 * 64 * tile_pitch(128) + 2 * 64 * 4
    assert fam.smem_bytes(three, 128) - fam.smem_bytes(two, 128) == slot + 128 * (64 + 16)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_writer_compiles(arch):
    from qattn.formats.kv8 import cache as kvcache

    src = kvcache.writer_source()
    assert "#include" not in src and "{{" not in src
    binary = compile_cuda(src, arch, "kv8_write")
    ptx = binary.ptx
    for sfx in ("f32", "f16", "bf16"):
        entry = f"{kvcache.WRITER_NAME}_{sfx}"
        assert f".entry {entry}(" in ptx
        res = _entry_resources(binary.log, entry)
        assert res["spill_stores"] == 0 and res["spill_loads"] == 0 and res["registers"] > 0
    assert "div.rn.f32" in ptx and "cvt.rni.s32.f32" in ptx  # the quantizer's IEEE division and rint


# ---- int32 exactness ----------------------------------------------------------------------------

@pytest.mark.parametrize("d", [64, 128])
def test_int32_sums_are_exact_for_the_kernel_chunks(d):
    fam = RECIPES["kv8-imma"].family("cuda")
    chunks = {IMMA_GROUP, fam.default_tiles[d].block_n, 128}  # QK: one channel group; PV: BN keys (<= 128)
    for terms in chunks:
        bound = kvquant.partial_sum_bound(terms)
        assert bound < 2 ** 31  # no int32 overflow
        assert bound < quant.F32_EXACT_INT  # cvt.rn.f32.s32 is exact: combine3 sees the true sums
    # the extreme operands reach the bound's scale: h = -128 is unreachable (|X| <= 127·65536), but
    # m = 255 with codes -127 over a whole group sums to 255·127·64 exactly in int32 and in fp32
    worst = 255 * 127 * IMMA_GROUP
    assert np.float32(worst) == worst


# ---- NumPy models of the fragment layouts -------------------------------------------------------
# PTX fragment definitions (g = lane // 4, t = lane % 4):
#   m16n8k32 (8-bit): a0 (g, k 4t..4t+3), a1 (g+8, 4t..), a2 (g, 16+4t..), a3 (g+8, 16+4t..);
#                     b0 (k 4t..4t+3, n g), b1 (k 16+4t.., n g); byte i of a register = k + i.
#   m16n8k16 (16-bit): a0 (g, k 2t, 2t+1), a1 (g+8, ..), a2 (g, 2t+8, 2t+9), a3 (g+8, ..);
#                     b0 (k 2t, 2t+1, n g), b1 (k 2t+8, 2t+9, n g).
#   c0 (g, 2t), c1 (g, 2t+1), c2 (g+8, 2t), c3 (g+8, 2t+1).
#   ldmatrix .x4 .b16: lane L gives the row address of row L % 8 of matrix L // 8; lane T gets,
#                     of matrix i, bytes 4(T%4)..4(T%4)+3 of row T // 4.

LANES = np.arange(32)
G_, T_ = LANES // 4, LANES % 4


def byte_perm(x: int, y: int, sel: int) -> int:
    """CUDA __byte_perm(x, y, s): result byte n is byte (s >> 4n) & 7 of the 8 bytes {y, x}."""
    pool = (y << 32) | x
    return sum(((pool >> (8 * ((sel >> (4 * n)) & 7))) & 0xFF) << (8 * n) for n in range(4))


def ldmatrix_x4(smem: np.ndarray, lane_addr) -> np.ndarray:
    """[32 lanes, 4 regs, 4 bytes] from a byte array, given each lane's row address."""
    rows = np.array([lane_addr(L) for L in range(32)])
    out = np.zeros((32, 4, 4), dtype=smem.dtype)
    for T in range(32):
        for i in range(4):
            base = rows[8 * i + T // 4]
            out[T, i] = smem[base + 4 * (T % 4): base + 4 * (T % 4) + 4]
    return out


def mma_k32(a, b) -> np.ndarray:
    """m16n8k32: a [32, 4, 4] bytes (values), b [32, 2, 4] -> D [16, 8] (int64)."""
    A = np.zeros((16, 32), dtype=np.int64)
    B = np.zeros((32, 8), dtype=np.int64)
    for L in range(32):
        g, t = L // 4, L % 4
        for r, (row, k0) in enumerate(((g, 4 * t), (g + 8, 4 * t), (g, 16 + 4 * t), (g + 8, 16 + 4 * t))):
            A[row, k0:k0 + 4] = a[L, r]
        B[4 * t:4 * t + 4, g] = b[L, 0]
        B[16 + 4 * t:16 + 4 * t + 4, g] = b[L, 1]
    return A @ B


def mma_k16(a, b) -> np.ndarray:
    """m16n8k16: a [32, 4, 2] values, b [32, 2, 2] -> D [16, 8] (float64, exact for our values)."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for L in range(32):
        g, t = L // 4, L % 4
        for r, (row, k0) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
            A[row, k0:k0 + 2] = a[L, r]
        B[2 * t:2 * t + 2, g] = b[L, 0]
        B[2 * t + 8:2 * t + 10, g] = b[L, 1]
    return A @ B


def c_to_rows(c_per_lane: np.ndarray) -> np.ndarray:
    """[32, 4] accumulator registers -> [16, 8]."""
    out = np.zeros((16, 8), dtype=c_per_lane.dtype)
    for L in range(32):
        g, t = L // 4, L % 4
        out[g, 2 * t], out[g, 2 * t + 1], out[g + 8, 2 * t], out[g + 8, 2 * t + 1] = c_per_lane[L]
    return out


def rows_to_c(m: np.ndarray) -> np.ndarray:
    """[16, 8] -> [32, 4] accumulator registers (the S layout of one n-tile)."""
    return np.array([[m[L // 4, 2 * (L % 4)], m[L // 4, 2 * (L % 4) + 1], m[L // 4 + 8, 2 * (L % 4)],
                      m[L // 4 + 8, 2 * (L % 4) + 1]] for L in range(32)])


def test_byte_perm_model_and_vt_slot_order():
    assert byte_perm(0x03020100, 0x07060504, 0x5140) == 0x05010400
    assert byte_perm(0x03020100, 0x07060504, 0x7632) == 0x07060302
    assert [pv_slot_key(s) for s in range(16)] == [0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15]


def vt_core_at(bn: int):
    """VtCore::at (kv8_imma_wgmma.cuh.j2, transcribed): channel row, key slot -> byte in core matrices."""
    return lambda row, slot: core_offset(bn // 16, row, slot >> 4) + (slot & 15)


def core_offset(chunks: int, row: int, chunk: int) -> int:
    """core_offset<CHUNKS> (wgmma.cuh.j2, transcribed)."""
    return (((row >> 3) * chunks + chunk) << 7) + ((row & 7) << 4)


def transpose_v_model(v: np.ndarray, d: int, bn: int, at=None) -> np.ndarray:
    """transpose_v (kv8_mma.cuh.j2), unit by unit: V codes [BN][KPITCH] bytes -> the Vt tile; at(row,
    slot): the destination layout (default VtRows: D rows of VTPITCH bytes), ROW the step between
    the four rows a unit writes."""
    kpitch, vtpitch = d + 16, bn + 16
    at = at or (lambda row, slot: row * vtpitch + slot)
    row_step = at(1, 0) - at(0, 0)
    src = np.zeros(bn * kpitch, dtype=np.uint8)
    for key in range(bn):
        src[key * kpitch: key * kpitch + d] = v[key].view(np.uint8)
    vt = np.zeros(max(d * vtpitch, at(d - 1, bn - 1) + 1), dtype=np.uint8)
    ch = bn // 16

    def word(off):
        return int.from_bytes(src[off:off + 4].tobytes(), "little")

    def put(off, w):
        vt[off:off + 4] = np.frombuffer(int(w).to_bytes(4, "little"), dtype=np.uint8)

    for u in range(ch * 4 * (d // 4)):
        quad, chunk, cq = u & 3, (u >> 2) % ch, (u >> 2) // ch
        s = (16 * chunk + 2 * quad) * kpitch + 4 * cq
        x0, x1, x2, x3 = word(s), word(s + kpitch), word(s + 8 * kpitch), word(s + 9 * kpitch)
        lo01, hi01 = byte_perm(x0, x1, 0x5140), byte_perm(x0, x1, 0x7362)
        lo23, hi23 = byte_perm(x2, x3, 0x5140), byte_perm(x2, x3, 0x7362)
        dst = at(4 * cq, 16 * chunk + 4 * quad)
        put(dst, byte_perm(lo01, lo23, 0x5410))
        put(dst + row_step, byte_perm(lo01, lo23, 0x7632))
        put(dst + 2 * row_step, byte_perm(hi01, hi23, 0x5410))
        put(dst + 3 * row_step, byte_perm(hi01, hi23, 0x7632))
    return vt


@pytest.mark.parametrize("d, bn", [(64, 64), (128, 64), (64, 128)])
def test_transposed_v_holds_the_permuted_keys(d, bn):
    rng = np.random.default_rng(d + bn)
    v = rng.integers(-127, 128, size=(bn, d), dtype=np.int8)
    vt = transpose_v_model(v, d, bn).reshape(d, bn + 16)[:, :bn].view(np.int8)
    perm = np.array([16 * (s // 16) + pv_slot_key(s) for s in range(bn)])
    np.testing.assert_array_equal(vt, v[perm].T)


def desc_read(smem: np.ndarray, start: int, rows: int, chunks: int) -> np.ndarray:
    """The [rows, 32]-byte operand a k32 wgmma reads behind a no-swizzle K-major descriptor (core_desc:
    leading offset 128 B between core matrices along K, stride CHUNKS x 128 B along M/N)."""
    return np.array([[smem[start + (r >> 3) * chunks * 128 + (kb >> 4) * 128 + (r & 7) * 16 + (kb & 15)]
                      for kb in range(32)] for r in range(rows)])


@pytest.mark.parametrize("d, bn, qk_n, pv_n", [(128, 64, 64, 64), (64, 64, 32, 32), (128, 128, 32, 64)])
def test_wgmma_operands_give_q_times_k_and_w_times_v(d, bn, qk_n, pv_n):
    """The wgmma kernel's operands (kv8_imma_wgmma.cuh.j2, transcribed): q_operand's stores of the Q
    parts into core matrices, the K tile in core matrices (load_core_rows) and V transposed into
    VtCore, read back through the descriptors scores() and pv() build, with w's parts in the register
    A layout w_split packs: every S and PV wgmma sees the right 32 channels or keys, so the products
    are Q·Kᵀ and W·V."""
    rng = np.random.default_rng(d + bn + qk_n)
    qchunks, vchunks, q_part = d // 16, bn // 16, 64 * d
    qp = rng.integers(-128, 128, size=(3, 64, d))  # the three parts of one warpgroup's 64 rows
    qs = np.zeros(3 * q_part, dtype=np.int64)
    for warp in range(4):
        for lane in range(32):
            g, t = lane // 4, lane % 4
            row = 16 * warp + g
            for part in range(3):
                for ks in range(d // 32):
                    for r in range(4):  # q_split's fragment r: row g + 8(r & 1), channels ks*32 + (r >> 1)*16 + 4t
                        c = ks * 32 + (r >> 1) * 16 + 4 * t
                        at = part * q_part + core_offset(qchunks, row + 8 * (r & 1), 2 * ks + (r >> 1)) + 4 * t
                        qs[at:at + 4] = qp[part, row + 8 * (r & 1), c:c + 4]
    k = rng.integers(-127, 128, size=(bn, d))
    kt = np.zeros(bn * d, dtype=np.int64)
    for key in range(bn):
        for c in range(qchunks):
            kt[core_offset(qchunks, key, c):][:16] = k[key, 16 * c:16 * c + 16]
    for part in range(3):
        s = np.zeros((64, bn), dtype=np.int64)
        for kc in range(bn // qk_n):
            for ks in range(d // 32):
                a = desc_read(qs, part * q_part + 256 * ks, 64, qchunks)
                b = desc_read(kt, core_offset(qchunks, kc * qk_n, 2 * ks), qk_n, qchunks)
                s[:, kc * qk_n:(kc + 1) * qk_n] += a @ b.T
        np.testing.assert_array_equal(s, qp[part] @ k.T)

    v = rng.integers(-127, 128, size=(bn, d), dtype=np.int8)
    vt = transpose_v_model(v, d, bn, vt_core_at(bn)).view(np.int8).astype(np.int64)
    w = rng.integers(-128, 128, size=(64, bn))  # any byte part of w, rows of the warpgroup
    out = np.zeros((64, d), dtype=np.int64)
    for warp in range(4):
        rows = w[16 * warp:16 * warp + 16]
        acc = np.stack([rows_to_c(rows[:, 8 * nt:8 * nt + 8]) for nt in range(bn // 8)], axis=1)  # [32, NT, 4]
        for dc in range(d // pv_n):
            for kq in range(bn // 32):
                a = np.zeros((16, 32), dtype=np.int64)  # w_split's register A fragment, in k-slot order
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    for r in range(4):
                        h, nb = r & 1, 4 * kq + (r >> 1) * 2
                        a[g + 8 * h, (r >> 1) * 16 + 4 * t:(r >> 1) * 16 + 4 * t + 4] = [
                            acc[lane, nb, 2 * h], acc[lane, nb, 2 * h + 1], acc[lane, nb + 1, 2 * h], acc[lane, nb + 1, 2 * h + 1]]
                b = desc_read(vt, core_offset(vchunks, dc * pv_n, 2 * kq), pv_n, vchunks)
                out[16 * warp:16 * warp + 16, dc * pv_n:(dc + 1) * pv_n] += a @ b.T
    np.testing.assert_array_equal(out, w @ v.astype(np.int64))


def test_wgmma_combine_rounds_as_combine3():
    """combine3_raw (kv8_imma_wgmma.cuh.j2, transcribed) on raw part sums rounds exactly as combine3
    (imma.cuh.j2) on the same sums biased by QATTN_MAGIC: the same float32 bits, over random and
    extreme sums below 2^22 (float64 holds every intermediate exactly; astype(float32) is one RN)."""
    rng = np.random.default_rng(7)
    lim = 2**22 - 1
    h, l, m = (rng.integers(-lim, lim + 1, 200_000) for _ in range(3))
    edges = np.array([lim, -lim, 0, 1, -1, 49152, -49152])
    h, l, m = (np.concatenate([x, np.repeat(edges, 49), np.tile(edges, 49)]) for x in (h, l, m))
    magic = 12582912.0
    h0 = (magic + h) * 65536 - magic * 65793  # exact: combine3's first FMA does not round
    assert np.array_equal(h0.astype(np.float32).astype(np.float64), h0)
    t = ((magic + l) * 256 + h0).astype(np.float32)
    old = (t.astype(np.float64) + (magic + m)).astype(np.float32)
    high = (h * 256 + l - 49152).astype(np.float32)  # __int2float_rn
    new = (high.astype(np.float64) * 256 + (magic + m)).astype(np.float32)  # the FMA
    np.testing.assert_array_equal(old.view(np.uint32), new.view(np.uint32))


def test_imma_pv_packing_gives_p_times_v():
    """pv() of kv8_imma.cuh.j2: A packed from the S layout, B by ldmatrix from the permuted Vt."""
    d, bn = 64, 64
    rng = np.random.default_rng(0)
    v = rng.integers(-127, 128, size=(bn, d), dtype=np.int8)
    w = rng.integers(-128, 128, size=(16, bn))  # any byte part of w (h, l or m): the layout is the same
    s = np.stack([rows_to_c(w[:, 8 * nt: 8 * nt + 8]) for nt in range(bn // 8)], axis=1)  # [32, NT, 4]
    vt = transpose_v_model(v, d, bn).view(np.int8)
    vtpitch = bn + 16
    out = np.zeros((16, d), dtype=np.int64)
    for dt in range(d // 8):
        c = np.zeros((16, 8), dtype=np.int64)
        for kc in range(bn // 64):
            b = ldmatrix_x4(vt, lambda L: dt * 8 * vtpitch + kc * 64 + (L & 7) * vtpitch + (L >> 3) * 16)
            for kk in range(2):
                kq = 2 * kc + kk
                a = np.zeros((32, 4, 4), dtype=np.int64)
                for r in range(4):
                    h, nb = r & 1, 4 * kq + (r >> 1) * 2
                    a[:, r] = np.stack([s[:, nb, 2 * h], s[:, nb, 2 * h + 1], s[:, nb + 1, 2 * h],
                                        s[:, nb + 1, 2 * h + 1]], axis=1)
                c += mma_k32(a, b[:, 2 * kk: 2 * kk + 2].astype(np.int64))
        out[:, 8 * dt: 8 * dt + 8] = c
    np.testing.assert_array_equal(out, w @ v.astype(np.int64))


def test_imma_qk_fragments_give_q_times_k():
    """q_operand() / scores() of kv8_imma.cuh.j2: Q parts in A layout, K rows by ldmatrix."""
    d, bn = 128, 64
    kpitch = d + 16
    rng = np.random.default_rng(1)
    qp = rng.integers(-128, 128, size=(16, d))
    k = rng.integers(-127, 128, size=(bn, d), dtype=np.int8)
    ks = np.zeros(bn * kpitch, dtype=np.int8)
    for key in range(bn):
        ks[key * kpitch: key * kpitch + d] = k[key]
    frag = np.zeros((32, d // 32, 4, 4), dtype=np.int64)  # q_operand: c = ks*32 + (r>>1)*16 + 4t
    for L in range(32):
        g, t = L // 4, L % 4
        for kst in range(d // 32):
            for r in range(4):
                row = g + 8 * (r & 1)
                c = kst * 32 + (r >> 1) * 16 + 4 * t
                frag[L, kst, r] = qp[row, c:c + 4]
    s = np.zeros((16, bn), dtype=np.int64)
    for g_ in range(d // 64):
        for nt in range(bn // 8):
            b = ldmatrix_x4(ks, lambda L: nt * 8 * kpitch + g_ * 64 + (L & 7) * kpitch + (L >> 3) * 16)
            for kk in range(2):
                s[:, 8 * nt: 8 * nt + 8] += mma_k32(frag[:, 2 * g_ + kk], b[:, 2 * kk: 2 * kk + 2].astype(np.int64))
    np.testing.assert_array_equal(s, qp @ k.T.astype(np.int64))


def s8x2_to_f16x2_model(x: int, sel: int) -> tuple[float, float]:
    biased = byte_perm(x ^ 0x80808080, 0x64646464, sel)
    halves = np.array([biased & 0xFFFF, biased >> 16], dtype=np.uint16).view(np.float16).astype(np.float64)
    return tuple(halves - 1152.0)


def test_int8_to_fp16_is_exact():
    codes = np.arange(-128, 128, dtype=np.int8)
    for i in range(0, 256, 4):
        x = int.from_bytes(codes[i:i + 4].tobytes(), "little")
        assert s8x2_to_f16x2_model(x, 0x4140) == (codes[i], codes[i + 1])
        assert s8x2_to_f16x2_model(x, 0x4342) == (codes[i + 2], codes[i + 3])


def test_split_fragments_give_q_times_k_and_p_times_v():
    """kv8_split.cuh.j2: Q channels permuted to match int8 K read by ldmatrix; W from the S layout
    against the permuted Vt read by ldmatrix (vt_lane_offset = lane * VTPITCH)."""
    d, bn = 128, 64
    kpitch, vtpitch = d + 16, bn + 16
    rng = np.random.default_rng(2)
    q = rng.standard_normal((16, d))
    k = rng.integers(-127, 128, size=(bn, d), dtype=np.int8)
    ks = np.zeros(bn * kpitch, dtype=np.int8)
    for key in range(bn):
        ks[key * kpitch: key * kpitch + d] = k[key]
    # QK: q_operand packs channels c, c+1 with c = ks*16 + 4t + (r>>1)*2
    s = np.zeros((16, bn))
    for nt in range(bn // 8):
        for kc in range(d // 64):
            b = ldmatrix_x4(ks, lambda L: nt * 8 * kpitch + kc * 64 + (L & 7) * kpitch + (L >> 3) * 16)
            for i in range(4):
                kst = 4 * kc + i
                a = np.zeros((32, 4, 2))
                for L in range(32):
                    g, t = L // 4, L % 4
                    for r in range(4):
                        c = kst * 16 + 4 * t + (r >> 1) * 2
                        a[L, r] = q[g + 8 * (r & 1), c:c + 2]
                bb = np.stack([b[:, i, 0:2], b[:, i, 2:4]], axis=1).astype(np.float64)  # b0 = bytes 0,1; b1 = 2,3
                s[:, 8 * nt: 8 * nt + 8] += mma_k16(a, bb)
    np.testing.assert_allclose(s, q @ k.T.astype(np.float64), rtol=1e-12, atol=1e-9)
    # PV
    v = rng.integers(-127, 128, size=(bn, d), dtype=np.int8)
    w = rng.random((16, bn))
    sl = np.stack([rows_to_c(w[:, 8 * nt: 8 * nt + 8]) for nt in range(bn // 8)], axis=1)
    vt = transpose_v_model(v, d, bn).view(np.int8)
    out = np.zeros((16, d))
    a = [np.stack([sl[:, 2 * kp, 0:2], sl[:, 2 * kp, 2:4], sl[:, 2 * kp + 1, 0:2], sl[:, 2 * kp + 1, 2:4]], axis=1)
         for kp in range(bn // 16)]
    for dq in range(d // 32):
        part = np.zeros((16, 32))  # the block's product, added to the accumulator once
        for kp in range(bn // 16):
            b = ldmatrix_x4(vt, lambda L: dq * 32 * vtpitch + kp * 16 + L * vtpitch)
            for i in range(4):
                bb = np.stack([b[:, i, 0:2], b[:, i, 2:4]], axis=1).astype(np.float64)
                part[:, 8 * i: 8 * i + 8] += mma_k16(a[kp], bb)
        out[:, 32 * dq: 32 * dq + 32] += part
    np.testing.assert_allclose(out, w @ v.astype(np.float64), rtol=1e-12, atol=1e-9)


def split3_device_model(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """split3() of imma.cuh.j2 in int32 arithmetic (>> arithmetic, & on two's complement)."""
    big = np.rint(np.asarray(x, np.float32) * np.float32(65536)).astype(np.int64)
    big = np.clip(big, -kvquant.SPLIT_MAX, kvquant.SPLIT_MAX).astype(np.int32)
    m = big & 0xFF
    rest = (big - m) >> 8
    low = ((rest + 128) & 0xFF) - 128
    high = (rest - low) >> 8
    return high, low, m


def test_split3_device_arithmetic_matches_quant():
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.uniform(-127, 127, 100_000), rng.standard_normal(10_000) * 1e-3,
                        [0.0, 127.0, -127.0, 127.00001, -127.00001, 1 / 65536, -0.5 / 65536, 1.5 / 65536]]).astype(np.float32)
    h, l, m = split3_device_model(x)
    qh, ql, qm = kvquant.split3(x)
    np.testing.assert_array_equal(h, qh)
    np.testing.assert_array_equal(l, ql)
    np.testing.assert_array_equal(m, qm)
    # byte ranges the MMAs are given: h, l signed bytes; m unsigned
    assert h.min() >= -128 and h.max() <= 127 and l.min() >= -128 and l.max() <= 127 and m.min() >= 0 and m.max() <= 255
    # combine3's fp32 order on exact sums equals the emulator's
    hs, ls, ms = (rng.integers(-(2 ** 20), 2 ** 20, 1000) for _ in range(3))
    ours = np.float32(np.float32(hs.astype(np.float32) * np.float32(65536)) + np.float32(ls.astype(np.float32) * np.float32(256))) + ms.astype(np.float32)
    from qattn.formats.kv8.emulate import _combine3

    np.testing.assert_array_equal(ours, _combine3(np.stack([hs, ls, ms]).astype(np.float64)))


def test_markstein_division_matches_ieee():
    """div_by (kv8_mma.cuh.j2): RN(a·RN(1/b)) then one FMA correction gives RN(a/b)."""
    rng = np.random.default_rng(4)
    b = (rng.random(2000).astype(np.float32) * np.float32(3) + np.float32(1e-3)).astype(np.float32)
    a = (rng.random((2000, 50)).astype(np.float32) * b[:, None] * np.float32(127)).astype(np.float32)
    rb = (np.float32(1) / b).astype(np.float32)
    q = (a * rb[:, None]).astype(np.float32)
    resid = (a.astype(np.float64) - q.astype(np.float64) * b[:, None].astype(np.float64)).astype(np.float32)  # exact in fp32
    corr = (q.astype(np.float64) + resid.astype(np.float64) * rb[:, None].astype(np.float64)).astype(np.float32)
    np.testing.assert_array_equal(corr, (a / b[:, None]).astype(np.float32))


# ---- split over keys: key ranges, merge, how many splits ------------------------------------------

def split_key_blocks_model(nblocks: int, split: int, splits: int) -> range:
    """split_key_blocks (kv8_merge.cuh.j2): key blocks [first, end) of one split."""
    return range(nblocks * split // splits, nblocks * (split + 1) // splits)


@pytest.mark.parametrize("nblocks", [0, 1, 2, 3, 7, 33, 1024])
@pytest.mark.parametrize("splits", [1, 2, 3, 8, 33])
def test_splits_cover_every_key_block_once_in_order(nblocks, splits):
    ranges = [split_key_blocks_model(nblocks, s, splits) for s in range(splits)]
    assert [j for r in ranges for j in r] == list(range(nblocks))
    sizes = [len(r) for r in ranges]
    assert max(sizes) - min(sizes) <= 1  # balanced; splits past nblocks are empty, not negative
    if splits == 1:
        assert ranges == [range(nblocks)]  # the plain kernel's loop


def merge_model(part_o, part_ml):
    """merge_splits (kv8_merge.cuh.j2) in fp32, splits in order: part_o [S, rows, D], part_ml [S, rows, 2]."""
    f32 = np.float32
    m = part_ml[..., 0].max(axis=0)
    l = np.zeros(m.shape, f32)
    acc = np.zeros(part_o.shape[1:], f32)
    live_max = m != -np.inf
    for s in range(part_o.shape[0]):
        with np.errstate(invalid="ignore"):
            w = np.where(live_max, np.exp2(part_ml[s, :, 0] - m), 0).astype(f32)
        l = (w.astype(np.float64) * part_ml[s, :, 1] + l).astype(f32)  # one FMA: one rounding
        acc = (w[:, None].astype(np.float64) * part_o[s] + acc).astype(f32)
    live = l > 0
    out = np.where(live[:, None], acc / np.where(live, l, 1)[:, None], 0).astype(f32)
    with np.errstate(divide="ignore"):
        lse = np.where(live, (m.astype(np.float64) + np.log2(np.where(live, l, 1))) * np.log(2), -np.inf)
    return out, lse


def test_merge_of_split_partials_is_the_softmax():
    """Partials as store_partial writes them (each split's own max; -inf and 0 where a row sees no
    key of the split) merge into softmax(S)·V, LSE included; a row that sees no key gives zeros."""
    rng = np.random.default_rng(20)
    rows, keys, d, splits, bn = 6, 200, 8, 3, 64
    s2 = rng.standard_normal((rows, keys)) * 4  # log2-domain scores
    v = rng.standard_normal((keys, d))
    visible = np.arange(keys)[None, :] <= np.array([-1, 0, 10, 64, 150, 199])[:, None]  # causal-like rows
    nblocks = -(-keys // bn)
    part_o = np.zeros((splits, rows, d), np.float32)
    part_ml = np.zeros((splits, rows, 2), np.float32)
    for s in range(splits):
        blocks = split_key_blocks_model(nblocks, s, splits)
        cols = np.zeros(keys, bool)
        cols[blocks.start * bn: blocks.stop * bn] = True
        seen = visible & cols[None, :]
        m = np.where(seen.any(1), np.where(seen, s2, -np.inf).max(1), -np.inf)
        p = np.where(seen, np.exp2(s2 - np.where(np.isinf(m), 0, m)[:, None]), 0)
        part_o[s], part_ml[s, :, 0], part_ml[s, :, 1] = p @ v, m, p.sum(1)
    out, lse = merge_model(part_o, part_ml)
    p = np.where(visible, np.exp2(s2 - s2.max(1, keepdims=True)), 0)
    live = visible.any(1)
    want = np.where(live[:, None], (p @ v) / np.where(live, p.sum(1), 1)[:, None], 0)
    np.testing.assert_allclose(out, want, rtol=2e-6, atol=2e-6)
    assert np.all(out[0] == 0) and lse[0] == -np.inf
    want_lse = np.log(np.where(visible, np.exp2(s2), 0).sum(1)[1:])
    np.testing.assert_allclose(lse[1:], want_lse, rtol=1e-6)


H200_SLOTS = (132, 2)  # SMs, resident kv8-imma d128 blocks per SM (BENCHMARKS: 2 blocks per SM)


@pytest.mark.parametrize("ctx, queries, want", [
    (32768, 2048, 1), (1500, 1500, 1),  # 256 and 192 blocks: more than half the 264 slots
    (2100, 256, 8), (32768, 256, 8),   # 32 blocks: 8 splits fill one wave (2100 keys: 33 blocks, >= 4 each)
    (65536, 64, 33),                    # 8 blocks: 33 splits, 264 blocks
    (100, 64, 1),                       # 2 key blocks: not worth a split
])
def test_auto_splits_at_the_seed_shapes(ctx, queries, want):
    from types import SimpleNamespace

    from qattn.formats.kv8 import host as kv8

    for fmt in kv8_families.MMA_FORMATS:
        kernel = SimpleNamespace(spec=KernelSpec(recipe=fmt, head_dim=128, arch="sm_90a"),
                                 resident=lambda device_id: H200_SLOTS)
        assert kv8.choose_splits(kernel, 1, 8, queries, ctx) == want
    f32 = SimpleNamespace(spec=KernelSpec(recipe="kv8-f32", head_dim=128, arch="sm_90a"))
    assert kv8.choose_splits(f32, 1, 8, queries, ctx) == 1


def test_auto_splits_rule():
    from qattn.formats.kv8 import host as kv8
    from qattn.formats.kv8.host import MIN_KEY_BLOCKS_PER_SPLIT, auto_splits

    sms, per_sm = H200_SLOTS
    for blocks in range(sms * per_sm // 2 + 1, 4 * sms * per_sm, 37):  # over half the slots: no split
        assert auto_splits(blocks, 10_000, sms, per_sm) == 1
    for blocks in (2, 8, 32, 100, 132):
        n = auto_splits(blocks, 10_000, sms, per_sm)
        assert n > 1 and blocks * n <= sms * per_sm < blocks * (n + 1)  # one full wave
    assert auto_splits(1, 10_000, sms, per_sm) == kv8.MAX_SPLITS
    for key_blocks in range(0, 40):  # each split keeps enough key blocks to amortize the merge
        n = auto_splits(8, key_blocks, sms, per_sm)
        assert n == max(1, key_blocks // MIN_KEY_BLOCKS_PER_SPLIT)


@pytest.mark.parametrize("bad", [0, -1, 257, 2.0, "2", True])
def test_bad_splits_raise_naming_the_argument(bad):
    from types import SimpleNamespace

    from qattn.formats.kv8 import host as kv8

    with pytest.raises(ValueError, match=r"splits: expected None \(automatic\) or an integer 1\.\.256"):
        kv8.check_splits(bad, "kv8-imma")
    kernel = SimpleNamespace(spec=KernelSpec(recipe="kv8-imma", head_dim=64, arch="sm_90a"))
    with pytest.raises(ValueError, match="splits: expected"):
        kv8.prefill_kv8(kernel, None, None, splits=bad)  # checked before anything touches the GPU


def test_splits_accepted_and_f32_does_not_split():
    from qattn.formats.kv8 import host as kv8

    assert kv8.check_splits(None, "kv8-split") is None
    assert [kv8.check_splits(n, "kv8-imma") for n in (1, 3, np.int64(4), 256)] == [1, 3, 4, 256]
    assert kv8.check_splits(1, "kv8-f32") == 1 and kv8.check_splits(None, "kv8-f32") is None
    with pytest.raises(ValueError, match="splits: kv8-f32 .* does not split over keys"):
        kv8.check_splits(2, "kv8-f32")


# ---- format dispatch ------------------------------------------------------------------------------

def test_default_format_and_env_override(monkeypatch):
    from qattn.formats.kv8 import host as kv8

    monkeypatch.delenv(kv8.ENV_VAR, raising=False)
    for arch in ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_120"):
        assert kv8.default_format(arch) == "kv8-imma"
        assert kv8.resolve_format(None, arch) == "kv8-imma" == kv8.resolve_format("kv8", arch)
    assert kv8.default_format("sm_75") == "kv8-f32"
    for arch in ("gfx90a", "gfx942", "gfx1100", "gfx1201"):  # int8 MFMA / iu8 WMMA
        assert kv8.default_format(arch) == "kv8-imma" == kv8.resolve_format(None, arch)
    with pytest.raises(ValueError, match="arch: expected a CUDA arch such as sm_90a or a HIP target"):
        kv8.default_format("gfx803")
    for value, fmt in (("imma", "kv8-imma"), ("split", "kv8-split"), ("f32", "kv8-f32"), (" Split ", "kv8-split")):
        monkeypatch.setenv(kv8.ENV_VAR, value)
        assert kv8.resolve_format(None, "sm_90a") == fmt == kv8.resolve_format("kv8", "sm_90a")
        assert kv8.resolve_format("kv8-imma", "sm_90a") == "kv8-imma"  # an explicit format wins
    monkeypatch.setenv(kv8.ENV_VAR, "fp8")
    with pytest.raises(ValueError, match="QATTN_PREFILL_KV8: expected one of imma, split, f32"):
        kv8.resolve_format(None, "sm_90a")
    with pytest.raises(ValueError, match="format: an int8 KV cache runs one of"):
        kv8.resolve_format("f16", "sm_90a")
