#!/usr/bin/env python3
"""rel_l2 against FP64 of qattn formats beside torch SDPA (cuDNN), SageAttention 1.0.6 and
SageAttention2 (each when importable; SageAttention2 built from source runs beside 1.0.6 as
`sageattention2`) on the same fp16 inputs from the qattn.data presets, in one run on the GPU.
The queries are the last min(CTX, --max-queries) positions; causal rows only where Lq = Lk.

    tools/bench_accuracy.py                                   # i8-f8, five presets, 4K and 32K
    tools/bench_accuracy.py --format i8-f8 --format i8-f16 --preset outliers --ctx 8192 --json acc.json
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qattn.bench.prefill import ACCURACY_PRESETS, accuracy_against_fp64  # noqa: E402

PEERS = ("sdpa_cudnn", "sageattn", "sageattn2")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", action="append", help="qattn formats (repeatable; default i8-f8)")
    ap.add_argument("--preset", action="append", choices=ACCURACY_PRESETS,
                    help="input presets (repeatable; default all of them)")
    ap.add_argument("--ctx", action="append", type=_positive, help="context lengths (repeatable; default 4096 and 32768)")
    ap.add_argument("--max-queries", type=_positive, default=4096, help="queries per context at most (default 4096)")
    ap.add_argument("--heads", type=_positive, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", choices=["no", "yes", "both"], default="both")
    ap.add_argument("--json", help="write the records here")
    args = ap.parse_args()
    formats = tuple(args.format or ["i8-f8"])
    causal = {"no": (False,), "yes": (True,), "both": (False, True)}[args.causal]
    records = accuracy_against_fp64(tuple(args.preset or ACCURACY_PRESETS), tuple(args.ctx or [4096, 32768]), formats,
                                    peers=PEERS, heads=args.heads, head_dim=args.head_dim,
                                    max_queries=args.max_queries, causal=causal)
    impls = list(dict.fromkeys(r["impl"] for r in records))
    print(f"{'preset':<16}{'ctx':>7}{'Lq':>7} {'causal':<7}" + "".join(f"{n:>14}" for n in impls))
    rows = {}
    for r in records:
        rows.setdefault((r["preset"], r["ctx"], r["queries"], r["causal"]), {})[r["impl"]] = r
    for (preset, ctx, lq, is_causal), by_impl in rows.items():
        cells = [f"{by_impl[n]['rel_l2']:>14.3e}" if "rel_l2" in by_impl.get(n, {}) else f"{'-':>14}" for n in impls]
        print(f"{preset:<16}{ctx:>7}{lq:>7} {str(is_causal):<7}" + "".join(cells))
    for r in records:
        if "error" in r:
            print(f"{r['impl']} at {r['preset']} {r['ctx']}: {r['error']}")
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
