#!/usr/bin/env python3
"""A small workload for compute-sanitizer: every format with a CUDA kernel (and, as FORMAT@UNIT,
every other matrix unit the GPU's arch builds a format with), with tails, GQA and causal
Lq != Lk, checked against FP64 (rel_l2 within the format's tolerance) so a silent corruption
also fails. A --format entry may also name template options and a tile, as the benchmarks'
FORMAT[@UNIT][+OPTION[=VALUE]...][:TILE]; --batch gives persistent blocks several items each.

    compute-sanitizer --tool memcheck python tools/sanitize.py
    compute-sanitizer --tool racecheck python tools/sanitize.py --format f16
    compute-sanitizer --tool racecheck python tools/sanitize.py --format f16@wgmma+persistent --head-dim 128 --batch 96
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

import qattn  # noqa: E402
from qattn.bench.prefill import kernel_entry  # noqa: E402
from qattn.check import emulate  # noqa: E402
from qattn.check import metrics  # noqa: E402
from qattn.engine.arrays import numpy_dtype  # noqa: E402


def default_formats() -> list:
    """Every format with a CUDA kernel, then FORMAT@UNIT for the other matrix units this GPU's arch
    builds a format with."""
    from qattn.engine.spec import device_arch

    arch = device_arch()
    names = [n for n, r in qattn.RECIPES.items() if "cuda" in r.families]
    extra = [f"{n}@{f.values['mma_unit']}" for n in names
             for f in qattn.RECIPES[n].arch_options("cuda", arch)[1:]]
    return names + extra


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", action="append",
                    help="formats, FORMAT@UNIT for another matrix unit (default: every format with a CUDA kernel)")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1, help="sequences per call (default 1)")
    args = ap.parse_args()
    import cupy

    formats = args.format or default_formats()
    rng = np.random.default_rng(0)
    worst = 0
    for entry in formats:
        fmt, mma, options, tile = kernel_entry(entry)
        dt = numpy_dtype(qattn.recipe(fmt).input_dtypes[0])
        for causal, lq, lk in ((False, 77, 131), (True, 131, 77), (True, 65, 200)):
            host = [rng.standard_normal(s).astype(np.float32).astype(dt)
                    for s in ((args.batch, 4, lq, args.head_dim), (args.batch, 2, lk, args.head_dim),
                              (args.batch, 2, lk, args.head_dim))]
            inputs = [cupy.asarray(x) for x in host]
            if mma or options or tile:
                kernel = qattn.build("prefill", format=fmt, head_dim=args.head_dim, causal=causal, mma=mma,
                                     options=options, tile=tile)
                out = kernel(*inputs)
            else:
                out = qattn.attention(*inputs, format=fmt, causal=causal)
            err = metrics.compare(out, emulate.reference(fmt, *host, causal=causal))  # kv8: the dequantized cache
            ok = err.nonfinite == 0 and err.rel_l2 <= qattn.recipe(fmt).tolerance.rel_l2
            worst += not ok
            print(f"{entry:12} B{args.batch} causal={causal!s:5} {lq}x{lk}: rel_l2 {err.rel_l2:.2e} {'ok' if ok else 'FAIL'}")
    cupy.cuda.runtime.deviceSynchronize()
    return 1 if worst else 0


if __name__ == "__main__":
    raise SystemExit(main())
