#!/usr/bin/env python3
"""Time the exact int8-KV-cache kernels (kv8-imma, kv8-split, kv8-f32) per launch at the
parity shapes, beside torch SDPA's fp16 flash backend run on the dequantized cache (same
inputs, same run; with --causal only where queries and keys are as many: that backend has no
bottom-right causal mask). The cache is written once; only attention is timed, every kernel of a
shape in the same interleaved rounds (--rounds; odd rounds in reverse order), medians kept. The tensor-core
kernels run twice: with the launcher's split over keys (its automatic choice, or --splits) and
unsplit (splits=1, the plain grid), so the split's gain is measured in the same run. A second line
per shape splits the short calls' time: the host's time to enqueue one call and the per-call time
of calls queued back to back (equal to the host time when the call is host-bound). --unit
FORMAT@UNIT (repeatable) also times a format on one matrix unit (e.g. kv8-imma@mma.sync beside the
kernel a call runs, which on sm_90a is the wgmma kernel for many queries), with its automatic
splits.

    tools/bench_kv8.py --shape 32768/2048 --shape 1500/1500 --unit kv8-imma@mma.sync --json kv8.json
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qattn.bench.timing import attention_flops, time_interleaved, time_queued  # noqa: E402

FORMATS = ("kv8-imma", "kv8-split", "kv8-f32")
SPLIT_FORMATS = ("kv8-imma", "kv8-split")  # the formats with a split over keys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", action="append", help="CTX/QUERIES (repeatable)")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--splits", type=int, help="force this many splits over keys (default: the launcher's choice)")
    ap.add_argument("--unit", action="append", default=[], metavar="FORMAT@UNIT",
                    help="also time this format on this matrix unit (repeatable)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds per shape (default 3)")
    ap.add_argument("--json", help="write the records here")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds: expected a positive integer, got {args.rounds}")
    import cupy
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import qattn
    from qattn.formats.kv8 import host as kv8
    from qattn.engine.kernel import build_kernel
    from qattn.engine.spec import call_spec, default_spec

    shapes = [tuple(int(x) for x in s.split("/")) for s in (args.shape or ["32768/2048", "1500/1500"])]
    hkv = args.kv_heads or args.heads
    rng = cupy.random.default_rng(0)
    records = []
    for ctx, queries in shapes:
        d = args.head_dim
        q = rng.standard_normal((1, args.heads, queries, d), dtype=cupy.float32)
        k, v = (rng.standard_normal((1, hkv, ctx, d), dtype=cupy.float32) for _ in range(2))
        cache = qattn.KVCacheInt8.from_kv(k, v)
        flops = attention_flops(1, args.heads, queries, ctx, d, args.causal)
        row = {"ctx": ctx, "queries": queries, "heads": args.heads, "kv_heads": hkv, "head_dim": d,
               "causal": args.causal}
        deq = [x.astype(cupy.float16) for x in cache.dequantize(cupy.float32)]
        tq, tk, tv = (torch.from_dlpack(x) for x in (q.astype(cupy.float16), *deq))
        def sdpa_flash():
            return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=args.causal,
                                                                    enable_gqa=args.heads != hkv)

        queued, timed = {}, {}  # timed: name -> call, all timed together once the kernels are built
        for fmt in FORMATS:
            kernel = build_kernel(call_spec(fmt, d, args.causal, queries, default_spec(fmt, d).arch))
            row[f"{fmt}_kernel"] = kernel.spec.name
            out = cupy.empty_like(q)
            splits = args.splits if fmt in SPLIT_FORMATS else 1
            row[f"{fmt}_splits"] = splits or kv8.choose_splits(kernel, 1, args.heads, queries, ctx, q.device.id)
            timed[fmt] = lambda kernel=kernel, out=out, splits=splits: kernel(q, cache, out=out, splits=splits)
            if fmt in SPLIT_FORMATS:
                timed[f"{fmt}_unsplit"] = lambda kernel=kernel, out=out: kernel(q, cache, out=out, splits=1)
                queued[fmt[4:]] = time_queued(timed[fmt])
        for entry in args.unit:
            fmt, _, unit = entry.partition("@")
            kernel = build_kernel(call_spec(fmt, d, args.causal, queries, default_spec(fmt, d).arch, mma=unit))
            row[f"{entry}_kernel"] = kernel.spec.name
            timed[entry] = lambda kernel=kernel, out=cupy.empty_like(q): kernel(q, cache, out=out, splits=args.splits)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # entered once: its cost is not the peer's
            try:
                sdpa_flash()
                timed["flash"] = sdpa_flash
                queued["flash"] = time_queued(sdpa_flash)
            except RuntimeError:  # torch's flash backend has no causal mask for Lq != Lk
                pass
            rounds = time_interleaved(list(timed.values()), args.rounds)
        ms = {name: statistics.median(times) for name, times in zip(timed, rounds)}
        flash = ms.get("flash")
        row["sdpa_flash_fp16_ms"] = flash
        for fmt in FORMATS:
            row[f"{fmt}_ms"] = ms[fmt]
            row[f"{fmt}_tops"] = flops / ms[fmt] / 1e9
            if fmt in SPLIT_FORMATS:
                row[f"{fmt}_unsplit_ms"] = ms[f"{fmt}_unsplit"]
        for entry in args.unit:
            row[f"{entry}_ms"] = ms[entry]
        for name, t in queued.items():
            row[f"{name}_host_ms"], row[f"{name}_back_to_back_ms"] = t.host_ms, t.back_to_back_ms
        records.append(row)
        imma, split = row["kv8-imma_ms"], row["kv8-split_ms"]
        print(f"{ctx:>6}/{queries:<5} splits {row['kv8-imma_splits']:>3}  "
              f"imma {imma:8.3f} ms ({row['kv8-imma_tops']:6.1f} TOPS, unsplit {row['kv8-imma_unsplit_ms']:8.3f})  "
              f"split {split:8.3f} (unsplit {row['kv8-split_unsplit_ms']:8.3f})  f32 {row['kv8-f32_ms']:8.3f}  "
              f"imma/split {split / imma:5.2f}x  " + (
                  f"fp16 flash {flash:8.3f}  imma/flash {flash / imma:5.2f}x (unsplit {flash / row['kv8-imma_unsplit_ms']:5.2f}x)"
                  if flash is not None else "fp16 flash: n/a (no causal mask for Lq != Lk in torch's flash backend)"))
        print(" " * 13 + "host / back-to-back ms per call: " + "  ".join(
            f"{name} {t.host_ms:.3f} / {t.back_to_back_ms:.3f}" for name, t in queued.items()))
        for entry in args.unit:
            fmt = entry.partition("@")[0]
            print(" " * 13 + f"{entry} {row[f'{entry}_ms']:8.3f} ms ({row[f'{entry}_kernel']}): "
                  f"the call's {fmt} kernel is {row[f'{entry}_ms'] / row[f'{fmt}_ms']:5.2f}x as fast")
        print(" " * 13 + "kernels: " + ", ".join(row[f"{fmt}_kernel"] for fmt in FORMATS))
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
