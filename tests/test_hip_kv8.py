"""HIP: the tensor-core kv8 formats (kv8's hip/prefill_kv8_mma.hip.j2: kv8-imma on int8 MFMA / iu8 WMMA, kv8-split on
fp16 MFMA / WMMA) rendered for CDNA and RDNA and compiled offline with clang-19 (no ROCm, no AMD GPU). Every spec
compiles, its module holds the three entries the kv8 launcher plans (statistics, attention, merge), the attention
entry runs the format's products of each k step (kv8-imma: three int8 ops, the split's h, l and m parts; kv8-split:
two fp16 ops, hi and lo) and no other matrix op, and no entry touches scratch. tests/test_hip_kv8_host.py runs the
same sources on the CPU."""
import re

import pytest

from qattn.engine.compile import resource_remarks
from qattn.engine.family import HIP_ARCHS, SMEM_LIMIT
from qattn.engine.inspect import inspect_spec
from qattn.engine.registry import RECIPES
from qattn.engine.render import entry_name, render
from qattn.engine.spec import KernelSpec
from qattn.engine.tile import Tile
from qattn.formats.kv8.recipes import MERGE_ENTRY, MMA_FORMATS, STAT_ENTRY

from hip_offline import WAVE, built, needs_clang, op_count

INT8_OP = {"gfx90a": ("v_mfma_i32_16x16x16i8", 16), "gfx942": ("v_mfma_i32_16x16x32_i8", 32),
           "gfx1100": ("v_wmma_i32_16x16x16_iu8", 16), "gfx1201": ("v_wmma_i32_16x16x16_iu8", 16)}
F16_OP = {"gfx90a": "v_mfma_f32_16x16x16f16", "gfx942": "v_mfma_f32_16x16x16_f16",
          "gfx1100": "v_wmma_f32_16x16x16_f16", "gfx1201": "v_wmma_f32_16x16x16_f16"}

SPECS = [KernelSpec("prefill", fmt, d, None, causal, "hip", arch) for fmt in MMA_FORMATS
         for arch in HIP_ARCHS for d in (64, 128) for causal in (False, True)]


def products(spec: KernelSpec) -> tuple[str, int]:
    """The attention entry's matrix op and its count in a trip through the key loop: S^T over the channels' k steps
    of BN / 16 key tiles, O^T over the keys' k steps of D / 16 channel tiles, per 16-row query tile of a wave, each
    product three times (kv8-imma: h, l, m) or twice (kv8-split: hi, lo)."""
    d, bn, tiles = spec.head_dim, spec.tile.block_n, WAVE[spec.arch] // 32
    if spec.recipe == "kv8-imma":
        op, k8 = INT8_OP[spec.arch]
        return op, 3 * tiles * ((d // k8) * (bn // 16) + (bn // k8) * (d // 16))
    return F16_OP[spec.arch], 2 * tiles * ((d // 16) * (bn // 16) + (bn // 16) * (d // 16))


@pytest.mark.parametrize("fmt", MMA_FORMATS)
def test_family(fmt):
    family = RECIPES[fmt].family("hip")
    assert family.template == "hip/prefill_kv8_mma.hip.j2" and family.launcher == "prefill_kv8"
    assert family.archs == HIP_ARCHS and family.head_dims == (64, 128)
    for spec in (s for s in SPECS if s.recipe == fmt):
        # the CUDA kernels' 64 keys a block (kv8-imma's w-scale chunk), but kv8-split's fp16 tiles at d128
        wide = fmt == "kv8-imma" or spec.head_dim == 64
        assert spec.tile == Tile(64, 64 if wide else 32, 4, 1)
        assert family.smem_bytes(spec.tile, spec.head_dim) <= SMEM_LIMIT["hip"]


@pytest.mark.parametrize("tile, reason", [
    (Tile(64, 48, 4, 1), "block_n must be 32, 64 or 128"),
    (Tile(128, 64, 4, 1), "block_m must be 16 rows per warp"),
    (Tile(48, 64, 3, 1), "warps must be even"),
    (Tile(64, 64, 4, 2), "stages must be 1"),
    (Tile(128, 128, 8, 1), "LDS"),
])
@pytest.mark.parametrize("fmt", MMA_FORMATS)
def test_tile_rules(fmt, tile, reason):
    with pytest.raises(ValueError, match=reason):
        KernelSpec("prefill", fmt, 128, tile, False, "hip", "gfx942")
    KernelSpec("prefill", fmt, 128, Tile(32, 64, 2, 1), False, "hip", "gfx942")  # a valid other tile


@needs_clang
@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_compiles_to_the_formats_matrix_instructions(spec):
    source = render(spec)
    assert "mma.sync" not in source and "cp.async" not in source and "asm(" not in source  # no CUDA leaks in
    binary, funcs = built(spec)
    name = entry_name(spec)
    entries = (name + STAT_ENTRY, name, name + MERGE_ENTRY)
    for entry in entries:
        assert entry in funcs, (entry, sorted(funcs))
    op, count = products(spec)
    assert op_count(op, funcs[name]) == count, spec.name
    assert len(re.findall(r"\bv_(mfma|wmma)_\w+", funcs[name])) == count  # nothing but the format's products
    for entry in (name + STAT_ENTRY, name + MERGE_ENTRY):
        assert not re.search(r"v_(mfma|wmma)", funcs[entry]), entry
    remarks = resource_remarks(binary.log)
    for entry in entries:
        assert remarks[entry]["ScratchSize"] == 0 and remarks[entry]["VGPRs Spill"] == 0, (entry, remarks[entry])


@needs_clang
@pytest.mark.parametrize("fmt", MMA_FORMATS)
def test_inspect_reports_the_attention_entry_and_the_emulator_options(fmt):
    """The module's first kernel is the statistics pass; `qattn inspect` reports the attention kernel's resources, and
    the emulator's options for it (its key tile; kv8-imma's signed low byte)."""
    spec = KernelSpec("prefill", fmt, 128, None, True, "hip", "gfx1100")
    report = inspect_spec(spec)
    remarks = resource_remarks(built(spec)[0].log)
    assert report["resources"]["registers"] == remarks[entry_name(spec)]["VGPRs"]
    assert report["resources"]["registers"] != remarks[entry_name(spec) + STAT_ENTRY]["VGPRs"]
    assert report["emulator"] == {"block_n": spec.tile.block_n, **({"signed_low": True} if fmt == "kv8-imma" else {})}
    op, count = products(spec)
    assert report["instructions"]["matrix"] == {op: count}


def _parameters(source: str, entry: str) -> list[str]:
    """An entry point's parameter list as written, whitespace normalized."""
    m = re.search(rf"\b{re.escape(entry)}\((.*?)\)\s*\{{", source, re.S)
    assert m, entry
    return [" ".join(p.split()) for p in m.group(1).split(",")]


@pytest.mark.parametrize("fmt", MMA_FORMATS)
def test_entries_take_the_cuda_modules_arguments(fmt):
    """launch.Kv8Plan packs one argument list for both backends: each HIP entry's parameters are the CUDA entry's."""
    cuda = KernelSpec("prefill", fmt, 128, None, True, "cuda", "sm_80")
    hip = KernelSpec("prefill", fmt, 128, None, True, "hip", "gfx942")
    for suffix in (STAT_ENTRY, "", MERGE_ENTRY):
        want = _parameters(render(cuda), entry_name(cuda) + suffix)
        assert _parameters(render(hip), entry_name(hip) + suffix) == want, suffix
        assert len(want) >= 8
