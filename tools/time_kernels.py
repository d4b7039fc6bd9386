#!/usr/bin/env python3
"""Prefill kernels timed alone, each called directly (CUDA events, median over 200 ms of calls), beside
cuDNN through torch SDPA (--peers) on the same fp16 inputs: the quick comparison of kernel variants
(matrix unit, template options, tile) that tools/bench_prefill.py then confirms in interleaved rounds.
Entries as bench_prefill's: FORMAT[@UNIT][+OPTION[=VALUE]...][:TILE]; an int8-QK format's time is its
whole call (quantization included).

    tools/time_kernels.py f16@mma.sync,f16@wgmma+pingpong=off,f16@wgmma,f16@wgmma+persistent --peers
    tools/time_kernels.py i8-f16,i8-f16:m128n128w8s2 --causal --shape 4x32x4096x128 --shape 1x32x32768x128
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qattn.bench.prefill import format_inputs, kernel_entry  # noqa: E402
from qattn.bench.sizes import BATCH_HEADS_SEQ, sizes  # noqa: E402
from qattn.bench.timing import attention_flops, time_cuda  # noqa: E402

DEFAULT_SHAPES = ((4, 32, 4096, 128), (16, 32, 1024, 128), (1, 32, 32768, 128), (4, 32, 8192, 64))




def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("entries", help="comma-separated kernel entries")
    ap.add_argument("--shape", type=sizes((*BATCH_HEADS_SEQ, "HEAD_DIM")), action="append", help="BATCHxHEADSxSEQxHEAD_DIM (repeatable)")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--peers", action="store_true", help="also time cuDNN through torch SDPA")
    args = ap.parse_args()
    if args.peers:
        try:
            import torch  # noqa: F401
        except ImportError:
            ap.error("--peers times cuDNN through torch, which is not installed")
    import cupy

    from qattn.engine.kernel import build_kernel
    from qattn.engine.spec import KernelSpec

    entries = [e for e in args.entries.split(",") if e]
    for b, h, seq, d in args.shape or DEFAULT_SHAPES:
        q, k, v = (cupy.random.standard_normal((b, h, seq, d), dtype=cupy.float32).astype(cupy.float16)
                   for _ in range(3))
        flops = attention_flops(b, h, seq, seq, d, args.causal)
        cells = []
        for entry in entries:
            fmt, mma, options, tile = kernel_entry(entry)
            spec = KernelSpec(recipe=fmt, head_dim=d, causal=args.causal, mma=mma, tile=tile, options=options)
            kernel, xs = build_kernel(spec), format_inputs(fmt, q, k, v)
            out = cupy.empty_like(xs[0])
            ms = time_cuda(lambda: kernel(*xs, out=out)).median_ms
            cells.append(f"{entry} {ms:.3f} ms {flops / ms / 1e9:.0f} TF")
        if args.peers:
            import torch
            from torch.nn.attention import SDPBackend, sdpa_kernel

            tq, tk, tv = (torch.as_tensor(x, device="cuda") for x in (q, k, v))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                ms = time_cuda(lambda: torch.nn.functional.scaled_dot_product_attention(
                    tq, tk, tv, is_causal=args.causal)).median_ms
            cells.append(f"cudnn {ms:.3f} ms {flops / ms / 1e9:.0f} TF")
        print(f"B{b} H{h} L{seq} D{d}{' causal' if args.causal else ''}: " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
