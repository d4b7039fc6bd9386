#!/usr/bin/env python3
"""Q/K channel balancing on the CPU emulators: rel_l2 against FP64 of every int8-QK format under
"mean" (K smoothing) and "mean+balance" (then α per channel, by each α rule: "outliers", "sqrt",
"pow2"), on every qattn.data
preset and the captured MiniLM tensors (tests/data/minilm_qkv.npz, its last CTX keys), averaged over
seeds. Prints a markdown table; the ratio columns are balanced over mean-only (below 1: better), the
mean over seeds and the worst seed's in brackets.

    tools/bench_balancing.py                                    # 4K and 32K, 2 seeds, every preset
    tools/bench_balancing.py --ctx 4096 --preset outliers_scale --seeds 5 --json balancing.json
"""
import argparse
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from qattn.bench.sources import SOURCES, inputs  # noqa: E402
from qattn.check import emulate, metrics  # noqa: E402
from qattn.formats.int8qk.emulate import FORMATS  # noqa: E402

# (smoothing, alpha rule) of each column, mean-only first: the ratios' denominator
VARIANTS = (("mean", "sqrt"), ("mean+balance", "outliers"), ("mean+balance", "sqrt"), ("mean+balance", "pow2"))


def measure(job: tuple) -> dict:
    """rel_l2 of every format under every variant on one (source, ctx, seed)."""
    source, ctx, seed, heads, kv_heads, queries = job
    x = inputs(source, ctx=ctx, queries=queries, heads=heads, kv_heads=kv_heads, seed=seed)
    q, k, v, scale = x["q"], x["k"], x["v"], x.get("scale")
    ref = emulate.reference("i8-f16", q, k, v, scale=scale)
    errors = {fmt: [metrics.compare(emulate.emulate(fmt, q, k, v, scale=scale, smoothing=smoothing,
                                                    alpha_rule=rule), ref).rel_l2 for smoothing, rule in VARIANTS]
              for fmt in FORMATS}
    return {"source": source, "ctx": ctx, "seed": seed, "rel_l2": errors}


def table(records: list) -> str:
    """One row per (source, ctx, format): mean rel_l2 over the seeds of each variant, each balanced
    one with its ratio to mean-only."""
    groups = {}
    for r in records:
        for fmt, errors in r["rel_l2"].items():
            groups.setdefault((r["source"], r["ctx"], fmt), []).append(errors)
    lines = ["| K | keys | format | mean | + balance | / mean | + balance, every channel | / mean "
             "| + balance, 2ⁿ α | / mean |", "|---|---|---|---|---|---|---|---|---|---|"]
    for (source, ctx, fmt), runs in groups.items():
        e = np.asarray(runs)  # [seeds, variants]
        ratios = e[:, 1:] / e[:, :1]
        cells = [f"{e[:, 0].mean():.2e}"]
        for i in range(ratios.shape[1]):
            cells += [f"{e[:, i + 1].mean():.2e}", f"{ratios[:, i].mean():.2f} [{ratios[:, i].max():.2f}]"]
        lines.append(f"| {source} | {ctx // 1024}K | {fmt} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", action="append", choices=SOURCES, help="inputs (repeatable; default all)")
    ap.add_argument("--ctx", action="append", type=int, help="keys (repeatable; default 4096 and 32768)")
    ap.add_argument("--seeds", type=int, default=2, help="seeds per (input, ctx), averaged (default 2)")
    ap.add_argument("--heads", type=int, default=2, help="query heads (default 2)")
    ap.add_argument("--kv-heads", type=int, default=1, help="kv heads (default 1: one GQA group of --heads)")
    ap.add_argument("--queries", type=int, default=128, help="query rows, the context's last (default 128)")
    ap.add_argument("--workers", type=int, default=2, help="processes (default 2)")
    ap.add_argument("--json", help="also write the records here")
    args = ap.parse_args()
    jobs = [(source, ctx, seed, args.heads, args.kv_heads, args.queries)
            for source in args.preset or SOURCES for ctx in args.ctx or (4096, 32768) for seed in range(args.seeds)]
    with ProcessPoolExecutor(args.workers) as pool:
        records = list(pool.map(measure, jobs))
    print(table(records))
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
