#!/usr/bin/env python3
"""rel_l2 against FP64 of qattn formats beside torch SDPA (cuDNN), SageAttention 1.0.6 and
SageAttention2 (each when importable; SageAttention2 built from source runs beside 1.0.6 as
`sageattention2`) on the same fp16 inputs, in one run on the GPU: the qattn.data presets and MiniLM's
captured tensors ("minilm": one head, D 32, run padded to D 64 at its own softmax scale). The queries
are the last min(CTX, --max-queries) positions; causal rows only where Lq = Lk. The int8-QK formats
run once under each --smoothing. Prints a markdown table: a row per inputs and qattn format, a
column per smoothing, each later smoothing's ratio to the first (below 1: more accurate), then the
peers' rel_l2 on the same inputs.

    tools/bench_accuracy.py                                   # i8-f8, five presets, 4K and 32K
    tools/bench_accuracy.py --format i8-f8 --format i8-f16 --preset outliers --ctx 8192 --json acc.json
    tools/bench_accuracy.py --balancing --heads 8 --kv-heads 2 --markdown balancing.md   # Q/K balancing
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qattn.bench.prefill import ACCURACY_PRESETS, SMOOTHINGS, accuracy_against_fp64, smoothing_label  # noqa: E402
from qattn.bench.sources import SOURCES  # noqa: E402
from qattn.engine.registry import formats_with_option  # noqa: E402

PEERS = ("sdpa_cudnn", "sageattn", "sageattn2")
DEFAULT_CALL = "rel_l2"  # the column of a format called without a smoothing


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _column(record: dict) -> str:
    return smoothing_label(record["smoothing"]) if "smoothing" in record else DEFAULT_CALL


def _keys(ctx: int) -> str:
    return f"{ctx // 1024}K" if ctx % 1024 == 0 else str(ctx)


def _cell(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _ratio(errors: dict, column: str, base: str):
    return errors[column] / errors[base] if errors.get(column) is not None and errors.get(base) else None


def table(records: list) -> str:
    """The records as a markdown table: one row per (source, keys, queries, causal, qattn format),
    its rel_l2 under each smoothing, each later smoothing's ratio to the first, and the peers' rel_l2
    on the same inputs ("-": no value, e.g. an error)."""
    columns = list(dict.fromkeys(_column(r) for r in records if "format" in r))
    smoothed = [c for c in columns if c != DEFAULT_CALL]
    peers = list(dict.fromkeys(r["impl"] for r in records if "format" not in r))
    rows, peer_errors = {}, {}
    for r in records:
        key = (r["source"], r["ctx"], r["queries"], r["causal"])
        if "format" in r:
            rows.setdefault(key + (r["format"],), {})[_column(r)] = r.get("rel_l2")
        else:
            peer_errors.setdefault(key, {})[r["impl"]] = r.get("rel_l2")
    header = ["source", "keys", "queries", "causal", "format", *columns,
              *(f"{c} / {smoothed[0]}" for c in smoothed[1:]), *peers]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (source, ctx, lq, causal, fmt), errors in rows.items():
        peer_row = peer_errors.get((source, ctx, lq, causal), {})
        cells = [source, _keys(ctx), str(lq), "yes" if causal else "no", fmt,
                 *(_cell(errors.get(c), ".2e") for c in columns),
                 *(_cell(_ratio(errors, c, smoothed[0]), ".2f") for c in smoothed[1:]),
                 *(_cell(peer_row.get(p), ".2e") for p in peers)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--balancing", action="store_true",
                    help="Q/K balancing's table: by default every int8-QK format, under smoothing mean and "
                         "mean+balance, on every source")
    ap.add_argument("--format", action="append",
                    help="qattn formats (repeatable; default i8-f8, with --balancing every int8-QK format)")
    ap.add_argument("--smoothing", action="append", choices=list(SMOOTHINGS),
                    help="the int8-QK formats' smoothing (repeatable: each format runs under each; default "
                         "their default call, with --balancing mean and mean+balance)")
    ap.add_argument("--preset", action="append", choices=SOURCES,
                    help=f"inputs (repeatable; default {', '.join(ACCURACY_PRESETS)}, with --balancing all)")
    ap.add_argument("--ctx", action="append", type=_positive,
                    help="context lengths (repeatable; default 4096 and 32768)")
    ap.add_argument("--max-queries", type=_positive, default=4096, help="queries per context at most (default 4096)")
    ap.add_argument("--heads", type=_positive, default=2, help="query heads of the presets (default 2)")
    ap.add_argument("--kv-heads", type=_positive, help="kv heads of the presets (default: --heads)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", choices=["no", "yes", "both"], default="both")
    ap.add_argument("--json", help="write the records here")
    ap.add_argument("--markdown", help="also write the table here")
    args = ap.parse_args()
    formats = args.format or (formats_with_option("smoothing") if args.balancing else ["i8-f8"])
    smoothings = args.smoothing or (["mean", "mean+balance"] if args.balancing else [])
    sources = args.preset or (SOURCES if args.balancing else ACCURACY_PRESETS)
    causal = {"no": (False,), "yes": (True,), "both": (False, True)}[args.causal]
    records = accuracy_against_fp64(tuple(sources), tuple(args.ctx or [4096, 32768]), tuple(formats),
                                    smoothings=tuple(SMOOTHINGS[s] for s in smoothings), peers=PEERS,
                                    heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                                    max_queries=args.max_queries, causal=causal)
    text = table(records)
    print(text)
    for r in records:
        if "error" in r:
            print(f"{r['impl']} at {r['source']} {r['ctx']}: {r['error']}")
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
