"""What a compiled kernel costs the hardware: resources, resident blocks per SM and the matrix and
conversion instructions in its SASS, PTX or AMDGPU listing (`qattn inspect`, `qattn compile`)."""
from __future__ import annotations

import math
import re

from .render import main_entry_name, render
from .spec import KernelSpec
from . import compile as compiler
from . import registry

# CUDA C++ Programming Guide, "Technical Specifications per Compute Capability": resident blocks
# and threads per SM, shared memory per SM and per block (KiB). Every arch: 64K registers per SM
# in 4 partitions, allocated per warp in units of 256; 1 KiB of shared memory reserved per block.
_SM_LIMITS = {
    "sm_80": (32, 2048, 164, 163), "sm_86": (16, 1536, 100, 99), "sm_89": (24, 1536, 100, 99),
    "sm_90": (32, 2048, 228, 227), "sm_90a": (32, 2048, 228, 227), "sm_100a": (32, 2048, 228, 227),
    "sm_120": (32, 1536, 128, 99),
}


def blocks_per_sm(arch: str, threads: int, registers: int, smem_bytes: int) -> int | None:
    """Resident blocks per SM (0: the block cannot launch), or None for an arch not in the table."""
    if arch not in _SM_LIMITS:
        return None
    max_blocks, max_threads, smem_sm_kib, smem_block_kib = _SM_LIMITS[arch]
    if smem_bytes > smem_block_kib * 1024 or registers > 255:
        return 0
    warps = math.ceil(threads / 32)
    regs_per_warp = math.ceil(max(registers, 1) * 32 / 256) * 256
    by_regs = 4 * (16384 // regs_per_warp) // warps
    by_smem = smem_sm_kib * 1024 // (smem_bytes + 1024)
    return min(max_blocks, max_threads // threads, by_regs, by_smem)


_OPCODE = {
    "sass": re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]\s+)?([A-Z][A-Z0-9_.]*)", re.M),
    "ptx": re.compile(r"^\s*(?:@!?%p\d+\s+)?([a-z][a-z0-9_]*(?:\.[a-z0-9_]+)*)", re.M),
    "amdgpu": re.compile(r"^\s+([vs]_[a-z0-9_]+)", re.M),
}
_MATRIX = {"sass": r"(HMMA|IMMA|HGMMA|IGMMA|QGMMA|QMMA|OMMA)\b", "ptx": r"(mma\.|wgmma\.mma_async|tcgen05\.mma)",
           "amdgpu": r"v_(mfma|smfmac|wmma)"}
_CONVERT = {"sass": r"(F2F|F2FP|I2F|F2I|I2FP|F2IP)\b", "ptx": r"cvt\.", "amdgpu": r"v_cvt"}
# The instruction each operand type's 16x16 matrix op of the HIP templates (hip/matrix16.h.j2, matrix8.h.j2)
# compiles to on each target, as llvm-objdump names it: what the offline checks look for.
HIP_MATRIX_OPS = {
    ("f16", "gfx90a"): "v_mfma_f32_16x16x16f16", ("f16", "gfx942"): "v_mfma_f32_16x16x16_f16",
    ("f16", "gfx1100"): "v_wmma_f32_16x16x16_f16", ("f16", "gfx1201"): "v_wmma_f32_16x16x16_f16",
    ("bf16", "gfx90a"): "v_mfma_f32_16x16x16bf16_1k", ("bf16", "gfx942"): "v_mfma_f32_16x16x16_bf16",
    ("bf16", "gfx1100"): "v_wmma_f32_16x16x16_bf16", ("bf16", "gfx1201"): "v_wmma_f32_16x16x16_bf16",
    ("fp8", "gfx942"): "v_mfma_f32_16x16x32_fp8_fp8", ("fp8", "gfx1201"): "v_wmma_f32_16x16x16_fp8_fp8",
    ("int8", "gfx90a"): "v_mfma_i32_16x16x16i8", ("int8", "gfx942"): "v_mfma_i32_16x16x32_i8",
    ("int8", "gfx1100"): "v_wmma_i32_16x16x16_iu8", ("int8", "gfx1201"): "v_wmma_i32_16x16x16_iu8",
}


def count_instructions(text: str, listing: str) -> dict:
    """Matrix and conversion instructions in a SASS, PTX or AMDGPU listing, by full opcode."""
    counts = {"matrix": {}, "convert": {}}
    for op in _OPCODE[listing].findall(text):
        for group, pattern in (("matrix", _MATRIX[listing]), ("convert", _CONVERT[listing])):
            if re.match(pattern, op):
                counts[group][op] = counts[group].get(op, 0) + 1
    return counts


def warpgroup_mmas(ptx: str, sass: str) -> dict:
    """Hopper warpgroup MMAs in the PTX against those left in the SASS: {"ptx", "sass",
    "placeholders"}, where a placeholder is an MMA ptxas emits onto RZ in place of one it found
    dead (an accumulator it sees undefined: the product is then silently missing); {} without any."""
    in_ptx = len(re.findall(r"\bwgmma\.mma_async\.", ptx or ""))
    if not in_ptx:
        return {}
    ops = re.findall(r"\b[HIQ]GMMA\.\S+\s+(\w+),", sass or "")
    return {"ptx": in_ptx, "sass": sum(d != "RZ" for d in ops), "placeholders": sum(d == "RZ" for d in ops)}


def register_hand_over(ptx: str) -> dict:
    """Per-thread registers after setmaxnreg in a warp-specialized kernel: {"registers_released":
    what the warps that shrink keep, "registers_claimed": what the ones that grow get}; {} without."""
    found = {}
    for kind, n in re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx or ""):
        found["registers_claimed" if kind == "inc" else "registers_released"] = int(n)
    return found


def inspect_spec(spec: KernelSpec) -> dict:
    """Compile one spec and report its resources, occupancy and instruction counts (HIP needs
    clang-19: RuntimeError without it)."""
    source = render(spec)
    if spec.backend == "cuda":
        binary = compiler.compile_cuda(source, spec.arch, spec.name, entry=main_entry_name(spec))
    else:
        binary = compiler.compile_hip_offline(source, spec.arch, spec.name, entry=main_entry_name(spec))
    family = spec.family
    resources = dict(binary.resources, threads=family.threads(spec.tile),
                     dynamic_smem=family.smem_bytes(spec.tile, spec.head_dim))
    if spec.backend == "cuda":
        resources["blocks_per_sm"] = blocks_per_sm(spec.arch, resources["threads"], resources["registers"],
                                                   resources["static_smem"] + resources["dynamic_smem"])
        resources.update(register_hand_over(binary.ptx))
    text = compiler.disassemble(binary.data, spec.backend)
    listing = ("sass" if spec.backend == "cuda" else "amdgpu") if text is not None else None
    if text is None and spec.backend == "cuda":
        text, listing = binary.ptx, "ptx"
    counts = count_instructions(text, listing) if listing else {"matrix": {}, "convert": {}}
    report = {"name": spec.name, "spec": spec.as_dict(), "resources": resources,
              "instructions": dict(counts, listing=listing)}
    if listing == "sass" and (wgmma := warpgroup_mmas(binary.ptx, text)):
        report["instructions"]["warpgroup_mmas"] = wgmma
    extra = registry.family_of(spec.recipe, spec.kind).inspect
    if extra is not None:  # e.g. the int8-QK scale blocks: what the emulator needs to match the kernel
        report.update(extra(spec))
    return report
