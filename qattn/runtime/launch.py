"""Launchers, one per kernel kind: check the arguments against the kernel's spec, allocate the
outputs and launch. Errors name the argument and what was expected."""
from __future__ import annotations

import math

import numpy as np

from ..codegen.recipes import recipe
from .arrays import as_device_array, like_input
from .reference import check_shapes


def _check_view(x, name: str, itemsize: int, align: int) -> None:
    if x.ndim == 4 and x.strides[-1] != itemsize:
        raise ValueError(f"{name}: the head_dim axis must be contiguous (stride {itemsize} bytes), "
                         f"got strides {x.strides}")
    if x.data.ptr % align:
        raise ValueError(f"{name}: data pointer must be {align}-byte aligned")
    for axis, stride in enumerate(x.strides[:3]):
        if stride % align and x.shape[axis] > 1:
            raise ValueError(f"{name}: stride of axis {axis} ({stride} bytes) must be a multiple of {align} bytes")


def prefill(kernel, q, k, v, *, scale: float | None = None, return_lse: bool = False, out=None, stream=None):
    """out = softmax(q kᵀ·scale) v for one prefill kernel; returns out or (out, lse)."""
    import cupy

    spec = kernel.spec
    example = q
    q, k, v = (as_device_array(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    allowed = recipe(spec.recipe).input_dtypes
    for x, n in ((q, "q"), (k, "k"), (v, "v")):
        if x.dtype.name not in allowed:
            raise TypeError(f"{n}: format {spec.recipe!r} takes {' or '.join(allowed)}, got {x.dtype.name}")
        if x.device.id != q.device.id:
            raise ValueError(f"{n}: on device {x.device.id}, but q is on device {q.device.id}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v: expected one dtype, got {q.dtype.name}, {k.dtype.name}, {v.dtype.name}")
    b, hq, hkv, lq, lk, d = check_shapes(q.shape, k.shape, v.shape)
    if d != spec.head_dim:
        raise ValueError(f"q: head_dim {d} does not match the kernel's {spec.head_dim} ({spec.name})")
    if b > 65535 or hq > 65535:
        raise ValueError(f"q: batch and heads must be <= 65535 (grid limits), got batch {b}, heads {hq}")
    align = spec.family.align_bytes
    for x, n in ((q, "q"), (k, "k"), (v, "v")):
        _check_view(x, n, q.itemsize, align)
    if out is None:
        out_arr = cupy.empty(q.shape, dtype=q.dtype)
    else:
        out_arr = as_device_array(out, "out")
        if out_arr.shape != q.shape or out_arr.dtype != q.dtype:
            raise ValueError(f"out: expected shape {q.shape} and dtype {q.dtype.name}, "
                             f"got {out_arr.shape} {out_arr.dtype.name}")
        _check_view(out_arr, "out", q.itemsize, align)
    lse = cupy.empty((b, hq, lq), dtype=cupy.float32) if return_lse else None
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale: expected a positive finite number, got {scale}")

    def strides(x):
        return [np.int64(s // x.itemsize) for s in x.strides[:3]]

    args = (q, k, v, out_arr, lse if lse is not None else np.uintp(0),
            *strides(q), *strides(k), *strides(v), *strides(out_arr), np.int64(lq),
            np.int32(hq), np.int32(hq // hkv), np.int32(lq), np.int32(lk), np.float32(scale * math.log2(math.e)))
    grid = (math.ceil(lq / spec.tile.block_m), hq, b)
    with q.device:
        kernel.function()(grid, (kernel.threads,), args, shared_mem=kernel.shared_bytes, stream=stream)
    out_arr = like_input(out_arr, example) if out is None else out
    if return_lse:
        return out_arr, like_input(lse, example)
    return out_arr


def _prefill_i8(kernel, *args, **kwargs):
    from .int8 import prefill_i8

    return prefill_i8(kernel, *args, **kwargs)


def _prefill_kv8(kernel, *args, **kwargs):
    from .kv8 import prefill_kv8

    return prefill_kv8(kernel, *args, **kwargs)


# Family.launcher -> function(kernel, q, k, v, *, scale, return_lse, out, stream)
LAUNCHERS = {"prefill": prefill, "prefill_i8": _prefill_i8, "prefill_kv8": _prefill_kv8}
