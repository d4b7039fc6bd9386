"""The decode family on the CPU: its formats and specs, every kernel compiling for the archs it names,
the host model of the cache writer, the emulator against FP64, the split choice, and bad arguments
refused by name before anything reaches a GPU."""
from __future__ import annotations

import math

import numpy as np
import pytest
from click.testing import CliRunner

import qattn
from qattn.check import metrics
from qattn.engine import registry
from qattn.engine.compile import compile_cuda
from qattn.engine.render import main_entry_name, render
from qattn.engine.spec import KernelSpec
from qattn.engine.tile import Tile
from qattn.formats.decode import emulate as emu
from qattn.formats.decode.host import auto_splits, keys_per_split, least_splits, workspace_bytes
from qattn.formats.decode.quant import HostPagedCache, mean_record, mean_terms, page_starts, quantize_tokens
from qattn.formats.decode.recipes import FORMATS, PAGE_SIZES, TABLE_SLOTS, qk_paths, resolve_qk, sides, tile_path_problem


def test_formats_live_in_their_own_kind():
    decode = registry.recipes("decode")
    assert list(decode) == list(FORMATS) and {"f16-f16", "e4m3-e4m3", "i8-i8", "e4m3-f16", "f16-e4m3"} <= set(decode)
    # i8-i8 names a prefill format (int8 QK, int8 PV) and a decode format (int8 K and V caches)
    assert qattn.recipe("i8-i8").kind == "prefill" and qattn.recipe("i8-i8", "decode").kind == "decode"
    assert "e4m3-e4m3" not in qattn.RECIPES
    with pytest.raises(ValueError, match="known decode formats"):
        qattn.recipe("f16", "decode")
    assert decode["f16-e4m3"].input_dtypes == ("float16",) and decode["e4m3-e4m3"].input_dtypes == ("float16", "bfloat16")


def test_spec_options_name_and_validate():
    spec = KernelSpec(kind="decode", recipe="e4m3-e4m3", head_dim=128, arch="sm_90a", options={"page_size": 16})
    assert spec.options == (("page_size", 16), ("scale_mode", "token"), ("k_mean", "off"), ("k_balance", "off"),
                            ("k_rope", "off"), ("qk", "transform"))
    assert spec.name == "decode_e4m3-e4m3_d128_m8n64w4s2_p16_token_transform_sm90a"  # "off" stays out of the name
    assert spec.family.values["page_size"] == 16 and spec.as_dict()["options"] == {
        "page_size": 16, "scale_mode": "token", "k_mean": "off", "k_balance": "off", "k_rope": "off",
        "qk": "transform"}
    paged = spec.with_(options={"page_size": 16, "k_mean": "page"})
    assert paged.name == "decode_e4m3-e4m3_d128_m8n64w4s2_p16_token_kmean-page_transform_sm90a"
    # a 16-bit K has no QK paths; an 8-bit K has its own 8-bit MMA path only
    assert KernelSpec(kind="decode", recipe="f16-e4m3", arch="sm_90a").name == "decode_f16-e4m3_d128_m8n32w2s2_p32_token_sm90a"
    with pytest.raises(ValueError, match="^qk: i8-i8 takes one of transform, int8, got 'fp8'"):
        KernelSpec(kind="decode", recipe="i8-i8", arch="sm_90a", options={"qk": "fp8"})
    with pytest.raises(ValueError, match="^options: f16-f16 takes page_size, scale_mode, got qk"):
        KernelSpec(kind="decode", recipe="f16-f16", arch="sm_90a", options={"qk": "transform"})
    with pytest.raises(ValueError, match="^options: f16-i8 takes page_size, scale_mode, got k_mean"):
        KernelSpec(kind="decode", recipe="f16-i8", arch="sm_90a", options={"k_mean": "page"})
    with pytest.raises(ValueError, match="^k_mean: i8-i8 takes one of"):
        KernelSpec(kind="decode", recipe="i8-i8", arch="sm_90a", options={"k_mean": "token"})
    assert KernelSpec(recipe="f16", arch="sm_90a").as_dict().keys() == {
        "kind", "recipe", "head_dim", "tile", "causal", "backend", "arch", "mma"}  # prefill keys unchanged
    with pytest.raises(ValueError, match="^page_size: e4m3-e4m3 takes one of"):
        KernelSpec(kind="decode", recipe="e4m3-e4m3", arch="sm_90a", options={"page_size": 24})
    with pytest.raises(ValueError, match="^options: f16 takes none"):
        KernelSpec(recipe="f16", arch="sm_90a", options={"page_size": 16})
    with pytest.raises(ValueError, match="^arch: e4m3-e4m3 on cuda supports"):  # e4m3 conversions need sm_89
        KernelSpec(kind="decode", recipe="e4m3-e4m3", arch="sm_80")
    assert KernelSpec(kind="decode", recipe="i8-f16", arch="sm_80").arch == "sm_80"
    for tile in (qattn.Tile(8, 32, 4, 2), qattn.Tile(8, 48, 3, 2), qattn.Tile(8, 16, 1, 2)):
        with pytest.raises(ValueError, match=r"block_n must be 16 keys per warp \(16\*warps, warps 2, 4 or 8\)"):
            KernelSpec(kind="decode", recipe="f16-f16", arch="sm_90a", tile=tile)
    assert KernelSpec(kind="decode", recipe="i8-i8", head_dim=256, arch="sm_90a", tile=qattn.Tile(8, 32, 2, 2),
                      options={"qk": "transform"}).tile.warps == 2


def _qk_instruction(path: str, arch: str) -> str:
    """The PTX of a QK path's S product: wgmma on sm_90a (its mma.sync e4m3 is not native), else mma.sync."""
    if path == "transform":
        return "mma.sync.aligned.m16n8k16.row.col.f32"
    if arch == "sm_90a":
        return "wgmma.mma_async.sync.aligned.m64n8k32." + ("s32.s8.s8" if path == "int8" else "f32.e4m3.e4m3")
    return "mma.sync.aligned.m16n8k32.row.col." + ("s32.s8.s8.s32" if path == "int8" else "f32.e4m3.e4m3.f32")


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_compiles_without_spills(fmt):
    archs = ("sm_89", "sm_90a", "sm_120") if "e4m3" in fmt else ("sm_80", "sm_90a")
    for arch in archs:
        for path in qk_paths(fmt):
            shapes = ((128, 32, "token"), (64, 16, "head")) if path == "transform" else ((128, 64, "head"),)
            for d, page, scale in shapes:
                options = {"page_size": page, "scale_mode": scale, **({"qk": path} if len(qk_paths(fmt)) > 1 else {})}
                spec = KernelSpec(kind="decode", recipe=fmt, head_dim=d, arch=arch, options=options)
                binary = compile_cuda(render(spec), arch, spec.name, entry=main_entry_name(spec))
                assert binary.resources["spill_stores"] == 0 and binary.resources["spill_loads"] == 0, spec.name
                assert _qk_instruction(path, arch) in binary.ptx, spec.name
            for entry in ("_f16", "_bf16", "_merge_f16", "_write_f16_i32", "_write_bf16_i64"):
                assert f"qattn_{spec.name.replace('-', '_')}{entry}(" in binary.ptx or \
                    f".entry qattn_{spec.name.replace('-', '_')}{entry}" in binary.ptx


def test_two_and_eight_warp_tiles_compile():
    """A thread's stage copies keep their strides (compile-time checks) at every allowed warp count."""
    for fmt, d, warps in (("i8-i8", 256, 2), ("e4m3-e4m3", 64, 8), ("f16-i8", 128, 2), ("f16-f16", 64, 8)):
        options = {"qk": "transform"} if len(qk_paths(fmt)) > 1 else {}
        spec = KernelSpec(kind="decode", recipe=fmt, head_dim=d, arch="sm_90a",
                          tile=qattn.Tile(8, 16 * warps, warps, 2), options=options)
        binary = compile_cuda(render(spec), "sm_90a", spec.name, entry=main_entry_name(spec))
        assert f"qattn_{spec.name.replace('-', '_')}_f16" in binary.ptx, spec.name


def test_quantize_tokens_int8_e4m3_and_non_finite_rows():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 2, 64)).astype(np.float32) * 3
    for code, qmax in (("i8", 127), ("e4m3", 448)):
        q = quantize_tokens(x, code)
        assert q.scale.shape == (5, 2) and np.allclose(q.scale, np.abs(x).max(-1) / qmax)
        err = np.abs(q.dequantize() - x) / np.abs(x).max(-1, keepdims=True)
        assert err.max() <= (0.5 / 127 if code == "i8" else 2.0 ** -4) * 1.0001
    x[1, 0, 3] = np.nan
    q = quantize_tokens(x, "i8")
    assert np.isnan(q.scale[1, 0]) and np.isnan(q.dequantize()[1, 0]).all()  # int8 has no NaN: the scale carries it
    head = quantize_tokens(x[:, 1], "e4m3", np.float32(0.01))
    assert head.scale.shape == (5,) and np.all(head.scale == np.float32(0.01))


def _host_cache(fmt, rng, *, lens, kv_heads=2, head_dim=64, page=16, scale="token"):
    max_pages = max(-(-n // page) for n in lens) + 1
    cache = HostPagedCache.empty(fmt, len(lens) * max_pages + 3, page, kv_heads, head_dim, scale)
    table = rng.permutation(len(lens) * max_pages + 3)[:len(lens) * max_pages].reshape(len(lens), max_pages)
    ks, vs = [], []
    for b, n in enumerate(lens):
        k = rng.standard_normal((n, kv_heads, head_dim)).astype(np.float16)
        v = rng.standard_normal((n, kv_heads, head_dim)).astype(np.float16)
        cache.write(k, v, table[b, np.arange(n) // page] * page + np.arange(n) % page, scale=scale)
        ks.append(k.astype(np.float64).transpose(1, 0, 2))
        vs.append(v.astype(np.float64).transpose(1, 0, 2))
    return cache, table.astype(np.int32), np.asarray(lens, np.int32), ks, vs


@pytest.mark.parametrize("fmt", ["f16-f16", "e4m3-e4m3", "i8-i8", "e4m3-f16", "f16-i8"])
@pytest.mark.parametrize("scale", ["token", "head"])
def test_emulator_against_fp64_on_the_cache_and_on_the_original(fmt, scale):
    rng = np.random.default_rng(1)
    cache, table, lens, ks, vs = _host_cache(fmt, rng, lens=[3, 150, 333], scale=scale)
    q = rng.standard_normal((3, 8, 3, 64)).astype(np.float16)  # GQA 4, three new tokens each
    out = emu.emulate(q, cache, table, lens, splits=2)
    assert metrics.compare(out, emu.reference(q, cache, table, lens)).rel_l2 < 1e-3  # the kernel's arithmetic
    cost = metrics.compare(out, emu.reference_dense(q, ks, vs)).rel_l2  # the format's own rounding
    assert cost < {"f16": 1e-3, "i8": 2.5e-2, "e4m3": 6e-2}[max(sides(fmt), key=lambda s: ("f16", "i8", "e4m3").index(s))]


@pytest.mark.parametrize("fmt, path", [("e4m3-e4m3", "fp8"), ("i8-i8", "int8"), ("i8-f16", "int8")])
def test_emulator_8bit_qk_paths_quantize_q_per_row(fmt, path):
    """The 8-bit QK paths: exact against FP64 on the cache with Q replaced by its dequantized codes
    (the kernel's arithmetic), within the path's tolerance of FP64 with Q as given (Q's rounding)."""
    from qattn.formats.decode.recipes import QK_CODE, tolerance

    rng = np.random.default_rng(4)
    cache, table, lens, *_ = _host_cache(fmt, rng, lens=[70, 400], head_dim=128)
    q = rng.standard_normal((2, 8, 2, 128)).astype(np.float16)
    out = emu.emulate(q, cache, table, lens, qk=path)
    q_codes = quantize_tokens(q.astype(np.float32), QK_CODE[path]).dequantize()
    assert metrics.compare(out, emu.reference(q_codes, cache, table, lens)).rel_l2 < 1e-3
    err = metrics.compare(out, emu.reference(q, cache, table, lens))
    assert 1e-3 < err.rel_l2 < tolerance(fmt, path).rel_l2 and err.max_rel < tolerance(fmt, path).max_rel
    other = "fp8" if path == "int8" else "int8"
    with pytest.raises(ValueError, match=f"^qk: {fmt} has no '{other}' path"):
        emu.emulate(q, cache, table, lens, qk=other)


def test_qk_paths_and_the_auto_pick():
    assert qk_paths("e4m3-f16") == ("transform", "fp8") and qk_paths("i8-i8") == ("transform", "int8")
    assert qk_paths("f16-e4m3") == ("transform",)
    assert resolve_qk("f16-f16", "sm_90a") == "transform" and resolve_qk("e4m3-e4m3", "sm_89", "transform") == "transform"
    assert resolve_qk("i8-i8", "sm_90a") == "transform" and resolve_qk("e4m3-e4m3", "sm_90a", rows=64) == "transform"
    # on sm_90a the int8 path once a kv head's rows (GQA x new tokens) fill more than one block
    assert resolve_qk("i8-i8", "sm_90a", rows=8) == "transform" and resolve_qk("i8-i8", "sm_90a", rows=9) == "int8"
    assert resolve_qk("i8-i8", "sm_90a", "transform", rows=64) == "transform"
    assert resolve_qk("i8-i8", "sm_120") == "transform"  # not measured there: the path that keeps Q exact
    with pytest.raises(ValueError, match="^qk: f16-f16 takes 'auto' or one of transform, got 'int8'"):
        resolve_qk("f16-f16", "sm_90a", "int8")


def test_emulator_splits_change_only_roundings_and_causal_rows_see_fewer_keys():
    rng = np.random.default_rng(2)
    cache, table, lens, *_ = _host_cache("e4m3-e4m3", rng, lens=[40, 300])
    q = rng.standard_normal((2, 2, 4, 64)).astype(np.float16)
    one, lse = emu.emulate(q, cache, table, lens, splits=1, return_lse=True)
    many = emu.emulate(q, cache, table, lens, splits=5)
    assert 0 < metrics.compare(one, many).rel_l2 < 1e-3
    # the first new token sees three keys fewer than the last: without the causal mask it would differ
    full = emu.reference(q, cache, table, lens)
    lq_last = emu.reference(q[:, :, 3:], cache, table, lens)
    np.testing.assert_allclose(full[:, :, 3:], lq_last, rtol=1e-12, atol=1e-12)
    assert metrics.compare(full[:, :, :1], emu.reference(q[:, :, :1], cache, table, lens)).rel_l2 > 1e-3
    ref, ref_lse = emu.reference(q, cache, table, lens, return_lse=True)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-3, atol=1e-3)


def test_split_choice_fills_waves_and_fits_the_page_table():
    assert auto_splits(64, 512, 132, 3) == 6  # 384 blocks: one wave of 396 slots
    assert auto_splits(512, 64, 132, 3) == 3  # 1536 blocks: four waves, the last nearly full
    assert auto_splits(8, 2048, 132, 3) * 8 <= 396
    assert auto_splits(4, 7, 132, 3) == 1  # too few steps to split
    assert least_splits(4096 * 32, 64, 32) >= math.ceil(4096 / (TABLE_SLOTS - 1))
    kps = keys_per_split(4096 * 16, least_splits(4096 * 16, 64, 16), 64)
    assert kps % 64 == 0 and kps // 16 + 1 <= TABLE_SLOTS
    assert workspace_bytes(2, 8, 1, 128, 1) == 0 and workspace_bytes(2, 8, 1, 128, 3) == 3 * 16 * 130 * 4


@pytest.mark.parametrize("kwargs, words", [
    ({"page_size": 24}, "page_size"),
    ({"head_dim": 96}, "head_dim"),
    ({"k": "e5m2"}, "^k:"),
    ({"k": "f16", "v": "bf16"}, "not a decode format"),
    ({"scale": "channel"}, "^scale"),
    ({"k": "e4m3", "scale": "token", "k_scale": 0.1}, "^k_scale"),
    ({"num_pages": 0}, "^num_pages"),
    ({"num_pages": 2**31 // 64, "kv_heads": 2}, "^num_pages, kv_heads, page_size: at most 2\\^31 - 1 token rows"),
    ({"k": "i8", "k_mean": "channel"}, "^k_mean: expected one of 'off', 'page'"),
    ({"k": "f16", "k_mean": "page"}, "^k_mean: page means are for an 8-bit K"),
])
def test_cache_arguments_are_checked_first(kwargs, words):
    args = {"num_pages": 4, "page_size": 32, "kv_heads": 2, "head_dim": 128, **kwargs}
    with pytest.raises(ValueError, match=words):
        qattn.PagedKVCache(args.pop("num_pages"), args.pop("page_size"), args.pop("kv_heads"), args.pop("head_dim"),
                           **args)


def test_cache_names_the_device_it_needs(monkeypatch):
    """No GPU, or a device index the machine lacks: an error naming `device`, not the CUDA runtime's."""
    import cupy

    monkeypatch.setattr(cupy.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="^device: a PagedKVCache lives on a CUDA GPU"):
        qattn.PagedKVCache(4, 32, 2, 128)
    monkeypatch.setattr(cupy.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", lambda: 2)
    for bad in (2, -1, 1.0, True, "0"):
        with pytest.raises(ValueError, match="^device: expected a CUDA device index from 0 to 1"):
            qattn.PagedKVCache(4, 32, 2, 128, device=bad)


def test_cli_inspects_a_decode_kernel():
    """`qattn inspect decode` shows the decode module's resources (no prefill launch list for it)."""
    import json

    from qattn.cli import main

    runner = CliRunner()
    table = runner.invoke(main, ["inspect", "decode", "-f", "e4m3-e4m3", "--page-size", "16", "--arch", "sm_90a"])
    assert table.exit_code == 0, table.output
    assert "decode_e4m3-e4m3_d128" in table.output and "registers / thread" in table.output
    report = json.loads(runner.invoke(main, ["inspect", "decode", "-f", "e4m3-e4m3", "-d", "64", "--arch", "sm_89",
                                             "--json"]).output)
    assert report["resources"]["spill_stores"] == 0 and report["resources"]["registers"] > 0
    assert "launch_tiles" not in report
    # the writer's e4m3 codes, counted with the kernel's (SASS, or PTX where no nvdisasm is found)
    assert any("E4M3" in op.upper() and "SAT" in op.upper() for op in report["instructions"]["convert"])


def test_int8_k_on_the_transform_path_widens_without_a_subtract():
    """An int8 K on the transform path with fp16 queries is widened as 1152 + v (a byte permute), the
    offset taken off the score accumulators: no packed subtract is left for K, where V's int8 codes and
    the pre-RoPE keys (turned on chip as exact values) keep theirs."""
    def subtracts(fmt, **options):
        spec = KernelSpec(kind="decode", recipe=fmt, head_dim=128, arch="sm_90a", options=options)
        return compile_cuda(render(spec), "sm_90a", spec.name, entry=main_entry_name(spec)).ptx.count("sub.f16x2")

    assert subtracts("i8-f16", qk="transform") == 0
    assert subtracts("i8-i8", qk="transform") == subtracts("f16-i8") > 0  # V's widening only
    assert subtracts("i8-f16", qk="transform", k_rope="pre") > 0


def test_default_tile_by_arch_and_qk_path():
    """Two warps a block where measured faster (on sm_90a: K16/V16, K16/V8 and K8/V16 on two slots on every page
    size, K8/V8 on the transform path on three slots on pages of 16 and 32 at D64); the 8-bit paths' wgmma there,
    K8/V8 at D128 and D256 and on longer pages, and other archs keep four warps."""
    def tile(fmt, arch, head_dim=128, **options):
        return KernelSpec(kind="decode", recipe=fmt, head_dim=head_dim, arch=arch, options=options).tile.name

    assert tile("f16-f16", "sm_90a") == tile("bf16-e4m3", "sm_90a") == tile("f16-i8", "sm_90a") == "m8n32w2s2"
    assert tile("e4m3-e4m3", "sm_90a", qk="transform") == tile("i8-i8", "sm_90a", qk="transform") == "m8n64w4s2"
    assert tile("e4m3-e4m3", "sm_90a", 64, qk="transform") == tile("i8-i8", "sm_90a", 64, qk="transform") == "m8n32w2s3"
    assert tile("e4m3-e4m3", "sm_90a", qk="fp8") == tile("i8-i8", "sm_90a", qk="int8") == "m8n64w4s2"
    assert tile("e4m3-f16", "sm_90a", qk="transform") == tile("i8-bf16", "sm_90a", qk="transform") == "m8n32w2s2"
    assert tile("f16-f16", "sm_89") == tile("e4m3-e4m3", "sm_120", qk="fp8") == "m8n64w4s2"
    assert tile("f16-f16", "sm_90a", page_size=16) == "m8n32w2s2"
    assert tile("i8-i8", "sm_90a", qk="transform", page_size=16) == "m8n64w4s2"
    assert tile("i8-i8", "sm_90a", 256, qk="transform", page_size=16) == "m8n64w4s2"
    assert tile("i8-i8", "sm_90a", 64, qk="transform", page_size=16) == tile(
        "e4m3-e4m3", "sm_90a", 64, qk="transform", page_size=16) == "m8n32w2s3"
    assert tile("e4m3-e4m3", "sm_90a", 64, qk="fp8", page_size=16) == "m8n64w4s2"
    assert tile("f16-e4m3", "sm_90a", page_size=16) == tile("e4m3-f16", "sm_90a", qk="transform", page_size=16) == "m8n32w2s2"
    assert tile("e4m3-f16", "sm_90a", qk="fp8", page_size=32) == "m8n64w4s2"
    for page in (64, 128):
        assert tile("f16-f16", "sm_90a", page_size=page) == tile("bf16-e4m3", "sm_90a", page_size=page) == tile(
            "e4m3-f16", "sm_90a", qk="transform", page_size=page) == "m8n32w2s2"
        assert tile("e4m3-e4m3", "sm_90a", qk="transform", page_size=page) == tile(
            "e4m3-e4m3", "sm_90a", 64, qk="transform", page_size=page) == "m8n64w4s2"
    given = KernelSpec(kind="decode", recipe="f16-f16", arch="sm_90a", tile=Tile(8, 64, 4, 2))
    assert given.tile.name == "m8n64w4s2"  # a tile named is kept
    two = Tile(8, 32, 2, 3)
    assert tile_path_problem(two, "int8", "sm_90a") == (
        "tile: the int8 QK path on sm_90a runs wgmma over one warpgroup (4 warps), got m8n32w2s3")
    assert tile_path_problem(two, "transform", "sm_90a") is None and tile_path_problem(two, "fp8", "sm_89") is None


def test_cli_generates_and_lists_decode_kernels():
    from qattn.cli import main

    runner = CliRunner()
    out = runner.invoke(main, ["gen", "decode", "-f", "e4m3-e4m3", "-d", "128", "--page-size", "16", "--arch", "sm_90a"])
    auto = resolve_qk("e4m3-e4m3", "sm_90a")
    assert out.exit_code == 0 and f"decode_e4m3-e4m3_d128_m8n64w4s2_p16_token_{auto}_sm90a" in out.output
    fp8 = runner.invoke(main, ["gen", "decode", "-f", "e4m3-e4m3", "--qk", "fp8", "--arch", "sm_90a"])
    assert fp8.exit_code == 0 and "_token_fp8_sm90a" in fp8.output and "wgmma.mma_async" in fp8.output
    refused = runner.invoke(main, ["gen", "-f", "f16", "--page-size", "16", "--arch", "sm_90a"])
    assert refused.exit_code == 2 and "decode options" in refused.output
    refused = runner.invoke(main, ["gen", "decode", "--qk", "fp8", "--arch", "sm_90a"])  # f16-f16: no 8-bit K
    assert refused.exit_code == 2 and "only the transform path" in refused.output
    refused = runner.invoke(main, ["gen", "decode", "-f", "i8-i8", "--qk", "fp8", "--arch", "sm_90a"])
    assert refused.exit_code == 2 and "i8-i8 takes 'auto' or one of transform, int8" in refused.output
    listing = runner.invoke(main, ["list"])
    assert listing.exit_code == 0 and "e4m3-f16" in listing.output and "page_size" in listing.output
    assert "qk transform, fp8 (e4m3 K" in " ".join(listing.output.split())
    assert ("on sm_90a K16/V16 m8n32w2s2 on pages of every size, K16/V8 m8n32w2s2 on pages of every size, K8/V16 "
            "m8n32w2s2 on pages of every size, K8/V8 m8n32w2s3 on pages of 16 and 32 at d64"
            in " ".join(listing.output.split()))
    built = runner.invoke(main, ["compile", "decode", "-f", "i8-f16", "-d", "64", "--scale", "head", "--arch", "sm_80"])
    assert built.exit_code == 0 and "1 of 1 compiled" in built.output
    assert all(p in PAGE_SIZES for p in (16, 32, 64, 128))


def test_parity_decode_on_the_emulator_records_both_references(tmp_path):
    from qattn.check import parity

    records = parity.run_parity(["e4m3-e4m3", "f16-f16"], [(300, 1), (200, 3)], batch=2, heads=8, kv_heads=2,
                                head_dim=64, backend="numpy", kind="decode", page_size=16, scale="head", source=None,
                                qk="transform")
    assert [(r["format"], r["ctx"], r["queries"]) for r in records] == [
        ("e4m3-e4m3", 300, 1), ("e4m3-e4m3", 200, 3), ("f16-f16", 300, 1), ("f16-f16", 200, 3)]
    for r in records:
        assert r["passed"] and r["backend"] == "numpy" and r["ms"] is None and r["kind"] == "decode"
        assert r["rel_l2"] < 1e-3  # the arithmetic, against FP64 on the dequantized cache
    by_format = {r["format"]: r["format_rel_l2"] for r in records}
    assert by_format["f16-f16"] < 1e-3 < 1e-2 < by_format["e4m3-e4m3"] < 6e-2  # the format's own cost
    with pytest.raises(ValueError, match="known decode formats"):
        parity.run_parity(["i8-f8"], [(64, 1)], backend="numpy", kind="decode")
    with pytest.raises(ValueError, match="^options: prefill checks take only source and smoothing"):
        parity.run_parity(["f16"], [(64, 1)], backend="numpy", page_size=16)


@pytest.mark.parametrize("fmt", ["e4m3-e4m3", "i8-i8"])
def test_a_large_k_bias_ruins_an_8bit_k_cache_and_the_residual_k_fixes_it(fmt):
    """The Qwen-style preset: a K-projection bias far larger than the token-varying part sets every
    token's 8-bit scale, and the residual that carries the attention rounds away; K16/V8 keeps K
    exact. The pre-bias residual K (K - b stored, q·b added back to the scores) is within 2x of the
    format's own N(0,1) error."""
    from qattn.check import parity

    def cost(fmts, **options):
        records = parity.run_parity(fmts, [(600, 1)], batch=2, heads=8, kv_heads=2, head_dim=64, backend="numpy",
                                    kind="decode", page_size=32, scale="token", qk="transform", **options)
        assert all(r["passed"] for r in records)  # the kernel's arithmetic stays exact either way
        return {r["format"]: r["format_rel_l2"] for r in records}

    biased = cost([fmt, "f16-e4m3"], source="bias")
    assert biased[fmt] > 0.15 and biased["f16-e4m3"] < 0.06 and biased[fmt] > 5 * biased["f16-e4m3"], biased
    residual = cost([fmt], source="bias", k_bias=True)[fmt]
    normal = cost([fmt], source=None)[fmt]
    assert residual < 2 * normal and residual < biased[fmt] / 5, (residual, normal)


def _captured_bias_file(path):
    """A file as tools/capture_qkv.py writes it (q, k, v BHSD) whose keys carry a K bias 8x the tokens' spread (the
    bias preset's failure)."""
    rng = np.random.default_rng(11)
    q = rng.standard_normal((2, 8, 900, 64)).astype(np.float32)
    k = rng.standard_normal((2, 2, 900, 64)).astype(np.float32) + 8.0 * rng.standard_normal(64).astype(np.float32)
    v = rng.standard_normal((2, 2, 900, 64)).astype(np.float32)
    np.savez(path, q=q, k=k, v=v)
    return q, k, v


def test_parity_decode_on_captured_tensors(tmp_path):
    """parity --kind decode --npz: the paged cache written from the file's last CTX keys, the last QUERIES of them new
    (all keys and one new token by default), batch, heads and head dim the file's, the records naming it; the bias
    preset's failure shows on captured tensors as on the preset, and the pre-bias residual K (the file's channel
    mean) fixes it."""
    import json

    from qattn.check.captured import Captured
    from qattn.cli import main
    from qattn.formats.decode import parity

    path, out = tmp_path / "layer3.npz", tmp_path / "decode.json"
    q, k, v = _captured_bias_file(path)
    # the window: q's last rows, K and V's last keys as tokens [B, L, Hkv, D]
    wq, wk, wv, bias, theta, _ = parity._inputs("e4m3-e4m3", 2, 8, 2, 500, 4, 64, Captured.load(path), 0)
    assert np.array_equal(wq, q[:, :, -4:].astype(np.float16)) and theta is None
    assert np.array_equal(wk, k[:, :, -500:].transpose(0, 2, 1, 3).astype(np.float16))
    assert np.array_equal(wv, v[:, :, -500:].transpose(0, 2, 1, 3).astype(np.float16))
    assert np.allclose(bias, wk.astype(np.float32).mean(axis=(0, 1)), atol=1e-3)  # the mean before fp16 rounding

    def records(*args):
        result = CliRunner().invoke(main, ["parity", "--kind", "decode", "--backend", "numpy", "--npz", str(path),
                                           "--json", str(out), *args])
        assert result.exit_code == 0, result.output
        return result, {(r["format"], r["ctx"], r["queries"]): r for r in json.loads(out.read_text())}

    result, plain = records("-f", "e4m3-e4m3,f16-e4m3", "--shape", "600/1", "--shape", "500/4", "--page-size", "16")
    assert "layer3.npz K/V" in result.output and "batch 2, heads 8/2, D 64" in result.output
    assert set(plain) == {(f, c, n) for f in ("e4m3-e4m3", "f16-e4m3") for c, n in ((600, 1), (500, 4))}
    for r in plain.values():
        assert r["data"] == "npz:layer3.npz" and (r["batch"], r["heads"], r["kv_heads"], r["head_dim"]) == (2, 8, 2, 64)
        assert r["passed"] and r["page_size"] == 16
    for shape in ((600, 1), (500, 4)):
        k8, k16 = plain[("e4m3-e4m3", *shape)]["format_rel_l2"], plain[("f16-e4m3", *shape)]["format_rel_l2"]
        assert k16 < 0.06 and k8 > 5 * k16, (shape, k8, k16)
    _, residual = records("-f", "e4m3-e4m3", "--shape", "600/1", "--k-bias")
    normal = parity.check("e4m3-e4m3", 600, 1, backend="numpy", batch=2, heads=8, kv_heads=2, head_dim=64,
                          page_size=16, qk="transform")["format_rel_l2"]
    fixed = residual[("e4m3-e4m3", 600, 1)]["format_rel_l2"]
    assert fixed < 2 * normal and fixed < plain[("e4m3-e4m3", 600, 1)]["format_rel_l2"] / 4, (fixed, normal)
    _, whole = records("-f", "f16-f16")
    assert list(whole) == [("f16-f16", 900, 1)] and whole[("f16-f16", 900, 1)]["passed"]

    def refused(*args):
        return CliRunner().invoke(main, ["parity", "--kind", "decode", "--backend", "numpy", "--npz", str(path),
                                         *args])

    for args, option in ((("--heads", "8"), "--npz"), (("--shape", "901/1"), "--shape"),
                         (("--preset", "bias"), "--npz")):
        result = refused(*args)
        assert result.exit_code == 2 and option in result.output, (args, result.output)
    result = refused("-f", "e4m3-e4m3", "--shape", "600/1", "--k-rope", "post")
    assert result.exit_code != 0 and "the data (npz:layer3.npz) has no RoPE" in result.output


def test_the_host_cache_stores_k_minus_the_bias_and_adds_it_back():
    rng = np.random.default_rng(6)
    bias = (rng.standard_normal((2, 64)) * 40).astype(np.float32)
    k = (rng.standard_normal((20, 2, 64)) + bias).astype(np.float16)
    v = rng.standard_normal((20, 2, 64)).astype(np.float16)
    for fmt in ("e4m3-e4m3", "f16-f16"):
        cache = HostPagedCache.empty(fmt, 2, 16, 2, 64, "token", k_bias=bias)
        cache.write(k, v, np.arange(20))
        values, scale = cache.gather("k", np.arange(2), 20)
        stored = values * (1 if scale is None else scale[..., None])
        assert np.abs(stored).max() < 10  # the residual, not the biased K
        exact = k.astype(np.float64).transpose(1, 0, 2)
        err = np.abs(cache.dequantize("k", np.arange(2), 20) - exact).max()
        assert err < (0.4 if fmt == "e4m3-e4m3" else 1e-2), err  # the residual's rounding only


def test_cli_parity_kind_decode(tmp_path):
    import json

    from qattn.cli import main

    out = tmp_path / "decode.json"
    result = CliRunner().invoke(main, ["parity", "--kind", "decode", "-f", "i8-f16", "--shape", "150/2", "--heads", "4",
                                       "--kv-heads", "2", "--head-dim", "64", "--page-size", "16", "--backend",
                                       "numpy", "--qk", "transform", "--qk", "int8", "--json", str(out)])
    assert result.exit_code == 0, result.output
    records = json.loads(out.read_text())
    assert [(r["format"], r["qk"], r["page_size"], r["passed"]) for r in records] == [
        ("i8-f16", "transform", 16, True), ("i8-f16", "int8", 16, True)]
    assert records[1]["tolerance"]["rel_l2"] > records[0]["tolerance"]["rel_l2"]  # Q's own rounding
    assert "format rel_l2" in result.output and "i8-f16 (int8)" in result.output
    refused = CliRunner().invoke(main, ["parity", "--kind", "decode", "-f", "f16-i8", "--qk", "int8",
                                        "--backend", "numpy"])
    assert refused.exit_code == 2 and "f16-i8 has no int8 path" in refused.output
    refused = CliRunner().invoke(main, ["parity", "--page-size", "16", "--backend", "numpy"])
    assert refused.exit_code == 2 and "decode options" in refused.output


def test_plan_picks_the_fastest_format_within_the_gate():
    from qattn.formats.decode import plan

    times = {"f16-f16": 1.0, "e4m3-e4m3": 0.8, "f16-e4m3": 0.9, "i8-i8": 0.95}
    assert plan.choose({"f16-f16": 1e-4, "e4m3-e4m3": 0.03, "f16-e4m3": 0.02, "i8-i8": 0.01}, times, 0.05) == \
        ("e4m3-e4m3", "fastest within the gate")
    assert plan.choose({"f16-f16": 1e-4, "e4m3-e4m3": 0.9, "f16-e4m3": 0.02, "i8-i8": 0.4}, times, 0.05)[0] == "f16-e4m3"
    assert plan.choose({"f16-f16": 1e-4, "e4m3-e4m3": 0.9, "f16-e4m3": 0.2, "i8-i8": 0.4}, times, 0.05)[0] == "f16-f16"
    assert plan.choose({"f16-f16": 1e-4, "e4m3-e4m3": 0.9, "f16-e4m3": 0.02}, {"f16-f16": 1.0}, 0.05)[0] == "f16-e4m3"


def test_cli_plan_decode_on_the_h200_table(tmp_path):
    from qattn import data
    from qattn.cli import main

    args = ["plan", "decode", "--ctx", "2048", "--heads", "8", "--kv-heads", "2", "--head-dim", "64", "--gpu", "H200",
            "--max-rel-l2", "0.05"]
    # the bias preset carries its K bias: the residual-K variants are weighed, and one passes the gate
    result = CliRunner().invoke(main, args + ["--preset", "bias"])
    assert result.exit_code == 0, result.output
    assert "e4m3-e4m3/fp8" in result.output and "+k_bias" in result.output
    assert "chosen: e4m3-e4m3 +k_bias" in result.output or "chosen: i8-i8/int8 +k_bias" in result.output, result.output
    # the same tensors without their bias: every 8-bit K fails the gate, K16/V8 is the fallback
    x = data.preset("bias", ctx=2048, queries=2048, heads=8, kv_heads=2, head_dim=64)
    np.savez(tmp_path / "qkv.npz", q=x["q"], k=x["k"], v=x["v"])
    result = CliRunner().invoke(main, args + ["--npz", str(tmp_path / "qkv.npz")])
    assert result.exit_code == 0, result.output
    assert "chosen: f16-e4m3" in result.output and "+k_bias" not in result.output
    refused = CliRunner().invoke(main, ["plan", "decode", "--heads", "6", "--kv-heads", "4", "--no-measure"])
    assert refused.exit_code == 2 and "--heads" in refused.output


def test_cli_plan_decode_table_of_the_named_gpu():
    from qattn.cli import main
    from qattn.formats.decode import plan

    args = ["plan", "decode", "--ctx", "1024", "--heads", "8", "--kv-heads", "2", "--head-dim", "64"]
    h100 = CliRunner().invoke(main, args + ["--gpu", "h100"])
    assert h100.exit_code == 0 and "relative times measured on the H100" in " ".join(h100.output.split()), h100.output
    rows = {line.split()[1]: line for line in h100.output.splitlines() if line.startswith("│ i8-f16 ")}
    assert f"{plan.RELATIVE_TIME['H100']['i8-f16']:.3f}" in rows["i8-f16"]
    both = CliRunner().invoke(main, args + ["--gpu", "H100", "--measure"])
    assert both.exit_code == 2 and "--gpu picks a measured table" in both.output


# ---- page means of an 8-bit K (k_mean "page") ------------------------------------------------------

def _drifting_k(rng, tokens, kv_heads, head_dim, base=30.0, drift=1.0):
    """K with a large channel mean that drifts over the positions (a few channels at base, growing by
    drift x base over the sequence) on N(0,1), and N(0,1) V."""
    mean = np.zeros((kv_heads, head_dim))
    mean[:, ::16] = base * rng.choice([-1, 1], size=(kv_heads, head_dim // 16))
    mean[:, 3] = base / 2
    growth = 1 + drift * np.arange(tokens)[:, None, None] / tokens
    k = rng.standard_normal((tokens, kv_heads, head_dim)) + mean[None] * growth
    return k.astype(np.float16), rng.standard_normal((tokens, kv_heads, head_dim)).astype(np.float16)


def _written(fmt, k, v, page, k_mean, pieces=(0.25,), piece=96, seed=0, k_bias=None):
    """A host cache of one sequence written as an engine does: a prompt (the first pieces[0] of the
    tokens), then `piece` tokens a write; pages shuffled."""
    tokens, kv_heads, head_dim = k.shape
    pages = -(-tokens // page)
    table = np.random.default_rng(seed).permutation(pages + 2)[:pages][None].astype(np.int32)
    slots = table[0, np.arange(tokens) // page] * page + np.arange(tokens) % page
    cache = HostPagedCache.empty(fmt, pages + 2, page, kv_heads, head_dim, k_mean=k_mean, k_bias=k_bias)
    bounds = [0, int(tokens * pieces[0])] + list(range(int(tokens * pieces[0]) + piece, tokens, piece)) + [tokens]
    for lo, hi in zip(bounds, bounds[1:]):
        cache.write(k[lo:hi], v[lo:hi], slots[lo:hi])
    return cache, table, np.array([tokens], np.int32)


def test_page_means_are_exact_where_nothing_is_rounded():
    """K = μ + z with μ an int8 record's exact value (codes, scale 1) and z integer rows of max 127 that
    cancel in pairs: the running mean is μ, every page stores z as its codes with token scale 1, and the
    FP64 attention of the page-mean cache is that of the original K to fp64 rounding; the emulator is
    within its own fp32/fp16 arithmetic of it, where plain int8 K (scale max|K| / 127 = 2) is not."""
    rng = np.random.default_rng(3)
    tokens, h, d = 256, 2, 64
    mu = rng.integers(-127, 128, size=(h, d)).astype(np.float64)
    mu[:, 0] = 127
    z = rng.integers(-126, 127, size=(tokens // 2, h, d))
    z[:, :, 1] = 127
    z = np.stack([z, -z], axis=1).reshape(tokens, h, d)
    k = (mu[None] + z).astype(np.float16)
    v = rng.standard_normal((tokens, h, d)).astype(np.float16)
    q = rng.standard_normal((1, 4, 2, d)).astype(np.float16)
    cache, table, lens = _written("i8-f16", k, v, 16, "page", piece=32)
    np.testing.assert_array_equal(cache.k_mean.codes[table[0]], np.broadcast_to(mu, (table.shape[1], h, d)))
    np.testing.assert_array_equal(cache.k_mean.scale[table[0]], 1.0)
    stored, scale = cache.gather("k", table[0], tokens)
    np.testing.assert_array_equal(stored * scale[..., None], z.transpose(1, 0, 2))
    dense = emu.reference_dense(q, [k.astype(np.float64).transpose(1, 0, 2)], [v.astype(np.float64).transpose(1, 0, 2)])
    np.testing.assert_allclose(emu.reference(q, cache, table, lens), dense, rtol=0, atol=1e-12)
    err = metrics.compare(emu.emulate(q, cache, table, lens), dense).rel_l2
    plain, *_ = _written("i8-f16", k, v, 16, "off", piece=32)
    plain_err = metrics.compare(emu.emulate(q, plain, table, lens), dense).rel_l2
    assert err < 1e-3 < plain_err, (err, plain_err)


@pytest.mark.parametrize("fmt", ["i8-f16", "e4m3-f16", "i8-i8", "e4m3-e4m3"])
def test_page_means_cut_the_error_of_a_large_drifting_channel_mean(fmt):
    """A channel mean 30x the token-varying part, doubling over the sequence: plain 8-bit K spends its
    scale on it; page means (each page against the running mean when it was started) cut the format's
    error on the original K/V several times, and the emulator stays exact against FP64 on the cache."""
    rng = np.random.default_rng(4)
    k, v = _drifting_k(rng, 1024, 2, 64)
    q = rng.standard_normal((1, 8, 1, 64)).astype(np.float16)
    dense = emu.reference_dense(q, [k.astype(np.float64).transpose(1, 0, 2)], [v.astype(np.float64).transpose(1, 0, 2)])
    errors = {}
    for k_mean in ("off", "page"):
        cache, table, lens = _written(fmt, k, v, 16, k_mean)
        out = emu.emulate(q, cache, table, lens, splits=2)
        assert metrics.compare(out, emu.reference(q, cache, table, lens)).rel_l2 < 1e-3
        errors[k_mean] = metrics.compare(out, dense).rel_l2
    assert errors["page"] < errors["off"] / 3, errors


def test_page_means_follow_the_running_mean():
    """The prompt's pages start from its own mean (a fresh cache is seeded); a page started later takes
    the running mean of every earlier write; a token written into a page started before takes that
    page's record; the running sums are the integer sums of the fixed-point terms."""
    rng = np.random.default_rng(5)
    h, d, page = 2, 64, 16
    first = (rng.standard_normal((40, h, d)) + 10).astype(np.float16)
    second = (rng.standard_normal((30, h, d)) - 20).astype(np.float16)
    cache = HostPagedCache.empty("i8-i8", 8, page, h, d, k_mean="page")
    cache.write(first, first, np.arange(40))  # pages 0, 1, 2 (page 2 to offset 7)
    prompt = mean_record(mean_terms(first).sum(0), np.full(h, 40))
    for p in (0, 1, 2):
        np.testing.assert_array_equal(cache.k_mean.codes[p], prompt[0])
    cache.write(second, second, np.arange(40, 70))  # the rest of page 2, then pages 3 and 4
    np.testing.assert_array_equal(cache.k_mean.codes[2], prompt[0])  # page 2 keeps its record
    for p in (3, 4):  # started by the second write: the mean as of the first (the snapshot)
        np.testing.assert_array_equal(cache.k_mean.codes[p], prompt[0])
    both = np.concatenate([first, second])
    np.testing.assert_array_equal(cache.k_mean.sums, mean_terms(both).sum(0))
    assert list(cache.k_mean.counts) == [70, 70]
    third = (rng.standard_normal((16, h, d))).astype(np.float16)
    cache.write(third, third, np.arange(80, 96))  # page 5, started by the third write: the mean of 70 tokens
    codes, scale = mean_record(mean_terms(both).sum(0), np.full(h, 70))
    np.testing.assert_array_equal(cache.k_mean.codes[5], codes)
    np.testing.assert_array_equal(cache.k_mean.scale[5], scale)
    # a write starts a page where the page's offset 0 is its token `offset` places before
    assert page_starts(np.array([16, 17, 18, -1, 3, 33, 32]), 16).tolist() == [True, True, True, False, False,
                                                                                 False, True]


def test_page_means_with_a_k_bias_store_k_minus_both():
    rng = np.random.default_rng(6)
    bias = (rng.standard_normal((2, 64)) * 40).astype(np.float32)
    k, v = _drifting_k(rng, 300, 2, 64, base=10.0)
    k = (k.astype(np.float32) + bias).astype(np.float16)
    cache, table, lens = _written("e4m3-e4m3", k, v, 16, "page", k_bias=bias, piece=50)
    values, scale = cache.gather("k", table[0], 300)
    assert np.abs(values * scale[..., None]).max() < 12  # not the bias (to ~120) nor the channel mean (10 to 20)
    exact = k.astype(np.float64).transpose(1, 0, 2)
    err = np.abs(cache.dequantize("k", table[0], 300) - exact).max()
    assert err < 0.3, err
    q = rng.standard_normal((1, 4, 1, 64)).astype(np.float16)
    assert metrics.compare(emu.emulate(q, cache, table, lens), emu.reference(q, cache, table, lens)).rel_l2 < 1e-3


@pytest.mark.parametrize("fmt, archs", [("i8-i8", ("sm_80", "sm_89", "sm_90a", "sm_120")),
                                        ("e4m3-e4m3", ("sm_89", "sm_90a", "sm_120")), ("i8-bf16", ("sm_80",)),
                                        ("e4m3-f16", ("sm_90a",))])
def test_page_mean_kernels_compile_without_spills(fmt, archs):
    """Every QK path with page means, and the module's writers, stay out of local memory; the q·μ_page
    products run on the 16-bit MMA (the transform path's own, or added beside the 8-bit one)."""
    for i, arch in enumerate(archs):
        for path in qk_paths(fmt):
            # every arch at d128; the other head dims, page sizes and head scales on the first
            shapes = ((128, 32, "token"),) + (((64, 16, "head"), (256, 128, "token")) if i == 0 else ())
            for d, page, scale in shapes:
                spec = KernelSpec(kind="decode", recipe=fmt, head_dim=d, arch=arch,
                                  options={"page_size": page, "scale_mode": scale, "qk": path, "k_mean": "page"})
                source = render(spec)
                entries = ("_f16", "_bf16", "_write_f16_i32", "_write_bf16_i64") if d == 128 else ("_f16",)
                for entry in entries:
                    binary = compile_cuda(source, arch, spec.name, entry=f"qattn_{spec.name.replace('-', '_')}{entry}")
                    assert binary.resources["spill_stores"] == 0 and binary.resources["spill_loads"] == 0, (spec.name,
                                                                                                          entry)
                assert "mma.sync.aligned.m16n8k16.row.col.f32" in binary.ptx, spec.name
                assert "atom.global.add.u64" in binary.ptx and ".entry qattn_" in binary.ptx


def test_page_means_build_on_hip():
    """Page means build on HIP as on CUDA (tests/test_hip_decode_options.py compiles them)."""
    spec = KernelSpec(kind="decode", recipe="i8-i8", backend="hip", arch="gfx942", options={"k_mean": "page"})
    assert "_kmean-page_" in spec.name and dict(spec.options)["k_mean"] == "page"
    assert dict(KernelSpec(kind="decode", recipe="i8-i8", backend="hip", arch="gfx942").options)["k_mean"] == "off"


def test_cli_page_means(tmp_path):
    import json

    from qattn.cli import main

    runner = CliRunner()
    out = runner.invoke(main, ["gen", "decode", "-f", "i8-i8", "--k-mean", "page", "--qk", "int8", "--arch", "sm_90a"])
    assert out.exit_code == 0 and "decode_i8-i8_d128_m8n64w4s2_p32_token_kmean-page_int8_sm90a" in out.output
    refused = runner.invoke(main, ["gen", "decode", "-f", "f16-i8", "--k-mean", "page", "--arch", "sm_90a"])
    assert refused.exit_code != 0 and "k_mean" in refused.output
    path = tmp_path / "mean.json"
    result = runner.invoke(main, ["parity", "--kind", "decode", "-f", "i8-f16", "--shape", "700/1", "--heads", "4",
                                  "--kv-heads", "2", "--head-dim", "64", "--page-size", "16", "--backend", "numpy",
                                  "--k-mean", "page", "--json", str(path)])
    assert result.exit_code == 0, result.output
    record = json.loads(path.read_text())[0]
    assert record["k_mean"] == "page" and record["passed"] and "page means of K" in result.output
