#!/usr/bin/env python3
"""Where a prefill kernel's warps stall, instruction by instruction, beside cuDNN's kernel (Nsight Compute's
warp-state sampling per SASS instruction; qattn.bench.sass_profile).

One call of `qattn.attention` and one of torch SDPA's cuDNN backend (when torch is importable) on the same
inputs run between cudaProfilerStart and Stop after warm-ups; ncu profiles both with the SourceCounters and
WarpStateStats sections, exports the source page as CSV, and each kernel is summed by stall reason, by opcode,
by execution count (the stages of its schedule) and its hottest instructions.

    tools/ncu_sass.py --shape 16x32x1024                        # f16, D128, non-causal, beside cuDNN
    tools/ncu_sass.py --shape 16x32x1024 --head-dim 64 --causal --format bf16 --json sass.json
    tools/ncu_sass.py --shape 1x32x32768 --format i8-f8 --peer none   # the quantization's kernels and the attention
    tools/ncu_sass.py --csv out/sass.csv                        # read a saved export again (no GPU, no ncu)

The report and the CSV are kept in --out. ncu runs this file with --run-one as its target.
"""
from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qattn.bench import sass_profile  # noqa: E402
from qattn.bench.sizes import sizes  # noqa: E402

NCU = "/usr/local/cuda/bin/ncu"
SECTIONS = ("SourceCounters", "WarpStateStats")


def run_one(args) -> None:
    """ncu's target: warm-ups, then one qattn call (and one cuDNN call) between cudaProfilerStart and Stop."""
    import qattn

    b, h, length = args.shape
    shape, causal = (b, h, length, args.head_dim), args.causal
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        torch = None
    if torch is not None:
        dtype = torch.bfloat16 if args.format == "bf16" else torch.float16
        q, k, v = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(3))

        def peer():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

        sync, start, stop = torch.cuda.synchronize, torch.cuda.cudart().cudaProfilerStart, \
            torch.cuda.cudart().cudaProfilerStop
    else:
        import cupy

        dtype = "bfloat16" if args.format == "bf16" else cupy.float16
        q, k, v = (cupy.random.standard_normal(shape, dtype=cupy.float32).astype(dtype) for _ in range(3))
        peer = None
        sync, start, stop = cupy.cuda.Device().synchronize, cupy.cuda.runtime.profilerStart, \
            cupy.cuda.runtime.profilerStop
    calls = [lambda: qattn.attention(q, k, v, causal=causal, format=args.format)]
    if peer is not None and args.peer == "cudnn":
        calls.append(peer)
    for _ in range(3):
        for call in calls:
            call()
    sync()
    start()
    for call in calls:
        call()
    sync()
    stop()


def profile(args) -> str:
    """Runs ncu over --run-one and returns the source page's CSV (also saved in --out)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = out / "sass"
    target = [sys.executable, str(Path(__file__).resolve()), "--run-one", "--shape", "x".join(map(str, args.shape)),
              "--head-dim", str(args.head_dim), "--format", args.format, "--peer", args.peer]
    if args.causal:
        target.append("--causal")
    sections = [a for s in SECTIONS for a in ("--section", s)]
    subprocess.run([args.ncu, "--profile-from-start", "off", *sections, "--force-overwrite", "-o", str(report),
                    *target], check=True)
    text = subprocess.run([args.ncu, "-i", f"{report}.ncu-rep", "--page", "source", "--print-source", "sass", "--csv"],
                          check=True, capture_output=True, text=True).stdout
    (out / "sass.csv").write_text(text)
    return text


def read_csv(path: str) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return f.read()


def show(summaries: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for s in summaries:
        console.print(f"\n[bold]{s['kernel']}[/bold]: {s['samples']:.0f} samples, {s['executed']:.4g} warp "
                      f"instructions, {s['sass_instructions']} SASS lines")
        console.print("stalls: " + ", ".join(f"{r} {v:.1%}" for r, v in s["stalls"].items() if v >= 0.005))
        ops = Table("opcode", "samples", "executed", "main stall", title="by opcode")
        for r in s["by_opcode"][:16]:
            ops.add_row(r["opcode"], f"{r['samples']:.1%}", f"{r['executed']:.1%}", r["main_stall"])
        stages = Table("executed", "instructions", "listing", "samples", title="by execution count (stages)")
        for r in s["by_count"][:10]:
            stages.add_row(f"{r['executed']:.0f}", str(r["instructions"]), f"{r['first']}-{r['last']}",
                           f"{r['samples']:.1%}")
        hot = Table("#", "samples", "executed", "stalls", "SASS", title="hottest instructions")
        for r in s["hottest"]:
            stalls = ", ".join(f"{k} {v:.0%}" for k, v in r["stalls"].items())
            hot.add_row(str(r["index"]), f"{r['samples']:.2%}", f"{r['executed']:.0f}", stalls, r["source"][:70])
        for table in (ops, stages, hot):
            console.print(table)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", type=sizes(), default=(16, 32, 1024), help="BATCHxHEADSxSEQ (default 16x32x1024)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--format", default="f16", choices=("f16", "bf16", "i8-f16", "i8-f8"),
                   help="qattn's format (default f16; the int8-QK formats' quantization kernels are summed too, "
                        "each kernel on its own, on fp16 inputs)")
    p.add_argument("--peer", default="cudnn", choices=("cudnn", "none"), help="profile torch SDPA's cuDNN kernel too")
    p.add_argument("--top", type=int, default=20, help="hottest instructions listed per kernel (default 20)")
    p.add_argument("--csv", help="summarize a saved source-page export (.csv or .csv.gz) instead of profiling")
    p.add_argument("--out", default="ncu_sass", help="where the report and the CSV go (default ./ncu_sass)")
    p.add_argument("--ncu", default=NCU)
    p.add_argument("--json", help="also write the summaries as JSON")
    p.add_argument("--run-one", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.run_one:
        run_one(args)
        return 0
    text = read_csv(args.csv) if args.csv else profile(args)
    summaries = [sass_profile.summary(k, args.top) for k in sass_profile.parse(text)]
    show(summaries)
    if args.json:
        Path(args.json).write_text(json.dumps(summaries, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
