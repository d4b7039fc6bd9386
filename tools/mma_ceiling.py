#!/usr/bin/env python3
"""Throughput of one warp-level mma.sync shape on the current GPU: a register-only loop over eight
independent accumulator chains, each with its own operands (so no two chains can be merged), all
SMs busy, CUDA events, median of the timed launches. Beside each figure it prints the SASS
matrix and conversion instructions ptxas emitted for the loop (needs nvdisasm), which is where a
ceiling can mislead: on sm_90a ptxas lowers the e4m3 m16n8k32 MMA to fp16 HMMAs plus F2FP unpacks,
and with operands shared by every chain it also merges the chains, so a naive loop reports a
"ceiling" the attention kernels can never reach.

    tools/mma_ceiling.py                       # f16, s8 and e4m3 on the current device's arch
    tools/mma_ceiling.py --shape e4m3 --shared-operands
"""
import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# name -> (PTX shape, PTX types, accumulator C type, asm constraint, k per MMA)
SHAPES = {
    "f16": ("m16n8k16", "f32.f16.f16.f32", "float", "f", 16),
    "s8": ("m16n8k32", "s32.s8.s8.s32", "int", "r", 32),
    "e4m3": ("m16n8k32", "f32.e4m3.e4m3.f32", "float", "f", 32),
}
CHAINS = 8

SOURCE = r"""
typedef unsigned u32;
extern "C" __global__ void mma_loop(float* out, u32 seed, int iters) {
    %(acc)s c[%(chains)d][4];
    u32 a[%(chains)d][4], b[%(chains)d][2];
#pragma unroll
    for (int i = 0; i < %(chains)d; ++i) {
        const u32 base = seed ^ (threadIdx.x * 0x9e3779b9u) ^ (%(distinct)s * 0x01010101u);
        a[i][0] = base; a[i][1] = base * 3u; a[i][2] = base * 5u; a[i][3] = base * 7u;
        b[i][0] = base * 11u; b[i][1] = base * 13u;
        c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0;
    }
    for (int it = 0; it < iters; ++it) {
#pragma unroll
        for (int i = 0; i < %(chains)d; ++i)
            asm volatile("mma.sync.aligned.%(shape)s.row.col.%(types)s "
                         "{%%0,%%1,%%2,%%3}, {%%4,%%5,%%6,%%7}, {%%8,%%9}, {%%0,%%1,%%2,%%3};"
                         : "+%(cc)s"(c[i][0]), "+%(cc)s"(c[i][1]), "+%(cc)s"(c[i][2]), "+%(cc)s"(c[i][3])
                         : "r"(a[i][0]), "r"(a[i][1]), "r"(a[i][2]), "r"(a[i][3]), "r"(b[i][0]), "r"(b[i][1]));
    }
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < %(chains)d; ++i) s += (float)c[i][0] + (float)c[i][1] + (float)c[i][2] + (float)c[i][3];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
"""


def source(shape: str, shared_operands: bool) -> str:
    ptx_shape, types, acc, cc, _ = SHAPES[shape]
    return SOURCE % dict(shape=ptx_shape, types=types, acc=acc, cc=cc, chains=CHAINS,
                         distinct="0u" if shared_operands else "(u32)(i + 1)")


def sass_ops(binary: bytes) -> dict:
    from qattn.engine.compile import disassemble

    text = disassemble(binary, "cuda")
    if text is None:
        return {}
    ops: dict = {}
    for op in re.findall(r"\b((?:HMMA|IMMA|QMMA|F2FP)\.[\w.]+)", text):
        ops[op] = ops.get(op, 0) + 1
    return ops


def measure(shape: str, arch: str, shared_operands: bool, iters: int, repeats: int) -> dict:
    import cupy
    import numpy as np

    from qattn.bench.timing import time_cuda
    from qattn.engine.compile import compile_cuda

    binary = compile_cuda(source(shape, shared_operands), arch, f"mma_{shape}", entry="mma_loop")
    module = cupy.cuda.Module()
    module.load(binary.data)
    fn = module.get_function("mma_loop")
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    blocks, threads = 4 * sms, 256
    out = cupy.empty(blocks * threads, dtype=cupy.float32)
    run = lambda: fn((blocks,), (threads,), (out, np.uint32(1), np.int32(iters)))  # noqa: E731
    ms = time_cuda(run, runs=repeats).median_ms
    k = SHAPES[shape][4]
    ops = 2 * 16 * 8 * k * CHAINS * iters * blocks * threads / 32
    return {"shape": shape, "arch": arch, "shared_operands": shared_operands, "ms": ms,
            "tops": ops / (ms * 1e-3) / 1e12, "sass": sass_ops(binary.data), "registers": binary.resources["registers"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", action="append", choices=sorted(SHAPES), help="MMA to time (repeatable; default all)")
    ap.add_argument("--arch", help="NVRTC arch (default: the current device's)")
    ap.add_argument("--shared-operands", action="store_true",
                    help="give every chain the same operands (the naive loop ptxas can merge)")
    ap.add_argument("--iters", type=int, default=4096, help="loop iterations per launch")
    ap.add_argument("--repeats", type=int, default=20, help="timed launches (median)")
    args = ap.parse_args()
    from qattn.engine.spec import device_arch

    arch = args.arch or device_arch()
    if arch is None:
        ap.error("no CUDA device: this tool times MMAs on a GPU")
    print(f"{'mma':6} {'arch':7} {'operands':9} {'T(FL)OPS':>9} {'regs':>5}  SASS per {CHAINS} MMAs")
    for shape in args.shape or list(SHAPES):
        r = measure(shape, arch, args.shared_operands, args.iters, args.repeats)
        sass = ", ".join(f"{op} x{n}" for op, n in sorted(r["sass"].items())) or "(nvdisasm not found)"
        print(f"{shape:6} {arch:7} {'shared' if args.shared_operands else 'distinct':9} {r['tops']:9.0f} "
              f"{r['registers']:5d}  {sass}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
