"""HIP: kv8-imma (kv8's hip/prefill_kv8_imma.hip.j2) rendered for CDNA (int8 MFMA) and RDNA (iu8 WMMA) and compiled
offline with clang-19 (no ROCm, no AMD GPU). Every spec compiles, its module holds the three entries the kv8
launcher plans (statistics, attention, merge), the attention entry runs three int8 ops per product of each k step
(the split's h, l and m parts) and no other matrix op, and no entry touches scratch. tests/test_hip_kv8_host.py runs
the same source on the CPU."""
import re

import pytest

from qattn.engine.compile import functions_by_symbol, resource_remarks
from qattn.engine.family import HIP_ARCHS, SMEM_LIMIT
from qattn.engine.inspect import inspect_spec
from qattn.engine.registry import RECIPES
from qattn.engine.render import entry_name, render
from qattn.engine.spec import KernelSpec
from qattn.engine.tile import Tile
from qattn.formats.kv8.recipes import MERGE_ENTRY, STAT_ENTRY

from hip_offline import WAVE, built, needs_clang, op_count

INT8_OP = {"gfx90a": ("v_mfma_i32_16x16x16i8", 16), "gfx942": ("v_mfma_i32_16x16x32_i8", 32),
           "gfx1100": ("v_wmma_i32_16x16x16_iu8", 16), "gfx1201": ("v_wmma_i32_16x16x16_iu8", 16)}

FAMILY = RECIPES["kv8-imma"].family("hip")
SPECS = [KernelSpec("prefill", "kv8-imma", d, None, causal, "hip", arch)
         for arch in FAMILY.archs for d in FAMILY.head_dims for causal in (False, True)]


def test_family():
    assert FAMILY.template == "hip/prefill_kv8_imma.hip.j2" and FAMILY.launcher == "prefill_kv8"
    assert FAMILY.archs == HIP_ARCHS and FAMILY.head_dims == (64, 128)
    for spec in SPECS:
        # the CUDA kernel's 64 keys a block (the emulator's w-scale chunk), but on RDNA3 at d128
        assert spec.tile == (Tile(64, 32, 4, 1) if (spec.arch, spec.head_dim) == ("gfx1100", 128) else Tile(64, 64, 4, 1))
        assert FAMILY.smem_bytes(spec.tile, spec.head_dim) <= SMEM_LIMIT["hip"]


@pytest.mark.parametrize("tile, reason", [
    (Tile(64, 48, 4, 1), "block_n must be 32, 64 or 128"),
    (Tile(128, 64, 4, 1), "block_m must be 16 rows per warp"),
    (Tile(48, 64, 3, 1), "warps must be even"),
    (Tile(64, 64, 4, 2), "stages must be 1"),
    (Tile(128, 128, 8, 1), "LDS"),
])
def test_tile_rules(tile, reason):
    with pytest.raises(ValueError, match=reason):
        KernelSpec("prefill", "kv8-imma", 128, tile, False, "hip", "gfx942")
    KernelSpec("prefill", "kv8-imma", 128, Tile(32, 128, 2, 1), False, "hip", "gfx942")  # a valid other tile


@needs_clang
@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_compiles_to_int8_matrix_instructions(spec):
    source = render(spec)
    assert "mma.sync" not in source and "cp.async" not in source and "asm(" not in source  # no CUDA leaks in
    binary, funcs = built(spec)
    name = entry_name(spec)
    entries = (name + STAT_ENTRY, name, name + MERGE_ENTRY)
    for entry in entries:
        assert entry in funcs, (entry, sorted(funcs))
    op, k8 = INT8_OP[spec.arch]
    tiles = WAVE[spec.arch] // 32  # 16-row query tiles per wave
    d, bn = spec.head_dim, spec.tile.block_n
    # a trip through the key loop: S^T over d / k8 k steps of bn / 16 key tiles, O^T over bn / k8 k steps of d / 16
    # channel tiles, each product three times (h, l, m)
    assert op_count(op, funcs[name]) == 3 * tiles * ((d // k8) * (bn // 16) + (bn // k8) * (d // 16)), spec.name
    assert not re.search(r"v_(mfma|wmma)_f32", funcs[name])  # nothing but int8 products
    for entry in (name + STAT_ENTRY, name + MERGE_ENTRY):
        assert not re.search(r"v_(mfma|wmma)", funcs[entry]), entry
    remarks = resource_remarks(binary.log)
    for entry in entries:
        assert remarks[entry]["ScratchSize"] == 0 and remarks[entry]["VGPRs Spill"] == 0, (entry, remarks[entry])


@needs_clang
def test_inspect_reports_the_attention_entry_and_the_emulator_options():
    """The module's first kernel is the statistics pass; `qattn inspect` reports the attention kernel's resources, and
    the emulator's options for it (its key tile, the signed low byte)."""
    spec = KernelSpec("prefill", "kv8-imma", 128, None, True, "hip", "gfx1100")
    report = inspect_spec(spec)
    remarks = resource_remarks(built(spec)[0].log)[entry_name(spec)]
    assert report["resources"]["registers"] == remarks["VGPRs"]
    assert report["resources"]["registers"] != resource_remarks(built(spec)[0].log)[entry_name(spec) + STAT_ENTRY]["VGPRs"]
    assert report["emulator"] == {"block_n": 32, "signed_low": True}
    assert report["instructions"]["matrix"] == {"v_wmma_i32_16x16x16_iu8": 3 * ((128 // 16) * 2 + 2 * 8)}
