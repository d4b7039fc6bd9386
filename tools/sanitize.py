#!/usr/bin/env python3
"""A small workload for compute-sanitizer: every format with a CUDA kernel, with tails, GQA and
causal Lq != Lk, checked against FP64 (rel_l2 within the format's tolerance) so a silent
corruption also fails.

    compute-sanitizer --tool memcheck python tools/sanitize.py
    compute-sanitizer --tool racecheck python tools/sanitize.py --format f16
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

import qattn  # noqa: E402
from qattn.runtime import emulate, metrics  # noqa: E402
from qattn.runtime.arrays import numpy_dtype  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", action="append", help="formats (default: every format with a CUDA kernel)")
    ap.add_argument("--head-dim", type=int, default=64)
    args = ap.parse_args()
    import cupy

    formats = args.format or [n for n, r in qattn.RECIPES.items() if "cuda" in r.families]
    rng = np.random.default_rng(0)
    worst = 0
    for fmt in formats:
        dt = numpy_dtype(qattn.recipe(fmt).input_dtypes[0])
        for causal, lq, lk in ((False, 77, 131), (True, 131, 77), (True, 65, 200)):
            host = [rng.standard_normal(s).astype(np.float32).astype(dt)
                    for s in ((1, 4, lq, args.head_dim), (1, 2, lk, args.head_dim), (1, 2, lk, args.head_dim))]
            out = qattn.attention(*(cupy.asarray(x) for x in host), format=fmt, causal=causal)
            err = metrics.compare(out, emulate.reference(fmt, *host, causal=causal))  # kv8: the dequantized cache
            ok = err.nonfinite == 0 and err.rel_l2 <= qattn.recipe(fmt).tolerance.rel_l2
            worst += not ok
            print(f"{fmt:6} causal={causal!s:5} {lq}x{lk}: rel_l2 {err.rel_l2:.2e} {'ok' if ok else 'FAIL'}")
    cupy.cuda.runtime.deviceSynchronize()
    return 1 if worst else 0


if __name__ == "__main__":
    raise SystemExit(main())
