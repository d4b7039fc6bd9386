"""Dispatch by operating point (`qattn plan decode`): for a batch, context, head layout and the K/V
a model produces (an .npz of captured tensors or a qattn.data preset), each cache format's error
against FP64 on the original K/V (its emulator) and its speed (a quick run on the local GPU, else
the times measured on the H200 and recorded in BENCHMARKS.md), and the choice: the fastest format
within the error gate, K16/V8 (f16-e4m3) when no 8-bit K passes, f16-f16 when nothing 8-bit does.
"""
from __future__ import annotations

import numpy as np

from ...check import metrics
from . import emulate
from .quant import HostPagedCache

# The fp16-query formats a plan weighs, the 16-bit one first.
PLAN_FORMATS = ("f16-f16", "e4m3-e4m3", "i8-i8", "e4m3-f16", "f16-e4m3", "i8-f16", "f16-i8")
FALLBACK = "f16-e4m3"  # K16/V8: no K transform, and V8's error is the format's own
# Decode time relative to f16-f16, measured on the H200 (BENCHMARKS.md, 2026-12-02, GQA 32/8, D128,
# pages of 32, token scales; the mean over 8x32768, 64x4096, 1x131072, 256x1024 and 16x16384).
H200_RELATIVE_TIME = {"f16-f16": 1.0, "e4m3-e4m3": 0.82, "i8-i8": 0.99, "e4m3-f16": 0.90, "f16-e4m3": 0.88}
ERROR_CTX = 4096  # keys per sequence of the error estimate (the emulator runs on the CPU)


def _tensors(npz, preset, ctx, heads, kv_heads, head_dim, seed):
    """q [1, Hq, 1, D] (the last position) and k, v [1, L, Hkv, D] (float32)."""
    if npz is not None:
        with np.load(npz) as z:
            q, k, v = (np.asarray(z[name], np.float32) for name in ("q", "k", "v"))
        if q.ndim != 4 or k.shape != v.shape or k.ndim != 4 or q.shape[-1] != k.shape[-1]:
            raise ValueError(f"npz: expected q [B, Hq, L, D], k and v [B, Hkv, L, D], got {q.shape}, {k.shape}")
        return q[:1, :, -1:], k[:1].transpose(0, 2, 1, 3), v[:1].transpose(0, 2, 1, 3)
    from ... import data

    x = data.preset(preset, ctx=ctx, queries=1, heads=heads, kv_heads=kv_heads, head_dim=head_dim, seed=seed)
    return x["q"], x["k"].transpose(0, 2, 1, 3), x["v"].transpose(0, 2, 1, 3)


def format_errors(formats=PLAN_FORMATS, *, npz=None, preset: str = "normal", ctx: int = ERROR_CTX, heads: int = 32,
                  kv_heads: int = 8, head_dim: int = 128, page_size: int = 32, scale: str = "token",
                  seed: int = 0) -> dict:
    """rel_l2 of each format's emulator against FP64 on the original K/V."""
    q, k, v = _tensors(npz, preset, min(ctx, ERROR_CTX), heads, kv_heads, head_dim, seed)
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
    for fmt in formats:
        cache = HostPagedCache.empty(fmt, pages, page_size, kv_heads, head_dim, scale)
        cache.write(k[0], v[0], slots, scale=scale)
        out = emulate.emulate(q, cache, table, lens)
        errors[fmt] = metrics.compare(np.asarray(out, np.float32), dense).rel_l2
    return errors


def measured_times(formats, *, batch: int, ctx: int, heads: int, kv_heads: int, head_dim: int, page_size: int,
                   scale: str) -> dict:
    """Milliseconds of each format's decode at the operating point on the local GPU (no peers)."""
    from ...bench.decode import bench_decode

    records = bench_decode([(batch, ctx)], formats, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                           page_size=page_size, scale=scale, peers=(), rounds=2)
    return {r["impl"].removeprefix("qattn:"): r["ms"] for r in records if "ms" in r}


def choose(errors: dict, times: dict, max_rel_l2: float) -> tuple[str, str]:
    """(format, why): the fastest timed format whose error is within the gate; K16/V8 when no format
    with an 8-bit K passes; f16-f16 when no 8-bit format does."""
    passing = [f for f in times if errors.get(f, np.inf) <= max_rel_l2]
    eight_bit = [f for f in passing if f != "f16-f16"]
    if eight_bit:
        best = min(eight_bit, key=lambda f: times[f])
        if times.get("f16-f16", np.inf) < times[best]:
            return "f16-f16", "fastest, and within the gate"
        return best, "fastest within the gate"
    if errors.get(FALLBACK, np.inf) <= max_rel_l2:
        return FALLBACK, "no 8-bit K within the gate: K16/V8"
    return "f16-f16", "no 8-bit format within the gate"
