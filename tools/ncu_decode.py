#!/usr/bin/env python3
"""The break-even decomposition of an 8-bit K in the decode kernel, from Nsight Compute.

T(K8/V8) - T(K16/V8) at one shape, from one profiled launch of each, split into (a) the K bytes
saved (the DRAM bytes difference at the K16/V8 kernel's DRAM read bandwidth: a negative time), (b)
the unhidden K preparation (the extra conversion and MMA instructions at the K8/V8 kernel's rate of
instructions) and (c) the pipeline and occupancy penalty (what remains). Both kernels are profiled
HBM-cold (ncu flushes the caches before each replay pass), at the GPU's own clocks unless
--clock-control says otherwise. Beside them, the L2 sectors the SMs read per DRAM sector: a streaming
kernel reads each sector once (1.0); more means copies that reach the L2 in pieces, a sector asked for
twice (the V^T copies of pages of 16 once read 1.48).

    tools/ncu_decode.py                               # B8 L32K, GQA 32/8, D128: e4m3-e4m3 vs f16-e4m3
    tools/ncu_decode.py --code i8 --qk int8 --json ncu_i8.json
    tools/ncu_decode.py --csv k8.csv k16.csv          # read saved CSVs again (no GPU, no ncu)

ncu runs this file with --run-one FORMAT as its target: a few warm-up decode calls, then the one
call it profiles (--launch-skip over the warm-ups, the kernel name filtered to the format's decode
kernel, not its merge or cache writer). Reports and CSVs are kept in --out.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

try:
    import qattn  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

NCU = "/usr/local/cuda/bin/ncu"

METRICS = {
    "duration": "gpu__time_duration.sum",
    "dram_read": "dram__bytes_read.sum",
    "occupancy": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "theoretical_occupancy": "sm__maximum_warps_per_active_cycle_pct",
    "registers": "launch__registers_per_thread",
    "smem_static": "launch__shared_mem_per_block_static",
    "smem_dynamic": "launch__shared_mem_per_block_dynamic",
    "instructions": "smsp__inst_executed.sum",
    "issue_busy": "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "l2_sectors": "lts__t_sectors_srcunit_tex_op_read.sum",
    "l2_requests": "lts__t_requests_srcunit_tex_op_read.sum",
}
SECTOR_BYTES = 32
OPCODES = "sass__inst_executed_per_opcode"  # warp instructions executed, per SASS opcode
STALL_REASONS = ("long_scoreboard", "short_scoreboard", "barrier", "math_pipe_throttle", "mio_throttle",
                 "lg_throttle", "not_selected", "selected", "wait", "dispatch_stall", "no_instruction",
                 "branch_resolving")


def stall_metric(reason: str) -> str:
    """Warp cycles per issued instruction spent stalled for `reason` (the reasons add up to the CPI)."""
    return f"smsp__average_warps_issue_stalled_{reason}_per_issue_active.ratio"


ALL_METRICS = (*METRICS.values(), OPCODES, *(stall_metric(r) for r in STALL_REASONS))

# SASS opcodes by what they do; the K preparation is the conversion and MMA instructions.
CATEGORIES = {
    "convert": ("F2FP", "F2F", "I2F", "I2FP", "F2I", "I2I", "F2IP"),
    "mma": ("HMMA", "IMMA", "QMMA", "HGMMA", "IGMMA", "QGMMA", "DMMA"),
    "fp": ("FADD", "FMUL", "FFMA", "FMNMX", "HADD2", "HMUL2", "HFMA2", "HMNMX2", "MUFU", "FSETP", "FSEL"),
    "int": ("IMAD", "IADD3", "VIADD", "LOP3", "SHF", "PRMT", "LEA", "ISETP", "SEL", "IABS", "IMNMX", "VIMNMX", "MOV",
            "SHFL"),
    "memory": ("LDG", "LDGSTS", "LDS", "LDSM", "STS", "STG", "LDC", "ULDC", "LDGDEPBAR", "DEPBAR", "MOVM"),
}
PREP = ("convert", "mma")


# ---- the profiled workload -------------------------------------------------------------------------

def run_one(fmt: str, args) -> None:
    """Fill a cache of `fmt` at the shape and decode `warmup` times, then once more (the profiled launch)."""
    import cupy
    import numpy as np

    from qattn.bench.decode import filled_cache, page_ids
    from qattn.formats.decode import decode

    crng, rng = cupy.random.default_rng(args.seed), np.random.default_rng(args.seed)
    k, v = (crng.standard_normal((args.batch * args.ctx, args.kv_heads, args.head_dim), dtype=cupy.float32)
            .astype(cupy.float16) for _ in range(2))
    q = crng.standard_normal((args.batch, args.heads, 1, args.head_dim), dtype=cupy.float32).astype(cupy.float16)
    cache, table = filled_cache(fmt, k, v, args.batch, args.ctx, args.kv_heads, args.head_dim, args.page_size,
                                args.scale, page_ids(args.batch, args.ctx, args.page_size, "shuffled", rng))
    del k, v
    lens = cupy.full(args.batch, args.ctx, dtype=cupy.int32)
    out = cupy.empty_like(q)
    qk = args.qk if fmt == k8_format(args.code) else "auto"
    for _ in range(args.warmup + 1):
        decode(q, cache, table, lens, out=out, qk=qk, splits=args.splits)
    cupy.cuda.get_current_stream().synchronize()


# ---- running ncu --------------------------------------------------------------------------------------

def k8_format(code: str) -> str:
    return f"{code}-{code}"


def k16_format(code: str) -> str:
    return f"f16-{code}"


def kernel_regex(fmt: str, head_dim: int, page_size: int) -> str:
    """The decode kernel of a format (qattn_decode_<spec name>_f16): the spec name ends in the arch, so
    the merge (..._sm90a_merge_f16) and the cache writer (..._sm90a_write_f16_i64) do not match."""
    return f"^qattn_decode_{fmt.replace('-', '_')}_d{head_dim}_.*_p{page_size}_.*_sm[0-9]+a?_b?f16$"


def runner_args(args) -> list[str]:
    """The shape options of this run, passed on to the --run-one target."""
    options = {"--batch": args.batch, "--ctx": args.ctx, "--heads": args.heads, "--kv-heads": args.kv_heads,
               "--head-dim": args.head_dim, "--page-size": args.page_size, "--scale": args.scale, "--code": args.code,
               "--qk": args.qk, "--warmup": args.warmup, "--seed": args.seed}
    if args.splits is not None:
        options["--splits"] = args.splits
    return [str(x) for name, value in options.items() for x in (name, value)]


def profile_command(fmt: str, args, report: Path) -> list[str]:
    """ncu over one decode launch of `fmt` after the warm-ups, its report written to `report`."""
    return [args.ncu, "--kernel-name", f"regex:{kernel_regex(fmt, args.head_dim, args.page_size)}",
            "--launch-skip", str(args.warmup), "--launch-count", "1", "--metrics", ",".join(ALL_METRICS),
            "--cache-control", "all", "--clock-control", args.clock_control, "--export", str(report),
            "--force-overwrite", sys.executable, str(Path(__file__).resolve()), "--run-one", fmt, *runner_args(args)]


def export_command(ncu: str, report: Path) -> list[str]:
    """The raw page of a report as CSV: base units, per-opcode counts with their opcode names."""
    return [ncu, "--import", str(report), "--csv", "--page", "raw", "--print-units", "base",
            "--print-metric-instances", "details"]


def profile(fmt: str, args) -> str:
    """Profile `fmt`'s decode launch; returns the raw-page CSV (also saved beside the report)."""
    report = args.out / f"{fmt}.ncu-rep"
    subprocess.run(profile_command(fmt, args, report), check=True)
    text = subprocess.run(export_command(args.ncu, report), check=True, capture_output=True, text=True).stdout
    (args.out / f"{fmt}.csv").write_text(text)
    return text


# ---- reading ncu's CSV --------------------------------------------------------------------------------

PREFIXES = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
BASE_UNITS = ("second", "byte", "cycle", "inst", "hz", "s")  # "s": ncu prints durations as ns, us, ms


def _prefixed(unit: str) -> float:
    for base in BASE_UNITS:
        if unit.endswith(base) and unit[:-len(base)] in PREFIXES:
            return PREFIXES[unit[:-len(base)]]
    return 1.0


def unit_scale(unit: str) -> float:
    """The factor from `unit` to its base unit: ns 1e-9, Kbyte 1e3, Gbyte/second 1e9, % 1."""
    numerator, _, denominator = unit.partition("/")
    return _prefixed(numerator) / (_prefixed(denominator) if denominator else 1.0)


def number(text: str, unit: str = "") -> float | None:
    """A CSV value in base units, None where ncu has none ("n/a", empty). A launch attribute printed
    with its instances ("120 (0: 120)") is its total."""
    try:
        return float(text.partition(" (")[0].replace(",", "")) * unit_scale(unit)
    except ValueError:
        return None


_INSTANCES = re.compile(r"\s*([\d.,]+)\s*\((.*)\)\s*")


def opcode_counts(text: str) -> dict[str, float]:
    """An instanced value printed with --print-metric-instances details, "TOTAL (OP: n; OP: n)", as
    {OP: n}; {} where the instances are missing."""
    match = _INSTANCES.fullmatch(text)
    if not match:
        return {}
    counts = {}
    for item in match.group(2).split(";"):
        name, _, value = item.rpartition(":")
        if name.strip():
            counts[name.strip()] = float(value.replace(",", ""))
    return counts


def parse_raw_csv(text: str) -> list[dict[str, tuple[str, str]]]:
    """The kernels of a raw-page CSV, each {column: (value, unit)}; lines before the header (ncu's own
    messages) are skipped, and so is the units row."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError("no ncu raw-page CSV header (a line starting with \"ID\") in the input")
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header, units, kernels = rows[0], rows[1], rows[2:]
    return [{name: (value, unit) for name, value, unit in zip(header, row, units)} for row in kernels if row]


@dataclass
class KernelProfile:
    """One kernel launch as ncu measured it (seconds, bytes, warp instructions)."""
    name: str
    duration_s: float
    dram_read_bytes: float
    occupancy_pct: float | None = None
    theoretical_occupancy_pct: float | None = None
    registers: float | None = None
    smem_bytes: float | None = None
    instructions: float | None = None
    issue_busy_pct: float | None = None
    l2_read_sectors: float | None = None  # sectors the SMs read from the L2
    l2_read_requests: float | None = None
    opcodes: dict = field(default_factory=dict)
    stalls: dict = field(default_factory=dict)

    @classmethod
    def from_row(cls, row: dict) -> "KernelProfile":
        def metric(key):
            return number(*row[key]) if key in row else None

        smem = [metric(METRICS[k]) for k in ("smem_static", "smem_dynamic")]
        duration, dram = metric(METRICS["duration"]), metric(METRICS["dram_read"])
        if duration is None or dram is None:
            raise ValueError(f"{METRICS['duration']} and {METRICS['dram_read']} are needed; the CSV lacks one")
        return cls(name=row.get("Kernel Name", ("?", ""))[0], duration_s=duration, dram_read_bytes=dram,
                   occupancy_pct=metric(METRICS["occupancy"]),
                   theoretical_occupancy_pct=metric(METRICS["theoretical_occupancy"]),
                   registers=metric(METRICS["registers"]),
                   smem_bytes=None if None in smem else sum(smem), instructions=metric(METRICS["instructions"]),
                   issue_busy_pct=metric(METRICS["issue_busy"]), l2_read_sectors=metric(METRICS["l2_sectors"]),
                   l2_read_requests=metric(METRICS["l2_requests"]),
                   opcodes=opcode_counts(row[OPCODES][0]) if OPCODES in row else {},
                   stalls={r: v for r in STALL_REASONS if (v := metric(stall_metric(r))) is not None})

    @property
    def l2_sectors_per_dram_sector(self) -> float | None:
        """L2 sectors read per DRAM sector read: 1.0 when every sector streamed is asked for once."""
        if self.l2_read_sectors is None or not self.dram_read_bytes:
            return None
        return self.l2_read_sectors * SECTOR_BYTES / self.dram_read_bytes

    @property
    def categories(self) -> dict[str, float]:
        """Warp instructions executed per category (CATEGORIES), the rest as "other"."""
        counts = {name: 0.0 for name in (*CATEGORIES, "other")}
        for opcode, n in self.opcodes.items():
            base = opcode.split(".")[0]
            counts[next((c for c, ops in CATEGORIES.items() if base in ops), "other")] += n
        return counts


def only_kernel(text: str) -> KernelProfile:
    """The one kernel of a profile's CSV."""
    kernels = parse_raw_csv(text)
    if len(kernels) != 1:
        raise ValueError(f"expected one profiled kernel, found {len(kernels)}: is the kernel regex right?")
    return KernelProfile.from_row(kernels[0])


# ---- the decomposition ---------------------------------------------------------------------------------

def decompose(k8: KernelProfile, k16: KernelProfile) -> dict:
    """T(K8) - T(K16) = bytes_s + prep_s + pipeline_s (seconds). bytes_s: minus the DRAM bytes K8 saves
    at K16's DRAM read bandwidth; prep_s: K8's extra conversion and MMA instructions at K8's rate of
    warp instructions per second (None without per-opcode counts); pipeline_s: the remainder."""
    delta = k8.duration_s - k16.duration_s
    bandwidth = k16.dram_read_bytes / k16.duration_s
    saved = k16.dram_read_bytes - k8.dram_read_bytes
    bytes_s = -saved / bandwidth
    prep_s = extra = rate = None
    if k8.opcodes and k16.opcodes and k8.instructions:
        extra = sum(k8.categories[c] - k16.categories[c] for c in PREP)
        rate = k8.instructions / k8.duration_s
        prep_s = extra / rate
    return {"delta_s": delta, "bytes_saved": saved, "k16_dram_bandwidth": bandwidth, "bytes_s": bytes_s,
            "prep_instructions": extra, "k8_instruction_rate": rate, "prep_s": prep_s,
            "pipeline_s": delta - bytes_s - (prep_s or 0.0)}


def _cell(value, scale: float = 1.0, spec: str = ".1f") -> str:
    return "-" if value is None else format(value * scale, spec)


def comparison_rows(k8: KernelProfile, k16: KernelProfile) -> list[tuple[str, str, str, str]]:
    """(quantity, K8/V8, K16/V8, difference) rows of the side-by-side table."""
    def row(label, get, scale=1.0, spec=".1f"):
        a, b = get(k8), get(k16)
        diff = None if a is None or b is None else a - b
        return label, _cell(a, scale, spec), _cell(b, scale, spec), _cell(diff, scale, "+" + spec)

    rows = [row("duration (us)", lambda p: p.duration_s, 1e6, ".2f"),
            row("DRAM read (MB)", lambda p: p.dram_read_bytes, 1e-6),
            row("DRAM read (GB/s)", lambda p: p.dram_read_bytes / p.duration_s, 1e-9, ".0f"),
            row("achieved occupancy (%)", lambda p: p.occupancy_pct),
            row("theoretical occupancy (%)", lambda p: p.theoretical_occupancy_pct),
            row("registers / thread", lambda p: p.registers, 1.0, ".0f"),
            row("shared memory / block (KB)", lambda p: p.smem_bytes, 1e-3),
            row("warp instructions (M)", lambda p: p.instructions, 1e-6, ".3f"),
            row("issue slots busy (%)", lambda p: p.issue_busy_pct),
            row("L2 read sectors (M)", lambda p: p.l2_read_sectors, 1e-6, ".3f"),
            row("L2 read requests (M)", lambda p: p.l2_read_requests, 1e-6, ".3f"),
            row("L2 sectors / DRAM sector", lambda p: p.l2_sectors_per_dram_sector, 1.0, ".2f")]
    if k8.opcodes or k16.opcodes:
        rows += [row(f"  {name} instructions (M)", lambda p, n=name: p.categories[n], 1e-6, ".3f")
                 for name in (*CATEGORIES, "other")]
    rows += [row(f"stall {reason} (cycles / issue)", lambda p, r=reason: p.stalls.get(r), 1.0, ".2f")
             for reason in STALL_REASONS if reason in k8.stalls or reason in k16.stalls]
    return rows


def top_opcode_changes(k8: KernelProfile, k16: KernelProfile, count: int = 8) -> list[tuple[str, float]]:
    """The opcodes (modifiers dropped) whose executed counts differ most, (opcode, K8 - K16)."""
    change: dict[str, float] = {}
    for profile, sign in ((k8, 1.0), (k16, -1.0)):
        for opcode, n in profile.opcodes.items():
            base = opcode.split(".")[0]
            change[base] = change.get(base, 0.0) + sign * n
    return sorted((c for c in change.items() if c[1]), key=lambda c: -abs(c[1]))[:count]


def decomposition_rows(parts: dict) -> list[tuple[str, str]]:
    """(what, microseconds) rows of the decomposition; the three parts add up to the difference."""
    bytes_label = (f"(a) K bytes saved: {parts['bytes_saved'] * 1e-6:.1f} MB at "
                   f"{parts['k16_dram_bandwidth'] * 1e-9:.0f} GB/s")
    if parts["prep_s"] is None:
        prep = ("(b) K preparation: no per-opcode counts (in (c))", "-")
    else:
        prep = (f"(b) K preparation: {parts['prep_instructions'] * 1e-6:+.3f} M conversion/MMA instructions at "
                f"{parts['k8_instruction_rate'] * 1e-9:.0f} G/s", f"{parts['prep_s'] * 1e6:+.2f} us")
    return [(bytes_label, f"{parts['bytes_s'] * 1e6:+.2f} us"), prep,
            ("(c) pipeline and occupancy (the remainder)", f"{parts['pipeline_s'] * 1e6:+.2f} us")]


def _aligned(rows) -> list[str]:
    width = max(len(label) for label, _ in rows)
    return [f"  {label:<{width}}  {value:>10}" for label, value in rows]


def report(k8_fmt: str, k16_fmt: str, k8: KernelProfile, k16: KernelProfile, parts: dict) -> str:
    rows = [("", k8_fmt, k16_fmt, "difference"), *comparison_rows(k8, k16)]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [f"{r[0]:<{widths[0]}}  " + "  ".join(f"{r[i]:>{widths[i]}}" for i in range(1, 4)) for r in rows]
    changes = top_opcode_changes(k8, k16)
    if changes:
        lines += ["", "opcodes executed, K8 - K16 (M): " + ", ".join(f"{n} {d * 1e-6:+.3f}" for n, d in changes)]
    lines += ["", f"T(K8/V8) - T(K16/V8) = {parts['delta_s'] * 1e6:+.2f} us:", *_aligned(decomposition_rows(parts))]
    return "\n".join(lines)


# ---- the command ----------------------------------------------------------------------------------------

def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=positive, default=8)
    ap.add_argument("--ctx", type=positive, default=32768)
    ap.add_argument("--heads", type=positive, default=32)
    ap.add_argument("--kv-heads", type=positive, default=8)
    ap.add_argument("--head-dim", type=int, choices=(64, 128), default=128)
    ap.add_argument("--page-size", type=int, choices=(16, 32, 64, 128), default=32)
    ap.add_argument("--scale", choices=("token", "head"), default="token")
    ap.add_argument("--code", choices=("e4m3", "i8"), default="e4m3",
                    help="the 8-bit code: CODE-CODE (K8/V8) against f16-CODE (K16/V8)")
    ap.add_argument("--qk", choices=("auto", "transform", "fp8", "int8"), default="auto",
                    help="the K8/V8 format's QK path (fp8 for e4m3, int8 for i8)")
    ap.add_argument("--splits", type=positive, help="split count of both calls [default: chosen per format]")
    ap.add_argument("--warmup", type=positive, default=5, help="decode calls before the profiled one")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random K, V and queries")
    ap.add_argument("--ncu", default=NCU, help="the Nsight Compute command line")
    ap.add_argument("--clock-control", choices=("none", "base"), default="none",
                    help="none: the GPU's own clocks, as the benchmark runs; base: ncu's fixed base clocks")
    ap.add_argument("--out", type=Path, default=Path("ncu_decode"), help="folder of the reports and CSVs")
    ap.add_argument("--csv", nargs=2, type=Path, metavar=("K8_CSV", "K16_CSV"),
                    help="read these raw-page CSVs instead of profiling")
    ap.add_argument("--json", type=Path, help="also write the kernels and the decomposition as JSON")
    ap.add_argument("--run-one", metavar="FORMAT", help=argparse.SUPPRESS)  # the target ncu profiles
    args = ap.parse_args(argv)
    if args.qk not in ("auto", "transform") and {"fp8": "e4m3", "int8": "i8"}[args.qk] != args.code:
        ap.error(f"--qk {args.qk} needs --code {'e4m3' if args.qk == 'fp8' else 'i8'}, got --code {args.code}")
    if args.heads % args.kv_heads:
        ap.error(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.run_one:
        run_one(args.run_one, args)
        return 0
    k8_fmt, k16_fmt = k8_format(args.code), k16_format(args.code)
    if args.csv:
        texts = [path.read_text() for path in args.csv]
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        texts = [profile(fmt, args) for fmt in (k8_fmt, k16_fmt)]
    k8, k16 = (only_kernel(text) for text in texts)
    parts = decompose(k8, k16)
    print(f"decode B{args.batch} L{args.ctx} GQA {args.heads}/{args.kv_heads} D{args.head_dim} page {args.page_size}, "
          f"{k8_fmt} (qk {args.qk}) vs {k16_fmt}; {k8.name} vs {k16.name}\n")
    print(report(k8_fmt, k16_fmt, k8, k16, parts))
    if args.json:
        shape = {k: getattr(args, k) for k in ("batch", "ctx", "heads", "kv_heads", "head_dim", "page_size", "scale")}
        args.json.write_text(json.dumps({"shape": shape, "k8_format": k8_fmt, "k16_format": k16_fmt, "qk": args.qk,
                                         "kernels": {k8_fmt: asdict(k8), k16_fmt: asdict(k16)},
                                         "decomposition": parts}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
