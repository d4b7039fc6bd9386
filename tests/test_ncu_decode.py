"""tools/ncu_decode.py without ncu or a GPU: the raw-page CSV it reads (a synthetic one in the
layout `ncu --import R --csv --page raw --print-units base --print-metric-instances details` prints),
the decomposition's arithmetic, the kernel filter and the profiling command. CPU only."""
from __future__ import annotations

import csv
import io
import json
import re
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parent.parent / "tools"
sys.path.insert(0, str(TOOLS))

import ncu_decode  # noqa: E402

LAUNCH_COLUMNS = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream", "Block Size",
                  "Grid Size", "Device", "CC"]
K8_NAME = "qattn_decode_e4m3_e4m3_d128_m8n64w4s2_p32_token_fp8_sm90a_f16"
K16_NAME = "qattn_decode_f16_e4m3_d128_m8n64w4s2_p32_token_sm90a_f16"


def raw_csv(name: str, metrics: dict) -> str:
    """A raw-page CSV of one kernel: ncu's messages, the header, the units row and the kernel's row.
    metrics: {metric: (value, unit)}."""
    out = io.StringIO()
    out.write("==PROF== Connected to process 4242 (python3)\n")
    writer = csv.writer(out, quoting=csv.QUOTE_ALL, lineterminator="\n")
    writer.writerow(LAUNCH_COLUMNS + list(metrics))
    writer.writerow([""] * len(LAUNCH_COLUMNS) + [unit for _, unit in metrics.values()])
    writer.writerow(["0", "4242", "python3", "host", name, "1", "7", "(128, 1, 1)", "(4, 8, 8)", "0", "9.0"]
                    + [value for value, _ in metrics.values()])
    return out.getvalue()


def stalls(long_scoreboard: str) -> dict:
    return {ncu_decode.stall_metric("long_scoreboard"): (long_scoreboard, ""),
            ncu_decode.stall_metric("barrier"): ("1.5", "")}


# K16/V8: 400 us, 1.2 GB read (3 TB/s); K8/V8: 350 us, 0.8 GB read, 20 M more F2FP, 700 M instructions
K16_CSV = raw_csv(K16_NAME, {
    "gpu__time_duration.sum": ("400,000", "ns"),
    "dram__bytes_read.sum": ("1,200,000,000", "byte"),
    "sm__warps_active.avg.pct_of_peak_sustained_active": ("45.5", "%"),
    "sm__maximum_warps_per_active_cycle_pct": ("50", "%"),
    "launch__registers_per_thread": ("122", "register/thread"),
    "launch__shared_mem_per_block_static": ("0", "byte"),
    "launch__shared_mem_per_block_dynamic": ("49.15", "Kbyte"),
    "smsp__inst_executed.sum": ("600,000,000", "inst"),
    "smsp__issue_active.avg.pct_of_peak_sustained_active": ("40.0", "%"),
    "lts__t_sectors_srcunit_tex_op_read.sum": ("37,500,000", "sector"),
    "lts__t_requests_srcunit_tex_op_read.sum": ("9,375,000", "request"),
    "sass__inst_executed_per_opcode": ("60,000,000 (HMMA: 10,000,000; F2FP: 20,000,000; LDS: 30,000,000)", "inst"),
    **stalls("12.0"),
})
K8_CSV = raw_csv(K8_NAME, {
    "gpu__time_duration.sum": ("0.35", "ms"),
    "dram__bytes_read.sum": ("800", "Mbyte"),
    "sm__warps_active.avg.pct_of_peak_sustained_active": ("40.0", "%"),
    "sm__maximum_warps_per_active_cycle_pct": ("50", "%"),
    "launch__registers_per_thread": ("128 (0: 128)", "register/thread"),
    "launch__shared_mem_per_block_static": ("1,024", "byte"),
    "launch__shared_mem_per_block_dynamic": ("40,960", "byte"),
    "smsp__inst_executed.sum": ("700,000,000", "inst"),
    "smsp__issue_active.avg.pct_of_peak_sustained_active": ("55.0", "%"),
    "lts__t_sectors_srcunit_tex_op_read.sum": ("37,000,000", "sector"),
    "lts__t_requests_srcunit_tex_op_read.sum": ("27,500,000", "request"),
    "sass__inst_executed_per_opcode": ("85,000,000 (HMMA.16816.F32: 10,000,000; F2FP.F16.E4M3.UNPACK_B: 40,000,000; "
                                       "LDS: 30,000,000; PRMT: 5,000,000)", "inst"),
    **stalls("9.0"),
})


def test_units_scale_to_base():
    assert [ncu_decode.unit_scale(u) for u in ("ns", "us", "ms", "s")] == [1e-9, 1e-6, 1e-3, 1.0]  # ncu's durations
    assert ncu_decode.unit_scale("nsecond") == 1e-9 and ncu_decode.unit_scale("pass") == 1.0
    assert ncu_decode.unit_scale("Kbyte") == 1e3 and ncu_decode.unit_scale("Gbyte/second") == 1e9
    assert ncu_decode.unit_scale("byte/nsecond") == pytest.approx(1e9)
    assert ncu_decode.unit_scale("%") == 1.0 and ncu_decode.unit_scale("register/thread") == 1.0
    assert ncu_decode.number("1,234.5", "msecond") == pytest.approx(1.2345)
    assert ncu_decode.number("n/a") is None and ncu_decode.number("") is None


def test_opcode_counts():
    assert ncu_decode.opcode_counts("3 (HMMA: 1; F2FP.F16.E4M3.UNPACK_B: 2)") == {"HMMA": 1.0,
                                                                                "F2FP.F16.E4M3.UNPACK_B": 2.0}
    assert ncu_decode.opcode_counts("1,500 (LDS: 1,000; STS: 500)") == {"LDS": 1000.0, "STS": 500.0}
    assert ncu_decode.opcode_counts("123") == {}  # printed without --print-metric-instances details


def test_parse_raw_csv_skips_messages_and_units():
    kernels = ncu_decode.parse_raw_csv(K16_CSV)
    assert len(kernels) == 1
    assert kernels[0]["Kernel Name"] == (K16_NAME, "")
    assert kernels[0]["gpu__time_duration.sum"] == ("400,000", "ns")
    with pytest.raises(ValueError, match="header"):
        ncu_decode.parse_raw_csv("==PROF== nothing profiled\n")


def test_kernel_profile_from_row():
    k8, k16 = ncu_decode.only_kernel(K8_CSV), ncu_decode.only_kernel(K16_CSV)
    assert k16.name == K16_NAME and k16.duration_s == pytest.approx(400e-6) and k8.duration_s == pytest.approx(350e-6)
    assert k16.dram_read_bytes == pytest.approx(1.2e9) and k8.dram_read_bytes == pytest.approx(8e8)
    assert k16.smem_bytes == pytest.approx(49150) and k8.smem_bytes == pytest.approx(41984)
    assert (k8.registers, k8.occupancy_pct, k8.theoretical_occupancy_pct) == (128, 40.0, 50.0)
    assert k8.stalls == {"long_scoreboard": 9.0, "barrier": 1.5}
    # K16/V8 reads each DRAM sector once from the L2; the K8/V8 row asks for its 25 M sectors 37 M times
    assert k16.l2_sectors_per_dram_sector == pytest.approx(1.0) and k8.l2_sectors_per_dram_sector == pytest.approx(1.48)
    assert k8.l2_read_requests == 27.5e6
    assert k8.categories == {"convert": 4e7, "mma": 1e7, "fp": 0.0, "int": 5e6, "memory": 3e7, "other": 0.0}


def test_one_kernel_per_profile():
    two = K16_CSV + K16_CSV.splitlines(keepends=True)[-1]
    with pytest.raises(ValueError, match="expected one profiled kernel, found 2"):
        ncu_decode.only_kernel(two)


def test_decomposition_adds_up():
    k8, k16 = ncu_decode.only_kernel(K8_CSV), ncu_decode.only_kernel(K16_CSV)
    parts = ncu_decode.decompose(k8, k16)
    assert parts["delta_s"] == pytest.approx(-50e-6)
    assert parts["k16_dram_bandwidth"] == pytest.approx(3e12) and parts["bytes_saved"] == pytest.approx(4e8)
    assert parts["bytes_s"] == pytest.approx(-4e8 / 3e12)  # -133.3 us
    assert parts["prep_instructions"] == pytest.approx(2e7)  # F2FP +20 M, HMMA +0
    assert parts["k8_instruction_rate"] == pytest.approx(2e12) and parts["prep_s"] == pytest.approx(10e-6)
    assert parts["pipeline_s"] == pytest.approx(-50e-6 + 4e8 / 3e12 - 10e-6)  # +73.3 us
    assert parts["bytes_s"] + parts["prep_s"] + parts["pipeline_s"] == pytest.approx(parts["delta_s"])


def test_decomposition_without_opcodes_leaves_prep_in_the_remainder():
    k8, k16 = ncu_decode.only_kernel(K8_CSV), ncu_decode.only_kernel(K16_CSV)
    k8.opcodes = {}
    parts = ncu_decode.decompose(k8, k16)
    assert parts["prep_s"] is None and parts["pipeline_s"] == pytest.approx(-50e-6 + 4e8 / 3e12)


def test_report_table():
    k8, k16 = ncu_decode.only_kernel(K8_CSV), ncu_decode.only_kernel(K16_CSV)
    text = ncu_decode.report("e4m3-e4m3", "f16-e4m3", k8, k16, ncu_decode.decompose(k8, k16))
    rows = {cells[0]: cells for line in text.splitlines() if (cells := re.split(r"\s{2,}", line.strip()))}
    assert rows["duration (us)"][-3:] == ["350.00", "400.00", "-50.00"]
    assert rows["DRAM read (GB/s)"][-3:] == ["2286", "3000", "-714"]
    assert rows["convert instructions (M)"][-3:] == ["40.000", "20.000", "+20.000"]
    assert rows["stall long_scoreboard (cycles / issue)"][-3:] == ["9.00", "12.00", "-3.00"]
    assert rows["L2 sectors / DRAM sector"][-3:] == ["1.48", "1.00", "+0.48"]
    assert rows["L2 read requests (M)"][-3:] == ["27.500", "9.375", "+18.125"]
    assert "(M): F2FP +20.000, PRMT +5.000\n" in text  # by opcode without modifiers; HMMA unchanged
    assert "T(K8/V8) - T(K16/V8) = -50.00 us:" in text
    assert re.search(r"\(a\) K bytes saved: 400\.0 MB at 3000 GB/s\s+-133\.33 us", text)
    assert re.search(r"\(b\) K preparation: \+20\.000 M .* at 2000 G/s\s+\+10\.00 us", text)
    assert re.search(r"\(c\) pipeline and occupancy \(the remainder\)\s+\+73\.33 us", text)


def test_main_reads_saved_csvs(tmp_path, capsys):
    k8_path, k16_path, out = tmp_path / "k8.csv", tmp_path / "k16.csv", tmp_path / "ncu.json"
    k8_path.write_text(K8_CSV)
    k16_path.write_text(K16_CSV)
    assert ncu_decode.main(["--csv", str(k8_path), str(k16_path), "--json", str(out)]) == 0
    assert "(c) pipeline and occupancy" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["k8_format"] == "e4m3-e4m3" and data["k16_format"] == "f16-e4m3" and data["shape"]["ctx"] == 32768
    assert data["kernels"]["e4m3-e4m3"]["name"] == K8_NAME
    assert data["decomposition"]["prep_s"] == pytest.approx(10e-6)


def test_kernel_regex_picks_the_decode_kernel_only():
    pattern = re.compile(ncu_decode.kernel_regex("e4m3-e4m3", 128, 32))
    assert pattern.search(K8_NAME) and pattern.search(K8_NAME.replace("_fp8_", "_transform_"))
    assert pattern.search(K8_NAME.replace("_f16", "_bf16"))
    merge, writer = (K8_NAME.replace("_sm90a_f16", f"_sm90a_{entry}") for entry in ("merge_f16", "write_f16_i64"))
    for other in (merge, writer, K16_NAME, K8_NAME.replace("_p32_", "_p16_"), K8_NAME.replace("_d128_", "_d64_")):
        assert not pattern.search(other), other
    assert re.compile(ncu_decode.kernel_regex("f16-e4m3", 128, 32)).search(K16_NAME)


def test_profile_command_targets_one_launch_after_the_warmups(tmp_path):
    args = ncu_decode.parse_args(["--batch", "4", "--ctx", "4096", "--warmup", "3", "--ncu", "/opt/ncu",
                                  "--qk", "fp8", "--clock-control", "base"])
    cmd = ncu_decode.profile_command("e4m3-e4m3", args, tmp_path / "r.ncu-rep")
    assert cmd[0] == "/opt/ncu"
    assert cmd[cmd.index("--kernel-name") + 1] == "regex:" + ncu_decode.kernel_regex("e4m3-e4m3", 128, 32)
    assert cmd[cmd.index("--launch-skip") + 1] == "3" and cmd[cmd.index("--launch-count") + 1] == "1"
    assert cmd[cmd.index("--clock-control") + 1] == "base" and cmd[cmd.index("--cache-control") + 1] == "all"
    metrics = cmd[cmd.index("--metrics") + 1].split(",")
    assert "sass__inst_executed_per_opcode" in metrics and "dram__bytes_read.sum" in metrics
    assert "lts__t_sectors_srcunit_tex_op_read.sum" in metrics
    target = cmd[cmd.index(sys.executable):]
    assert target[1].endswith("ncu_decode.py") and target[2:4] == ["--run-one", "e4m3-e4m3"]
    again = ncu_decode.parse_args(target[4:])  # the target parses the shape it is given
    assert (again.batch, again.ctx, again.qk, again.warmup) == (4, 4096, "fp8", 3)
    export = ncu_decode.export_command("/opt/ncu", tmp_path / "r.ncu-rep")
    assert export[export.index("--print-metric-instances") + 1] == "details" and "raw" in export


@pytest.mark.parametrize("argv, message", [(["--code", "i8", "--qk", "fp8"], "--qk fp8 needs --code e4m3"),
                                           (["--heads", "30"], "--heads 30"), (["--batch", "0"], "--batch")])
def test_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        ncu_decode.parse_args(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_real_profiles():
    """The CSVs of a real run (tests/data/ncu_decode: B8 L4096, GQA 32/8, D128, H200)."""
    data = Path(__file__).resolve().parent / "data" / "ncu_decode"
    k8, k16 = (ncu_decode.only_kernel((data / f"{fmt}.csv").read_text()) for fmt in ("e4m3-e4m3", "f16-e4m3"))
    assert re.search(ncu_decode.kernel_regex("e4m3-e4m3", 128, 32), k8.name)
    assert re.search(ncu_decode.kernel_regex("f16-e4m3", 128, 32), k16.name)
    assert k8.duration_s == pytest.approx(29.12e-6) and k8.dram_read_bytes == 69_320_960
    assert (k8.registers, k8.smem_bytes, k8.theoretical_occupancy_pct) == (120, 44_032, 25)
    assert sum(k8.opcodes.values()) == k8.instructions == 13_357_792 and k8.categories["other"] < 0.15 * k8.instructions
    assert set(k8.stalls) == set(ncu_decode.STALL_REASONS)
    parts = ncu_decode.decompose(k8, k16)
    assert parts["bytes_s"] < 0 < parts["prep_s"]
    assert parts["bytes_s"] + parts["prep_s"] + parts["pipeline_s"] == pytest.approx(k8.duration_s - k16.duration_s)
