"""The int8-QK kernels (i8-f16, i8-i8, i8-f8) on a machine with no GPU: every spec renders and
compiles with NVRTC for its archs, every entry point of the module stays in registers, the PTX has
the MMAs and conversions the format needs, and a NumPy model of the PV fragment packing shows that
the permuted V^T layout gives Σ_keys P·V. CPU only."""
from __future__ import annotations

import functools
import re

import numpy as np
import pytest
from conftest import check_grid_dependency, check_spills, entry_ptx

from qattn.engine.fragments import pv_key_slot, pv_slot_key
from qattn.engine.registry import RECIPES
from qattn.engine.family import SMEM_LIMIT
from qattn.engine.render import entry_name, main_entry_name, render
from qattn.engine.spec import KernelSpec
from qattn.formats.int8qk import host as int8
from qattn.engine import packed
from qattn.engine.compile import compile_cuda, entry_resources, parse_ptxas

I8_FORMATS = ("i8-f16", "i8-i8", "i8-f8")
ARCHS = {"i8-f16": ("sm_80", "sm_90a"), "i8-i8": ("sm_80", "sm_90a"), "i8-f8": ("sm_89", "sm_90a", "sm_120")}
# The mma.sync kernels on every arch (spelled out where the arch's default is another unit: i8-f8
# and i8-f16 on sm_90a run on wgmma, tests/test_wgmma.py and tests/test_wgmma_prefill.py).
SPECS = [KernelSpec(recipe=f, head_dim=d, causal=c, arch=a, mma="mma.sync")
         for f in I8_FORMATS for a in ARCHS[f] for d in (64, 128) for c in (False, True)]


def _entries(spec: KernelSpec) -> list[str]:
    return [entry_name(spec) + suffix for suffix in int8.module_entries(spec.recipe, spec.backend)]


@functools.lru_cache(maxsize=None)
def _compiled(spec: KernelSpec):
    return compile_cuda(render(spec), spec.arch, spec.name)


# ---- families and specs -----------------------------------------------------------------------

def test_families_archs_and_launcher():
    for f in I8_FORMATS:
        fam = RECIPES[f].family("cuda")
        assert fam.template == "cuda/prefill_i8.cu.j2" and fam.launcher == "prefill_i8"
        assert fam.head_dims == (64, 128) and fam.main_entry == "_f16"
        assert RECIPES[f].ctype["pv"] == {"i8-f16": "f16", "i8-i8": "i8", "i8-f8": "f8"}[f]
        for d in fam.head_dims:
            tile = fam.default_tiles[d]
            # the emulator's defaults: 128 query rows per Q scale, 64 keys per K scale
            assert (tile.block_m, tile.block_n) == (128, 64)
            assert fam.tile_problem(tile, d) is None
            assert fam.smem_bytes(tile, d) <= SMEM_LIMIT["cuda"]
        for (d, causal, arch), tile in fam.tuned.items():  # tuned tiles keep the scale blocks
            assert (tile.block_m, tile.block_n) == (128, 64) and arch in fam.archs
            assert fam.tile_problem(tile, d) is None
    assert "sm_80" in RECIPES["i8-i8"].family("cuda").archs
    f8 = RECIPES["i8-f8"].family("cuda").archs
    assert "sm_80" not in f8 and "sm_86" not in f8 and {"sm_89", "sm_90a", "sm_120"} <= set(f8)
    with pytest.raises(ValueError, match="arch: i8-f8 on cuda supports sm_89"):
        KernelSpec(recipe="i8-f8", head_dim=128, arch="sm_80")


def test_hopper_carries_e4m3_in_fp16():
    """i8-f8 on mma.sync on sm_90/sm_90a builds the fp16-carrier variant (V as fp16 rows of e4m3
    values, fp16 PV MMAs; sm_90a's default is the wgmma kernel, with e4m3 PV); every other arch and
    format keeps its own PV operand."""
    from qattn.formats.int8qk.recipes import E4M3_IN_F16_ARCHS

    assert set(E4M3_IN_F16_ARCHS) == {"sm_90", "sm_90a"}
    for arch in ("sm_89", "sm_90", "sm_90a", "sm_120"):
        spec = KernelSpec(recipe="i8-f8", head_dim=128, arch=arch, mma="mma.sync")
        want = "f16" if arch in E4M3_IN_F16_ARCHS else "f8"
        assert spec.family.values["pv_operand"] == want, arch
        assert spec.family.archs == RECIPES["i8-f8"].family("cuda").archs
    for f in ("i8-f8", "i8-f16"):  # tests/test_wgmma.py, tests/test_wgmma_prefill.py
        assert KernelSpec(recipe=f, head_dim=128, arch="sm_90a").family.values["mma_unit"] == "wgmma"
    assert KernelSpec(recipe="i8-i8", head_dim=128, arch="sm_90a").family is RECIPES["i8-i8"].family("cuda")
    carrier = KernelSpec(recipe="i8-f8", head_dim=128, arch="sm_90a", mma="mma.sync").family
    f16 = RECIPES["i8-f16"].family("cuda")
    from qattn.engine.tile import Tile

    t = Tile(128, 64, 4, 2)
    assert carrier.smem_bytes(t, 128) == f16.smem_bytes(t, 128)  # fp16 V rows, like i8-f16


def test_launcher_registered():
    from qattn.engine.registry import LAUNCHERS

    assert LAUNCHERS["prefill_i8"] is int8.prefill_i8 and "prefill" in LAUNCHERS
    assert callable(int8.quantize) and callable(int8.attention_quantized) and callable(int8.prefill_i8)


def test_smem_covers_loop_and_epilogue():
    from qattn.engine.tile import Tile

    fam = RECIPES["i8-i8"].family("cuda")
    t = Tile(128, 64, 8, 2)
    loop = 128 * (128 + 16) + 2 * (64 * (128 + 16) + 128 * (64 + 16))
    assert fam.smem_bytes(t, 128) == max(loop, 128 * (128 + 8) * 2)
    f16 = RECIPES["i8-f16"].family("cuda")
    assert f16.smem_bytes(t, 128) == 128 * 144 + 2 * (64 * 144 + 64 * 288)  # fp16 V rows: 256 B + 32
    assert fam.tile_problem(Tile(128, 48, 8, 2), 128) is not None  # block_n must be a multiple of 32
    assert fam.tile_problem(Tile(128, 64, 8, 5), 128) is not None


def test_render_every_i8_spec():
    for spec in SPECS:
        src = render(spec)
        for leftover in ("{{", "}}", "{%", "%}", "{#", "#}"):
            assert leftover not in src, (spec.name, leftover)
        for e in _entries(spec):
            assert f"{e}(" in src, (spec.name, e)
        assert "#include" not in src
        assert "m16n8k32.row.col.s32.s8.s8.s32" in src


# ---- NVRTC compile, per entry point -------------------------------------------------------------

@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_compile_i8(spec):
    binary = _compiled(spec)
    assert binary.data[:4] == b"\x7fELF"
    ptx = binary.ptx
    assert re.search(rf"\.target\s+{spec.arch}\b", ptx)
    # Defaults stay in registers but where the family lists a measured-faster tile that spills a
    # little (Family.measured_spills); see check_spills for the quantization kernels.
    measured = ((spec.head_dim, spec.causal, spec.arch) in spec.family.measured_spills
                and spec.tile == spec.family.default_tile(spec.head_dim, spec.causal, spec.arch))
    for e in _entries(spec):
        res = entry_resources(binary.log, e)
        check_spills(e, res, attention=e in (entry_name(spec) + "_f16", entry_name(spec) + "_bf16"),
                     allowed=64 if measured else 0)
        assert 0 < res["registers"] <= 255, (e, res)
    # From sm_90 the call's launches are programmatic (int8_launch.programmatic): each entry waits
    # for the kernel ahead of it before its first memory access; before sm_90 no such instruction.
    for e in _entries(spec):
        check_grid_dependency(ptx, e, packed.programmatic(spec))
    attn = entry_ptx(ptx, entry_name(spec) + "_f16")
    assert "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32" in attn
    assert "cp.async" in attn and "ldmatrix" in attn
    pv = RECIPES[spec.recipe].ctype["pv"]
    if pv == "f8" and spec.family.values["pv_operand"] == "f16":
        # e4m3 values carried in fp16: fp16 PV MMAs, P rounded to e4m3 and widened, no e4m3 MMA
        assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in attn
        assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in attn
        assert "cvt.rn.satfinite.e4m3x2.f32" in attn and "cvt.rn.f16x2.e4m3x2" in attn
        assert "e4m3.e4m3" not in attn
        quant_v = entry_ptx(ptx, entry_name(spec) + "_quant_qkv_f16")
        assert "cvt.rn.satfinite.e4m3x2.f32" in quant_v and "cvt.rn.f16x2.e4m3x2" in quant_v
    elif pv == "f16":
        assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in attn
        assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in attn
        assert "e4m3" not in attn
    elif pv == "i8":
        # QK and PV are both s8 MMAs: D/32 * BN/8 QK MMAs per m-tile and D/8 * BN/32 PV MMAs
        assert "m16n8k16" not in attn and "e4m3" not in attn and ".trans" not in attn
    else:
        assert "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32" in attn
        assert "cvt.rn.satfinite.e4m3x2.f32" in attn
        assert "cvt.rn.satfinite.e4m3x2.f32" in entry_ptx(ptx, entry_name(spec) + "_quant_qkv_f16")
        assert "m16n8k16" not in attn
    # the bf16-output entry differs only in its output conversion
    assert "cvt.rn.bf16x2.f32" in entry_ptx(ptx, entry_name(spec) + "_bf16")
    assert "cvt.rn.bf16x2.f32" not in attn


def test_compile_reports_the_attention_entry():
    """Kernels, `qattn inspect` and `qattn compile` report the attention kernel, not whichever
    quantization kernel ptxas lists first."""
    spec = KernelSpec(recipe="i8-f8", head_dim=128, arch="sm_90a")
    binary = compile_cuda(render(spec), spec.arch, spec.name, entry=main_entry_name(spec))
    assert main_entry_name(spec) == entry_name(spec) + "_f16"
    assert binary.resources == entry_resources(binary.log, main_entry_name(spec))
    assert binary.resources != parse_ptxas(binary.log)  # the first-listed entry is another kernel


def test_entry_resources_picks_the_named_entry():
    log = ("ptxas info    : Compiling entry function 'a_x' for 'sm_90a'\n"
           "ptxas info    : Function properties for a_x\n"
           "    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n"
           "ptxas info    : Used 40 registers, used 1 barriers\n"
           "ptxas info    : Compiling entry function 'a' for 'sm_90a'\n"
           "ptxas info    : Function properties for a\n"
           "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
           "ptxas info    : Used 200 registers, used 1 barriers, 1024 bytes smem\n")
    assert entry_resources(log, "a") == {"registers": 200, "static_smem": 1024, "stack": 0,
                                         "spill_stores": 0, "spill_loads": 0}
    assert entry_resources(log, "a_x")["registers"] == 40
    assert entry_resources(log, "b") == {}


# ---- NumPy model of the PV fragments --------------------------------------------------------------

def _vt_slot(k: int) -> int:
    """quantize_i8.cuh.j2's vt_slot (the slot of key k), transcribed."""
    return 4 * ((k & 7) >> 1) + (k & 1) + 2 * (k >> 3)


def test_vt_slot_is_the_inverse_of_the_packing_order():
    assert sorted(pv_slot_key(s) for s in range(16)) == list(range(16))
    for s in range(16):
        assert _vt_slot(pv_slot_key(s)) == s == pv_key_slot(pv_slot_key(s))
    from qattn.engine.render import template_path

    text = template_path("cuda/quantize_i8.cuh.j2").read_text()
    assert "return 4 * ((k & 7) >> 1) + (k & 1) + 2 * (k >> 3);" in text


def _a_fragment_model(p_acc, kq):
    """A[16 rows, 32 k slots] of the PV m16n8k32 for one m-tile and 32-key step kq, built the way
    pv_mma8 packs it from the S accumulator p_acc[lane][nt][4] (m16n8 C layout) and read the way
    the MMA reads an 8-bit row-major A fragment."""
    a = np.zeros((16, 32))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        pk = p_acc[lane]
        regs = [
            (pk[4 * kq][0], pk[4 * kq][1], pk[4 * kq + 1][0], pk[4 * kq + 1][1]),
            (pk[4 * kq][2], pk[4 * kq][3], pk[4 * kq + 1][2], pk[4 * kq + 1][3]),
            (pk[4 * kq + 2][0], pk[4 * kq + 2][1], pk[4 * kq + 3][0], pk[4 * kq + 3][1]),
            (pk[4 * kq + 2][2], pk[4 * kq + 2][3], pk[4 * kq + 3][2], pk[4 * kq + 3][3]),
        ]
        for r, vals in enumerate(regs):
            for i, val in enumerate(vals):  # byte i of register r
                a[g + 8 * (r % 2), 4 * t + i + 16 * (r // 2)] = val
    return a


def _b_fragment_model(vt_smem, dp, kq):
    """B[32 k slots, 16 channels] (two n-tiles) from ldmatrix.x4 (non-transposed) on the V^T smem
    rows at b_lane_offset, as the MMA reads an 8-bit column-major B fragment."""
    b = np.zeros((32, 16))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for m in range(4):  # matrix m: row addresses from lanes 8m..8m+7 (b_lane_offset)
            src_lane = 8 * m + g
            row = (src_lane & 7) + (src_lane >> 4) * 8
            col = ((src_lane >> 3) & 1) * 16
            for i in range(4):  # the thread's 4 bytes of that row: b16 pair t
                val = vt_smem[dp * 16 + row, kq * 32 + col + 4 * t + i]
                # register b[m]: n-tile m >> 1 (channels 8(m>>1) + g), k slots (m & 1)*16 + 4t + i
                b[(m & 1) * 16 + 4 * t + i, 8 * (m >> 1) + g] = val
    return b


def test_pv_fragment_model_gives_p_times_v():
    rng = np.random.default_rng(0)
    bn, d = 64, 32
    p = rng.integers(0, 128, size=(16, bn)).astype(np.float64)  # one m-tile, one key block
    v = rng.integers(-127, 128, size=(bn, d)).astype(np.float64)
    # S accumulator layout: lane (g, t) holds keys nt*8 + 2t + e of rows g (e) and g + 8 (2 + e)
    p_acc = np.zeros((32, bn // 8, 4))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for nt in range(bn // 8):
            p_acc[lane, nt] = [p[g, nt * 8 + 2 * t], p[g, nt * 8 + 2 * t + 1],
                               p[g + 8, nt * 8 + 2 * t], p[g + 8, nt * 8 + 2 * t + 1]]
    # V^T as quant_v writes it: key kl of the block goes to column (kl & ~15) + vt_slot(kl & 15)
    vt = np.zeros((d, bn))
    for kl in range(bn):
        vt[:, (kl & ~15) + _vt_slot(kl & 15)] = v[kl]
    out = np.zeros((16, d))
    for dp in range(d // 16):
        for kq in range(bn // 32):
            out[:, dp * 16:(dp + 1) * 16] += _a_fragment_model(p_acc, kq) @ _b_fragment_model(vt, dp, kq)
    np.testing.assert_array_equal(out, p @ v)
    # and the unpermuted layout would not: the permutation is what makes it right
    vt_plain = v.T.copy()
    wrong = sum(_a_fragment_model(p_acc, kq) @ _b_fragment_model(vt_plain, 0, kq) for kq in range(bn // 32))
    assert not np.array_equal(wrong, (p @ v)[:, :16])


def test_qk_fragment_model_in_bytes():
    """QK on m16n8k32 reads Q8/K8 rows with the f16 kernel's ldmatrix addressing in bytes: the
    A model (rows at a_lane_offset) times the B model (rows at b_lane_offset) is Q8 K8ᵀ."""
    rng = np.random.default_rng(1)
    q = rng.integers(-127, 128, size=(16, 32)).astype(np.float64)
    k = rng.integers(-127, 128, size=(16, 32)).astype(np.float64)  # 16 keys, one 32-channel step
    a = np.zeros((16, 32))
    b = np.zeros((32, 16))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for m in range(4):
            src = 8 * m + g
            # a_lane_offset: row (lane & 7) + ((lane >> 3) & 1) * 8, byte (lane >> 4) * 16
            arow, acol = (src & 7) + ((src >> 3) & 1) * 8, (src >> 4) * 16
            # b_lane_offset: row (lane & 7) + (lane >> 4) * 8, byte ((lane >> 3) & 1) * 16
            brow, bcol = (src & 7) + (src >> 4) * 8, ((src >> 3) & 1) * 16
            for i in range(4):
                # A register m: rows g + 8 (m % 2), k 4t + i + 16 (m // 2)
                a[g + 8 * (m % 2), 4 * t + i + 16 * (m // 2)] = q[arow, acol + 4 * t + i]
                b[(m & 1) * 16 + 4 * t + i, 8 * (m >> 1) + g] = k[brow, bcol + 4 * t + i]
    np.testing.assert_array_equal(a @ b, q @ k.T)


def _vt_tile_row(c: int, bn: int) -> int:
    """quantize_i8.cuh.j2's vt_tile_row (the smem row of channel c), transcribed."""
    per_line = 1 if bn >= 128 else 128 // bn
    return c ^ ((c >> 3) & (per_line - 1))


@pytest.mark.parametrize("bn", [32, 64, 128])
@pytest.mark.parametrize("d", [64, 128])
def test_vt_tile_writes_without_bank_conflicts(bn, d):
    """quant_v_body's smem V^T tile: vt_tile_row permutes each channel octet, and every word store of
    a warp (lanes = consecutive (octet, slot quad) items, one store per channel of the octet) hits 32
    distinct banks; the 16-byte reads of a quarter warp hit 32 distinct banks too."""
    from qattn.engine.render import template_path

    text = template_path("cuda/quantize_i8.cuh.j2").read_text()
    assert "return c ^ ((c >> 3) & (VT_ROWS_PER_LINE - 1));" in text
    words = bn // 4
    assert sorted(_vt_tile_row(c, bn) for c in range(d)) == list(range(d))
    items = words * (d // 8)
    for w0 in range(0, items, 32):
        for e in range(8):
            banks = [(_vt_tile_row((i // words) * 8 + e, bn) * words + i % words) % 32
                     for i in range(w0, min(items, w0 + 32))]
            assert len(set(banks)) == len(banks), (w0, e, banks)
    chunks = bn // 16
    for i0 in range(0, d * chunks, 8):  # read-out: 8 lanes x 16 bytes
        banks = [(_vt_tile_row(i // chunks, bn) * words + (i % chunks) * 4 + x) % 32
                 for i in range(i0, i0 + 8) for x in range(4)]
        assert len(set(banks)) == len(banks), (i0, banks)
