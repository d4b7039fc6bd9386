"""The decode benchmark without a GPU: byte accounting, the sweep's grid and presets, the QK variants,
the table cells and markdown, the timing of a mode (the GPU parts faked), and `qattn bench decode`'s options
(the sweep faked). CPU only."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import qattn.cli_bench
from qattn.bench import decode as bench
from qattn.bench import paged_peers
from qattn.bench.timing import Timing
from qattn.cli import main

ROOT = Path(__file__).resolve().parent.parent


# ---- bytes ---------------------------------------------------------------------------------------

def test_kv_bytes_counts_codes_scales_and_table():
    # f16 K and V: 2 x 2 bytes per channel; 8 kv heads, 128 channels, 1000 tokens, pages of 32 (32 pages)
    assert bench.kv_bytes("f16-f16", 1, 8, 1000, 128, 32, "token") == 8 * 1000 * 512 + 32 * 4
    # e4m3 K, f16 V, token scales: 128 + 4 bytes for K, 256 for V
    assert bench.kv_bytes("e4m3-f16", 2, 8, 64, 128, 32, "token") == 2 * 8 * 64 * (132 + 256) + 2 * 2 * 4
    # head scales live outside the pages: codes only
    assert bench.kv_bytes("i8-i8", 1, 4, 128, 64, 16, "head") == 4 * 128 * 128 + 8 * 4


def test_write_bytes_are_the_inputs_read_and_the_codes_and_scales_written():
    # 64 tokens of 8 kv heads at D128: fp16 K and V read (2 x 64 x 8 x 256 bytes), e4m3 codes and token
    # scales written (2 x 64 x 8 x 132 bytes); no block table
    assert bench.write_bytes("e4m3-e4m3", 64, 8, 128, 32, "token") == 2 * 64 * 8 * 256 + 2 * 64 * 8 * 132
    assert bench.write_bytes("f16-f16", 3, 2, 64, 16, "token") == 2 * 3 * 2 * 128 + 2 * 3 * 2 * 128


def test_decode_step_slots_put_each_sequence_on_a_page_of_its_own():
    rng = np.random.default_rng(1)
    for pages, page_size, n in ((100, 32, 64), (8, 16, 8), (1000, 64, 1)):
        slots = bench.decode_step_slots(pages, page_size, n, rng)
        assert len(slots) == n and len(set(slots // page_size)) == n
        assert slots.min() >= 0 and slots.max() < pages * page_size
    with pytest.raises(ValueError, match="sequences: expected 1 to 8"):
        bench.decode_step_slots(8, 16, 9, rng)


def test_point_fp16_bytes_and_label():
    point = bench.Point(8, 32768)
    assert point.fp16_kv_bytes == 8 * 32768 * 8 * 128 * 4 == 1 << 30
    assert point.label == "8x32768 32/8 d128 p32"


# ---- the grid --------------------------------------------------------------------------------------

def test_contract_formats_are_the_four_controls_per_code():
    assert bench.contract_formats() == ("f16-f16", "e4m3-f16", "f16-e4m3", "e4m3-e4m3", "i8-f16", "f16-i8", "i8-i8")
    assert bench.contract_formats(("i8",)) == ("f16-f16", "i8-f16", "f16-i8", "i8-i8")


def test_grid_is_every_combination():
    points = bench.grid([(1, 1024), (8, 4096)], heads=32, kv_heads=(8, 4), head_dims=(64, 128), page_sizes=(32,))
    assert len(points) == 8
    assert points[0] == bench.Point(1, 1024, 32, 8, 64, 32) and points[-1] == bench.Point(8, 4096, 32, 4, 128, 32)


def test_merge_runs_unions_modes_per_point_in_order():
    a, b = bench.Point(1, 1024), bench.Point(8, 4096)
    runs = bench.merge_runs([(a, ("cold",)), (b, ("warm",)), (a, ("warm",))])
    assert runs == [bench.Run(a, ("warm", "cold")), bench.Run(b, ("warm",))]


def test_within_cap_splits_by_fp16_bytes():
    small, big = bench.Run(bench.Point(1, 1024), ("warm",)), bench.Run(bench.Point(256, 131072), ("warm",))
    assert bench.within_cap([small, big], 1 << 30) == ([small], [big])
    assert bench.within_cap([small, big], None) == ([small, big], [])


def test_contract_preset():
    runs = bench.preset_runs("contract")
    kept, skipped = bench.within_cap(runs, bench.PRESET_MAX_KV_BYTES)
    main_grid = [r for r in runs if r.modes == ("warm", "cold")]
    assert len(main_grid) == 16 and {r.point.batch for r in main_grid} == {1, 8, 64, 256}
    assert {r.point.ctx for r in main_grid} == {1024, 4096, 32768, 131072}
    assert {(r.point.batch, r.point.ctx) for r in skipped} == {(64, 131072), (256, 32768), (256, 131072)}
    side = [r.point for r in runs if r.modes == ("warm",)]
    assert all((p.batch, p.ctx) == (8, 32768) for p in side)
    assert {p.kv_heads for p in side} == {32, 8, 4}  # GQA 1, 4, 8 (GQA 4 at p32 d128 is the main grid's point)
    assert {p.page_size for p in side} == {16, 32, 64, 128} and {p.head_dim for p in side} == {64, 128}
    assert sum(p != bench.Point(8, 32768) for p in side) == len(side) == 6
    assert len(kept) == 19 and len(set(r.point for r in runs)) == len(runs)


def test_smoke_preset_is_small():
    runs = bench.preset_runs("smoke")
    assert all(r.point.fp16_kv_bytes <= 1 << 30 for r in runs)
    assert any(r.modes == ("warm", "cold") for r in runs)


# ---- QK variants -----------------------------------------------------------------------------------

def test_qk_variants_auto_is_every_formats():
    assert bench.qk_variants(["f16-f16", "e4m3-e4m3"], ["auto"], strict=False) == [("f16-f16", "auto"),
                                                                                   ("e4m3-e4m3", "auto")]


def test_qk_variants_skip_paths_a_format_lacks():
    pairs = bench.qk_variants(["f16-f16", "e4m3-f16", "f16-i8", "i8-i8"], ["transform", "fp8", "int8"], strict=False)
    assert pairs == [("f16-f16", "transform"), ("e4m3-f16", "transform"), ("e4m3-f16", "fp8"),
                     ("f16-i8", "transform"), ("i8-i8", "transform"), ("i8-i8", "int8")]


def test_qk_variants_strict_names_the_format():
    with pytest.raises(ValueError, match="i8-i8 has no fp8 path"):
        bench.qk_variants(["e4m3-e4m3", "i8-i8"], ["fp8"], strict=True)
    with pytest.raises(ValueError, match="none of f16-f16"):
        bench.qk_variants(["f16-f16"], ["fp8", "int8"], strict=False)


def test_impl_name():
    assert bench.impl_name("e4m3-e4m3", "auto") == "qattn:e4m3-e4m3"
    assert bench.impl_name("e4m3-e4m3", "fp8") == "qattn:e4m3-e4m3/fp8"


# ---- ratios, cells, markdown ---------------------------------------------------------------------------

def test_bandwidth_fields_and_the_faster_peer():
    # flash took 1.25 ms, cuDNN 0.8 ms, this 1.0 ms: 0.8x the faster one (cuDNN)
    rec = {"bytes": 2e9, "ms": 1.0, "vs_sdpa_flash": 1.25, "vs_sdpa_cudnn": 0.8}
    fields = bench.bandwidth_fields(rec, copy_gbs=4000.0)
    assert fields == {"gbs": pytest.approx(2000.0), "of_copy": pytest.approx(0.5), "vs_sdpa": 0.8}
    assert bench.fastest_peer_ratio({"vs_sdpa_flash": 0.9}) == 0.9
    assert bench.fastest_peer_ratio({"vs_sageattn": 2.0}) is None


BASE = {"batch": 8, "ctx": 32768, "heads": 32, "kv_heads": 8, "head_dim": 128, "page_size": 32, "copy_gbs": 4200.0}


def test_row_cells():
    rec = dict(BASE, impl="qattn:e4m3-e4m3/fp8", format="e4m3-e4m3", l2="cold", ms=0.25, gbs=2300.4, of_copy=0.55,
               vs_sdpa=1.19, vs_flashinfer=1.6, vs_flashinfer_e4m3=1.05, rel_l2_vs_fp16=3.7e-2, splits=8, merge="kernel")
    assert bench.row_cells(rec) == ["8x32768", "32/8", "128", "32", "cold", "qattn:e4m3-e4m3/fp8", "8 (kernel)", "0.2500",
                                    "2300", "0.55", "1.19", "1.05", "3.70e-02"]  # K8/V8 against FlashInfer's e4m3 cache
    assert bench.row_cells(dict(rec, splits=2, merge="cluster"))[6] == "2 (cluster)"
    assert bench.row_cells(dict(rec, splits=1, merge="none"))[6] == "1"
    k8v16 = dict(rec, impl="qattn:e4m3-f16", format="e4m3-f16")
    assert bench.row_cells(k8v16)[-2] == "1.60"  # against its fp16 cache
    peer = dict(BASE, impl="sdpa_flash", l2="warm", ms=0.3, gbs=3600.0, of_copy=0.86, vs_sdpa=None)
    assert bench.row_cells(peer)[-3:] == ["-", "-", "-"] and bench.row_cells(peer)[6] == "-"
    error = dict(BASE, impl="qattn:i8-i8/int8", error="qk: not built | yet")
    assert bench.row_cells(error) == ["8x32768", "32/8", "128", "32", "-", "qattn:i8-i8/int8", "-",
                                      "qk: not built | yet", "", "", "", "", ""]
    assert len(bench.row_cells(rec)) == len(bench.COLUMNS)
    assert bench.row_cells(dict(rec, page_order="in-order"))[3] == "32 in order"
    assert bench.row_cells(dict(rec, page_order="shuffled"))[3] == "32"


def test_markdown_table():
    records = [dict(BASE, impl="sdpa_cudnn", l2="warm", ms=0.287, gbs=3736.0, of_copy=0.89),
               dict(BASE, impl="qattn:e4m3-e4m3", l2="warm", ms=0.24, gbs=2299.0, of_copy=0.55, vs_sdpa=1.19),
               dict(BASE, impl="qattn:i8-i8/int8", error="a | b")]
    text = bench.markdown_table(records, date="2026-12-03", gpu="NVIDIA H200", command="qattn bench decode --preset x")
    lines = text.splitlines()
    assert lines[0] == "2026-12-03, NVIDIA H200, copy bandwidth 4200 GB/s, `qattn bench decode --preset x`"
    assert lines[2] == "| " + " | ".join(bench.COLUMNS) + " |"
    assert lines[3].count("|") == len(bench.COLUMNS) + 1 and "---:" in lines[3]
    assert lines[5] == "| 8x32768 | 32/8 | 128 | 32 | warm | qattn:e4m3-e4m3 | - | 0.2400 | 2299 | 0.55 | 1.19 | - | - |"
    assert "a \\| b" in lines[6] and len(re.split(r"(?<!\\)\|", lines[6])) == len(bench.COLUMNS) + 2  # one cell


# ---- the paged peers (FlashInfer) ------------------------------------------------------------------

def test_flashinfer_page_table_and_pages():
    """The CSR table FlashInfer's plan takes, and the NHD pages it reads: each sequence's tokens in
    order, the last page zero-padded; a ctx that fills its pages needs no padding."""
    indptr, indices, last = paged_peers.page_table(3, 70, 32)  # 3 pages a sequence, 6 tokens on the last
    assert indptr.tolist() == [0, 3, 6, 9] and indices.tolist() == list(range(9)) and last.tolist() == [6, 6, 6]
    assert {a.dtype for a in (indptr, indices, last)} == {np.dtype(np.int32)}
    assert paged_peers.page_table(2, 64, 32)[2].tolist() == [32, 32]
    rng = np.random.default_rng()
    x = rng.standard_normal((3 * 70, 2, 4)).astype(np.float16) + 5  # no zeros among the tokens
    pages = paged_peers.paged(x, 3, 70, 32)
    assert pages.shape == (9, 32, 2, 4) and pages.flags.c_contiguous
    per_seq = pages.reshape(3, 96, 2, 4)
    assert np.array_equal(per_seq[:, :70], x.reshape(3, 70, 2, 4)) and not per_seq[:, 70:].any()
    y = x[: 2 * 64]
    assert np.array_equal(paged_peers.paged(y, 2, 64, 32).reshape(-1, 2, 4), y)
    with pytest.raises(ValueError, match="page_size"):
        paged_peers.page_table(1, 10, 0)


def test_flashinfer_reads_qattns_shuffled_pages():
    """With qattn's block table the peer's CSR indices are its page ids, and page j of sequence b sits at
    table[b, j] of the NHD pages, so both read the same pages in the same order."""
    rng = np.random.default_rng()
    table = bench.page_ids(3, 70, 32, "shuffled", rng)
    _, indices, _ = paged_peers.page_table(3, 70, 32, table)
    assert indices.tolist() == table.reshape(-1).tolist() and indices.dtype == np.int32
    x = rng.standard_normal((3 * 70, 2, 4)).astype(np.float16) + 5
    pages = paged_peers.paged(x, 3, 70, 32, table)
    in_order = paged_peers.paged(x, 3, 70, 32)
    for b in range(3):
        for j in range(3):
            assert np.array_equal(pages[table[b, j]], in_order[3 * b + j])
    with pytest.raises(ValueError, match="table"):
        paged_peers.page_table(3, 70, 32, table[:, :2])


def test_page_ids_shuffled_or_in_order():
    rng = np.random.default_rng()
    shuffled = bench.page_ids(4, 100, 32, "shuffled", rng)  # 4 pages a sequence
    assert shuffled.shape == (4, 4) and shuffled.dtype == np.int32
    assert sorted(shuffled.reshape(-1).tolist()) == list(range(16)) and shuffled.reshape(-1).tolist() != list(range(16))
    assert bench.page_ids(4, 100, 32, "in-order", rng).reshape(-1).tolist() == list(range(16))
    with pytest.raises(ValueError, match="page order"):
        bench.page_ids(1, 32, 32, "reversed", rng)


def test_flashinfer_e4m3_scale_fills_the_format():
    x = np.array([[0.5, -3.0], [2.0, 1.0]], np.float32)
    scale = paged_peers.e4m3_tensor_scale(x)
    assert scale == pytest.approx(3.0 / 448) and abs(x / scale).max() == pytest.approx(448)
    assert paged_peers.e4m3_tensor_scale(np.zeros(4, np.float32)) == 1.0


def test_flashinfer_peer_is_left_out_without_the_library(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import flashinfer raises ImportError
    q = np.zeros((1, 4, 1, 64), np.float16)
    k = np.zeros((32, 1, 64), np.float16)
    assert paged_peers.paged_peer("flashinfer", q, k, k, batch=1, ctx=32, page_size=32) is None
    with pytest.raises(ValueError, match="peer: expected one of flashinfer, flashinfer_e4m3"):
        paged_peers.paged_peer("flashinfer_fp4", q, k, k, batch=1, ctx=32, page_size=32)
    assert set(paged_peers.PAGED_PEERS) <= set(bench.DECODE_PEERS)
    assert bench.fastest_peer_ratio({"vs_flashinfer": 0.5, "vs_sdpa_cudnn": 0.9}) == 0.9  # vs SDPA: SDPA only


# ---- timing a mode (timers faked) ----------------------------------------------------------------------

def test_time_mode_runs_the_prelude_ahead_of_every_timed_call(monkeypatch):
    preludes, timed_fns = [], []

    def fake_after(fn, before, **kwargs):
        before()
        timed_fns.append(fn)
        return Timing(0.5 if fn is peer_call else 0.25, 0.2, 5)

    def peer_call():
        pass

    def qattn_call():
        pass

    monkeypatch.setattr(bench, "time_cuda_after", fake_after)
    timed = [(dict(BASE, impl="sdpa_flash", bytes=int(1e9)), peer_call),
             (dict(BASE, impl="qattn:e4m3-e4m3", bytes=int(5e8)), qattn_call)]
    records = bench._time_mode(timed, "cold", 2, lambda: preludes.append(1), 4000.0)
    assert len(preludes) == len(timed_fns) == 4  # 2 rounds x 2 calls, each after the prelude
    assert timed_fns == [peer_call, qattn_call, qattn_call, peer_call]  # odd rounds in reverse
    assert [r["l2"] for r in records] == ["cold", "cold"]
    assert "l2" not in timed[0][0]  # each mode's records are copies
    peer, ours = records
    assert ours["ms"] == 0.25 and ours["vs_sdpa_flash"] == 2.0 and ours["vs_sdpa"] == 2.0
    assert ours["gbs"] == pytest.approx(2000.0) and peer["gbs"] == pytest.approx(2000.0) and peer["vs_sdpa"] is None


def test_mode_preludes(monkeypatch):
    calls = []
    monkeypatch.setattr(bench, "GpuSpin", lambda: lambda: calls.append("spin"))
    monkeypatch.setattr(bench, "L2Flush", lambda: lambda: calls.append("flush"))
    assert set(bench.mode_preludes({"warm"})) == {"warm"}
    preludes = bench.mode_preludes({"warm", "cold"})
    preludes["cold"]()
    preludes["warm"]()
    assert calls == ["flush", "spin", "spin"]  # cold: evict L2, then cover the host's enqueue time


# ---- the command (sweep faked) -------------------------------------------------------------------------

def run(*args):
    return CliRunner().invoke(main, ["bench", "decode", *args], prog_name="qattn")


@pytest.fixture
def fake_sweep(monkeypatch):
    """bench_sweep, bench_write and the GPU name replaced; returns what the sweep was called with."""
    calls = {}

    def sweep(runs, variants, **kwargs):
        calls.update(kwargs, runs=runs, variants=variants)
        records = []
        for r in runs:
            p = r.point
            base = dict(batch=p.batch, ctx=p.ctx, heads=p.heads, kv_heads=p.kv_heads, head_dim=p.head_dim,
                        page_size=p.page_size, copy_gbs=4000.0)
            for mode in r.modes:
                records.append(dict(base, impl="sdpa_flash", l2=mode, ms=0.5, gbs=3000.0, of_copy=0.75, vs_sdpa=None))
                records += [dict(base, impl=bench.impl_name(f, qk, term), l2=mode, ms=0.25, gbs=2000.0, of_copy=0.5,
                                 vs_sdpa=2.0, vs_sdpa_flash=2.0) for f, qk, term in variants]
        return records

    monkeypatch.setattr(qattn.cli_bench, "device_arch", lambda: "sm_90a")
    monkeypatch.setattr(bench, "bench_sweep", sweep)
    monkeypatch.setattr(bench, "bench_write", lambda *a, **k: [])
    monkeypatch.setattr(bench, "gpu_name", lambda: "NVIDIA H200")
    return calls


def assert_usage_error(result, option):
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert option in result.output, result.output


def test_defaults_are_the_old_shapes_and_formats(fake_sweep):
    result = run("--write-tokens", "0")
    assert result.exit_code == 0, result.output
    assert [(r.point.batch, r.point.ctx) for r in fake_sweep["runs"]] == list(bench.DEFAULT_SHAPES)
    assert all(r.modes == ("warm",) and r.point.kv_heads == 8 and r.point.heads == 32 for r in fake_sweep["runs"])
    assert fake_sweep["variants"] == [(f, "auto", "plain") for f in bench.DEFAULT_FORMATS]
    assert fake_sweep["stages"] is None and fake_sweep["rounds"] == 3


def test_grid_options(fake_sweep):
    result = run("--batch", "1,8", "--ctx", "1K", "--ctx", "32k", "--shape", "2x100", "--gqa", "1", "--gqa", "8",
                 "--kv-heads", "8", "-d", "64", "-d", "128", "--page-size", "16", "--cold", "--write-tokens", "0")
    assert result.exit_code == 0, result.output
    points = [r.point for r in fake_sweep["runs"]]
    assert {(p.batch, p.ctx) for p in points} == {(2, 100), (1, 1024), (1, 32768), (8, 1024), (8, 32768)}
    assert {p.kv_heads for p in points} == {8, 32, 4} and {p.head_dim for p in points} == {64, 128}
    assert len(points) == 5 * 3 * 2 and all(r.modes == ("cold",) for r in fake_sweep["runs"])
    assert "│ cold" in result.output


def test_a_named_tile_reaches_the_sweep_for_every_head_dim(fake_sweep):
    result = run("--tile", "m8n32w2s3", "-d", "64", "-d", "128", "--write-tokens", "0")
    assert result.exit_code == 0, result.output
    assert {d: t.name for d, t in fake_sweep["tiles"].items()} == {64: "m8n32w2s3", 128: "m8n32w2s3"}
    assert fake_sweep["stages"] is None


def test_a_bad_tile_name_or_tile_with_stages_is_refused(fake_sweep):
    bad = run("--tile", "8x32")
    assert bad.exit_code == 2 and "--tile" in bad.output and "m128n64w4s2" in bad.output
    both = run("--tile", "m8n32w2s3", "--stages", "2")
    assert both.exit_code == 2 and "not both" in both.output and "runs" not in fake_sweep


def test_page_order_reaches_the_sweep(fake_sweep):
    assert run("--write-tokens", "0").exit_code == 0 and fake_sweep["page_order"] == "shuffled"
    result = run("--page-order", "in-order", "--write-tokens", "0")
    assert result.exit_code == 0, result.output
    assert fake_sweep["page_order"] == "in-order"
    assert_usage_error(run("--page-order", "reversed"), "--page-order")


def test_stages_reach_the_sweep(fake_sweep):
    result = run("--stages", "3", "-d", "64", "-d", "128", "--write-tokens", "0")
    assert result.exit_code == 0, result.output
    assert fake_sweep["stages"] == 3 and fake_sweep["tiles"] is None


def test_qk_lists_skip_formats_without_the_path(fake_sweep):
    result = run("-f", "f16-f16", "-f", "e4m3-e4m3", "--qk", "transform", "--qk", "fp8", "--write-tokens", "0")
    assert result.exit_code == 0, result.output
    assert fake_sweep["variants"] == [("f16-f16", "transform", "plain"), ("e4m3-e4m3", "transform", "plain"),
                                      ("e4m3-e4m3", "fp8", "plain")]
    assert "qattn:e4m3-e4m3/fp8" in result.output


def test_one_qk_path_a_named_format_lacks_is_an_error(fake_sweep):
    assert_usage_error(run("-f", "i8-i8", "--qk", "fp8"), "--qk")
    assert "i8-i8 has no fp8 path" in run("-f", "i8-i8", "--qk", "fp8").output
    result = run("--qk", "fp8", "--write-tokens", "0")  # the default formats: those with the path
    assert result.exit_code == 0, result.output
    assert fake_sweep["variants"] == [("e4m3-e4m3", "fp8", "plain"), ("e4m3-f16", "fp8", "plain")]


def test_preset_contract(fake_sweep, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["qattn", "bench", "decode", "--preset", "contract"])
    out = tmp_path / "decode.json"
    result = run("--preset", "contract", "--write-tokens", "0", "--json", str(out), "--markdown")
    assert result.exit_code == 0, result.output
    assert len(fake_sweep["runs"]) == 19 and "skipped over --max-kv-gib 8: 64x131072" in result.output
    assert {f for f, _, _ in fake_sweep["variants"]} == set(bench.contract_formats())
    assert len(fake_sweep["variants"]) == 11  # 7 transform, 2 fp8, 2 int8
    data = json.loads(out.read_text())
    assert data["meta"]["gpu"] == "NVIDIA H200" and data["meta"]["command"].endswith("--preset contract")
    assert {r["l2"] for r in data["decode"]} == {"warm", "cold"} and data["write"] == []
    command = "`qattn bench decode --preset contract`"
    header = next(line for line in result.output.splitlines() if line.endswith(command))
    assert "NVIDIA H200, copy bandwidth 4000 GB/s" in header
    assert "| 1x1024 | 32/8 | 128 | 32 | cold | qattn:e4m3-e4m3/fp8 | - | 0.2500 |" in result.output


@pytest.mark.parametrize("args, option", [
    (["--preset", "smoke", "--shape", "1x1024"], "--preset"),
    (["--preset", "smoke", "--cold"], "--preset"),
    (["--batch", "8"], "--batch"),
    (["--ctx", "0"], "--ctx"),
    (["--ctx", "4Q"], "--ctx"),
    (["--heads", "32", "--gqa", "3"], "--gqa"),
    (["--heads", "32", "--kv-heads", "5"], "--heads"),
    (["--shape", "8x0"], "--shape"),
    (["--qk", "fp4"], "--qk"),
    (["--stages", "9"], "--stages"),
    (["--max-kv-gib", "0"], "--max-kv-gib"),
])
def test_usage_errors_name_the_option(fake_sweep, args, option):
    assert_usage_error(run(*args), option)


def test_cap_that_skips_everything_is_an_error(fake_sweep):
    assert_usage_error(run("--shape", "64x131072", "--max-kv-gib", "1"), "--max-kv-gib")


def test_needs_a_gpu(monkeypatch):
    monkeypatch.setattr(qattn.cli_bench, "device_arch", lambda: None)
    result = run("--shape", "1x1024")
    assert result.exit_code == 1 and "no CUDA GPU" in result.output


def test_tool_is_the_same_command():
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_decode.py"), "--ctx", "0"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "--ctx" in result.stderr and "tools/bench_decode.py" in result.stderr


def test_k_terms_go_with_8bit_k_only():
    pairs = [("f16-f16", "auto"), ("e4m3-e4m3", "transform"), ("i8-i8", "int8")]
    triples = bench.with_k_terms(pairs, ("plain", "rope-post"))
    assert triples == [("f16-f16", "auto", "plain"), ("e4m3-e4m3", "transform", "plain"),
                       ("e4m3-e4m3", "transform", "rope-post"), ("i8-i8", "int8", "plain"), ("i8-i8", "int8", "rope-post")]
    assert bench.impl_name("i8-i8", "int8", "balance") == "qattn:i8-i8/int8 +balance"
    assert bench.impl_name("e4m3-e4m3", "auto") == "qattn:e4m3-e4m3"


def test_k_term_options_build_the_cache_options():
    assert bench.k_term_options("plain", 2, 64, 100) == {}
    assert bench.k_term_options("balance", 2, 64, 100) == {"k_balance": "calibrate"}
    post, pre = (bench.k_term_options(t, 2, 64, 100) for t in ("rope-post", "rope-pre"))
    assert post["k_bias"].shape == (2, 64) and post["rope"].max_positions == 100
    assert post["k_bias_layout"] == "post-rope" and pre["k_bias_layout"] == "pre-rope"
    np.testing.assert_array_equal(post["k_bias"], bench.k_term_options("bias", 2, 64, 100)["k_bias"])
    with pytest.raises(ValueError, match="^k_term: expected one of"):
        bench.k_term_options("rope", 2, 64, 100)


def test_cli_k_term_needs_an_8bit_k(fake_sweep):
    assert_usage_error(run("-f", "f16-f16", "--k-term", "balance"), "only an 8-bit K carries a K term")
    assert run("-f", "f16-f16", "-f", "i8-i8", "--k-term", "plain", "--k-term", "rope-post", "--write-tokens",
               "0").exit_code == 0
    assert fake_sweep["variants"] == [("f16-f16", "auto", "plain"), ("i8-i8", "auto", "plain"),
                                      ("i8-i8", "auto", "rope-post")]
