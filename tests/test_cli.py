"""The command line through click's test runner (CPU only: parity runs the emulators, compiles
need NVRTC but no GPU)."""
import dataclasses
import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from click.testing import CliRunner

import qattn.cli
import qattn.cli_bench
import qattn.cli_plan
import qattn.check.parity
from qattn.cli import compile_matrix, main
from qattn.engine.inspect import blocks_per_sm, count_instructions
from qattn.engine.registry import RECIPES
from qattn.engine.family import Tolerance
from qattn.engine.registry import family_of
from qattn.engine.spec import KernelSpec, builtin_spec
from qattn.formats.dense.launch import stride_variants
from qattn.formats.decode.recipes import MAX_ROWS, resolve_qk
from qattn.engine.cache import KernelCache
from qattn.engine.compile import CompileError, find_tool

ROOT = Path(__file__).resolve().parent.parent
RECORD_KEYS = {"format", "ctx", "queries", "head_dim", "backend", "max_rel", "rel_l2", "cos", "failures", "ms",
               "passed", "batch", "heads", "kv_heads", "causal", "nonfinite", "tflops", "kernel", "data"}


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv("QATTN_CACHE_DIR", str(path))
    return path


@pytest.fixture
def no_gpu(monkeypatch):
    """Behave as on a machine without a GPU, wherever the tests run."""
    for module in (qattn.cli, qattn.cli_bench, qattn.cli_plan, qattn.check.parity):
        monkeypatch.setattr(module, "device_arch", lambda: None)


needs_clang = pytest.mark.skipif(find_tool("clang++-19", "clang++-20", "clang++") is None,
                                 reason="offline HIP compiles need clang-19 (.ci/run installs it)")


@pytest.fixture
def kernelless(monkeypatch):
    """A format with no generated kernel on any backend (emulator only), whatever kernels exist."""
    monkeypatch.setitem(RECIPES, "i8-f8", dataclasses.replace(RECIPES["i8-f8"], families={}))
    return "i8-f8"


def run(*args):
    return CliRunner().invoke(main, list(args))


def assert_usage_error(result, option):
    """A clean click usage error naming the option: exit 2 and no exception escaped (CliRunner
    catches a crash, so the absence of 'Traceback' in the output alone proves nothing)."""
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Usage:" in result.output and option in result.output, result.output


def test_list():
    result = run("list")
    assert result.exit_code == 0, result.output
    tile = RECIPES["f16"].family("cuda").default_tiles[128].name
    for text in ("prefill", "f16", "bf16", "kv8-imma", "sm_90a", "gfx942", tile):
        assert text in result.output
    # the archs that build a format through another family get their own rows
    wide = CliRunner().invoke(main, ["list"], env={"COLUMNS": "240"}).output
    assert "i8-f8 (--mma" in wide and "i8-f8 (default: wgmma)" in wide
    # a format whose arch default is the backend's own family: that row keeps the arch, the other unit has its own
    rows = [line for line in wide.splitlines() if "│ kv8-imma" in line]
    assert any("kv8-imma (--mma wgmma)" in line and "sm_90a" in line for line in rows), rows
    assert any("kv8-imma " in line.replace("kv8-imma (", "") and "sm_90a," in line for line in rows), rows
    # formats that share a family (f16 and bf16 on wgmma) name each arch once
    row = next(line for line in wide.splitlines() if "f16 (--mma wgmma)" in line)
    assert row.count("sm_90a") == 1, row


def test_gen_prints_source():
    name = KernelSpec(recipe="f16", head_dim=64, arch="sm_80").name
    result = run("gen", "prefill", "--format", "f16", "--head-dim", "64", "--arch", "sm_80")
    assert result.exit_code == 0, result.output
    assert name in result.stdout
    assert "extern \"C\"" in result.stdout


def test_gen_output_file_and_tile(tmp_path):
    out = tmp_path / "k.cu"
    result = run("gen", "-f", "f16", "-d", "128", "--tile", "64x64", "--warps", "4", "--stages", "3",
                 "--causal", "--arch", "sm_90a", "-o", str(out))
    assert result.exit_code == 0, result.output
    assert "prefill_f16_d128_m64n64w4s3_causal_sm90a" in out.read_text()


def test_gen_default_arch_without_gpu(no_gpu):
    result = run("gen", "-f", "f32")
    assert result.exit_code == 0, result.output
    assert "_sm90a" in result.stdout
    assert "no CUDA GPU found" in result.output


def test_inspect_json():
    result = run("inspect", "prefill", "-f", "f16", "-d", "64", "--arch", "sm_90a", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["resources"]["registers"] > 0
    assert report["resources"]["dynamic_smem"] > 0
    assert report["resources"]["blocks_per_sm"] >= 1
    assert report["instructions"]["listing"] in ("sass", "ptx")
    assert sum(report["instructions"]["matrix"].values()) > 0


def test_inspect_table():
    result = run("inspect", "-f", "f32", "-d", "64", "--arch", "sm_80")
    assert result.exit_code == 0, result.output
    assert "registers / thread" in result.output and "blocks / SM" in result.output
    assert "spill stores (B)" in result.output and "VGPRs" not in result.output
    assert "setmaxnreg" not in result.output


def test_inspect_shows_the_register_hand_over():
    """The warp-specialized wgmma kernel: registers at launch, then what setmaxnreg leaves the
    producer and gives the consumers (the launch's pool, shared out: 128*24 + 384*160 = 512*128 for
    the default's three consumer warpgroups, 128*24 + 128*232 = 256*128 for two 64-row blocks per SM)."""
    for tile, shape, claimed in ((["--tile", "192x128", "--warps", "12"], (128, 512, 1), 160),
                                 (["--tile", "64x128", "--warps", "4"], (128, 256, 2), 232)):
        args = ["inspect", "-f", "i8-f8", "-d", "128", "--arch", "sm_90a", "--stages", "2", *tile]
        res = json.loads(run(*args, "--json").stdout)["resources"]
        assert (res["registers"], res["threads"], res["blocks_per_sm"]) == shape
        assert (res["registers_released"], res["registers_claimed"]) == (24, claimed)
        consumers = res["threads"] - 128
        assert 128 * res["registers_released"] + consumers * res["registers_claimed"] <= res["threads"] * res["registers"]
        table = run(*args).output
        assert "registers after setmaxnreg: producer / consumers" in " ".join(table.split()) and f"24 / {claimed}" in table


def test_inspect_names_the_tile_kv8_calls_run():
    """Where qattn.attention runs a listed tile for long calls (kv8_families.LAUNCH_TILES), inspect
    without a tile says so; naming a tile, or an arch or format without one, drops the note."""
    plain = run("inspect", "-f", "kv8-split", "-d", "128", "--arch", "sm_90a")
    assert plain.exit_code == 0, plain.output
    text = " ".join(plain.output.split())
    assert "qattn.attention calls of at least 256 query rows run m128n64w8s3 instead (inspect it with --queries 256)" \
        in text
    split = json.loads(run("inspect", "-f", "kv8-split", "-d", "128", "--arch", "sm_90a", "--json").stdout)
    assert split["launch_tiles"] == [{"tile": "m128n64w8s3", "least_queries": 256, "least_heads": 1, "mma": "mma.sync", "options": {}}]
    named = run("inspect", "-f", "kv8-split", "-d", "128", "--arch", "sm_90a", "--tile", "64x64", "--stages", "2")
    assert named.exit_code == 0 and "instead" not in named.output
    assert "launch_tiles" not in json.loads(run("inspect", "-f", "kv8-split", "-d", "128", "--arch", "sm_80", "--json").stdout)
    imma = run("inspect", "-f", "kv8-imma", "-d", "64", "--arch", "sm_90a")
    text = " ".join(imma.output.split())
    assert "calls of at least 2048 query rows run m128n64w8s3 on wgmma instead" in text, imma.output
    assert "(inspect it with --queries 2048)" in text
    routed = json.loads(run("inspect", "-f", "kv8-imma", "-d", "64", "--arch", "sm_90a", "--queries", "2048",
                            "--json").stdout)
    assert routed["spec"]["tile"]["block_m"] == 128 and "launch_tiles" not in routed
    imma = json.loads(run("inspect", "-f", "kv8-imma", "-d", "128", "--arch", "sm_90a", "--json").stdout)
    assert imma["launch_tiles"] == [{"tile": "m128n64w8s3", "least_queries": 256, "least_heads": 1, "mma": "wgmma", "options": {}}]
    assert imma["spec"]["tile"]["stages"] == 3  # the tuned default: what shorter calls run
    wgmma = json.loads(run("inspect", "-f", "kv8-imma", "-d", "128", "--arch", "sm_90a", "--mma", "wgmma", "--json").stdout)
    assert "launch_tiles" not in wgmma and wgmma["instructions"]["warpgroup_mmas"]["placeholders"] == 0
    # f16 on sm_90a d128: bands by the query rows, causal or not (dense recipes.LAUNCH_TILES)
    f16 = json.loads(run("inspect", "-f", "f16", "-d", "128", "--arch", "sm_90a", "--json").stdout)
    assert [(b["least_queries"], b["mma"], b["options"]) for b in f16["launch_tiles"]] == [
        (512, "wgmma", {"persistent": "on", "chain": "on"}), (4096, "wgmma", {})]
    text = " ".join(run("inspect", "-f", "f16", "-d", "128", "--arch", "sm_90a").output.split())
    assert "calls of 512 to 4095 query rows run m128n128w8s2 on wgmma, persistent on, chain on instead" in text, text
    assert "calls of at least 4096 query rows run m128n128w8s2 on wgmma instead" in text
    causal = json.loads(run("inspect", "-f", "f16", "-d", "128", "--arch", "sm_90a", "--causal", "--json").stdout)
    assert [(b["least_queries"], b["options"]) for b in causal["launch_tiles"]] == [
        (768, {"persistent": "on"}), (1024, {"persistent": "on", "chain": "on"})]


@pytest.mark.parametrize("queries", [1, 767, 1023, 1024, 9000])
def test_gen_and_inspect_take_the_kernel_calls_of_n_rows_run(queries):
    """--queries N shows what qattn.attention runs for calls of N query rows (the note's hint), options and all."""
    routed = builtin_spec("f16", 128, True, queries, "sm_90a")
    source = run("gen", "-f", "f16", "-d", "128", "--causal", "--queries", str(queries), "--arch", "sm_90a")
    assert source.exit_code == 0 and source.output.startswith(f"// {routed.name}:"), source.output[:300]
    report = json.loads(run("inspect", "-f", "f16", "-d", "128", "--causal", "--queries", str(queries), "--arch",
                            "sm_90a", "--json").stdout)
    assert report["name"] == routed.name and "launch_tiles" not in report
    assert ("wgmma" in routed.name) == (queries >= 768) and ("chain" in routed.name) == (queries >= 1024)
    assert_usage_error(run("gen", "--queries", "1024", "--stages", "3", "--arch", "sm_90a"), "--queries")
    assert_usage_error(run("inspect", "decode", "--queries", "1024", "--arch", "sm_90a"), "--queries")


def test_gen_and_inspect_take_the_kernel_of_a_calls_sequence_heads():
    """--heads N with --queries: on sm_90a d64 non-causal calls of 512 rows run the chained wgmma kernel over 512
    sequence-heads or more, the mma.sync kernel over fewer; without --heads, the kernel of many."""
    few, many = (builtin_spec("f16", 64, False, 512, "sm_90a", heads) for heads in (4, 512))
    assert few.name != many.name and "wgmma" in many.name and "wgmma" not in few.name
    for heads, routed in (("4", few), ("511", few), ("512", many), (None, many)):
        args = ("-f", "f16", "-d", "64", "--queries", "512", *(("--heads", heads) if heads else ()), "--arch", "sm_90a")
        source = run("gen", *args)
        assert source.exit_code == 0 and source.output.startswith(f"// {routed.name}:"), source.output[:300]
        assert json.loads(run("inspect", *args, "--json").stdout)["name"] == routed.name
    note = " ".join(run("inspect", "-f", "f16", "-d", "64", "--arch", "sm_90a").output.split())
    assert "over at least 512 sequence-heads (batch x heads) run" in note and "--queries 512 --heads 512)" in note
    for command in ("gen", "inspect", "compile"):
        assert_usage_error(run(command, "--heads", "8", "--arch", "sm_90a"), "--heads")
    assert_usage_error(run("inspect", "--queries", "512", "--heads", "0", "--arch", "sm_90a"), "--heads")


def test_inspect_shows_the_format_blocks():
    """int8-QK kernels: the query rows per Q scale, keys per K scale block and K scale groups the
    emulator must be given to compute what the kernel computes (on sm_90a the wgmma kernels' per-row
    Q scales and four K groups per tile); none for other formats."""
    wgmma = json.loads(run("inspect", "-f", "i8-f8", "-d", "64", "--arch", "sm_90a", "--json").stdout)
    assert wgmma["scale_blocks"] == {"q_rows": 1, "k_keys": 128, "k_groups": 4,
                                     "emulator": {"block_m": 1, "block_n": 128, "k_granularity": "thread"}}
    short = run("inspect", "-f", "i8-f8", "-d", "64", "--arch", "sm_90a", "--tile", "64x64", "--warps", "4",
                "--stages", "2")
    assert short.exit_code == 0, short.output
    words = " ".join(short.output.split())
    assert "one Q scale per query row, 64 keys per K scale block in 4 K scale groups and softmax step" in words
    assert "block_m=1, block_n=64, k_granularity='thread'" in words
    sync = json.loads(run("inspect", "-f", "i8-i8", "-d", "64", "--arch", "sm_80", "--json").stdout)
    assert sync["scale_blocks"] == {"q_rows": 128, "k_keys": 64, "k_groups": 1,
                                    "emulator": {"block_m": 128, "block_n": 64, "k_granularity": "block"}}
    assert "scale_blocks" not in json.loads(run("inspect", "-f", "f16", "-d", "64", "--arch", "sm_80", "--json").stdout)


@needs_clang
def test_inspect_hip():
    report = json.loads(run("inspect", "--backend", "hip", "--arch", "gfx942", "-d", "64", "--json").stdout)
    res = report["resources"]
    assert {"registers", "sgprs", "scratch", "vgpr_spills", "sgpr_spills", "occupancy_waves"} <= set(res)
    assert res["registers"] > 0 and res["sgprs"] > 0 and res["occupancy_waves"] >= 1
    assert report["instructions"]["listing"] == "amdgpu"
    assert any(op.startswith("v_mfma") for op in report["instructions"]["matrix"])
    assert any(op.startswith("v_cvt") for op in report["instructions"]["convert"])

    result = run("inspect", "--backend", "hip", "--arch", "gfx942", "-d", "64")
    assert result.exit_code == 0, result.output
    values = {}
    for line in result.stdout.splitlines():
        cells = [c.strip() for c in line.strip("│ ").split("│")]
        if len(cells) == 2:
            values[cells[0]] = cells[1]
    # HIP rows in clang's terms, none of CUDA's (which would all read "-").
    assert values["VGPRs / lane"] == str(res["registers"]) and values["SGPRs / wave"] == str(res["sgprs"])
    assert values["scratch (B / lane)"] == str(res["scratch"]) and values["VGPRs spilled"] == str(res["vgpr_spills"])
    assert values["occupancy (waves / SIMD)"] == str(res["occupancy_waves"])
    assert values["LDS, dynamic (B)"] == str(res["dynamic_smem"])
    assert "registers / thread" not in values and "blocks / SM" not in values


def test_inspect_hip_without_clang(monkeypatch):
    def no_clang(source, arch, name, entry=None):
        raise RuntimeError("backend hip: offline compiles need clang-19 (apt-get install clang-19)")

    monkeypatch.setattr("qattn.engine.compile.compile_hip_offline", no_clang)
    result = run("inspect", "--backend", "hip", "--arch", "gfx942", "-d", "64")
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    assert "need clang-19" in result.output and "Traceback" not in result.output


def test_count_instructions_and_occupancy():
    sass = ("        /*0100*/                   HMMA.16816.F32 R4, R8, R12, R4 ;\n"
            "        /*0110*/              @!P0 F2FP.F16.F32.PACK_AB R2, R3, R2 ;\n"
            "        /*0120*/                   FADD R1, R1, R2 ;\n")
    assert count_instructions(sass, "sass") == {"matrix": {"HMMA.16816.F32": 1}, "convert": {"F2FP.F16.F32.PACK_AB": 1}}
    ptx = "\tmma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%f1}, {%r1}, {%r2}, {%f1};\n\tcvta.to.global.u64 %rd1, %rd2;\n" \
          "\tcvt.rn.f16x2.f32 %r3, %f1, %f2;\n"
    counts = count_instructions(ptx, "ptx")
    assert counts["matrix"] == {"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32": 1}
    assert counts["convert"] == {"cvt.rn.f16x2.f32": 1}
    assert blocks_per_sm("sm_90a", 256, 128, 100_000) == 2
    assert blocks_per_sm("sm_86", 256, 128, 104_448) == 0  # over the 99 KiB per-block limit
    assert blocks_per_sm("sm_75", 256, 128, 0) is None


def test_compile_matrix():
    result = run("compile", "prefill", "-f", "f16", "-f", "f32", "-d", "64", "--arch", "sm_80", "--arch", "sm_90a")
    assert result.exit_code == 0, result.output
    assert "4 of 4 compiled, 0 failed" in result.output
    assert "prefill_f32_d64_m32n32w4s1_sm90a" in result.output


def test_compile_shows_progress_and_summary():
    result = run("compile", "-f", "f32", "-d", "32", "-d", "64", "--arch", "sm_80")
    assert result.exit_code == 0, result.output
    # Not a terminal: one progress line per spec on stderr, then the summary on stdout.
    names = [KernelSpec(recipe="f32", head_dim=d, arch="sm_80").name for d in (32, 64)]
    assert f"[1/2] {names[0]} ok" in result.stderr and f"[2/2] {names[1]} ok" in result.stderr
    assert all(name in result.stdout for name in names)
    assert "2 of 2 compiled, 0 failed" in result.stdout


def test_compile_all_expands_what_is_left_out(monkeypatch):
    split = RECIPES["kv8-split"]  # as if it had a CUDA kernel only: --all --backend hip leaves it out
    monkeypatch.setitem(RECIPES, "kv8-split", dataclasses.replace(split, families={"cuda": split.family("cuda")}))
    hip = compile_matrix("prefill", [], [64], None, None, None, None, "hip", ["gfx942"], True)
    with_hip = [name for name, rec in RECIPES.items() if "hip" in rec.families]
    assert [(s.recipe, s.head_dim, s.causal, s.arch) for s in hip] == [
        (f, 64, c, "gfx942") for f in with_hip for c in (False, True)]
    assert "kv8-imma" in with_hip and "kv8-split" not in with_hip
    cuda = compile_matrix("prefill", ["f32"], [], None, None, None, False, "cuda", [], True)
    family = RECIPES["f32"].family("cuda")
    assert {(s.head_dim, s.arch) for s in cuda} == {(d, a) for d in family.head_dims for a in family.archs}
    assert not any(s.causal for s in cuda)


def test_compile_all_skips_what_a_picked_format_does_not_support(monkeypatch):
    """--all --arch sm_80 builds every format whose kernel runs on sm_80 and skips the others;
    naming such a format, or an arch no kernel supports, is an error."""
    bf16 = RECIPES["bf16"]
    newer = dataclasses.replace(bf16.family("cuda"), archs=("sm_90a",), head_dims=(128,))
    monkeypatch.setitem(RECIPES, "bf16", dataclasses.replace(bf16, families={"cuda": newer}))
    dims, archs = [64, 128], ["sm_80", "sm_90a"]
    specs = compile_matrix("prefill", [], dims, None, None, None, False, "cuda", archs, True)
    built = {(s.recipe, s.head_dim, s.arch) for s in specs}
    assert {(d, a) for f, d, a in built if f == "bf16"} == {(128, "sm_90a")}
    assert {("f16", 64, "sm_80"), ("f32", 128, "sm_90a")} <= built
    assert built == {(name, d, a) for name, r in RECIPES.items() if "cuda" in r.families
                     for d in dims for a in archs if d in r.families["cuda"].head_dims and a in r.families["cuda"].archs}
    assert_usage_error(run("compile", "--all", "-f", "bf16", "--arch", "sm_80"), "--arch")
    assert_usage_error(run("compile", "--all", "--arch", "sm_75"), "--arch")
    assert_usage_error(run("compile", "--all", "-d", "48", "--arch", "sm_90a"), "'--head-dim' / '--arch'")


ROUTED = [(fmt, d, causal) for fmt in ("f16", "bf16", "i8-f16", "i8-f8", "kv8-imma") for d in (64, 128)
          for causal in (False, True)]


@pytest.mark.parametrize("fmt, d, causal", ROUTED)
def test_compile_all_builds_the_kernel_of_every_query_count(fmt, d, causal):
    """With QATTN_NO_JIT=1 a call finds its kernel only if `qattn compile` built it: on sm_90a the kernel
    depends on the call's query rows, and --all must hold each count's."""
    specs = compile_matrix("prefill", [fmt], [d], None, None, None, causal, "cuda", ["sm_90a"], True)
    counts = sorted({1, 63, 64, 255, 256, 1000, 65536} | {2 ** k + e for k in range(7, 16) for e in (-1, 0, 1)})
    called = {builtin_spec(fmt, d, causal, n, "sm_90a") for n in counts}
    assert len(called) >= 2  # the default (the shortest calls') and a routed kernel
    variants = family_of(fmt).variants
    assert set(specs) == called | {v for s in called for v in (variants(s) if variants else ())}


def test_compile_queries_builds_what_those_calls_run():
    specs = compile_matrix("prefill", ["i8-f8", "f16"], [128], None, None, None, True, "cuda", ["sm_90a", "sm_89"],
                           False, queries=[1024, 32768])
    routed = [builtin_spec(fmt, 128, True, n, arch) for fmt in ("i8-f8", "f16") for arch in ("sm_90a", "sm_89")
              for n in (1024, 32768)]
    i8_f8 = list(dict.fromkeys(routed[:4]))  # one kernel a call, no variant (sm_89: one for every count)
    assert specs[:len(i8_f8)] == i8_f8 and len(i8_f8) == 3
    f16 = set(routed[4:]) | {v for s in routed[4:] for v in stride_variants(s)}  # and the variants on sm_90a
    assert set(specs[len(i8_f8):]) == f16
    default = compile_matrix("prefill", ["f16"], [128], None, None, None, True, "cuda", ["sm_90a"], False)
    assert default[0] not in specs and routed[4].family.values["mma_unit"] == "wgmma"
    hip = compile_matrix("prefill", ["f16"], [64], None, None, None, None, "hip", ["gfx942"], False, queries=[4096])
    assert hip == compile_matrix("prefill", ["f16"], [64], None, None, None, None, "hip", ["gfx942"], False)


def test_compile_all_builds_each_qk_path_auto_picks():
    """A decode call's QK path ("auto") depends on its packed rows: i8-i8 on sm_90a takes int8 MMAs past one
    block's rows, so --all builds both, each the spec a cache of those options asks for."""
    specs = compile_matrix("decode", ["i8-i8", "e4m3-e4m3"], [128], None, None, None, False, "cuda", ["sm_90a"], True,
                           options={"qk": "auto"})
    cache_options = {"page_size": 32, "scale_mode": "token", "k_mean": "off", "k_balance": "off", "k_rope": "off"}
    assert specs == [KernelSpec(kind="decode", recipe=fmt, head_dim=128, arch="sm_90a",
                                options={**cache_options, "qk": resolve_qk(fmt, "sm_90a", "auto", rows)})
                     for fmt, rows in (("i8-i8", 1), ("i8-i8", MAX_ROWS + 1), ("e4m3-e4m3", 1))]
    assert compile_matrix("decode", ["i8-i8"], [128], None, None, None, None, "cuda", ["sm_90a"], True) == specs[:2]
    assert_usage_error(run("gen", "decode", "--causal", "--arch", "sm_90a"), "--causal")  # decode rows always are
    pre = compile_matrix("decode", ["i8-i8"], [128], None, None, None, False, "cuda", ["sm_90a"], True,
                         options={"qk": "auto", "k_rope": "pre"})
    assert [dict(s.options)["qk"] for s in pre] == ["transform"]


def test_compile_queries_builds_a_routed_kernel(monkeypatch):
    built = []
    resources = {"registers": 168, "dynamic_smem": 200_000, "spill_stores": 0, "spill_loads": 0}
    monkeypatch.setattr("qattn.engine.kernel.build_kernel",
                        lambda spec, cache=None: built.append(spec) or SimpleNamespace(resources=resources))
    result = run("compile", "-f", "f16", "-d", "128", "--causal", "--queries", "1024", "--arch", "sm_90a")
    assert result.exit_code == 0, result.output
    routed = builtin_spec("f16", 128, True, 1024, "sm_90a")
    assert built == [routed, *stride_variants(routed)] and len(built) == 3  # K/V rows by cp.async; Q rows too
    assert routed.name in result.stdout and "3 of 3 compiled" in result.stdout
    assert_usage_error(run("compile", "--queries", "1024", "--tile", "128x64", "--arch", "sm_90a"), "--queries")
    assert_usage_error(run("compile", "--queries", "1024", "--option", "persistent=on", "--arch", "sm_90a"),
                       "--queries")
    assert_usage_error(run("compile", "decode", "--queries", "4", "--arch", "sm_90a"), "--queries")
    assert_usage_error(run("compile", "--queries", "0", "--arch", "sm_90a"), "--queries")


def test_compile_queries_and_heads_builds_that_calls_kernel(monkeypatch):
    built = []
    resources = {"registers": 168, "dynamic_smem": 100_000, "spill_stores": 0, "spill_loads": 0}
    monkeypatch.setattr("qattn.engine.kernel.build_kernel",
                        lambda spec, cache=None: built.append(spec) or SimpleNamespace(resources=resources))
    result = run("compile", "-f", "f16", "-d", "64", "--queries", "512", "--heads", "4", "--arch", "sm_90a")
    assert result.exit_code == 0, result.output
    assert built == [builtin_spec("f16", 64, False, 512, "sm_90a", 4)]  # mma.sync: no stride variants
    built.clear()
    assert run("compile", "-f", "f16", "-d", "64", "--queries", "512", "--arch", "sm_90a").exit_code == 0
    assert {s.name for s in built} >= {builtin_spec("f16", 64, False, 512, "sm_90a", h).name for h in (4, 512)}


def test_stride_variants_hold_every_kernel_the_launcher_switches_to(monkeypatch):
    """Where the TMA cannot address a call's K/V or Q strides the dense launcher runs another spec
    (kv_rows on, q_tma off): each such spec is among stride_variants, which `qattn compile` builds."""
    from qattn.formats.dense import launch

    monkeypatch.setattr("qattn.engine.kernel.build_kernel", lambda spec, cache=None: SimpleNamespace(spec=spec))
    routed = builtin_spec("f16", 128, True, 1024, "sm_90a")
    assert dict(routed.options)["q_tma"] == "on" and routed.family.values["kv_rows"] == "off"
    k = np.broadcast_to(np.zeros((1, 1, 1024, 128), np.float16), (2, 2, 1024, 128))  # batch and heads at stride 0
    kernel, maps = launch._kv_maps(SimpleNamespace(spec=routed), k, k)
    assert maps is None and kernel.spec in stride_variants(routed)
    q = np.zeros((2, 8, 1024, 130), np.float16)[..., :128]  # rows 260 bytes apart: not a multiple of 16
    for start in (routed, kernel.spec):
        switched, q_map = launch._rows_map(SimpleNamespace(spec=start), "q_tma", "q", q.shape, q.strides, "float16", 128)
        assert switched.spec in [routed, *stride_variants(routed)] and q_map is None
    assert switched.spec == kernel.spec  # kv_rows on settles q_tma off already
    assert stride_variants(builtin_spec("f16", 128, True, 100, "sm_90a")) == []  # mma.sync: no TMA


def test_compile_builds_the_modules_a_family_builds_beside_its_kernels(monkeypatch):
    """kv8 calls write their cache with a writer module of its own: compiling a kv8 kernel builds it too (once an
    arch), so that QATTN_NO_JIT=1 finds it."""
    built = []
    monkeypatch.setattr("qattn.engine.kernel.build_kernel",
                        lambda spec, cache=None: built.append(spec.name) or SimpleNamespace(resources={"dynamic_smem": 0}))
    monkeypatch.setattr("qattn.formats.kv8.build_writer",
                        lambda arch: built.append(arch) or (b"", {"resources": {"registers": 30}}))
    result = run("compile", "-f", "kv8-imma", "-f", "f16", "-d", "64", "-d", "128", "--arch", "sm_90a")
    assert result.exit_code == 0, result.output
    assert built.count("sm_90a") == 1 and len(built) == 5
    assert "kv8_write_sm90a" in result.stdout and "5 of 5 compiled" in result.stdout


def test_compile_hip_summary_counts_spilled_registers(monkeypatch):
    resources = {"registers": 128, "sgprs": 60, "scratch": 16, "vgpr_spills": 3, "sgpr_spills": 1,
                 "occupancy_waves": 4, "threads": 128, "dynamic_smem": 18944}
    monkeypatch.setattr("qattn.engine.kernel.build_kernel", lambda spec, cache=None: SimpleNamespace(resources=resources))
    result = run("compile", "--backend", "hip", "-d", "64", "--arch", "gfx942")
    assert result.exit_code == 0, result.output
    row = next(line for line in result.stdout.splitlines() if "gfx942" in line)
    cells = [c.strip() for c in row.strip("│ ").split("│")]
    assert cells[1] == "ok" and cells[3:] == ["128", "18944", "4"], cells
    assert "VGPRs" in result.stdout and "spilled regs" in result.stdout


def test_compile_failure_exits_nonzero(monkeypatch):
    def broken(spec, cache=None):
        raise CompileError(spec.name, ["-O3"], "k.cu(3): error: expected a ';'", "a\nb\nc\n")

    monkeypatch.setattr("qattn.engine.kernel.build_kernel", broken)
    result = run("compile", "-f", "f16", "-d", "64", "--arch", "sm_80")
    assert result.exit_code == 1
    assert "FAILED" in result.output and "expected a ';'" in result.output


@pytest.mark.parametrize("args, option", [
    (["gen", "--format", "nope"], "--format"),
    (["gen", "--head-dim", "80", "--arch", "sm_90a"], "--head-dim"),
    (["gen", "--tile", "128by64", "--arch", "sm_90a"], "--tile"),
    (["gen", "--tile", "128x24", "--arch", "sm_90a"], "--tile"),
    (["gen", "--arch", "sm_70"], "--arch"),
    (["inspect", "--head-dim", "80", "--arch", "sm_90a"], "--head-dim"),
    (["compile", "--head-dim", "80", "--arch", "sm_90a"], "--head-dim"),
    (["parity", "--format", "f16,nope"], "--format"),
    (["parity", "--shape", "4096x4096"], "--shape"),
    (["parity", "--heads", "8", "--kv-heads", "3"], "--kv-heads"),
])
def test_bad_inputs_name_the_option(args, option):
    assert_usage_error(run(*args), option)


@pytest.mark.parametrize("args", [["gen", "--arch", "sm_90a"], ["compile", "--arch", "sm_90a"],
                                  ["gen", "--backend", "hip", "--arch", "gfx942"], ["parity", "--backend", "cuda"]])
def test_format_without_kernel_names_format(kernelless, args):
    assert_usage_error(run(*args, "--format", kernelless), "--format")


@pytest.mark.parametrize("args, hint", [
    (["--stages", "9"], "'--stages'"),
    (["--warps", "8", "--tile", "64x64"], "'--tile' / '--warps'"),
    (["--tile", "0x64"], "'--tile'"),
    (["-f", "f32", "--stages", "2"], "'--stages'"),
])
def test_tile_errors_name_the_options_given(args, hint):
    result = run("gen", "--arch", "sm_90a", *args)
    assert_usage_error(result, hint)
    if "--tile" not in args:
        assert "'--tile'" not in result.output  # the user gave no --tile: don't blame it


def test_json_folder_checked_before_running(monkeypatch, tmp_path):
    def never(*args, **kwargs):
        raise AssertionError("parity ran although --json cannot be written")

    monkeypatch.setattr(qattn.check.parity, "run_parity", never)
    assert_usage_error(run("parity", "--backend", "numpy", "--json", str(tmp_path / "missing" / "p.json")), "--json")


def test_parity_numpy_json(tmp_path):
    out = tmp_path / "parity.json"
    result = run("parity", "--backend", "numpy", "-f", "f32,f16", "--shape", "70/33", "--shape", "5/9",
                 "--heads", "4", "--kv-heads", "2", "-d", "64", "--causal", "--json", str(out))
    assert result.exit_code == 0, result.output
    records = json.loads(out.read_text())
    assert [(r["format"], r["ctx"], r["queries"]) for r in records] == [
        ("f32", 70, 33), ("f32", 5, 9), ("f16", 70, 33), ("f16", 5, 9)]
    for r in records:
        assert RECORD_KEYS <= set(r)
        assert r["backend"] == "numpy" and r["ms"] is None and r["kernel"] is None
        assert r["passed"] and r["nonfinite"] == 0 and r["failures"] == 0
    assert "pass" in result.output and "FAIL" not in result.output


def test_parity_on_a_preset_and_its_smoothing(tmp_path):
    """--preset checks the formats on a qattn.data preset's Q, K and V (named in the records and the title); on
    scale-type K outliers the int8-QK formats fail under K's mean alone, and --smoothing mean+balance goes to the
    emulator (and the kernel) as a call's smoothing, several times closer to FP64."""
    out = tmp_path / "parity.json"

    def records(*options):
        result = run("parity", "--backend", "numpy", "-f", "f16,i8-f16", "--shape", "512/64", "--heads", "2",
                     "--json", str(out), *options)
        assert result.exit_code in (0, 1), result.output
        return result, {r["format"]: r for r in json.loads(out.read_text())}

    plain, normal = records()
    assert plain.exit_code == 0 and "N(0,1) Q/K/V" in plain.stdout
    assert {r["data"] for r in normal.values()} == {"normal"} and "smoothing" not in normal["i8-f16"]
    failed, outliers = records("--preset", "outliers_scale")
    assert failed.exit_code == 1 and "outliers_scale Q/K/V" in failed.stdout
    assert {r["data"] for r in outliers.values()} == {"outliers_scale"}
    assert outliers["f16"]["passed"] and not outliers["i8-f16"]["passed"]
    assert outliers["i8-f16"]["rel_l2"] > 5 * normal["i8-f16"]["rel_l2"]
    _, balanced = records("--preset", "outliers_scale", "--smoothing", "mean+balance")
    assert balanced["i8-f16"]["smoothing"] == "mean+balance" and "smoothing" not in balanced["f16"]
    assert balanced["i8-f16"]["rel_l2"] < outliers["i8-f16"]["rel_l2"] / 2
    assert balanced["f16"]["rel_l2"] == outliers["f16"]["rel_l2"]  # the same draws
    _, unsmoothed = records("--smoothing", "none")
    assert unsmoothed["i8-f16"]["smoothing"] is None and unsmoothed["i8-f16"]["rel_l2"] != normal["i8-f16"]["rel_l2"]
    assert_usage_error(run("parity", "--backend", "numpy", "-f", "f16", "--smoothing", "mean"), "--smoothing")
    assert_usage_error(run("parity", "--kind", "decode", "--smoothing", "mean"), "--smoothing")
    assert_usage_error(run("parity", "--preset", "nope"), "--preset")


def test_parity_on_captured_tensors(tmp_path):
    """--npz checks the formats on a file's q, k, v: each CTX/QUERIES its last keys and rows (all of them by default),
    the file's batch, heads and head dim, the records naming it; what the file cannot hold is refused by option."""
    rng = np.random.default_rng(5)
    captured = {"q": rng.standard_normal((1, 4, 300, 64)).astype(np.float32),
                "k": rng.standard_normal((1, 2, 300, 64)).astype(np.float32) + 3.0,  # a K bias
                "v": rng.standard_normal((1, 2, 300, 64)).astype(np.float32)}
    path, out = tmp_path / "layer7.npz", tmp_path / "parity.json"
    np.savez(path, **captured)
    result = run("parity", "--backend", "numpy", "-f", "f16,i8-f8", "--npz", str(path), "--shape", "300/300",
                 "--shape", "200/40", "--causal", "--json", str(out))
    assert result.exit_code == 0, result.output
    assert "layer7.npz Q/K/V" in result.stdout and "heads 4/2, D 64" in result.stdout
    records = json.loads(out.read_text())
    assert [(r["format"], r["ctx"], r["queries"], r["heads"], r["kv_heads"], r["head_dim"]) for r in records] == [
        (f, c, q, 4, 2, 64) for f in ("f16", "i8-f8") for c, q in ((300, 300), (200, 40))]
    assert {r["data"] for r in records} == {"npz:layer7.npz"}
    # the window: the last 200 keys and the last 40 rows, against FP64 on the same rounded values
    from qattn.check import emulate, metrics, reference

    q, k, v = (x.astype(np.float16) for x in (captured["q"][:, :, -40:], captured["k"][:, :, -200:],
                                             captured["v"][:, :, -200:]))
    ref = reference.attention(*(x.astype(np.float64) for x in (q, k, v)), causal=True)
    window = emulate.emulate("f16", q, k, v, causal=True, block_n=qattn.check.parity._emulator_block_n("f16", 64))
    assert records[1]["rel_l2"] == metrics.compare(window, ref).rel_l2
    whole = run("parity", "--backend", "numpy", "-f", "f16", "--npz", str(path), "--json", str(out))
    assert whole.exit_code == 0 and [(r["ctx"], r["queries"]) for r in json.loads(out.read_text())] == [(300, 300)]
    assert_usage_error(run("parity", "--backend", "numpy", "--npz", str(path), "--shape", "400/10"), "--shape")
    assert_usage_error(run("parity", "--backend", "numpy", "--npz", str(path), "--heads", "4"), "--npz")
    assert_usage_error(run("parity", "--backend", "numpy", "--npz", str(path), "--preset", "bias"), "--npz")
    np.savez(tmp_path / "no_v.npz", q=captured["q"], k=captured["k"])
    assert_usage_error(run("parity", "--backend", "numpy", "--npz", str(tmp_path / "no_v.npz")), "--npz")


def test_parity_preset_inputs_are_the_presets_rounded():
    from qattn import data
    from qattn.check.parity import make_inputs

    shapes = ((1, 2, 40, 64), (1, 1, 300, 64), (1, 1, 300, 64))
    (q, k, v), (q64, _, _) = make_inputs("f16", shapes, np.random.SeedSequence([0, 300, 40]), "bias")
    seed = int(np.random.default_rng(np.random.SeedSequence([0, 300, 40])).integers(2 ** 31))
    given = data.preset("bias", ctx=300, queries=40, heads=2, kv_heads=1, head_dim=64, seed=seed)
    assert all(np.array_equal(x, given[n].astype(np.float16)) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    assert q64.dtype == np.float64 and np.array_equal(q64, q.astype(np.float64))
    (_, k8, _), (_, k8_64, _) = make_inputs("kv8-imma", shapes, np.random.SeedSequence([0, 300, 40]), "bias")
    assert not np.array_equal(k8_64, k8.astype(np.float64))  # the cache's dequantized codes, not the input


def test_parity_auto_without_gpu_runs_emulators(no_gpu):
    result = run("parity", "-f", "bf16", "--shape", "40/40", "--heads", "1")
    assert result.exit_code == 0, result.output
    assert "emulators" in result.output
    assert "numpy" in result.stdout


def test_parity_cuda_without_gpu_is_an_error(no_gpu):
    result = run("parity", "-f", "f16", "--backend", "cuda", "--shape", "8/8")
    assert result.exit_code != 0
    assert "no CUDA GPU" in result.output


def test_parity_matrix_unit_needs_a_gpu_and_a_known_unit(no_gpu):
    """FORMAT@UNIT names the format's CUDA kernel on another matrix unit: without a GPU it is
    refused by name (the emulator is the same for every unit), and so is an unknown unit."""
    result = run("parity", "-f", "i8-f8@mma.sync", "--shape", "8/8")
    assert result.exit_code == 2 and "a matrix unit names a CUDA kernel" in result.output
    result = run("parity", "-f", "i8-f8@tensor", "--shape", "8/8")
    assert result.exit_code == 2 and "unknown matrix unit 'tensor'" in result.output and "mma.sync, wgmma" in result.output


def test_parity_plans_a_format_on_a_matrix_unit(monkeypatch):
    from qattn.check import parity
    from qattn.engine import spec as spec_module

    monkeypatch.setattr(spec_module, "device_arch", lambda: "sm_90a")
    monkeypatch.setenv("QATTN_TUNED", "0")  # the built-in choices, whatever a local tune stored
    checks = parity.plan(["i8-f8@mma.sync", "i8-f8"], [(2048, 256)], gpu=True)
    assert checks == [("i8-f8@mma.sync", "cuda", 2048, 256), ("i8-f8", "cuda", 2048, 256)]
    spec = parity.cuda_spec("i8-f8@mma.sync", 128, False, 256)
    assert spec.family.values["mma_unit"] == "mma.sync" and spec.tile == spec.family.default_tile(128, False, "sm_90a")
    assert parity.cuda_spec("i8-f8", 128, False, 256).family.values["mma_unit"] == "wgmma"
    with pytest.raises(ValueError, match="kv8-split on cuda sm_90a builds with mma.sync, got 'wgmma'"):
        parity.plan(["kv8-split@wgmma"], [(64, 64)], gpu=True)
    # kv8-imma: calls of many queries run the wgmma kernel; FORMAT@UNIT pins the unit at its default tile
    assert parity.plan(["kv8-imma@wgmma"], [(2048, 64)], gpu=True) == [("kv8-imma@wgmma", "cuda", 2048, 64)]
    long_call = parity.cuda_spec("kv8-imma", 128, False, 2048)
    assert long_call.family.values["mma_unit"] == "wgmma" and long_call.tile.block_m == 128
    assert parity.cuda_spec("kv8-imma", 128, False, 64).family.values["mma_unit"] == "mma.sync"
    pinned = parity.cuda_spec("kv8-imma@mma.sync", 128, False, 2048)
    assert pinned.family.values["mma_unit"] == "mma.sync" and pinned.tile == pinned.family.default_tile(128, False, "sm_90a")
    # f16 / bf16: the wgmma kernel by the query rows and sequence-heads, as qattn.attention runs them (causal d128
    # from 768 rows, from 1024 below 64 sequence-heads)
    assert parity.cuda_spec("f16", 128, True, 32768).family.values["mma_unit"] == "wgmma"
    assert parity.cuda_spec("bf16", 64, False, 1024).family.values["mma_unit"] == "wgmma"
    assert parity.cuda_spec("f16", 128, True, 767).family.values["mma_unit"] == "mma.sync"
    assert parity.cuda_spec("f16", 128, True, 1023, heads=32).family.values["mma_unit"] == "mma.sync"
    assert parity.cuda_spec("f16@mma.sync", 128, False, 32768).family.values["mma_unit"] == "mma.sync"


def test_parity_fails_over_tolerance(monkeypatch):
    monkeypatch.setitem(RECIPES, "f32", dataclasses.replace(RECIPES["f32"], tolerance=Tolerance(0.0, 0.0)))
    result = run("parity", "--backend", "numpy", "-f", "f32", "--shape", "16/16", "--heads", "1")
    assert result.exit_code == 1
    assert "FAIL max_rel rel_l2" in result.stdout and "0 / 0" in result.stdout  # what failed, against what
    assert "1 of 1 checks failed" in result.stderr


def test_parity_auto_with_gpu_notes_formats_without_kernel(monkeypatch, kernelless):
    for module in (qattn.cli, qattn.check.parity):
        monkeypatch.setattr(module, "device_arch", lambda: "sm_90a")
    result = run("parity", "-f", kernelless, "--shape", "16/16", "--heads", "1")
    assert result.exit_code == 0, result.output
    assert f"no CUDA kernel for {kernelless}" in result.stderr and "no CUDA GPU" not in result.stderr


@pytest.mark.slow
def test_tools_parity_defaults_without_gpu():
    """tools/parity with no options on a machine without a GPU (hidden here): it says so, runs
    every default format on the emulators, writes no fake timing, and stays quick: a budget on
    CPU time with one BLAS thread (waiting BLAS threads spin, so on a busy machine wall and CPU
    time measure the load, not the job; the emulators of every default format and shape take about
    30 s of one core of a CI machine, so the budget is three times that)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT), OPENBLAS_NUM_THREADS="1")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "parity")], capture_output=True, text=True,
                            cwd="/", env=env, timeout=300)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime) < 90
    assert "no CUDA GPU found: running the CPU emulators" in result.stderr
    rows = [line for line in result.stdout.splitlines() if "numpy" in line]
    expected = len(qattn.check.parity.DEFAULT_FORMATS) * len(qattn.check.parity.DEFAULT_SHAPES["numpy"])
    assert len(rows) == expected and all("pass" in row for row in rows)
    assert "cuda" not in result.stdout


def test_bench_needs_a_gpu(no_gpu):
    result = run("bench", "--shape", "1/1/128", "--peer", "sageattn")  # every runtime peer is a choice
    assert result.exit_code == 1 and "no CUDA GPU" in result.output


def test_bench_table(monkeypatch, tmp_path):
    calls = {}

    def fake_bench(shapes, formats, **kwargs):
        calls.update(kwargs, shapes=shapes, formats=formats)
        base = {"batch": 1, "heads": 2, "seq": 128, "head_dim": 64, "causal": False}
        return [dict(base, impl="sdpa_flash", ms=0.5, tflops=0.1, rel_l2=3.1e-4),
                dict(base, impl="sageattn", error="needs sm_80 or newer"),
                dict(base, impl="qattn f16", ms=0.25, tflops=0.2, rel_l2=2.7e-4, vs_sdpa_flash=2.0)]

    monkeypatch.setattr(qattn.cli_bench, "device_arch", lambda: "sm_90a")
    monkeypatch.setattr("qattn.bench.prefill.bench_prefill", fake_bench)
    out = tmp_path / "bench.json"
    result = run("bench", "--shape", "1/2/128", "-d", "64", "--peer", "sdpa_flash", "--rounds", "5", "--json", str(out))
    assert result.exit_code == 0, result.output
    assert calls["shapes"] == [(1, 2, 128)] and calls["peers"] == ("sdpa_flash",) and calls["head_dim"] == 64
    # by default every timing follows an idle pause (an entry timed in the peers' wake reads slow)
    assert calls["rounds"] == 5 and calls["sustained"] is None and calls["settle"] == 0.3
    result = run("bench", "--shape", "1/2/128", "--sustained", "2.5", "--settle", "0.5")
    assert result.exit_code == 0, result.output
    assert calls["sustained"] == 2.5 and calls["settle"] == 0.5
    rows = {line.split("│")[2].strip(): [c.strip() for c in line.split("│")[3:-1]]
            for line in result.stdout.splitlines() if line.count("│") > 3}
    assert rows["qattn f16"] == ["0.250", "0.2", "2.70e-04", "2.00"]
    assert rows["sageattn"][1] == "needs sm_80 or newer"
    assert [r["impl"] for r in json.loads(out.read_text())] == ["sdpa_flash", "sageattn", "qattn f16"]


def test_bench_takes_kernel_entries(monkeypatch):
    """qattn bench -f takes the benchmark entries (FORMAT@UNIT+OPTION=VALUE:TILE) as they are and
    refuses a bad part by name."""
    calls = {}
    monkeypatch.setattr(qattn.cli_bench, "device_arch", lambda: "sm_90a")
    monkeypatch.setattr("qattn.bench.prefill.bench_prefill", lambda shapes, formats, **kw: calls.update(formats=formats) or [])
    result = run("bench", "-f", "f16@wgmma+persistent,i8-f16+pingpong=off:m128n64w8s3", "-f", "i8-f8")
    assert result.exit_code == 0, result.output
    assert list(calls["formats"]) == ["f16@wgmma+persistent", "i8-f16+pingpong=off:m128n64w8s3", "i8-f8"]
    for bad, why in (("f17@wgmma", "unknown format 'f17'"), ("f16@tensor", "unknown matrix unit"),
                     ("f16+", "OPTION"), ("f16:m12", "tile name")):
        result = run("bench", "-f", bad)
        assert result.exit_code == 2 and why in result.output, (bad, result.output)


def test_bench_rounds_must_be_positive(monkeypatch):
    monkeypatch.setattr(qattn.cli_bench, "device_arch", lambda: "sm_90a")
    result = run("bench", "--rounds", "0")
    assert result.exit_code == 2 and "--rounds" in result.output
    result = run("bench", "--sustained", "0")
    assert result.exit_code == 2 and "--sustained" in result.output
    result = run("bench", "--settle", "-1")
    assert result.exit_code == 2 and "--settle" in result.output


def test_cache_commands(cache_dir):
    result = run("cache", "path")
    assert result.exit_code == 0 and result.output.strip() == str(cache_dir)
    KernelCache().store("prefill_f16_d64_test", "ab" * 32, b"\0binary", "// source", {"name": "prefill_f16_d64_test"})
    result = run("cache", "list")
    assert result.exit_code == 0 and "prefill_f16_d64_test" in result.output
    result = run("cache", "clear")
    assert result.exit_code == 0 and "removed 1" in result.output
    assert KernelCache().entries() == []


def test_python_m_qattn_runs_the_cli():
    """`python -m qattn` is the console script: same commands, same name in its usage line."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-m", "qattn", "--help"], capture_output=True, text=True, cwd="/",
                            env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Usage: qattn [OPTIONS] COMMAND") and "tune" in result.stdout
    version = subprocess.run([sys.executable, "-m", "qattn", "--version"], capture_output=True, text=True, cwd="/",
                             env=env, timeout=120)
    assert version.returncode == 0 and version.stdout.strip() == f"qattn, version {qattn.__version__}"
    bad = subprocess.run([sys.executable, "-m", "qattn", "no-such-command"], capture_output=True, text=True, cwd="/",
                         env=env, timeout=120)
    assert bad.returncode == 2 and "No such command 'no-such-command'" in bad.stderr


def test_tools_parity_help():
    path = ROOT / "tools" / "parity"
    assert os.access(path, os.X_OK)
    result = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, cwd="/")
    assert result.returncode == 0, result.stderr
    assert "--shape CTX/QUERIES" in result.stdout and "--backend" in result.stdout
    assert "[default: every format with a CUDA kernel]" in " ".join(result.stdout.split())
    assert {"f16", "i8-f8", "kv8-imma"} <= set(qattn.check.parity.DEFAULT_FORMATS)


def test_gen_on_a_chosen_matrix_unit():
    runner = CliRunner()
    wgmma = runner.invoke(qattn.cli.main, ["gen", "-f", "i8-f8", "--arch", "sm_90a", "--mma", "wgmma"])
    assert wgmma.exit_code == 0, wgmma.output
    assert "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8" in wgmma.output
    default = runner.invoke(qattn.cli.main, ["gen", "-f", "i8-f8", "--arch", "sm_90a"])
    assert default.exit_code == 0 and default.output == wgmma.output  # wgmma is sm_90a's default
    sync = runner.invoke(qattn.cli.main, ["gen", "-f", "i8-f8", "--arch", "sm_90a", "--mma", "mma.sync"])
    assert sync.exit_code == 0 and "wgmma.mma_async" not in sync.output and "mma.sync.aligned" in sync.output
    bad = runner.invoke(qattn.cli.main, ["gen", "-f", "i8-i8", "--arch", "sm_90a", "--mma", "wgmma"])
    assert bad.exit_code == 2 and "'--mma'" in bad.output and "mma.sync" in bad.output


def test_template_options_select_a_kernel_variant():
    """--option NAME=VALUE (repeatable) sets a prefill family's template options in gen, inspect and compile, each
    checked against the family's (named in `qattn list`), its errors pointing at --option."""
    runner = CliRunner()
    base = ["gen", "-f", "f16", "--arch", "sm_90a", "--mma", "wgmma"]
    plain = runner.invoke(main, base)
    chosen = runner.invoke(main, [*base, "--option", "persistent=on", "--option", "pingpong=off"])
    assert plain.exit_code == 0 and chosen.exit_code == 0, chosen.output
    assert "constexpr bool PERSISTENT = false" in plain.output and "constexpr bool PERSISTENT = true" in chosen.output
    assert "prefill_f16_d128_m128n128w8s2_wgmma_pingpong_sm90a" in plain.output
    assert "prefill_f16_d128_m128n128w8s2_wgmma_persistent_sm90a" in chosen.output
    on = runner.invoke(main, [*base, "--option", "pingpong=on"])
    assert on.exit_code == 0 and on.output == plain.output  # d128's default, spelled out: the same kernel
    specs = compile_matrix("prefill", ["f16", "bf16"], [64, 128], None, None, None, None, "cuda", ["sm_90a"], False,
                           "wgmma", {"persistent": "on"})
    assert len(specs) == 4 and all(dict(s.options)["persistent"] == "on" for s in specs)
    listed = runner.invoke(main, ["list"], env={"COLUMNS": "240"}).output
    rows = [line for line in listed.splitlines() if "persistent off|on" in line]
    assert any("f16 (--mma wgmma)" in line and "kv_rows off|on" in line for line in rows), rows
    assert any("i8-f8 (default: wgmma)" in line for line in rows), rows
    assert "pingpong off|on (d128: on)" in " ".join(listed.split())


@pytest.mark.parametrize("args, message", [
    (["--option", "persistent"], "expected NAME=VALUE, e.g. persistent=on, got 'persistent'"),
    (["--option", "persistent=on", "--option", "persistent=off"], "persistent given twice"),
    (["--mma", "wgmma", "--option", "persistent=maybe"], "persistent: f16 takes one of off, on, got 'maybe'"),
    (["--mma", "wgmma", "--option", "colour=blue"], "options: f16 takes kv_rows, pingpong, persistent, chain, out_tma, q_tma, tail, got colour"),
    (["--option", "persistent=on"], "f16 on mma.sync takes none, got persistent; its wgmma kernel does (mma='wgmma')"),
])
def test_template_option_errors_name_the_option(args, message):
    result = run("gen", "-f", "f16", "--arch", "sm_90a", *args)
    assert_usage_error(result, "--option")
    assert message in " ".join(result.output.split()), result.output


def test_template_options_are_for_prefill():
    result = run("gen", "decode", "-f", "e4m3-e4m3", "--arch", "sm_90a", "--option", "page_size=16")
    assert_usage_error(result, "--option")
    assert "decode kernels take their options as --page-size" in " ".join(result.output.split())


def test_sanitize_workload_adds_the_arch_s_other_units(monkeypatch):
    """tools/sanitize.py covers every format, and on sm_90a also each format's other matrix unit
    (FORMAT@UNIT: f16 and bf16 on wgmma, i8-f16 and i8-f8 on mma.sync, kv8-imma on wgmma)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    import sanitize

    import qattn.engine.spec as spec_module

    with_kernel = [n for n, r in RECIPES.items() if "cuda" in r.families]
    monkeypatch.setattr(spec_module, "device_arch", lambda: "sm_90a")
    assert sanitize.default_formats() == with_kernel + ["f16@wgmma", "bf16@wgmma", "i8-f16@mma.sync",
                                                        "i8-f8@mma.sync", "kv8-imma@wgmma"]
    monkeypatch.setattr(spec_module, "device_arch", lambda: "sm_89")
    assert sanitize.default_formats() == with_kernel
