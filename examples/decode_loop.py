#!/usr/bin/env python3
"""Grow a paged K-V cache token by token, as a serving engine does, and check every step.

A prompt is written into a paged cache in one call; then each step writes the next Lq tokens' K and
V (one launch) and decodes their queries against everything cached so far (bottom-right causal among
the Lq new rows; speculative decoding verifies Lq = 4 draft tokens a step). Every --check-every
positions the step's output is compared with FP64 attention on the original fp16 K/V: the error of
the cache format as it accumulates over the context. Prints the error by position and the steps
per second (writes and decodes, no checks, one sync at the end).

    python examples/decode_loop.py --format e4m3-e4m3 --ctx 32768 --speculative 4
    python examples/decode_loop.py --format i8-i8 --preset outliers --ctx 8192
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

import qattn  # noqa: E402
from qattn import data  # noqa: E402
from qattn.check import metrics  # noqa: E402
from qattn.check.reference import attention as fp64_attention  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", default="e4m3-e4m3", help="decode format K-V (see `qattn list`)")
    ap.add_argument("--ctx", type=int, default=32768, help="positions to grow the cache to")
    ap.add_argument("--prompt", type=int, default=1024, help="tokens written before the first step")
    ap.add_argument("--speculative", type=int, default=4, help="new tokens per step (1: plain decode)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=32)
    ap.add_argument("--preset", default="normal", choices=sorted(data.PRESETS))
    ap.add_argument("--check-every", type=int, default=2048, help="positions between FP64 checks")
    ap.add_argument("--max-rel-l2", type=float, default=6e-2, help="exit 1 if a checked step errs more")
    args = ap.parse_args()
    import cupy

    lq, ctx = args.speculative, args.ctx
    if not 1 <= lq <= 16 or args.prompt < lq or ctx <= args.prompt:
        ap.error("expected 1 <= --speculative <= 16 and --speculative <= --prompt < --ctx")
    x = data.preset(args.preset, ctx=ctx, queries=ctx, heads=args.heads, kv_heads=args.kv_heads,
                    head_dim=args.head_dim, seed=0)
    q, k, v = (np.ascontiguousarray(x[n][0].astype(np.float16)) for n in ("q", "k", "v"))  # [H, L, D]
    k_tokens, v_tokens = (np.ascontiguousarray(t.transpose(1, 0, 2)) for t in (k, v))  # [L, Hkv, D]
    k_side, v_side = args.format.split("-")
    pages = -(-ctx // args.page_size)
    cache = qattn.PagedKVCache(pages, args.page_size, args.kv_heads, args.head_dim, k=k_side, v=v_side)
    table = cupy.asarray(np.random.default_rng(0).permutation(pages).astype(np.int32)[None])
    slot_of = (cupy.asnumpy(table)[0][np.arange(ctx) // args.page_size] * args.page_size
               + np.arange(ctx) % args.page_size).astype(np.int32)
    kd, vd, slots, qd = cupy.asarray(k_tokens), cupy.asarray(v_tokens), cupy.asarray(slot_of), cupy.asarray(q)
    cache.write(kd[:args.prompt], vd[:args.prompt], slots[:args.prompt])
    lens = cupy.empty(1, cupy.int32)
    out = cupy.empty((1, args.heads, lq, args.head_dim), cupy.float16)
    checks, worst = [], 0.0
    steps, spent = 0, 0.0
    pos = args.prompt
    next_check = args.prompt
    cupy.cuda.Device().synchronize()
    start = time.perf_counter()
    while pos + lq <= ctx:
        cache.write(kd[pos:pos + lq], vd[pos:pos + lq], slots[pos:pos + lq])
        lens.fill(pos + lq)
        qattn.decode(qd[None, :, pos:pos + lq], cache, table, lens, out=out)
        steps += 1
        if pos >= next_check:  # the clock stops for the check
            cupy.cuda.Device().synchronize()
            spent += time.perf_counter() - start
            got = cupy.asnumpy(out).astype(np.float32)
            ref = fp64_attention(q[None, :, pos:pos + lq], k[None, :, :pos + lq], v[None, :, :pos + lq], causal=True)
            err = metrics.compare(got, ref).rel_l2
            checks.append((pos + lq, err))
            worst = max(worst, err)
            next_check += args.check_every
            start = time.perf_counter()
        pos += lq
    cupy.cuda.Device().synchronize()
    spent += time.perf_counter() - start
    print(f"{args.format}, {args.preset} K/V, {args.heads}/{args.kv_heads} heads, D {args.head_dim}, "
          f"{lq} new token(s) a step, pages of {args.page_size}")
    print(f"{'position':>10} {'rel_l2 vs FP64':>15}")
    for position, err in checks:
        print(f"{position:>10} {err:>15.3e}")
    print(f"{steps} steps in {spent:.2f} s: {steps / spent:.0f} steps/s "
          f"({steps * lq / spent:.0f} tokens/s); worst rel_l2 {worst:.3e}")
    return 1 if worst > args.max_rel_l2 else 0


if __name__ == "__main__":
    sys.exit(main())
