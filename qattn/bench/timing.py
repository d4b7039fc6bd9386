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
    return time_cuda_after(fn, lambda: None, warmup=warmup, runs=runs, min_ms=min_ms)



class L2Flush:
    """Evicts a GPU's L2 by reading a buffer several times its size. Reading rather than writing
    leaves clean lines behind, so no write-back of the flush lands in the call timed next."""

    def __init__(self, device: int | None = None, factor: int = 4):
        import cupy

        with cupy.cuda.Device(device) as dev:
            self.l2_bytes = int(cupy.cuda.runtime.getDeviceProperties(dev.id)["l2CacheSize"])
            self._buffer = cupy.ones(factor * self.l2_bytes // 4, dtype=cupy.float32)
            self._sink = cupy.empty((), dtype=cupy.float32)

    def __call__(self) -> None:
        import cupy

        cupy.sum(self._buffer, out=self._sink)


_SPIN_SOURCE = r"""
extern "C" __global__ void qattn_spin(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (now - start < ns);
}
"""


class GpuSpin:
    """One GPU thread busy for `us` microseconds, touching no memory. Enqueued ahead of a timed call
    it covers the host's time to enqueue that call (tens of microseconds for a Python call), so that
    the CUDA events around the call time its GPU work alone, and L2 keeps what it held."""

    def __init__(self, us: float = 200.0):
        import cupy
        import numpy as np

        self._kernel = cupy.RawKernel(_SPIN_SOURCE, "qattn_spin")
        self._ns = np.uint64(us * 1000)

    def __call__(self) -> None:
        self._kernel((1,), (1,), (self._ns,))


def time_cuda_after(fn, before, *, warmup: int = 3, runs: int = 20, min_ms: float = 200.0) -> Timing:
    """time_cuda with before() enqueued ahead of every timed call, outside the CUDA events: a GpuSpin
    (the GPU's time alone, L2 as the previous call left it), or an L2Flush and a spin (HBM-cold)."""
    import cupy

    for _ in range(warmup):
        fn()
    cupy.cuda.get_current_stream().synchronize()
    times: list[float] = []
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    while len(times) < runs or (sum(times) < min_ms and len(times) < 10 * runs):
        before()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return Timing(statistics.median(times), min(times), len(times))


@dataclass
class Queued:
    host_ms: float  # host time per call, enqueueing it (nothing waited for)
    back_to_back_ms: float  # per call over back-to-back calls: the GPU's time, or the host's when that is longer


def time_queued(fn, *, calls: int = 200) -> Queued:
    """Where the time of a short call goes: the host's time to enqueue fn() (perf_counter over
    `calls` calls, no synchronization) and the per-call time of `calls` calls queued back to back
    between two CUDA events. A call whose back-to-back time equals its host time is host-bound."""
    import time

    import cupy

    if calls < 1:
        raise ValueError(f"calls: expected a positive integer, got {calls}")
    stream = cupy.cuda.get_current_stream()
    fn()
    stream.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host_ms = (time.perf_counter() - t0) * 1e3 / calls
    stream.synchronize()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(calls):
        fn()
    stop.record()
    stop.synchronize()
    return Queued(host_ms, cupy.cuda.get_elapsed_time(start, stop) / calls)


def time_sustained(fn, seconds: float, *, batch: int = 16) -> float:
    """Per-call ms of fn() run back to back for about `seconds` (after one warm-up call): the steady
    state of a long job on a power-capped GPU, which windows of a few dozen calls can miss (the
    clock a hungry kernel leaves behind recovers over milliseconds). CUDA events span the whole
    stretch; the host keeps one batch of calls queued ahead, so the GPU never waits for it."""
    import time

    import cupy

    if not seconds > 0:
        raise ValueError(f"seconds: expected a positive duration, got {seconds}")
    stream = cupy.cuda.get_current_stream()
    fn()
    stream.synchronize()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    calls, queued, t0 = 0, None, time.perf_counter()
    while True:
        for _ in range(batch):
            fn()
        calls += batch
        done = cupy.cuda.Event()
        done.record()
        if queued is not None:
            queued.synchronize()  # the batch before this one: one batch stays in flight
        queued = done
        if time.perf_counter() - t0 >= seconds:
            break
    stop.record()
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) / calls


def round_timer(fn, rounds: int) -> float:
    """time_interleaved's default timer: the median ms of single calls (time_cuda), the run budget
    split over the rounds."""
    return time_cuda(fn, runs=max(5, 20 // rounds), min_ms=200.0 / rounds).median_ms


def time_interleaved(fns, rounds: int, timer=None, *, settle: float = 0.0, sleep=None) -> list[list[float]]:
    """Per-call times of each of fns in `rounds` rounds, each round timing every fn once in turn
    (timer(fn, rounds) -> ms; default time_cuda with the run budget split over the rounds).
    Odd rounds run in reverse order: on a power-capped GPU the clock after a hungry kernel recovers
    over milliseconds, and a fixed order would hand that cost to the same fn every round.
    settle (seconds): the GPU idles that long before each timing (sleep(seconds), default
    time.sleep), so that every fn starts from the clock an idle GPU recovers to, whichever ran
    before it. Returns one list of round times per fn, in the order of fns."""
    if rounds < 1:
        raise ValueError(f"rounds: expected a positive integer, got {rounds}")
    if not settle >= 0:
        raise ValueError(f"settle: expected a non-negative number of seconds, got {settle}")
    if sleep is None:
        import time

        sleep = time.sleep
    timer = round_timer if timer is None else timer
    per_fn: list[list[float]] = [[] for _ in fns]
    for r in range(rounds):
        for k in range(len(fns)) if r % 2 == 0 else reversed(range(len(fns))):
            if settle:
                sleep(settle)
            per_fn[k].append(timer(fns[k], rounds))
    return per_fn


def attention_flops(batch: int, heads: int, lq: int, lk: int, head_dim: int, causal: bool) -> float:
    """4·B·H·Lq·Lk·D, halved for causal (the convention peers report TFLOPS with)."""
    return 4.0 * batch * heads * lq * lk * head_dim / (2.0 if causal else 1.0)


def with_ratios(timed, per_round, peers) -> list[dict]:
    """The records of one shape's interleaved timing: each gets its median ms and round medians, and
    every record that is not a peer the ratio of each peer's time to its own (vs_PEER, > 1: faster).
    timed: (record, fn) pairs in the order per_round (time_interleaved's result) holds them."""
    peer_ms = {}
    for times, (rec, _) in zip(per_round, timed):
        rec.update(ms=statistics.median(times), round_ms=times)
        if rec["impl"] in peers:
            peer_ms[rec["impl"]] = rec["ms"]
    for rec, _ in timed:
        if rec["impl"] not in peers:
            rec.update({f"vs_{p}": ms / rec["ms"] for p, ms in peer_ms.items()})
    return [rec for rec, _ in timed]
