"""HIP: the f16 and bf16 prefill specs rendered for CDNA (MFMA) and RDNA (WMMA) and compiled offline with
clang-19 (no ROCm, no AMD GPU). Running the kernels needs ROCm; these tests check that the code
generator produces device code that compiles, uses the matrix cores and stays out of scratch."""
import re

import pytest

from qattn.engine.family import Recipe
from qattn.engine.registry import RECIPES
from qattn.engine.render import entry_name, render
from qattn.engine.spec import KernelSpec
from qattn.engine.tile import Tile
from qattn.engine.inspect import HIP_MATRIX_OPS
from qattn.engine.compile import CompileError, compile_hip_offline, disassemble, find_tool

pytestmark = pytest.mark.skipif(find_tool("clang++-19", "clang++-20", "clang++") is None,
                                reason="offline HIP compiles need clang-19 (.ci/run installs it)")

# The matrix instruction each target must use for the products, by operand type.
MATRIX_OP = {t: {arch: op for (kind, arch), op in HIP_MATRIX_OPS.items() if kind == t} for t in ("f16", "bf16")}

SPECS = [KernelSpec("prefill", fmt, d, None, causal, "hip", arch)
         for fmt in MATRIX_OP for arch in MATRIX_OP[fmt] for d in RECIPES[fmt].family("hip").head_dims
         for causal in (False, True)]


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_hip_compiles_to_matrix_instructions(spec):
    source = render(spec)
    assert "mma.sync" not in source and "cp.async" not in source  # no CUDA code leaks in
    binary = compile_hip_offline(source, spec.arch, spec.name)
    asm = disassemble(binary.data, "hip")
    assert asm is not None, "llvm-objdump-19 should disassemble the code object"
    assert entry_name(spec) in asm
    ops = re.findall(MATRIX_OP[spec.recipe][spec.arch] + r"\b", asm)
    # All of the format's type: O += PV unrolled over its 16-channel tiles (one op each at least), and S = QK^T,
    # whose k loop stays rolled (prefill_matrix.hip.j2), at least one op in that loop's body.
    assert len(ops) >= spec.head_dim // 16 + 1, (spec.name, len(ops))
    assert not re.search(MATRIX_OP["bf16" if spec.recipe == "f16" else "f16"][spec.arch] + r"\b", asm)
    other = "wmma" if spec.arch.startswith("gfx9") else "mfma"
    assert f"v_{other}" not in asm
    res = binary.resources
    assert 0 < res["registers"] <= 512, res
    assert res["scratch"] == 0 and res["vgpr_spills"] == 0, res


@pytest.mark.parametrize("fmt, d, causal, arch", [("f16", 64, False, "gfx942"), ("i8-f8", 128, True, "gfx1201"),
                                                  ("f32", 128, True, "gfx1100")])
def test_hip_compile_error_names_spec_and_lines(fmt, d, causal, arch):
    spec = KernelSpec("prefill", fmt, d, None, causal, "hip", arch)
    broken = render(spec).replace("block_sync();", "block_sync(;", 1)
    with pytest.raises(CompileError) as info:
        compile_hip_offline(broken, spec.arch, spec.name)
    text = str(info.value)
    assert spec.name in text and f"--offload-arch={arch}" in text
    assert re.search(r"^\s*\d+[ |:].*block_sync\(;", text, re.M), text[-2000:]


def test_hip_tile_rules_are_checked():
    with pytest.raises(ValueError, match="block_m"):
        KernelSpec("prefill", "f16", 64, Tile(128, 32, 4, 1), False, "hip", "gfx942")
    with pytest.raises(ValueError, match="arch"):
        KernelSpec("prefill", "f16", 64, None, False, "hip", "sm_90a")
    cuda_only = Recipe("x", "a CUDA-only format", ("float16",), RECIPES["f16"].tolerance,
                       {"cuda": RECIPES["f16"].family("cuda")})
    with pytest.raises(ValueError, match="format 'x': no hip kernel; backends with a kernel: cuda"):
        cuda_only.arch_options("hip", "gfx942")
    with pytest.raises(ValueError, match="LDS"):  # the CUDA kernel's d256 tile is over 64 KB
        KernelSpec("prefill", "f32", 256, Tile(32, 32, 4, 1), False, "hip", "gfx942")


F32_SPECS = [KernelSpec("prefill", fmt, d, None, causal, "hip", arch)
             for fmt in ("f32", "kv8-f32") for arch in RECIPES[fmt].family("hip").archs
             for d in RECIPES[fmt].family("hip").head_dims for causal in (False, True)]


@pytest.mark.parametrize("spec", F32_SPECS, ids=[s.name for s in F32_SPECS])
def test_hip_f32_is_the_cuda_kernel_on_fp32_alus(spec):
    """f32, and kv8-f32 (its K and V dequantized on the way into LDS): the CUDA kernel's body on fp32 FMAs."""
    source = render(spec)
    cuda_spec = KernelSpec("prefill", spec.recipe, spec.head_dim, spec.tile, spec.causal, "cuda", "sm_80")
    cuda = render(cuda_spec).replace(entry_name(cuda_spec), entry_name(spec))
    # one body (templates/common/prefill_simt.j2) under each backend's header
    assert source[source.index("namespace {"):] == cuda[cuda.index("namespace {"):]
    binary = compile_hip_offline(source, spec.arch, spec.name)
    asm = disassemble(binary.data, "hip")
    assert entry_name(spec) in asm
    assert not re.search(r"v_(mfma|wmma|dot)", asm)  # fp32 FMAs only, no matrix or dot units
    # Q Kᵀ and P V: D / TPR FMA chains over each of a thread's BN / TPR keys and D / TPR channels (unrolled by 4)
    assert len(re.findall(r"v_fmac?_f32", asm)) >= spec.head_dim // 4, spec.name
    assert "v_div_fixup_f32" in asm  # acc / total: the IEEE division
    assert "ds_bpermute_b32" in asm  # the row's max and sum over the threads that share it
    # kv8-f32: each loaded word's four int8 codes sign-extended and converted (K and V: 8), none in f32
    assert len(re.findall(r"v_cvt_f32_i32", asm)) == (8 if spec.recipe == "kv8-f32" else 0), spec.name
    res = binary.resources
    assert res["scratch"] == 0 and res["vgpr_spills"] == 0, res
