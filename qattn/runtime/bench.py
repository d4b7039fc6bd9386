"""Timing on the GPU: CUDA events around each launch, warm-up first, median of many runs (DESIGN §4)."""
from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Timing:
    median_ms: float
    min_ms: float
    runs: int


def time_cuda(fn, *, warmup: int = 3, runs: int = 20, min_ms: float = 200.0) -> Timing:
    """Median per-call time of fn() on the current CuPy stream. Runs at least `runs` times and
    keeps going (up to 10x) until min_ms of GPU time has been measured."""
    import cupy

    for _ in range(warmup):
        fn()
    cupy.cuda.get_current_stream().synchronize()
    times: list[float] = []
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    while len(times) < runs or (sum(times) < min_ms and len(times) < 10 * runs):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return Timing(statistics.median(times), min(times), len(times))


def attention_flops(batch: int, heads: int, lq: int, lk: int, head_dim: int, causal: bool) -> float:
    """4·B·H·Lq·Lk·D, halved for causal (the convention peers report TFLOPS with)."""
    return 4.0 * batch * heads * lq * lk * head_dim / (2.0 if causal else 1.0)
