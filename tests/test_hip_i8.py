"""HIP: the int8-QK formats (i8-f16, i8-i8, i8-f8) rendered for CDNA (MFMA) and RDNA (WMMA) and
compiled offline with clang-19 (no ROCm, no AMD GPU). Every spec compiles; its disassembly has the
int8 matrix op for QK and the fp16 / int8 / e4m3 op its PV needs, and nothing of the other matrix
family; no entry point of the module (attention and quantization kernels) touches scratch. A NumPy
model of the 8-bit PV fragments checks that the per-target V^T key order pairs every P with its V.
Running the kernels needs ROCm."""
import functools
import re

import numpy as np
import pytest

from qattn.engine.family import HIP_ARCHS, SMEM_LIMIT
from qattn.engine.registry import RECIPES
from qattn.engine.render import entry_name, render
from qattn.engine.spec import KernelSpec
from qattn.formats.int8qk import host as int8
from qattn.engine.tile import Tile
from qattn.engine.compile import (compile_hip_offline, disassemble, find_tool, functions_by_symbol,
                                  resource_remarks)

pytestmark = pytest.mark.skipif(find_tool("clang++-19", "clang++-20", "clang++") is None,
                                reason="offline HIP compiles need clang-19 (.ci/run installs it)")

I8_FORMATS = ("i8-f16", "i8-i8", "i8-f8")
PV = {"i8-f16": "f16", "i8-i8": "i8", "i8-f8": "f8"}
# The QK op (int8 x int8 -> int32) and its k depth per target.
INT8_OP = {"gfx90a": ("v_mfma_i32_16x16x16i8", 16), "gfx942": ("v_mfma_i32_16x16x32_i8", 32),
           "gfx1100": ("v_wmma_i32_16x16x16_iu8", 16), "gfx1201": ("v_wmma_i32_16x16x16_iu8", 16)}
F16_OP = {"gfx90a": ("v_mfma_f32_16x16x16f16", 16), "gfx942": ("v_mfma_f32_16x16x16_f16", 16),
          "gfx1100": ("v_wmma_f32_16x16x16_f16", 16), "gfx1201": ("v_wmma_f32_16x16x16_f16", 16)}
FP8_OP = {"gfx942": ("v_mfma_f32_16x16x32_fp8_fp8", 32), "gfx1201": ("v_wmma_f32_16x16x16_fp8_fp8", 16)}
WAVE = {"gfx90a": 64, "gfx942": 64, "gfx1100": 32, "gfx1201": 32}

SPECS = [KernelSpec("prefill", f, d, None, causal, "hip", arch)
         for f in I8_FORMATS for arch in RECIPES[f].family("hip").archs
         for d in RECIPES[f].family("hip").head_dims for causal in (False, True)]


def _entries(spec: KernelSpec) -> list[str]:
    return [entry_name(spec) + suffix for suffix in int8.module_entries(spec.recipe, spec.backend)]


@functools.lru_cache(maxsize=None)
def _compiled(spec: KernelSpec):
    binary = compile_hip_offline(render(spec), spec.arch, spec.name)
    return binary, disassemble(binary.data, "hip")


def expected_ops(spec: KernelSpec) -> dict:
    """Matrix ops per attention entry point: {opcode: count} for one trip through the key loop."""
    fam = spec.family
    t, d, arch = spec.tile, spec.head_dim, spec.arch
    rows_per_wave_tiles = WAVE[arch] // 32  # 16-row query tiles per wave
    int8_op, k8 = INT8_OP[arch]
    ops = {int8_op: (d // k8) * (t.block_n // 16) * rows_per_wave_tiles}
    pv_op, kp = {"f16": F16_OP, "i8": INT8_OP, "f8": FP8_OP}[PV[spec.recipe]][arch]
    ops[pv_op] = ops.get(pv_op, 0) + (t.block_n // kp) * (d // 16) * rows_per_wave_tiles
    assert fam.smem_bytes(t, d) <= SMEM_LIMIT["hip"]
    return ops


# ---- families and specs -----------------------------------------------------------------------

def test_families():
    for f in I8_FORMATS:
        fam = RECIPES[f].family("hip")
        assert fam.template == "hip/prefill_i8.hip.j2" and fam.launcher == "prefill_i8"
        assert fam.head_dims == (64, 128) and fam.main_entry == "_f16"
        for d in fam.head_dims:
            tile = fam.default_tiles[d]
            # the emulator's defaults and the CUDA kernels': 128 query rows per Q scale, 64 keys per K scale
            assert (tile.block_m, tile.block_n) == (128, 64)
            assert fam.tile_problem(tile, d) is None
            assert fam.smem_bytes(tile, d) <= SMEM_LIMIT["hip"]
    assert RECIPES["i8-f16"].family("hip").archs == HIP_ARCHS
    assert RECIPES["i8-i8"].family("hip").archs == HIP_ARCHS
    # e4m3 PV needs an fp8 matrix op: CDNA3 and RDNA4 only (none on gfx90a, none on RDNA3)
    assert RECIPES["i8-f8"].family("hip").archs == ("gfx942", "gfx1201")
    with pytest.raises(ValueError, match="arch: i8-f8 on hip supports gfx942, gfx1201, got 'gfx1100'"):
        KernelSpec("prefill", "i8-f8", 128, None, False, "hip", "gfx1100")


@pytest.mark.parametrize("tile, reason", [
    (Tile(128, 48, 8, 1), "block_n must be 32 or 64"),
    (Tile(128, 64, 4, 1), "block_m must be 16 rows per warp"),
    (Tile(48, 64, 3, 1), "warps must be even"),
    (Tile(128, 64, 8, 2), "stages must be 1"),
])
def test_tile_rules(tile, reason):
    with pytest.raises(ValueError, match=reason):
        KernelSpec("prefill", "i8-i8", 128, tile, False, "hip", "gfx942")
    KernelSpec("prefill", "i8-i8", 128, Tile(64, 32, 4, 1), False, "hip", "gfx942")  # a valid other tile


# ---- compiled code ----------------------------------------------------------------------------
@pytest.mark.parametrize("spec", [s for s in SPECS if s.head_dim == 128 and not s.causal], ids=lambda s: s.name)
def test_balanced_quantization_divides_k_and_scales_q(spec):
    """The _balance entries (smoothing="mean+balance") quantize (K − K̄) / α with IEEE divisions and q̃·α: more
    divisions than the plain K entry, more products than the plain Q entry."""
    _, asm = _compiled(spec)
    funcs = functions_by_symbol(asm)
    for sfx in ("f16", "bf16"):
        plain_k, bal_k = (funcs[entry_name(spec) + f"_quant_k{b}_{sfx}"] for b in ("", "_balance"))
        plain_q, bal_q = (funcs[entry_name(spec) + f"_quant_q{b}_{sfx}"] for b in ("", "_balance"))
        assert bal_k.count("v_div_fixup_f32") > plain_k.count("v_div_fixup_f32"), sfx
        assert len(re.findall(r"v_(pk_)?mul_f32", bal_q)) > len(re.findall(r"v_(pk_)?mul_f32", plain_q)), sfx



@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_compiles_to_matrix_instructions(spec):
    source = render(spec)
    assert "mma.sync" not in source and "cp.async" not in source and "asm(" not in source  # no CUDA leaks in
    binary, asm = _compiled(spec)
    assert asm is not None, "llvm-objdump-19 should disassemble the code object"
    funcs = functions_by_symbol(asm)
    for name in _entries(spec):
        assert name in funcs, (name, sorted(funcs))
    other = "wmma" if spec.arch.startswith("gfx9") else "mfma"
    assert f"v_{other}" not in asm
    for sfx in ("_f16", "_bf16"):
        body = funcs[entry_name(spec) + sfx]
        for op, count in expected_ops(spec).items():
            found = len(re.findall(rf"\b{op}\b", body))
            assert found >= count, (spec.name, sfx, op, found, count)
        if spec.recipe == "i8-f8":
            assert "v_cvt_pk_fp8_f32" in body  # P -> e4m3 on the converter
            qk_op, k8 = INT8_OP[spec.arch]  # PV is not on the int8 op: its count is QK's alone
            assert len(re.findall(rf"\b{qk_op}\b", body)) == expected_ops(spec)[qk_op]
        else:
            assert "fp8" not in body
    for name in _entries(spec):  # quantization kernels: no matrix ops
        if "_quant_" in name or "_colstats_" in name or "_v_to_half_" in name:
            assert not re.search(r"v_(mfma|wmma)", funcs[name]), name
    if spec.recipe == "i8-f8":
        assert "v_cvt_pk_fp8_f32" in funcs[entry_name(spec) + "_quant_v_f16"]
    remarks = resource_remarks(binary.log)
    for name in _entries(spec):
        r = remarks[name]
        assert r["ScratchSize"] == 0 and r["VGPRs Spill"] == 0 and r["SGPRs Spill"] == 0, (name, r)
        assert 0 < r["VGPRs"] <= 512, (name, r)
    assert binary.resources["scratch"] == 0 and binary.resources["vgpr_spills"] == 0




def test_builds_offline_and_running_needs_rocm(tmp_path, monkeypatch):
    from qattn.engine.cache import KernelCache
    from qattn.engine.kernel import build_kernel

    monkeypatch.setenv("QATTN_CACHE_DIR", str(tmp_path))
    spec = KernelSpec("prefill", "i8-i8", 64, None, False, "hip", "gfx942")
    kernel = build_kernel(spec, KernelCache(tmp_path))
    assert kernel.resources["scratch"] == 0 and kernel.threads == 256
    with pytest.raises(RuntimeError, match="needs ROCm"):
        kernel.function("_quant_k_f16")


# ---- a NumPy model of the 8-bit PV fragments ----------------------------------------------------
# Per target (matrix8.h.j2): the k depth of one op (K8), the bytes a lane holds (KB), its first k
# (k0), the S^T accumulator rows a lane holds (frag_row), p_operand's packing and vt_slot. The model
# builds each lane's B operand from S^T the way p_operand does, each lane's A operand from V^T
# stored in vt_slot order, and checks that the op's sum over (lane group, byte) is Σ_keys P·V.

def _frag_row(arch, lane, i):
    return {"gfx90a": 4 * (lane // 16) + i, "gfx942": 4 * (lane // 16) + i,
            "gfx1100": 2 * i + lane // 16, "gfx1201": 8 * (lane // 16) + i}[arch]


def _vt_slot(arch, key):
    if arch == "gfx942":
        return 8 * ((key % 16) // 4) + 4 * (key // 16) + key % 4
    if arch == "gfx1100":
        return 8 * (key & 1) + (key >> 1)
    return key


K8KB = {"gfx90a": (16, 4), "gfx942": (32, 8), "gfx1100": (16, 16), "gfx1201": (16, 8)}


def _b_operand(arch, s_tiles, lane):
    """The KB keys' values lane holds in its B slots (p_operand, before packing to bytes)."""
    nd = {"gfx90a": 4, "gfx942": 4, "gfx1100": 8, "gfx1201": 8}[arch]
    own = [[s_tiles[t][_frag_row(arch, lane, i), lane % 16] for i in range(nd)] for t in range(len(s_tiles))]
    if arch == "gfx942":
        return own[0] + own[1]
    if arch == "gfx1100":
        other = lane ^ 16
        theirs = [s_tiles[0][_frag_row(arch, other, i), other % 16] for i in range(nd)]
        return theirs + own[0] if lane >= 16 else own[0] + theirs
    return own[0]


@pytest.mark.parametrize("arch", HIP_ARCHS)
def test_pv_fragment_model(arch):
    rng = np.random.default_rng(7)
    k8, kb = K8KB[arch]
    wave = WAVE[arch]
    p = rng.integers(0, 128, size=(k8, 16)).astype(np.int64)   # P^T: keys x query rows
    vt = rng.integers(-127, 128, size=(16, k8)).astype(np.int64)  # V^T: channels x keys
    s_tiles = [p[16 * t:16 * t + 16] for t in range(k8 // 16)]  # the S^T accumulator tiles
    stored = np.zeros_like(vt)
    for key in range(k8):
        stored[:, _vt_slot(arch, key)] = vt[:, key]  # V^T in the quantizer's slot order
    # the op: D[c][q] = Σ over the k slots of A[c][slot] · B[slot][q]; lane l holds slots k0 + e
    groups = 1 if kb == k8 else wave // 16
    out = np.zeros((16, 16), dtype=np.int64)
    for lane in range(16 * groups):
        k0 = 0 if kb == k8 else kb * (lane // 16)
        b = _b_operand(arch, s_tiles, lane)
        for c in range(16):
            a = stored[c, k0:k0 + kb]  # A: lane c + 16 * group reads the same slots of channel c
            out[c, lane % 16] += int(np.dot(a, b))
    if arch == "gfx1100":  # both half-waves must hold the same B (the op reads it replicated)
        for lane in range(16):
            assert _b_operand(arch, s_tiles, lane) == _b_operand(arch, s_tiles, lane + 16)
    np.testing.assert_array_equal(out, vt @ p)
