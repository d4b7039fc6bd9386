#!/usr/bin/env python3
"""Time the int8-QK quantization step alone (int8.quantize: K mean, Q/K codes, V operand), CUDA
events, median of many calls, fp16 inputs, and report its bandwidth against the H200's HBM.

Bytes counted are what the step must move: K (and V, for an 8-bit PV) read twice (statistics,
then codes), Q read once, and the codes and the V operand written.

    tools/bench_quant.py --format i8-f8 --shape 4x32x4096 --shape 16x32x1024 --shape 1x32x32768
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qattn.bench.sizes import sizes  # noqa: E402

HBM_TBS = 4.2  # H200 HBM3e, TB/s


def step_bytes(fmt: str, b: int, h: int, length: int, d: int, rows: bool) -> int:
    from qattn.engine.registry import recipe

    n = b * h * length * d
    pv = recipe(fmt).ctype["pv"]
    v_read = 2 * n * (2 if pv != "f16" else 0)           # statistics + codes
    v_write = 0 if pv == "f16" else (2 * n if rows else n)  # fp16 rows or 8-bit V^T
    return 2 * n * 2 + 2 * n + n * 2 + v_read + v_write      # K twice, Q once, Q8 + K8, V


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", action="append", help="i8-f16, i8-i8 or i8-f8 (repeatable; default i8-f8)")
    ap.add_argument("--shape", action="append", type=sizes(), help="BATCHxHEADSxSEQ (repeatable)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--label", default="", help="a name for this run's rows")
    args = ap.parse_args()
    import cupy

    import qattn
    from qattn.formats.int8qk import host as int8
    from qattn.bench.timing import time_cuda

    shapes = args.shape or [(4, 32, 4096), (16, 32, 1024), (1, 32, 32768)]
    print(f"| run | format | shape | ms | GB/s | of {HBM_TBS} TB/s |")
    print("|---|---|---|---|---|---|")
    for fmt in args.format or ["i8-f8"]:
        kernel = qattn.build("prefill", format=fmt, head_dim=args.head_dim)
        rows = kernel.spec.family.values["pv_operand"] == "f16"
        for b, h, length in shapes:
            rng = cupy.random.default_rng(0)
            q, k, v = (rng.standard_normal((b, h, length, args.head_dim), dtype=cupy.float32).astype(cupy.float16)
                       for _ in range(3))
            t = time_cuda(lambda: int8.quantize(q, k, v, kernel=kernel), warmup=5, runs=50).median_ms
            gbs = step_bytes(fmt, b, h, length, args.head_dim, rows) / t / 1e6
            print(f"| {args.label} | {fmt} | B{b} H{h} L{length} D{args.head_dim} | {t:.3f} | {gbs:.0f} | "
                  f"{gbs / (HBM_TBS * 1000):.0%} |", flush=True)
            del q, k, v
            cupy.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
