#!/usr/bin/env python3
"""A wgmma prefill kernel's work items from its own clock (qattn.bench.trace): one call, traced on the
first blocks, then the tensor pipe's idle share as its MMA issues allow it, what every role was doing in each
idle stretch, and the median cycles of a work item's phases. The kernel is the one qattn.attention runs for
the shape (bench's entry syntax: FORMAT[@UNIT][+OPTION[=VALUE]...][:TILE]).

    tools/trace_prefill.py f16 --shape 16/32/1024
    tools/trace_prefill.py f16+persistent=off --shape 4/32/4096 --causal --json trace.json

With --clock global the points record the GPU's nanosecond timer, which every SM shares, and the tool prints how
ragged the grid's tail is instead: when each block finished its last item, by the blocks' item counts.

    tools/trace_prefill.py f16 --shape 16/32/1024 --causal --clock global
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qattn.bench import trace  # noqa: E402
from qattn.bench.prefill import format_inputs, kernel_entry  # noqa: E402
from qattn.bench.sizes import sizes  # noqa: E402




def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def operand_bits(fmt: str) -> tuple:
    """(S, PV) operand widths of a format's MMAs."""
    return {"i8-f16": (8, 16), "i8-f8": (8, 8), "i8-i8": (8, 8)}.get(fmt, (16, 16))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("entry", help="the kernel entry, e.g. f16 or f16+persistent=off:m128n128w8s2")
    ap.add_argument("--shape", type=sizes(sep="/"), default=(16, 32, 1024), help="BATCH/HEADS/SEQ [default: 16/32/1024]")
    ap.add_argument("-d", "--head-dim", type=int, default=128, help="head dimension [default: 128]")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--blocks", type=_positive, default=132, help="blocks traced, from block 0 [default: 132]")
    ap.add_argument("--events", type=_positive, default=4096, help="events kept a role [default: 4096]")
    ap.add_argument("--clock", choices=tuple(trace.CLOCKS), default="sm",
                    help="sm: each SM's cycle counter (the tensor pipe and phase analysis); global: the GPU's "
                         "nanosecond timer (the blocks' ends) [default: sm]")
    ap.add_argument("--json", type=Path, help="write the analysis and the events to this file")
    args = ap.parse_args()
    import cupy

    from qattn.engine.spec import call_spec, device_arch

    fmt, mma, options, tile = kernel_entry(args.entry)
    b, h, seq = args.shape
    spec = call_spec(fmt, args.head_dim, args.causal, seq, device_arch(), mma=mma, heads=b * h)
    if options:
        spec = spec.with_(options={**dict(spec.options), **options})
    if tile is not None:
        spec = spec.with_(tile=tile)
    q, k, v = (cupy.random.standard_normal((b, h, seq, args.head_dim), dtype=cupy.float32).astype(cupy.float16)
               for _ in range(3))
    events = trace.run_traced(spec, format_inputs(fmt, q, k, v), blocks=args.blocks, events=args.events,
                              clock=args.clock)
    if not events:
        ap.error(f"{spec.name}: no events recorded")
    if args.clock == "global":
        ends = trace.block_ends(events)
        print(f"{spec.name}  B{b} H{h} L{seq}{' causal' if args.causal else ''}: {len(ends['by_items'])} item counts "
              f"over the traced blocks; the last block ended {ends['span'] / 1e3:.1f} us after the first event")
        print(f"the blocks' SM time idle at the tail: {ends['idle_share']:.1%}")
        for n, e in ends["by_items"].items():
            print(f"  {n:4d} items: {e['blocks']:4d} blocks, ended at {e['min'] / 1e3:.1f} / {e['median'] / 1e3:.1f} / "
                  f"{e['max'] / 1e3:.1f} us (least / median / largest)")
        if args.json:
            args.json.write_text(json.dumps({"spec": spec.name, "clock": "global", **ends, "events": events}))
        return 0
    cycles = trace.burst_cycles(args.head_dim, spec.tile.block_n, *operand_bits(fmt))
    result = trace.analyse(events, cycles)
    print(f"{spec.name}  B{b} H{h} L{seq}{' causal' if args.causal else ''}: {len(events)} events on "
          f"{len({e['sm'] for e in events})} SMs")
    print(f"tensor pipe: busy {result['busy_share']:.1%}, idle between bursts {result['idle_share']:.1%} of the "
          f"SMs' spans ({result['span_cycles']:.3g} cycles); bursts seen landed before the model finished them: "
          f"{result['late_bursts']}")
    print("idle stretches by what the roles were doing (share of the span):")
    for state, idle in result["idle_by_state"][:12]:
        print(f"  {idle / result['span_cycles']:6.1%}  {state}")
    print("a work item's phases, median cycles a consumer warpgroup:")
    for name, value in result["phases"].items():
        print(f"  {value:9.0f}  {name}")
    if args.json:
        args.json.write_text(json.dumps({"spec": spec.name, "cycles": cycles, **result, "events": events}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
