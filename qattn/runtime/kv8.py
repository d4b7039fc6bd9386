"""Attention over an int8 KV cache on the GPU (``kv8-f32``, ``kv8-split``, ``kv8-imma``; DESIGN §2):
the launcher of the kv8 kernel families and the choice of format.

``qattn.attention(q, cache, ...)`` with a ``KVCacheInt8`` (or ``format="kv8..."`` with float K/V,
which are written into a temporary cache first, as parity runs do) lands in ``attention_kv8``:

- ``format=None`` or ``"kv8"``: ``$QATTN_PREFILL_KV8`` (``imma``, ``split`` or ``f32``) when set,
  else the arch's default (``kv8-imma`` on sm_80 and later: every arch with a kv8 kernel);
- ``format="kv8-imma"`` etc.: that format, whatever the variable says.

q is float32 [B, Hq, Lq, D] (D = 64 or 128), out float32, LSE float32 natural-log. The launches are
deterministic (no atomics): the same inputs give the same bytes on every run.

What each kernel computes is what ``emulate.emulate(fmt, q, cache.k, cache.v, block_n=BN)`` computes
with the kernel's key tile BN (64 for the tensor-core kernels, 32 for kv8-f32): the same operand
splits and scales, the same exact integer sums, the fp32 operations in the same order (the
tensor-core fp16 accumulation of kv8-split and the exp2 of every kernel round differently).
"""
from __future__ import annotations

import math
import os

import numpy as np

from ..codegen.kv8_families import MMA_FORMATS, STAT_ENTRY
from .arrays import as_device_array, like_input
from .kvcache import CODE_ALIGN, KVCacheInt8
from .reference import check_shapes

KV8_FORMATS = ("kv8-f32", "kv8-split", "kv8-imma")
ENV_VAR = "QATTN_PREFILL_KV8"
ENV_CHOICES = {"imma": "kv8-imma", "split": "kv8-split", "f32": "kv8-f32"}
STAT_THREADS = 256  # threads of the statistics kernel (stat_body)


def default_format(arch: str | None = None) -> str:
    """The kv8 format an arch runs by default: kv8-imma on sm_80+ (int8 mma.sync), else kv8-f32."""
    if arch is None:
        from ..codegen.spec import device_arch

        arch = device_arch()
    if arch is None:
        raise ValueError("arch: no CUDA device found to pick a kv8 format for; name an arch")
    if not arch.startswith("sm_"):
        raise ValueError(f"arch: expected a CUDA arch such as sm_90a, got {arch!r}")
    major = int(arch[3:].rstrip("a")) // 10
    return "kv8-imma" if major >= 8 else "kv8-f32"


def resolve_format(format: str | None = None, arch: str | None = None) -> str:
    """The kv8 format to run: an explicit kv8-* format as given; None or "kv8": $QATTN_PREFILL_KV8
    (imma | split | f32) when set, else default_format(arch)."""
    if format not in (None, "kv8"):
        if format not in KV8_FORMATS:
            raise ValueError(f"format: an int8 KV cache runs one of {', '.join(KV8_FORMATS)} (or 'kv8' for the "
                             f"default), got {format!r}")
        return format
    env = os.environ.get(ENV_VAR, "").strip().lower()
    if env:
        if env in ENV_CHOICES:
            return ENV_CHOICES[env]
        if env in KV8_FORMATS:
            return env
        raise ValueError(f"{ENV_VAR}: expected one of {', '.join(ENV_CHOICES)} (or unset), got {env!r}")
    return default_format(arch)


def as_cache(k, v=None) -> KVCacheInt8:
    """The cache a kv8 kernel reads: a KVCacheInt8 as is (v must be None); two (codes, scales) pairs
    or CPU quant.Int8Cache objects wrapped; float K and V quantized into a new cache on the GPU."""
    from . import quant

    if isinstance(k, KVCacheInt8):
        if v is not None:
            raise ValueError("v: a KVCacheInt8 holds both K and V; pass the cache alone, as attention(q, cache)")
        return k
    if v is None:
        raise ValueError("v: expected V (or pass a qattn.KVCacheInt8 as k)")
    if isinstance(k, quant.Int8Cache) and isinstance(v, quant.Int8Cache):
        return KVCacheInt8.from_host(k, v)
    if isinstance(k, tuple) and isinstance(v, tuple):
        if len(k) != 2 or len(v) != 2:
            raise ValueError("k, v: cache pairs must be (codes, scales)")
        return KVCacheInt8.from_codes(k[0], k[1], v[0], v[1])
    if isinstance(k, (tuple, quant.Int8Cache)) or isinstance(v, (tuple, quant.Int8Cache)):
        raise TypeError("k, v: give both as caches ((codes, scales) pairs or quant.Int8Cache) or both as arrays")
    k_dev = as_device_array(k, "k")
    if k_dev.dtype == np.int8:
        raise ValueError("k: int8 codes need their scales: pass a qattn.KVCacheInt8 or (codes, scales) pairs")
    return KVCacheInt8.from_kv(k, v)


def _elem_strides(x) -> list:
    return [np.int64(s // x.itemsize) for s in x.strides[:3]]


def prefill_kv8(kernel, q, k, v=None, *, scale: float | None = None, return_lse: bool = False, out=None,
                stream=None):
    """out = softmax(q kᵀ·scale) v over an int8 KV cache with one kv8 kernel; returns out or
    (out, lse). k: a KVCacheInt8 (v None), (codes, scales) pairs, or float K and V (quantized into
    a temporary cache)."""
    import cupy

    spec = kernel.spec
    example = q
    q = as_device_array(q, "q")
    if q.dtype != cupy.float32:
        raise TypeError(f"q: format {spec.recipe!r} takes float32 queries, got {q.dtype.name}")
    cache = as_cache(k, v)
    if cache.length < 1:
        raise ValueError("k: the cache holds no tokens (length 0); append K and V first")
    b, hq, hkv, lq, lk, d = check_shapes(q.shape, cache.shape, cache.shape)
    if d != spec.head_dim:
        raise ValueError(f"q: head_dim {d} does not match the kernel's {spec.head_dim} ({spec.name})")
    if b > 65535 or hq > 65535:
        raise ValueError(f"q: batch and heads must be <= 65535 (grid limits), got batch {b}, heads {hq}")
    if q.device.id != cache.device.id:
        raise ValueError(f"q: on device {q.device.id}, but the cache is on device {cache.device.id}")
    if q.strides[-1] != 4:
        raise ValueError(f"q: the head_dim axis must be contiguous (stride 4 bytes), got strides {q.strides}")
    kc, ks = cache.k
    vc, vs = cache.v
    if any(x.data.ptr % CODE_ALIGN for x in (kc, vc)):
        raise ValueError(f"k: cache code arrays must be {CODE_ALIGN}-byte aligned")
    if out is None:
        out_arr = cupy.empty(q.shape, dtype=cupy.float32)
    else:
        out_arr = as_device_array(out, "out")
        if out_arr.shape != q.shape or out_arr.dtype != cupy.float32:
            raise ValueError(f"out: expected shape {q.shape} and dtype float32, got {out_arr.shape} {out_arr.dtype.name}")
        if out_arr.strides[-1] != 4:
            raise ValueError(f"out: the head_dim axis must be contiguous, got strides {out_arr.strides}")
        if out_arr.device.id != q.device.id:
            raise ValueError(f"out: on device {out_arr.device.id}, but q is on device {q.device.id}")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale: expected a positive finite number, got {scale}")
    scale_log2 = np.float32(scale * math.log2(math.e))
    group = hq // hkv

    with q.device:
        lse = cupy.empty((b, hq, lq), dtype=cupy.float32) if return_lse else None
        stat = cupy.zeros((b, hq, d // 64 + 1), dtype=cupy.float32)
        vs_st = _elem_strides(vs)[:2]
        if spec.recipe in MMA_FORMATS:
            kernel.function(STAT_ENTRY)((hq, b), (STAT_THREADS,),
                                        (q, *_elem_strides(q), vs, *vs_st, stat, np.int32(hq), np.int32(group),
                                         np.int32(lq), np.int32(lk), scale_log2), stream=stream)
        args = (q, *_elem_strides(q), kc, *_elem_strides(kc), ks, *_elem_strides(ks)[:2],
                vc, *_elem_strides(vc), vs, *vs_st, out_arr, *_elem_strides(out_arr),
                lse if lse is not None else np.uintp(0), np.int64(lq), stat,
                np.int32(hq), np.int32(group), np.int32(lq), np.int32(lk), scale_log2)
        grid = (math.ceil(lq / spec.tile.block_m), hq, b)
        kernel.function()(grid, (kernel.threads,), args, shared_mem=kernel.shared_bytes, stream=stream)
    out_arr = like_input(out_arr, example) if out is None else out
    if return_lse:
        return out_arr, like_input(lse, example)
    return out_arr


def attention_kv8(q, k, v=None, *, format: str | None = None, causal: bool = False, scale: float | None = None,
                  return_lse: bool = False, out=None, tile=None):
    """qattn.attention for an int8 KV cache (see the module docstring for how the format is chosen)."""
    from ..codegen.spec import KernelSpec, device_arch
    from ..codegen.tile import Tile
    from .kernel import build_kernel

    q_dev = as_device_array(q, "q")
    if q_dev.ndim != 4:
        raise ValueError(f"q: expected 4 dimensions [batch, heads, seq, head_dim], got shape {q_dev.shape}")
    with q_dev.device:
        arch = device_arch()
    fmt = resolve_format(format, arch)
    if isinstance(tile, (tuple, list)):
        tile = Tile(*tile)
    spec = KernelSpec(kind="prefill", recipe=fmt, head_dim=int(q_dev.shape[-1]), causal=causal, arch=arch,
                      **({"tile": tile} if tile is not None else {}))
    return build_kernel(spec)(q, k, v, scale=scale, return_lse=return_lse, out=out)
