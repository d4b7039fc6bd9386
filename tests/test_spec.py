"""KernelSpec and Tile: validation (each bad field named, with the supported set or the reason),
readable unique names, stable distinct keys, and Tile.parse. CPU only."""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import qattn
from qattn.engine import spec as spec_module
from qattn.engine.registry import RECIPES
from qattn.engine.spec import KernelSpec
from qattn.engine.tile import Tile

REPO = Path(__file__).resolve().parents[1]
# a default's options show where a head dim's default turns one on (Family.option_defaults)
NAME_RE = re.compile(r"^prefill_[a-z0-9-]+_d\d+_m\d+n\d+w\d+s\d+(_causal)?(_pingpong)?_(sm\d+a?|gfx\d+[a-z]?)$")


def cuda_recipes():
    return [name for name, rec in RECIPES.items() if "cuda" in rec.families]


def supported_cuda_specs(arch="sm_90a"):
    for name in cuda_recipes():
        fam = RECIPES[name].families["cuda"]
        for d in fam.head_dims:
            for causal in (False, True):
                yield KernelSpec(recipe=name, head_dim=d, causal=causal, arch=arch)


# ---- construction and defaults ------------------------------------------------------------

def test_required_head_dims_and_recipes_are_supported():
    for name in ("f16", "bf16", "f32"):
        fam = RECIPES[name].family("cuda")
        assert {64, 128} <= set(fam.head_dims), name
    for arch in ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_120"):
        assert arch in RECIPES["f16"].family("cuda").archs


def test_default_tile_is_filled_in_and_valid():
    for s in supported_cuda_specs():
        fam = s.family
        assert s.tile == fam.default_tile(s.head_dim, s.causal, s.arch)
        assert fam.tile_problem(s.tile, s.head_dim) is None


def test_spec_is_frozen_and_hashable():
    s = KernelSpec(recipe="f16", head_dim=128, arch="sm_90a")
    with pytest.raises(Exception):
        s.head_dim = 64  # type: ignore[misc]
    assert {s: 1}[KernelSpec(recipe="f16", head_dim=128, arch="sm_90a")] == 1
    assert s.with_(causal=True).causal is True and s.causal is False


# ---- validation -----------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, field, mentions", [
    (dict(kind="decode-ish"), "kind", ["prefill"]),
    (dict(backend="metal"), "backend", ["cuda", "hip"]),
    (dict(recipe="f7"), "format", ["f16", "bf16", "f32"]),
    (dict(recipe="f16", head_dim=80), "head_dim", ["64", "128", "80"]),
    (dict(recipe="f32", head_dim=100), "head_dim", ["64", "128", "100"]),
    (dict(recipe="f16", head_dim="128"), "head_dim", ["128"]),
    (dict(recipe="f16", arch="sm_70"), "arch", ["sm_80", "sm_90a", "sm_70"]),
    (dict(recipe="f16", arch="gfx942"), "arch", ["sm_90a", "gfx942"]),
    (dict(recipe="f16", backend="hip", head_dim=64, arch="sm_90a"), "arch", ["gfx942", "sm_90a"]),
    (dict(recipe="f16", causal=1), "causal", ["bool"]),
    (dict(recipe="f16", tile=(128, 64, 8, 2)), "tile", ["Tile"]),
])
def test_invalid_field_is_named(kwargs, field, mentions):
    full = dict(kind="prefill", recipe="f16", head_dim=128, arch="sm_90a")
    full.update(kwargs)
    with pytest.raises(ValueError) as info:
        KernelSpec(**full)
    msg = str(info.value)
    assert msg.startswith(field), msg
    for word in mentions:
        assert word in msg, (word, msg)


@pytest.mark.parametrize("name, backend", [("kv8-split", "hip"), ("f16", "cuda")])
def test_format_without_kernel_on_backend(monkeypatch, name, backend):
    """Every format has a kernel on both backends; one without (as a new format starts) is a clear error."""
    from qattn.engine.registry import RECIPES

    rec = RECIPES[name]
    other = "cuda" if backend == "hip" else "hip"
    monkeypatch.setitem(RECIPES, name, dataclasses.replace(rec, families={other: rec.family(other)}, arch_families={}))
    arch = "sm_90a" if backend == "cuda" else "gfx942"
    with pytest.raises(ValueError, match=rf"format '{re.escape(name)}': no {backend} kernel; backends with a kernel: {other}"):
        KernelSpec(recipe=name, head_dim=128, backend=backend, arch=arch)


@pytest.mark.parametrize("recipe_name, d, tile, reason", [
    ("f16", 128, Tile(128, 64, 2, 2), r"16 or 32 rows per warp"),
    ("f16", 128, Tile(128, 48, 8, 2), None),  # 48 is a multiple of 16: valid
    ("f16", 128, Tile(128, 40, 8, 2), r"block_n must be a multiple of 16"),
    ("bf16", 64, Tile(128, 256, 8, 2), r"block_n must be a multiple of 16 in \[16, 128\]"),
    ("f16", 64, Tile(128, 64, 8, 5), r"stages must be 2\.\.4"),
    ("f16", 256, Tile(128, 128, 4, 2), r"accumulator registers"),
    ("f16", 128, Tile(64, 128, 4, 4), r"shared memory"),
    ("f32", 64, Tile(32, 32, 4, 2), r"stages must be 1"),
    ("f32", 64, Tile(32, 32, 3, 1), r"power of two"),
    ("f32", 64, Tile(64, 32, 1, 1), r"multiple of block_m"),
])
def test_bad_tile_gives_reason(recipe_name, d, tile, reason):
    if reason is None:
        s = KernelSpec(recipe=recipe_name, head_dim=d, tile=tile, arch="sm_90a")
        assert s.tile == tile
        return
    with pytest.raises(ValueError) as info:
        KernelSpec(recipe=recipe_name, head_dim=d, tile=tile, arch="sm_90a")
    msg = str(info.value)
    assert msg.startswith(f"tile {tile.name} for {recipe_name} d{d} on cuda:"), msg
    assert re.search(reason, msg), msg


def test_arch_none_without_gpu_names_arch(monkeypatch):
    monkeypatch.setattr(spec_module, "device_arch", lambda: None)
    with pytest.raises(ValueError) as info:
        KernelSpec(recipe="f16", head_dim=128)
    msg = str(info.value)
    assert msg.startswith("arch:") and "sm_90a" in msg and "device" in msg


def test_arch_none_takes_the_device_arch(monkeypatch):
    monkeypatch.setattr(spec_module, "device_arch", lambda: "sm_86")
    assert KernelSpec(recipe="bf16", head_dim=64).arch == "sm_86"


def test_arch_none_for_hip_is_an_error_even_with_a_cuda_gpu(monkeypatch):
    monkeypatch.setattr(spec_module, "device_arch", lambda: "sm_90a")
    with pytest.raises(ValueError, match=r"^arch: no hip device"):
        KernelSpec(recipe="f16", head_dim=64, backend="hip")


def test_device_arch_is_none_or_a_known_arch():
    arch = spec_module.device_arch()
    assert arch is None or arch in RECIPES["f16"].family("cuda").archs
    assert arch != "sm_90"  # Hopper is always named sm_90a


# ---- names and keys -------------------------------------------------------------------------

def test_name_format():
    s = KernelSpec(recipe="f16", head_dim=128, tile=Tile(128, 64, 8, 2), causal=True, arch="sm_90a")
    assert s.name == "prefill_f16_d128_m128n64w8s2_causal_sm90a"
    s2 = KernelSpec(recipe="bf16", head_dim=64, tile=Tile(64, 32, 4, 3), arch="sm_80")
    assert s2.name == "prefill_bf16_d64_m64n32w4s3_sm80"
    assert KernelSpec(recipe="f32", head_dim=96, arch="sm_120").name.startswith("prefill_f32_d96_")


def _spec_matrix():
    archs = ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_120")
    specs = []
    for s in supported_cuda_specs():
        for arch in archs:
            if arch in s.family.archs:  # i8-f8 (the e4m3 MMA) starts at sm_89
                # the arch's own default tile (small-shared-memory archs take smaller ones)
                specs.append(KernelSpec(recipe=s.recipe, head_dim=s.head_dim, causal=s.causal, arch=arch))
    extra_tiles = [Tile(64, 64, 4, 2), Tile(128, 32, 8, 3), Tile(64, 64, 2, 2), Tile(128, 64, 8, 4)]
    for name, d, tile in itertools.product(("f16", "bf16"), (64, 128), extra_tiles):
        specs.append(KernelSpec(recipe=name, head_dim=d, tile=tile, arch="sm_90a"))
    specs.append(KernelSpec(recipe="f32", head_dim=64, tile=Tile(64, 32, 4, 1), arch="sm_90a"))
    return list(dict.fromkeys(specs))  # distinct specs, order kept


def test_names_and_keys_unique_across_specs():
    specs = _spec_matrix()
    assert len(specs) > 150
    names = [s.name for s in specs]
    keys = [s.key for s in specs]
    assert len(set(names)) == len(specs)
    assert len(set(keys)) == len(specs)
    for n in names:
        assert NAME_RE.match(n), n
        assert n == n.strip() and " " not in n and "/" not in n


def test_key_is_stable_hex_and_content_based():
    s = KernelSpec(recipe="bf16", head_dim=64, causal=True, arch="sm_89")
    again = KernelSpec(recipe="bf16", head_dim=64, causal=True, arch="sm_89", tile=s.tile)
    assert s.key == again.key
    assert re.fullmatch(r"[0-9a-f]{16}", s.key)
    expected = hashlib.sha256(json.dumps(s.as_dict(), sort_keys=True).encode()).hexdigest()[:16]
    assert s.key == expected
    assert s.as_dict()["tile"] == {"block_m": s.tile.block_m, "block_n": s.tile.block_n,
                                   "warps": s.tile.warps, "stages": s.tile.stages}
    # every field changes the key
    for change in (dict(causal=False), dict(arch="sm_90a"), dict(head_dim=96),
                   dict(recipe="f16"), dict(tile=Tile(64, 64, 4, 3))):
        assert s.with_(**change).key != s.key, change


def test_key_is_stable_across_processes():
    specs = [KernelSpec(recipe="f16", head_dim=128, causal=True, arch="sm_90a"),
             KernelSpec(recipe="f32", head_dim=64, arch="sm_80")]
    code = ("import qattn\n"
            "print(qattn.KernelSpec(recipe='f16', head_dim=128, causal=True, arch='sm_90a').key)\n"
            "print(qattn.KernelSpec(recipe='f32', head_dim=64, arch='sm_80').key)\n")
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [s.key for s in specs]


def test_public_exports():
    assert qattn.KernelSpec is KernelSpec and qattn.Tile is Tile


# ---- Tile -------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, bm, bn", [("128x64", 128, 64), (" 64 X 32 ", 64, 32), ("16x16", 16, 16)])
def test_tile_parse(text, bm, bn):
    t = Tile.parse(text, warps=4, stages=3)
    assert t == Tile(bm, bn, 4, 3)
    assert t.name == f"m{bm}n{bn}w4s3"


@pytest.mark.parametrize("text", ["128", "128x", "x64", "axb", "128x64x2", "128*64", "-128x64", ""])
def test_tile_parse_rejects(text):
    with pytest.raises(ValueError, match=r"^tile: expected BLOCK_MxBLOCK_N"):
        Tile.parse(text, warps=4, stages=2)


@pytest.mark.parametrize("args, field", [((0, 64, 4, 2), "block_m"), ((128, -1, 4, 2), "block_n"),
                                         ((128, 64, True, 2), "warps"), ((128, 64, 4, 2.0), "stages")])
def test_tile_fields_must_be_positive_ints(args, field):
    with pytest.raises(ValueError, match=rf"^tile\.{field}: expected a positive integer"):
        Tile(*args)


def test_tile_parse_zero_is_rejected_by_tile():
    with pytest.raises(ValueError, match=r"tile\.block_n"):
        Tile.parse("128x0", warps=4, stages=2)


def test_every_default_tile_fits_its_arch_shared_memory():
    from qattn.engine.family import CUDA_ARCHS, HIP_ARCHS, SMEM_PER_BLOCK

    checked = 0
    for name, rec in RECIPES.items():
        for backend in rec.families:
            for arch in CUDA_ARCHS if backend == "cuda" else HIP_ARCHS:
                try:
                    fam = rec.family(backend, arch)
                except ValueError:
                    continue
                if arch not in fam.archs:
                    continue
                for d, causal in itertools.product(fam.head_dims, (False, True)):
                    spec = KernelSpec(recipe=name, head_dim=d, causal=causal, arch=arch, backend=backend)
                    assert fam.smem_bytes(spec.tile, d) <= SMEM_PER_BLOCK[arch], spec.name
                    checked += 1
    assert checked > 200


def test_small_shared_memory_archs_fall_back_to_smaller_tiles():
    # 99 KB per block on sm_86/sm_89/sm_120: the d128 f16 default (108 KB) cannot launch there.
    big = KernelSpec(recipe="f16", head_dim=128, arch="sm_90a").tile
    for arch in ("sm_86", "sm_89", "sm_120"):
        small = KernelSpec(recipe="f16", head_dim=128, arch=arch).tile
        assert small != big and small.block_n < big.block_n
    assert KernelSpec(recipe="f16", head_dim=128, arch="sm_80").tile == big  # 163 KB is enough


def test_a_tile_over_the_arch_shared_memory_is_refused_by_name():
    tile = Tile(128, 64, 4, 2)
    KernelSpec(recipe="f16", head_dim=128, arch="sm_90a", tile=tile)
    with pytest.raises(ValueError, match=r"m128n64w4s2 .*needs \d+ B of shared memory per block; sm_89 allows 101376"):
        KernelSpec(recipe="f16", head_dim=128, arch="sm_89", tile=tile)


def test_the_default_format_of_a_call_follows_the_query_dtype():
    from qattn.api import default_format

    assert [default_format(n) for n in ("float16", "bfloat16", "float32")] == ["f16", "bf16", "f32"]
    assert default_format("int8") == "f16"  # its kernel then names the dtypes it takes
    for name in ("f16", "bf16", "f32"):  # each default is a format whose queries have that dtype
        dtype = {"f16": "float16", "bf16": "bfloat16", "f32": "float32"}[name]
        assert qattn.recipe(name).input_dtypes == (dtype,)


def test_attention_takes_the_listed_wgmma_kernel_from_1024_query_rows(monkeypatch):
    """qattn.attention's kernel for f16 and bf16 on sm_90a (without a GPU: the build and the device
    stood in): the mma.sync default below 1024 query rows a sequence (causal d128: 768), the wgmma kernel from
    there; a named tile still decides; the per-call kernel cache tells the two apart by the rows' band."""
    import contextlib
    from types import SimpleNamespace

    from qattn import api

    monkeypatch.setenv("QATTN_TUNED", "0")
    monkeypatch.setattr(api, "device_arch", lambda: "sm_90a")
    monkeypatch.setattr(api, "build_kernel", lambda spec: SimpleNamespace(spec=spec))
    monkeypatch.setattr(api, "_CALL_KERNELS", {})

    def q(rows, d=128, batch=2):
        return SimpleNamespace(shape=(batch, 8, rows, d), data=SimpleNamespace(device_id=0),
                               device=contextlib.nullcontext())

    def unit(fmt, rows, d=128, tile=None, causal=False, batch=2):
        spec = api._call_kernel(fmt, q(rows, d, batch), q(rows, d, batch), causal, tile).spec
        return spec.family.values.get("mma_unit"), spec.tile

    def options(fmt, rows, d=128, causal=False, batch=2):
        return dict(api._call_kernel(fmt, q(rows, d, batch), q(rows, d, batch), causal, None).spec.options)

    for fmt in ("f16", "bf16"):
        for d in (64, 128):
            assert unit(fmt, 1023, d, causal=True)[0] == "mma.sync"  # 16 sequence-heads
            assert unit(fmt, 767, d, causal=True, batch=64)[0] == "mma.sync"
            assert unit(fmt, 1024, d, causal=True) == ("wgmma", Tile(128, 128, 8, 2))
            assert options(fmt, 1024, d, causal=True)["chain"] == "on"
            assert unit(fmt, 32768, d, causal=True)[0] == "wgmma"
            assert unit(fmt, 300, d)[0] == "mma.sync"  # cached per band: the short call is not served wgmma
        # calls of 512-1023 rows over enough sequence-heads (batch x heads): causal d128 from 768 rows and 64
        # sequence-heads on persistent blocks, not chained; d64 chained, causal from 768 rows and 128 sequence-heads,
        # non-causal from 512 rows and 512 sequence-heads
        assert unit(fmt, 768, causal=True, batch=8) == ("wgmma", Tile(128, 128, 8, 2))
        assert unit(fmt, 1023, causal=True, batch=7)[0] == "mma.sync"
        assert options(fmt, 1023, causal=True, batch=8) == {**options(fmt, 1023, causal=True, batch=8), "persistent": "on"}
        assert options(fmt, 1023, causal=True, batch=8).get("chain", "off") == "off"
        assert unit(fmt, 768, 64, causal=True, batch=16) == ("wgmma", Tile(128, 128, 8, 2))
        assert options(fmt, 768, 64, causal=True, batch=16)["chain"] == "on"
        assert unit(fmt, 768, 64, causal=True, batch=15)[0] == "mma.sync"
        assert unit(fmt, 512, 64, batch=64) == ("wgmma", Tile(128, 128, 8, 2))
        assert unit(fmt, 1023, 64, batch=63)[0] == "mma.sync"
        # d64: wgmma from 1024 rows, causal or not; non-causal persistent blocks from 512 to 4095 rows at d128,
        # from 1024 on at d64 on three consumer warpgroups; causal ones from 768 rows at d128, and at d64 below
        # 4096 rows, from where d64 runs three consumer warpgroups a block an item
        assert unit(fmt, 1023, 64)[0] == "mma.sync" and unit(fmt, 1024, 64)[0] == "wgmma"
        assert unit(fmt, 511, 128)[0] == "mma.sync"
        for rows, persistent in ((512, "on"), (4095, "on"), (4096, "off"), (32768, "off")):
            assert unit(fmt, rows, 128)[0] == "wgmma" and options(fmt, rows)["persistent"] == persistent, rows
        for rows in (1024, 16384, 131072):
            assert unit(fmt, rows, 64) == ("wgmma", Tile(192, 128, 12, 2))
            assert options(fmt, rows, 64)["persistent"] == "on", rows
        for rows, tile, persistent in ((2048, Tile(128, 128, 8, 2), "on"), (4095, Tile(128, 128, 8, 2), "on"),
                                       (4096, Tile(192, 128, 12, 2), "off"), (32768, Tile(192, 128, 12, 2), "off")):
            assert unit(fmt, rows, 64, causal=True) == ("wgmma", tile), rows
            assert options(fmt, rows, 64, causal=True)["persistent"] == persistent, rows
        for rows in (2048, 32768):
            assert options(fmt, rows, 128, causal=True)["persistent"] == "on"
    assert unit("f16", 8192, tile=Tile(64, 64, 4, 2)) == ("mma.sync", Tile(64, 64, 4, 2))
    assert unit("f16", 8192, 96)[0] == "mma.sync"  # no wgmma kernel at d96
    assert unit("f32", 8192)[0] is None  # the SIMT kernel: nothing listed


def test_int8_calls_on_short_sequences_take_their_listed_kernels(monkeypatch):
    """On sm_90a (int8qk recipes.LAUNCH_TILES) i8-f8 calls below 2048 query rows (non-causal) or 4096
    (causal) run the m64 tile, two blocks per SM; longer ones the 192-row default; both tiles quantize
    alike (one Q scale a row, four K scale groups per 128 keys), so the operands do not depend on it.
    i8-f16 calls below 4096 rows run persistent blocks."""
    import contextlib
    from types import SimpleNamespace

    from qattn import api
    from qattn.formats.int8qk.launch import emulator_options
    from qattn.formats.int8qk.recipes import I8_F8_SHORT_TILE

    monkeypatch.setenv("QATTN_TUNED", "0")
    monkeypatch.setattr(api, "device_arch", lambda: "sm_90a")
    monkeypatch.setattr(api, "build_kernel", lambda spec: SimpleNamespace(spec=spec))
    monkeypatch.setattr(api, "_CALL_KERNELS", {})

    def spec(rows, d, causal):
        q = SimpleNamespace(shape=(2, 8, rows, d), data=SimpleNamespace(device_id=0), device=contextlib.nullcontext())
        return api._call_kernel("i8-f8", q, q, causal, None).spec

    for d in (64, 128):
        long_tile = Tile(192, 128, 12, 3 if d == 64 else 2)  # a third K/V slot at d64
        for causal, least in ((False, 2048), (True, 4096)):
            for rows, tile in ((1, I8_F8_SHORT_TILE), (1024, I8_F8_SHORT_TILE), (least - 1, I8_F8_SHORT_TILE),
                               (least, long_tile), (32768, long_tile)):
                chosen = spec(rows, d, causal)
                assert chosen.tile == tile and chosen.family.values["mma_unit"] == "wgmma", (d, causal, rows)
        assert emulator_options(spec(1024, d, False)) == emulator_options(spec(32768, d, False))
    q = SimpleNamespace(shape=(1, 8, 1024, 128), data=SimpleNamespace(device_id=0), device=contextlib.nullcontext())
    assert api._call_kernel("i8-f8", q, q, False, long_tile).spec.tile == long_tile  # a named tile still decides
    from qattn.engine import registry

    assert registry.launch_choice("i8-f8", 128, "sm_90", 1024) is None  # measured on sm_90a only
    # i8-f16 at d128: persistent blocks below 4096 rows, causal or not (in pairs when causal), then a block an item,
    # from 8192 rows on 192-key tiles; V by the TMA but in non-causal calls from 32768 rows
    for causal in (False, True):
        for rows, persistent, keys in ((1, "on", 128), (1024, "on", 128), (4095, "on", 128), (4096, "off", 128),
                                       (8191, "off", 128), (8192, "off", 192), (32767, "off", 192), (32768, "off", 192)):
            chosen = api._call_kernel("i8-f16", *(SimpleNamespace(shape=(2, 8, rows, 128), data=SimpleNamespace(
                device_id=0), device=contextlib.nullcontext()),) * 2, causal, None).spec
            v_tiles = "on" if rows >= 32768 and not causal else "off"
            want = {"pingpong": "on", "v_tiles": v_tiles, "persistent": persistent}
            assert dict(chosen.options) == want, (causal, rows)
            assert chosen.tile == Tile(128, keys, 8, 2) and emulator_options(chosen)["block_n"] == keys
    # i8-f16 at d64: three consumer warpgroups for calls from 2048 rows, causal or not (causal ones from 8192 rows on
    # three K/V slots); shorter calls keep the default
    for causal in (False, True):
        assert registry.launch_choice("i8-f16", 64, "sm_90a", 2047, causal=causal) is None
        for rows in (2048, 8191, 8192, 32768):
            chosen = api._call_kernel("i8-f16", *(SimpleNamespace(shape=(2, 8, rows, 64), data=SimpleNamespace(
                device_id=0), device=contextlib.nullcontext()),) * 2, causal, None).spec
            stages = 3 if causal and rows >= 8192 else 2
            assert chosen.tile == Tile(192, 128, 12, stages) and dict(chosen.options)["persistent"] == "off", rows


def test_a_head_dims_option_default_applies_unless_named():
    """Family.option_defaults: the wgmma f16 kernel takes its warpgroups in turns at d128 (measured
    faster there) but not at d64; a spec that names the option keeps it, and the name says which."""
    d128 = KernelSpec(recipe="f16", head_dim=128, arch="sm_90a", mma="wgmma")
    d64 = KernelSpec(recipe="f16", head_dim=64, arch="sm_90a", mma="wgmma")
    assert dict(d128.options)["pingpong"] == "on" and "_pingpong_" in d128.name
    assert dict(d64.options)["pingpong"] == "off" and "pingpong" not in d64.name
    off = KernelSpec(recipe="f16", head_dim=128, arch="sm_90a", mma="wgmma", options={"pingpong": "off"})
    assert dict(off.options)["pingpong"] == "off" and off.name != d128.name and off.key != d128.key
    assert dict(KernelSpec(recipe="i8-f16", head_dim=128, arch="sm_90a").options)["pingpong"] == "on"


def test_rocm_cupy_gets_a_clear_refusal(monkeypatch):
    """On ROCm's CuPy no CUDA arch is guessed from the device: a spec without an arch says that HIP kernels
    compile offline only, and names the CUDA archs."""
    import cupy

    from qattn.engine.spec import device_arch, rocm_runtime

    monkeypatch.setattr(cupy.cuda.runtime, "is_hip", True)
    assert rocm_runtime() and device_arch() is None
    with pytest.raises(ValueError, match=r"^arch: no cuda device found to default to \(this CuPy runs on ROCm, .*"
                                         r"--backend hip`\); name one of sm_80"):
        KernelSpec(recipe="f16", head_dim=128)
    assert KernelSpec(recipe="f16", head_dim=128, backend="hip", arch="gfx942").arch == "gfx942"


def test_build_of_a_query_count_is_the_kernel_listed_for_it(monkeypatch):
    """qattn.build(..., queries=N[, heads=H]): the kernel calls of N query rows (over H sequence-heads, default many)
    run where nothing is tuned (on sm_90a f16 causal d128 the persistent wgmma kernel from 768 rows, from 1024 below
    64 sequence-heads, below that the mma.sync default); refused for decode kinds and named kernels, and for anything
    but positive counts."""
    import qattn
    from qattn.engine.spec import builtin_spec

    monkeypatch.setattr("qattn.api.build_kernel", lambda spec: spec)
    for queries in (1, 767, 1023, 1024, 50000):
        built = qattn.build("prefill", format="f16", head_dim=128, causal=True, arch="sm_90a", queries=queries)
        assert built == builtin_spec("f16", 128, True, queries, "sm_90a")
        assert (built.family.values["mma_unit"] == "wgmma") == (queries >= 768)
        few = qattn.build("prefill", format="f16", head_dim=128, causal=True, arch="sm_90a", queries=queries, heads=32)
        assert few == builtin_spec("f16", 128, True, queries, "sm_90a", heads=32)
        assert (few.family.values["mma_unit"] == "wgmma") == (queries >= 1024)
    assert qattn.build("prefill", format="f16", arch="sm_90a") == KernelSpec(recipe="f16", arch="sm_90a")
    with pytest.raises(ValueError, match="^heads: expected a positive integer"):
        qattn.build("prefill", format="f16", arch="sm_90a", queries=64, heads=0)
    with pytest.raises(ValueError, match="^heads: give queries too"):
        qattn.build("prefill", format="f16", arch="sm_90a", heads=64)
    for bad, message in ((dict(queries=0), "positive integer"), (dict(queries=True), "positive integer"),
                         (dict(queries=64, tile=(64, 64, 4, 2)), "named by tile"),
                         (dict(queries=64, options={"persistent": "on"}), "named by options")):
        with pytest.raises(ValueError, match=f"^queries: .*{message}"):
            qattn.build("prefill", format="f16", arch="sm_90a", **bad)
    with pytest.raises(ValueError, match="^queries: decode kernels do not depend"):
        qattn.build("decode", format="f16-f16", arch="sm_90a", queries=4)
