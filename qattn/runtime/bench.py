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
    if timer is None:
        def timer(fn, n):
            return time_cuda(fn, runs=max(5, 20 // n), min_ms=200.0 / n).median_ms
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


PEERS = ("sdpa_flash", "sdpa_cudnn", "sageattn", "sageattn2")


def _sageattention2():
    """SageAttention2 (CUDA kernels built from source), or None: the module sageattention2 (its
    package folder renamed, so that it imports beside SageAttention 1.0.6 from PyPI), else
    sageattention itself when that is version 2 (it has the fp8-PV CUDA entry points)."""
    import importlib

    for name in ("sageattention2", "sageattention"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "sageattn_qk_int8_pv_fp8_cuda"):
            return module
    return None


def _peer(name: str):
    """A callable (q, k, v, causal) -> out for a peer on torch tensors, or None where its library is
    missing: torch SDPA on one backend, SageAttention's sageattn (1.0.6: int8 QK, fp16 PV, K
    smoothing), or SageAttention2's sageattn ("sageattn2": on sm_90 its wgmma kernel, int8 QK and
    fp8 PV; only where it is not the package "sageattn" already runs)."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None
    if name in ("sageattn", "sageattn2"):
        try:
            import sageattention
        except ImportError:
            sageattention = None
        module = sageattention if name == "sageattn" else _sageattention2()
        if module is None or (name == "sageattn2" and module is sageattention):
            return None
        return lambda q, k, v, causal: module.sageattn(q, k, v, tensor_layout="HND", is_causal=causal)
    backend = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}[name]

    def run(q, k, v, causal):
        with sdpa_kernel([backend]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                    enable_gqa=q.shape[1] != k.shape[1])
    return run


_CHECK_HEADS = 2  # heads of batch 0 whose output is compared with FP64 (all rows)


def _fp64_slice(q, k, v, causal):
    """FP64 attention (on the GPU) of the first _CHECK_HEADS heads of batch 0: the accuracy
    yardstick every implementation in a run is measured against."""
    import cupy

    qs, ks, vs = (x[0, :_CHECK_HEADS].astype(cupy.float64) for x in (q, k, v))
    s = qs @ ks.swapaxes(-1, -2) / float(q.shape[-1]) ** 0.5
    if causal:
        lq, lk = s.shape[-2:]
        s = cupy.where(cupy.arange(lk)[None, :] <= cupy.arange(lq)[:, None] + (lk - lq), s, -cupy.inf)
    p = cupy.exp(s - s.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ vs


def _rel_l2(out, ref) -> float:
    import cupy

    o = cupy.asarray(out)[0, :_CHECK_HEADS].astype(cupy.float64)
    return float(cupy.linalg.norm(o - ref) / cupy.linalg.norm(ref))


def bench_prefill(shapes, formats=("f16",), *, head_dim=128, causal=False, peers=PEERS, seed=0,
                  tiles=None, rounds: int = 3, sustained: float | None = None, settle: float = 0.0) -> list[dict]:
    """Time qattn prefill kernels and peers on the same inputs in the same run.
    shapes: iterable of (batch, heads, seq) with Lq = Lk = seq; formats: names, or "name@unit" for
    the format on another matrix unit of the arch (e.g. "i8-f8@wgmma"). Returns one record per
    (shape, implementation) with median ms, TFLOPS, the ratio to each peer and rel_l2 against
    FP64 on the first heads (a GPU FP64 reference of the same inputs).
    The implementations of a shape are timed in `rounds` interleaved rounds (each round times every
    one in turn) and each reports the median of its round medians, so that clock and power drift
    over the run, which on a power-bound GPU favours whoever runs first or last, is shared by all.
    sustained (seconds): time each implementation in each round over that long a back-to-back
    stretch (time_sustained) instead of a median of single calls. settle (seconds): an idle pause
    before each implementation's timing (time_interleaved), which makes single-call times those of
    a GPU at its idle clock rather than in the wake of the implementation timed before."""
    if sustained is not None and not sustained > 0:
        raise ValueError(f"sustained: expected a positive number of seconds, got {sustained}")
    if not settle >= 0:
        raise ValueError(f"settle: expected a non-negative number of seconds, got {settle}")
    import cupy

    from .api import default_spec
    from .kernel import build_kernel

    records = []
    rng = cupy.random.default_rng(seed)
    for batch, heads, seq in shapes:
        flops = attention_flops(batch, heads, seq, seq, head_dim, causal)
        shape_rec = {"batch": batch, "heads": heads, "seq": seq, "head_dim": head_dim, "causal": causal}
        q, k, v = (rng.standard_normal((batch, heads, seq, head_dim), dtype=cupy.float32).astype(cupy.float16)
                   for _ in range(3))
        ref = _fp64_slice(q, k, v, causal)
        timed = []  # (record, callable to time)
        torch_inputs = None
        for name in peers:
            fn = _peer(name)
            if fn is None:
                continue
            import torch

            torch_inputs = torch_inputs or tuple(torch.from_dlpack(x) for x in (q, k, v))
            try:
                out = fn(*torch_inputs, causal)
            except Exception as exc:  # backend unavailable for this shape/GPU
                records.append(dict(shape_rec, impl=name, error=str(exc).splitlines()[0]))
                continue
            timed.append((dict(shape_rec, impl=name, rel_l2=_rel_l2(out, ref)),
                          lambda fn=fn: fn(*torch_inputs, causal)))
        for entry in formats:
            fmt, _, mma = entry.partition("@")  # "i8-f8@wgmma": the format on a named matrix unit
            spec = default_spec(fmt, head_dim, causal=causal)
            if mma:
                try:
                    spec = spec.with_(mma=mma, tile=None)
                except ValueError as exc:  # this arch does not build the format on that unit
                    records.append(dict(shape_rec, impl=f"qattn:{entry}", error=str(exc)))
                    continue
            if tiles:
                spec = spec.with_(tile=tiles[entry] if isinstance(tiles, dict) else tiles)
            kernel = build_kernel(spec)
            xs = _format_inputs(fmt, q, k, v)
            out = cupy.empty_like(xs[0])
            kernel(*xs, out=out)
            rec = dict(shape_rec, impl=f"qattn:{entry}", kernel=spec.name, rel_l2=_rel_l2(out, ref))
            timed.append((rec, lambda kernel=kernel, xs=xs, out=out: kernel(*xs, out=out)))
            if spec.family.launcher == "prefill_i8":  # the share of the call spent quantizing Q, K, V
                from .int8 import quantize

                rec["quant_ms"] = time_cuda(lambda: quantize(*xs, kernel=kernel)).median_ms
        timer = None if sustained is None else (lambda fn, _rounds: time_sustained(fn, sustained))
        per_round = time_interleaved([fn for _, fn in timed], rounds, timer, settle=settle)
        peer_ms = {}
        for times, (rec, _) in zip(per_round, timed):
            rec.update(ms=statistics.median(times), round_ms=times)
            rec["tflops"] = flops / rec["ms"] / 1e9
            if rec["impl"] in PEERS:
                peer_ms[rec["impl"]] = rec["ms"]
        for rec, _ in timed:
            if rec["impl"] not in PEERS:
                rec.update({f"vs_{p}": ms / rec["ms"] for p, ms in peer_ms.items()})
            records.append(rec)
    return records


ACCURACY_PRESETS = ("normal", "outliers", "outliers_token", "bias", "rope")


def accuracy_against_fp64(presets=ACCURACY_PRESETS, contexts=(4096, 32768), formats=("i8-f8",), *, peers=PEERS,
                          heads: int = 2, head_dim: int = 128, max_queries: int = 4096, causal=(False, True),
                          seed: int = 1) -> list[dict]:
    """rel_l2 against FP64 (on the GPU) of qattn formats and peers on the same fp16 inputs, drawn
    from the qattn.data presets: one record per (preset, context, causal, implementation). The
    queries are the last min(ctx, max_queries) positions of the context; causal rows only where
    Lq = Lk (torch's and SageAttention's causal masks align top-left where they differ, qattn's
    bottom-right). A peer that fails on a shape gets a record with its error instead."""
    import cupy

    from .. import data
    from .api import attention

    for name in presets:
        if name not in data.PRESETS:
            raise ValueError(f"presets: unknown preset {name!r}; expected names from {sorted(data.PRESETS)}")
    if max_queries < 1:
        raise ValueError(f"max_queries: expected a positive number of queries, got {max_queries}")
    peer_fns = {name: fn for name in peers if (fn := _peer(name)) is not None}
    records = []
    for name in presets:
        for ctx in contexts:
            lq = min(ctx, max_queries)
            x = data.preset(name, ctx=ctx, queries=lq, heads=heads, head_dim=head_dim, seed=seed)
            q, k, v = (cupy.asarray(x[n]).astype(cupy.float16) for n in ("q", "k", "v"))
            torch_inputs = None
            for is_causal in causal:
                if is_causal and lq != ctx:
                    continue
                ref = _fp64_slice(q, k, v, is_causal)
                base = {"preset": name, "ctx": ctx, "queries": lq, "causal": is_causal, "heads": heads,
                        "head_dim": head_dim}
                for fmt in formats:
                    out = attention(*_format_inputs(fmt, q, k, v), format=fmt, causal=is_causal)
                    records.append(dict(base, impl=f"qattn:{fmt}", rel_l2=_rel_l2(out, ref)))
                for peer, fn in peer_fns.items():
                    import torch

                    torch_inputs = torch_inputs or tuple(torch.from_dlpack(t) for t in (q, k, v))
                    try:
                        out = cupy.from_dlpack(fn(*torch_inputs, is_causal).contiguous())
                    except Exception as exc:  # backend unavailable for this shape/GPU
                        records.append(dict(base, impl=peer, error=str(exc).splitlines()[0]))
                        continue
                    records.append(dict(base, impl=peer, rel_l2=_rel_l2(out, ref)))
    return records


def _format_inputs(fmt: str, q, k, v) -> tuple:
    """The fp16 inputs as the format takes them (fp32 for the fp32 recipes)."""
    dtype = recipe_dtype(fmt)
    return (q, k, v) if dtype == q.dtype else tuple(x.astype(dtype) for x in (q, k, v))


def recipe_dtype(fmt: str):
    from ..codegen.recipes import recipe
    from .arrays import numpy_dtype

    return numpy_dtype(recipe(fmt).input_dtypes[0])
