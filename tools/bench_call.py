#!/usr/bin/env python3
"""Where an int8-QK call's time goes, for the default kernel of each shape: the quantization step
alone (int8.quantize), the attention kernel alone on quantized operands
(int8.attention_quantized), and the whole call; each timed synchronously (CUDA events around one
call, as bench_prefill times calls, so host time before the first launch counts) and back to back
(calls queued between two events: the GPU's time), plus the host's time to enqueue one call.

    tools/bench_call.py --shape 4x32x4096 --shape 1x32x32768 --causal both
    tools/bench_call.py --head-dim 64 --shape 4x32x8192
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qattn.bench.sizes import sizes  # noqa: E402


shape = sizes()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", default="i8-f8", choices=("i8-f16", "i8-i8", "i8-f8"))
    ap.add_argument("--shape", action="append", type=shape, help="BxHxL (repeatable; default 4x32x4096)")
    ap.add_argument("--head-dim", type=int, default=128, choices=(64, 128))
    ap.add_argument("--causal", choices=("no", "yes", "both"), default="no")
    args = ap.parse_args()
    import cupy

    import qattn
    from qattn.formats.int8qk import host as int8
    from qattn.bench.timing import attention_flops, time_cuda, time_queued

    d = args.head_dim
    print("| shape | causal | quant ms (sync / back to back) | attention ms | whole call ms | host ms per call "
          "| TOPS: attention alone / whole (sync) / whole (back to back) |")
    print("|---|---|---|---|---|---|---|")
    for b, h, length in args.shape or [(4, 32, 4096)]:
        rng = cupy.random.default_rng(0)
        q, k, v = (rng.standard_normal((b, h, length, d), dtype=cupy.float32).astype(cupy.float16) for _ in range(3))
        out = cupy.empty_like(q)
        for causal in {"no": (False,), "yes": (True,), "both": (False, True)}[args.causal]:
            kernel = qattn.build("prefill", format=args.format, head_dim=d, causal=causal)
            qkv = int8.quantize(q, k, v, kernel=kernel)
            calls = {"quant": lambda: int8.quantize(q, k, v, kernel=kernel),
                     "attn": lambda: int8.attention_quantized(kernel, qkv, out=out),
                     "whole": lambda: kernel(q, k, v, out=out)}
            sync = {name: time_cuda(fn, runs=30).median_ms for name, fn in calls.items()}
            queued = {name: time_queued(fn, calls=50) for name, fn in calls.items()}
            tops = attention_flops(b, h, length, length, d, causal) / 1e9
            print(f"| B{b} H{h} L{length} D{d} | {'yes' if causal else 'no'} | {sync['quant']:.3f} / "
                  f"{queued['quant'].back_to_back_ms:.3f} | {queued['attn'].back_to_back_ms:.3f} | "
                  f"{sync['whole']:.3f} / {queued['whole'].back_to_back_ms:.3f} | {queued['whole'].host_ms:.3f} | "
                  f"{tops / queued['attn'].back_to_back_ms:.0f} / {tops / sync['whole']:.0f} / "
                  f"{tops / queued['whole'].back_to_back_ms:.0f} |", flush=True)
            del qkv
        del q, k, v, out
        cupy.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
