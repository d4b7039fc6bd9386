#!/usr/bin/env python3
"""Time qattn prefill kernels beside torch SDPA (flash, cuDNN), SageAttention 1.0.6 and SageAttention2
(each when importable; SageAttention2 built from source as `sageattention2`, its package folder
renamed, runs beside 1.0.6) on the same inputs, same run; rel_l2 is against an FP64 reference of the
first two heads.

    tools/bench_prefill.py --shape 4x32x4096 --shape 1x32x32768 --causal both --json out.json
    tools/bench_prefill.py --shape 4x32x4096 --tile 128x64x8x2 --tile 128x64x4x2   # tile sweep
    tools/bench_prefill.py --format i8-f8 --format i8-f8@mma.sync  # the same format on two matrix units
    tools/bench_prefill.py --shape 4x32x4096 --sustained 2.5 --rounds 2  # power-capped steady state
    tools/bench_prefill.py --shape 4x32x4096 --settle 1 --rounds 5   # single calls, each from an idle GPU
    tools/bench_prefill.py --format i8-f8 --smoothing mean --smoothing mean+balance --causal both  # balancing's cost
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qattn.engine.tile import Tile  # noqa: E402
from qattn.bench.peers import PEERS  # noqa: E402
from qattn.bench.prefill import SMOOTHINGS, bench_prefill, smoothing_label  # noqa: E402
from qattn.bench.sizes import sizes  # noqa: E402


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _seconds(*, zero_ok: bool):
    """An argparse type for a duration: positive, or with zero_ok non-negative (NaN never)."""
    def parse(text: str) -> float:
        value = float(text)
        if not (value >= 0 if zero_ok else value > 0):
            kind = "non-negative" if zero_ok else "positive"
            raise argparse.ArgumentTypeError(f"expected a {kind} number of seconds, got {text}")
        return value
    return parse


def smoothing_costs(records: list) -> str:
    """A markdown table of each int8-QK call's time under every smoothing against its time under the
    first smoothing timed (same shape, causal mask, format and tile): the whole call's ms and ratio,
    and the quantization's ms (what the smoothing adds is launched there) and its difference."""
    firsts, lines = {}, []
    for r in records:
        if "smoothing" not in r or "ms" not in r:
            continue
        first = firsts.setdefault((r["batch"], r["heads"], r["seq"], r["causal"], r["kernel"]), r)
        cells = [r["kernel"], f"B{r['batch']} H{r['heads']} L{r['seq']} D{r['head_dim']}",
                 "yes" if r["causal"] else "no", smoothing_label(r["smoothing"]), f"{r['ms']:.3f}",
                 f"{r['ms'] / first['ms']:.3f}", f"{r['quant_ms']:.3f}", f"{r['quant_ms'] - first['quant_ms']:+.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    base = smoothing_label(next(iter(firsts.values()))["smoothing"]) if firsts else "first"
    header = ["kernel", "shape", "causal", "smoothing", "ms", f"/ {base}", "quant ms", f"quant − {base}"]
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *lines])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", action="append", type=sizes(), help="BATCHxHEADSxSEQ (repeatable)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--format", action="append",
                    help="qattn formats (default f16); FORMAT@UNIT picks a matrix unit, e.g. i8-f8@mma.sync")
    ap.add_argument("--smoothing", action="append", choices=list(SMOOTHINGS),
                    help="the int8-QK formats' smoothing (repeatable: each format is timed under each, in the "
                         "same rounds, and a table of each one's time over the first's follows)")
    ap.add_argument("--causal", choices=["no", "yes", "both"], default="no")
    ap.add_argument("--tile", action="append", help="BMxBNxWARPSxSTAGES to sweep (default: tuned tile)")
    ap.add_argument("--rounds", type=_positive, default=3,
                    help="interleaved timing rounds per shape (every implementation once a round, odd rounds in reverse; median kept)")
    ap.add_argument("--sustained", type=_seconds(zero_ok=False), metavar="SECONDS",
                    help="time each implementation over SECONDS of back-to-back calls per round (the "
                         "power-capped steady state) instead of single calls")
    ap.add_argument("--settle", type=_seconds(zero_ok=True), default=0.3, metavar="SECONDS",
                    help="idle the GPU this long before each implementation's timing, so that none is timed "
                         "in the wake of a power-hungry one (default 0.3; with 0 the implementation timed right "
                         "after the peers follows them in every other round)")
    ap.add_argument("--json", help="write the records here")
    args = ap.parse_args()
    shapes = args.shape or [(4, 32, 4096)]
    tiles = [Tile(*(int(x) for x in t.split("x"))) for t in args.tile] if args.tile else [None]
    causals = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    records = []
    for causal in causals:
        for i, tile in enumerate(tiles):
            peers = PEERS if i == 0 else ()
            records += bench_prefill(shapes, tuple(args.format or ["f16"]), head_dim=args.head_dim,
                                     causal=causal, tiles=tile, peers=peers, rounds=args.rounds,
                                     sustained=args.sustained, settle=args.settle,
                                     smoothings=tuple(SMOOTHINGS[s] for s in args.smoothing or ()))
    print(f"{'impl':<27}{'kernel':<50}{'B':>3}{'H':>4}{'L':>7}{'D':>5} {'causal':<7}{'ms':>9}{'TFLOPS':>8}"
          f"{'vs flash':>9}{'vs cuDNN':>9}{'vs sage':>8}{'vs sage2':>9}{'rel_l2':>10}{'quant ms':>9}")
    for r in records:
        if "error" in r:
            print(f"{r['impl']:<27} error: {r['error']}")
            continue
        print(f"{r['impl']:<27}{r.get('kernel', ''):<50}{r['batch']:>3}{r['heads']:>4}{r['seq']:>7}{r['head_dim']:>5} "
              f"{str(r['causal']):<7}{r['ms']:>9.3f}{r['tflops']:>8.1f}"
              f"{r.get('vs_sdpa_flash', float('nan')):>9.2f}{r.get('vs_sdpa_cudnn', float('nan')):>9.2f}"
              f"{r.get('vs_sageattn', float('nan')):>8.2f}{r.get('vs_sageattn2', float('nan')):>9.2f}{r['rel_l2']:>10.2e}{r.get('quant_ms', float('nan')):>9.3f}")
    if args.smoothing:
        print(smoothing_costs(records))
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
