"""Dispatch by operating point for prefill (`qattn plan prefill`): for a batch, sequence length, head
layout, causal flag and the Q/K/V a model produces (an .npz of captured tensors or a qattn.data preset),
each prefill format of the inputs' type (the 16-bit one, i8-f16, i8-i8, i8-f8; the int8-QK ones with K
smoothing alone and with Q/K channel balancing too) with its error against FP64 (its CPU emulator on the
last query rows of up to ERROR_KEYS keys and ERROR_HEADS query heads) and its speed (a quick run on the
local GPU, else the times measured on an H200 or an H100 and recorded in BENCHMARKS.md, relative to cuDNN's),
and the choice: the fastest candidate within the error gate, the 16-bit format when none is timed or within.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import metrics
from .emulate import emulate
from .reference import attention as reference_attention

SIXTEEN_BIT = {"float16": "f16", "bfloat16": "bf16"}  # the 16-bit format of each input type
INT8_QK = ("i8-f16", "i8-i8", "i8-f8")
ERROR_KEYS = 4096  # keys of the error estimate (the emulators run on the CPU)
ERROR_ROWS = 256  # its query rows: a sequence's last ones (bottom-right causal: they see every key)
ERROR_HEADS = 8  # its query heads at most (whole GQA groups)

# Whole calls on the H200 against torch SDPA's cuDNN backend in the same run, as cuDNN's time over the
# format's (> 1: faster than cuDNN), by (head dim, causal) and then query rows per sequence. BENCHMARKS.md:
# D128 from "every format at the contract shapes on the H200" (2026-12-06, night: single calls from an idle GPU);
# D64 at 2048 and 8192 rows from "the H200's plan rows" (2026-12-07: the routed kernels of that day, three K/V
# slots for i8-f8 and for causal i8-f16 from 8192 rows included); D64 at 1024 and 4096 rows from "D64 on three
# consumer warpgroups" (2026-12-04, night) and, for i8-f8, "every format beside SageAttention 1.0.6 and
# SageAttention2" (2026-12-04, later).
# i8-i8 from "i8-f16 and i8-i8 beside i8-f8" (2026-12-02: the code of that day; no later run timed it).
_H200 = {
    (128, False): {1024: {"f16": 0.98, "bf16": 0.99, "i8-f16": 0.76, "i8-f8": 0.66},
                   2048: {"f16": 0.99, "bf16": 1.01, "i8-f16": 0.92, "i8-f8": 0.87},
                   4096: {"f16": 0.97, "bf16": 1.00, "i8-f16": 1.01, "i8-f8": 1.10, "i8-i8": 0.50},
                   32768: {"f16": 1.07, "bf16": 1.11, "i8-f16": 1.22, "i8-f8": 1.45, "i8-i8": 0.59}},
    (128, True): {1024: {"f16": 0.94, "bf16": 0.95, "i8-f16": 0.63, "i8-f8": 0.52},
                  2048: {"f16": 1.04, "bf16": 1.02, "i8-f16": 0.80, "i8-f8": 0.71},
                  4096: {"f16": 1.05, "bf16": 1.06, "i8-f16": 0.96, "i8-f8": 0.96, "i8-i8": 0.49},
                  32768: {"f16": 1.07, "bf16": 1.11, "i8-f16": 1.23, "i8-f8": 1.45, "i8-i8": 0.61}},
    (64, False): {1024: {"f16": 0.89, "bf16": 0.91, "i8-f8": 0.64},
                  2048: {"f16": 1.01, "bf16": 1.03, "i8-f16": 0.85, "i8-f8": 0.75},
                  4096: {"f16": 1.04, "bf16": 1.08},
                  8192: {"f16": 1.07, "bf16": 1.12, "i8-f16": 1.09, "i8-f8": 1.00, "i8-i8": 0.52}},
    (64, True): {1024: {"f16": 0.84, "bf16": 0.85, "i8-f8": 0.55},
                 2048: {"f16": 0.87, "bf16": 0.84, "i8-f16": 0.70, "i8-f8": 0.63},
                 4096: {"f16": 0.97, "bf16": 0.98},
                 8192: {"f16": 1.03, "bf16": 1.06, "i8-f16": 1.03, "i8-f8": 0.93, "i8-i8": 0.53}},
}


# The same on an H100 80GB HBM3, every format in one run (BENCHMARKS.md, "every format beside every peer", 2026-12-07:
# single calls after a 0.5 s idle, the kernels of that day at each point; i8-i8 was not timed).
_H100 = {
    (128, False): {1024: {"f16": 0.96, "bf16": 0.97, "i8-f16": 0.70, "i8-f8": 0.59},
                   2048: {"f16": 0.97, "bf16": 0.95, "i8-f16": 0.85, "i8-f8": 0.81},
                   4096: {"f16": 1.03, "bf16": 1.05, "i8-f16": 0.99, "i8-f8": 1.07},
                   8192: {"f16": 1.03, "bf16": 1.00, "i8-f16": 1.06, "i8-f8": 1.14},
                   32768: {"f16": 1.06, "bf16": 1.12, "i8-f16": 1.25, "i8-f8": 1.45}},
    (128, True): {1024: {"f16": 0.87, "bf16": 0.91, "i8-f16": 0.61, "i8-f8": 0.51},
                  2048: {"f16": 1.02, "bf16": 1.05, "i8-f16": 0.77, "i8-f8": 0.66},
                  4096: {"f16": 1.02, "bf16": 1.05, "i8-f16": 0.90, "i8-f8": 0.86},
                  8192: {"f16": 1.09, "bf16": 1.08, "i8-f16": 1.05, "i8-f8": 1.06},
                  32768: {"f16": 1.07, "bf16": 1.12, "i8-f16": 1.23, "i8-f8": 1.47}},
    (64, False): {2048: {"f16": 1.07, "bf16": 1.05, "i8-f16": 0.89, "i8-f8": 0.80},
                  8192: {"f16": 1.11, "bf16": 1.10, "i8-f16": 1.08, "i8-f8": 0.99}},
    (64, True): {2048: {"f16": 0.97, "bf16": 0.97, "i8-f16": 0.77, "i8-f8": 0.68},
                 8192: {"f16": 1.02, "bf16": 1.03, "i8-f16": 1.00, "i8-f8": 0.91}},
}
# By the GPU a table was measured on.
VS_CUDNN = {"H200": _H200, "H100": _H100}


@dataclass(frozen=True)
class Candidate:
    """A prefill format, for the int8-QK ones under one smoothing ("mean" or "mean+balance")."""

    fmt: str
    smoothing: str | None = None

    @property
    def name(self) -> str:
        return self.fmt + (" +balance" if self.smoothing == "mean+balance" else "")

    @property
    def call(self) -> str:
        """The qattn.attention arguments that run it."""
        return f'format="{self.fmt}"' + (f', smoothing="{self.smoothing}"' if self.smoothing else "")

    @property
    def options(self) -> dict:
        return {"smoothing": self.smoothing} if self.smoothing else {}


def candidates(dtype: str) -> list[Candidate]:
    """The 16-bit format of dtype first, then each int8-QK format with K smoothing and then with balancing
    too (a variant after its plain format, which a tie in time therefore prefers)."""
    if dtype not in SIXTEEN_BIT:
        raise ValueError(f"dtype: expected one of {', '.join(SIXTEEN_BIT)}, got {dtype!r}")
    return ([Candidate(SIXTEEN_BIT[dtype])] + [Candidate(fmt, "mean") for fmt in INT8_QK]
            + [Candidate(fmt, "mean+balance") for fmt in INT8_QK])


def error_heads(heads: int, kv_heads: int) -> tuple[int, int]:
    """(query heads, kv heads) of the error estimate: whole GQA groups, ERROR_HEADS query heads at most
    (one group where a group is larger)."""
    if heads < 1 or kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"heads: {heads} is not a positive multiple of kv_heads {kv_heads}")
    group = heads // kv_heads
    kv = max(1, min(kv_heads, ERROR_HEADS // group))
    return kv * group, kv


def _tensors(npz, preset, seq, heads, kv_heads, head_dim, seed):
    """q [1, Hq', rows, D], k, v [1, Hkv', keys, D] float32 for the error estimate: an npz's batch 0 (its
    first whole GQA groups; its last keys and, of those, the last rows) or the preset's."""
    hq, hkv = error_heads(heads, kv_heads)
    keys = min(seq, ERROR_KEYS)
    if npz is not None:
        with np.load(npz) as z:
            q, k, v = (np.asarray(z[name], np.float32) for name in ("q", "k", "v"))
        if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape or q.shape[-1] != k.shape[-1] or q.shape[2] != k.shape[2]:
            raise ValueError(f"npz: expected q [B, Hq, L, D], k and v [B, Hkv, L, D], got {q.shape}, {k.shape}, "
                             f"{v.shape}")
        hq, hkv = error_heads(q.shape[1], k.shape[1])
        keys = min(k.shape[2], ERROR_KEYS)
        k, v = (x[:1, :hkv, -keys:] for x in (k, v))
        return q[:1, :hq, -keys:][:, :, -min(keys, ERROR_ROWS):], k, v
    from .. import data

    x = data.preset(preset, ctx=keys, queries=min(keys, ERROR_ROWS), heads=hq, kv_heads=hkv, head_dim=head_dim,
                    seed=seed)
    return x["q"], x["k"], x["v"]


def format_errors(*, dtype: str = "float16", npz=None, preset: str = "normal", seq: int = 4096, heads: int = 32,
                  kv_heads: int = 8, head_dim: int = 128, causal: bool = False, seed: int = 0) -> dict:
    """rel_l2 of each candidate's emulator against FP64 on the same inputs rounded to dtype (the error of
    the format's arithmetic on the values the model hands it), by candidate name."""
    from ..engine.arrays import numpy_dtype

    q, k, v = (x.astype(numpy_dtype(dtype)) for x in _tensors(npz, preset, seq, heads, kv_heads, head_dim, seed))
    ref = reference_attention(*(x.astype(np.float64) for x in (q, k, v)), causal=causal)
    return {c.name: metrics.compare(np.asarray(emulate(c.fmt, q, k, v, causal=causal, **c.options), np.float32),
                                    ref).rel_l2
            for c in candidates(dtype)}


def table_times(names, *, head_dim: int, causal: bool, seq: int, gpu: str = "H200") -> dict:
    """Each named candidate's time on gpu (a VS_CUDNN key) relative to cuDNN's at the measured sequence length
    nearest to seq (in log2), for those the table has at (head_dim, causal); a balanced variant as its plain
    format (its Q/K factors cost 0-3% of the call at 32K keys, 3-9% at 4K)."""
    if gpu not in VS_CUDNN:
        raise ValueError(f"gpu: expected one of {', '.join(VS_CUDNN)}, got {gpu!r}")
    by_seq = VS_CUDNN[gpu].get((head_dim, causal))
    if not by_seq:
        return {}
    nearest = min(by_seq, key=lambda length: (abs(math.log2(length / seq)), -length))
    ratios = by_seq[nearest]
    pool = {c.name: c for c in candidates("float16") + candidates("bfloat16")}
    return {name: 1.0 / ratios[pool[name].fmt] for name in names if name in pool and pool[name].fmt in ratios}


def measured_times(names, *, batch: int, seq: int, heads: int, head_dim: int, causal: bool) -> dict:
    """Milliseconds of each named candidate's whole call (the int8-QK ones' quantization included) at the
    operating point on the local GPU, by candidate name (kv heads = heads: prefill is bound by its
    products, not by K/V's bytes)."""
    from ..bench.prefill import bench_prefill

    pool = {c.name: c for c in candidates("float16") + candidates("bfloat16")}
    chosen = [pool[name] for name in names]
    formats = sorted({c.fmt for c in chosen})
    smoothings = sorted({c.smoothing for c in chosen if c.smoothing})
    records = bench_prefill([(batch, heads, seq)], formats, head_dim=head_dim, causal=causal, peers=(), rounds=2,
                            smoothings=smoothings)
    ms = {r["impl"]: r["ms"] for r in records if r.get("ms") is not None}
    out = {}
    for c in chosen:
        impl = f"qattn:{c.fmt}" + (f"/{c.smoothing}" if c.smoothing else "")
        if impl in ms:
            out[c.name] = ms[impl]
    return out


def choose(errors: dict, times: dict, max_rel_l2: float, dtype: str = "float16") -> tuple[str, str]:
    """(candidate name, why): the fastest timed candidate within the gate; the 16-bit format where none is."""
    passing = [name for name in times if errors.get(name, np.inf) <= max_rel_l2]
    if passing:
        return min(passing, key=lambda name: times[name]), "fastest within the gate"
    base = SIXTEEN_BIT[dtype]
    return base, ("no timed format within the gate: the 16-bit format" if times else
                  "no speed data for this point: the 16-bit format")


def call_of(name: str) -> str:
    """The qattn.attention arguments of a candidate by name."""
    return {c.name: c.call for c in candidates("float16") + candidates("bfloat16")}[name]
