"""Dispatch by operating point (`qattn plan decode`): for a batch, context, head layout and the K/V
a model produces (an .npz of captured tensors or a qattn.data preset), each cache format on each of
its QK paths (an i8 K also with Q/K channel balancing; where the data carries a K bias, with the
pre-bias residual K) with its error
against FP64 on the original K/V (its emulator) and its speed (a quick run on the local GPU, else
the times measured on an H200 or an H100 and recorded in BENCHMARKS.md), and the choice: the fastest candidate
within the error gate, K16/V8 (f16-e4m3) when no 8-bit K passes, f16-f16 when nothing 8-bit does.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...check import metrics
from . import emulate
from .quant import HostPagedCache
from .recipes import EIGHT_BIT, qk_paths, sides

# The fp16-query formats a plan weighs, the 16-bit one first.
PLAN_FORMATS = ("f16-f16", "e4m3-e4m3", "i8-i8", "e4m3-f16", "f16-e4m3", "i8-f16", "f16-i8")
FALLBACK = "f16-e4m3"  # K16/V8: no K transform, and V8's error is the format's own
# Decode time relative to f16-f16, by the GPU it was measured on and candidate name (GQA 32/8, D128, pages of 32,
# token scales, L2-warm, shuffled pages; the mean over 8x32768, 64x4096 and 1x131072 where not said).
# H200: every candidate in one run, 2026-12-07 ("decode's QK paths and formats on the H200").
# H100 80GB HBM3: every candidate in one run, 2026-12-07 ("decode's QK paths and formats on the H100").
RELATIVE_TIME = {
    "H200": {"f16-f16": 1.0, "e4m3-e4m3": 0.558, "e4m3-e4m3/fp8": 0.590, "i8-i8": 0.564, "i8-i8/int8": 0.590,
             "e4m3-f16": 0.785, "e4m3-f16/fp8": 0.860, "f16-e4m3": 0.787, "i8-f16": 0.788, "i8-f16/int8": 0.861,
             "f16-i8": 0.789},
    "H100": {"f16-f16": 1.0, "e4m3-e4m3": 0.543, "e4m3-e4m3/fp8": 0.566, "i8-i8": 0.547, "i8-i8/int8": 0.566,
             "e4m3-f16": 0.774, "e4m3-f16/fp8": 0.817, "f16-e4m3": 0.777, "i8-f16": 0.776, "i8-f16/int8": 0.818,
             "f16-i8": 0.776},
}
ERROR_CTX = 4096  # keys per sequence of the error estimate (the emulator runs on the CPU)


@dataclass(frozen=True)
class Candidate:
    """A cache format read on one QK path, with or without the pre-bias residual K."""

    fmt: str
    qk: str = "transform"
    k_bias: bool = False
    k_balance: bool = False

    @property
    def name(self) -> str:
        return (self.fmt + ("" if self.qk == "transform" else f"/{self.qk}") + (" +k_bias" if self.k_bias else "")
                + (" +k_balance" if self.k_balance else ""))

    @property
    def timed_as(self) -> str:
        """The name its speed is looked up under (the residual K costs one dot product per block, balancing
        one multiply per query value)."""
        return Candidate(self.fmt, self.qk).name


def candidates(formats=PLAN_FORMATS, *, with_bias: bool = False) -> list[Candidate]:
    """Each format on each QK path it has; then the Q/K-balanced variants of the i8 K ones (balancing
    helps an int8 K against scale-type channel outliers; an e4m3 K measured no gain), and with_bias the
    residual-K variants of the 8-bit K ones. A variant comes after its plain format, which a tie in time
    therefore prefers."""
    out = [Candidate(fmt, qk) for fmt in formats for qk in qk_paths(fmt)]
    out += [Candidate(c.fmt, c.qk, k_balance=True) for c in list(out) if sides(c.fmt)[0] == "i8"]
    if with_bias:
        out += [Candidate(c.fmt, c.qk, True) for c in out if sides(c.fmt)[0] in EIGHT_BIT and not c.k_balance]
    return out


def _tensors(npz, preset, ctx, heads, kv_heads, head_dim, seed):
    """q [1, Hq, 1, D] (the last position), k, v [1, L, Hkv, D] (float32) and the K bias [Hkv, D]
    when the data has one (an npz's k_bias, the bias preset's), else None."""
    if npz is not None:
        with np.load(npz) as z:
            q, k, v = (np.asarray(z[name], np.float32) for name in ("q", "k", "v"))
            bias = np.asarray(z["k_bias"], np.float32) if "k_bias" in z else None
        if q.ndim != 4 or k.shape != v.shape or k.ndim != 4 or q.shape[-1] != k.shape[-1]:
            raise ValueError(f"npz: expected q [B, Hq, L, D], k and v [B, Hkv, L, D], got {q.shape}, {k.shape}")
        if bias is not None and bias.shape != (k.shape[1], k.shape[3]):
            raise ValueError(f"npz: expected k_bias [Hkv, D] = [{k.shape[1]}, {k.shape[3]}], got {bias.shape}")
        return q[:1, :, -1:], k[:1].transpose(0, 2, 1, 3), v[:1].transpose(0, 2, 1, 3), bias
    from ... import data

    x = data.preset(preset, ctx=ctx, queries=1, heads=heads, kv_heads=kv_heads, head_dim=head_dim, seed=seed)
    return x["q"], x["k"].transpose(0, 2, 1, 3), x["v"].transpose(0, 2, 1, 3), x.get("k_bias")


def format_errors(formats=PLAN_FORMATS, *, npz=None, preset: str = "normal", ctx: int = ERROR_CTX, heads: int = 32,
                  kv_heads: int = 8, head_dim: int = 128, page_size: int = 32, scale: str = "token",
                  seed: int = 0) -> dict:
    """rel_l2 of each candidate's emulator against FP64 on the original K/V, by candidate name."""
    q, k, v, bias = _tensors(npz, preset, min(ctx, ERROR_CTX), heads, kv_heads, head_dim, seed)
    q, k, v = (x.astype(np.float16) for x in (q, k, v))
    length, kv_heads, head_dim = k.shape[1], k.shape[2], k.shape[3]
    pages = -(-length // page_size)
    table = np.arange(pages, dtype=np.int32)[None]
    lens = np.array([length], np.int32)
    tokens = np.arange(length)
    slots = table[0, tokens // page_size] * page_size + tokens % page_size
    dense = emulate.reference_dense(q, [k[0].transpose(1, 0, 2).astype(np.float64)],
                                    [v[0].transpose(1, 0, 2).astype(np.float64)])
    errors = {}
    for c in candidates(formats, with_bias=bias is not None):
        cache = HostPagedCache.empty(c.fmt, pages, page_size, kv_heads, head_dim, scale,
                                     k_bias=bias if c.k_bias else None, k_balance="calibrate" if c.k_balance else None)
        cache.write(k[0], v[0], slots, scale=scale)
        out = emulate.emulate(q, cache, table, lens, qk=c.qk)
        errors[c.name] = metrics.compare(np.asarray(out, np.float32), dense).rel_l2
    return errors


def measured_times(names, *, batch: int, ctx: int, heads: int, kv_heads: int, head_dim: int, page_size: int,
                   scale: str) -> dict:
    """Milliseconds of each candidate's decode at the operating point on the local GPU (no peers), by
    candidate name."""
    from ...bench.decode import Point, Run, bench_sweep

    pool = {c.name: c for c in candidates(with_bias=True)}
    chosen = [pool[name] for name in names]
    variants = sorted({(c.fmt, c.qk) for c in chosen})
    run = Run(Point(batch, ctx, heads, kv_heads, head_dim, page_size), ("warm",))
    records = bench_sweep([run], variants, scale=scale, peers=(), rounds=2)
    ms = {Candidate(r["format"], r["qk"]).name: r["ms"] for r in records if r.get("ms") is not None}
    return {c.name: ms[c.timed_as] for c in chosen if c.timed_as in ms}


def table_times(names, gpu: str = "H200") -> dict:
    """The relative times on gpu (a RELATIVE_TIME key) of the candidates named (those the table has)."""
    if gpu not in RELATIVE_TIME:
        raise ValueError(f"gpu: expected one of {', '.join(RELATIVE_TIME)}, got {gpu!r}")
    pool, table = {c.name: c for c in candidates(with_bias=True)}, RELATIVE_TIME[gpu]
    return {name: table[pool[name].timed_as] for name in names if name in pool and pool[name].timed_as in table}


def choose(errors: dict, times: dict, max_rel_l2: float) -> tuple[str, str]:
    """(format, why): the fastest timed format whose error is within the gate; K16/V8 when no format
    with an 8-bit K passes; f16-f16 when no 8-bit format does."""
    passing = [f for f in times if errors.get(f, np.inf) <= max_rel_l2]  # names; f16-f16 has no variants
    eight_bit = [f for f in passing if f != "f16-f16"]
    if eight_bit:
        best = min(eight_bit, key=lambda f: times[f])
        if times.get("f16-f16", np.inf) < times[best]:
            return "f16-f16", "fastest, and within the gate"
        return best, "fastest within the gate"
    if errors.get(FALLBACK, np.inf) <= max_rel_l2:
        return FALLBACK, "no 8-bit K within the gate: K16/V8"
    return "f16-f16", "no 8-bit format within the gate"
