"""The dense formats' launcher (f16, bf16, f32): check a call's arguments against the kernel's spec,
allocate the outputs and launch. Errors name the argument and what was expected."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ...engine.registry import recipe
from ...engine.arrays import as_device_array, check_view, on_device, signature
from ...engine.grid import work_grid
from ...engine.memory import CallMemory, lse_output
from ...engine.packed import NULL, Blob, PackedLaunch, Pointer, cached_plan, element_strides, programmatic
from ...engine.tensormap import MAP_ALIGN, MAP_BYTES, MapEncoder, swizzled_rows
from ...check.reference import check_shapes


@dataclass(frozen=True)
class _PrefillPlan:
    launch: PackedLaunch
    lse_shape: tuple
    maps: tuple | None = None  # the K and V tensor maps' encoders (TMA kernels), by data pointer
    out_map: MapEncoder | None = None  # the output's (chained kernels' TMA stores), by data pointer
    q_map: MapEncoder | None = None  # Q's (chained kernels' Q boxes by TMA), by data pointer


def prefill(kernel, q, k, v, *, scale: float | None = None, return_lse: bool = False, out=None, lse=None,
            stream=None, workspace=None):
    """out = softmax(q kᵀ·scale) v for one prefill kernel; returns out or (out, lse). The launch is
    planned once per signature (shapes, strides, dtypes, options; packed.cached_plan): a repeated
    call checks its pointers' alignment, allocates what the caller did not give (memory.CallMemory)
    and launches. The dense kernels need no temporaries: workspace is accepted and unused."""
    example = q
    return_lse = return_lse or lse is not None
    q, k, v = (as_device_array(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    out_given = None if out is None else as_device_array(out, "out")
    scale = None if scale is None else float(scale)
    key = ("prefill", signature(q), signature(k), signature(v),
           None if out_given is None else signature(out_given), scale, bool(return_lse))
    plan = cached_plan(kernel, key, lambda: _plan(kernel, q, k, v, out_given, scale, return_lse))
    align = kernel.spec.family.align_bytes
    for x, n in ((q, "q"), (k, "k"), (v, "v"), (out_given, "out")):
        if x is not None and x.data.ptr % align:
            raise ValueError(f"{n}: data pointer must be {align}-byte aligned")
    lse_output(lse, plan.lse_shape)
    with on_device(q, stream):
        memory = CallMemory(example, stream, workspace)
        out_arr, out_result = memory.output(out, q.shape, q.dtype, "out", out_given)
        lse_arr, lse_result = memory.output(lse, plan.lse_shape, "float32", "lse") if return_lse else (None, None)
        params = {"q": q.data.ptr, "k": k.data.ptr, "v": v.data.ptr, "out": out_arr.data.ptr,
                  "lse": lse_arr.data.ptr if lse_arr is not None else 0}
        if plan.maps is not None:
            params["k_map"], params["v_map"] = plan.maps[0](k.data.ptr), plan.maps[1](v.data.ptr)
        if plan.out_map is not None:
            params["o_map"] = plan.out_map(out_arr.data.ptr)
        if plan.q_map is not None:
            params["q_map"] = plan.q_map(q.data.ptr)
        plan.launch(params, memory.stream_ptr)
    return (out_result, lse_result) if return_lse else out_result


def _plan(kernel, q, k, v, out, scale, return_lse) -> _PrefillPlan:
    """The full checks of a call signature, then its launch."""
    spec = kernel.spec
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
        check_view(x, n, q.itemsize, align, pointer=False)
    if out is None:
        out_strides = tuple(int(np.prod(q.shape[i + 1:])) * q.itemsize for i in range(4))  # a new C-order array
    else:
        if out.shape != q.shape or out.dtype != q.dtype:
            raise ValueError(f"out: expected shape {q.shape} and dtype {q.dtype.name}, "
                             f"got {out.shape} {out.dtype.name}")
        if out.device.id != q.device.id:
            raise ValueError(f"out: on device {out.device.id}, but q is on device {q.device.id}")
        check_view(out, "out", q.itemsize, align, pointer=False)
        out_strides = out.strides
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale: expected a positive finite number, got {scale}")
    wgmma = spec.family.values.get("mma_unit") == "wgmma"
    args = (Pointer("q"), Pointer("k"), Pointer("v"), Pointer("out"), Pointer("lse") if return_lse else NULL,
            *element_strides(q.strides, q.itemsize), *element_strides(k.strides, q.itemsize),
            *element_strides(v.strides, q.itemsize), *element_strides(out_strides, q.itemsize), np.int64(lq),
            *((np.int32(b),) if wgmma else ()), np.int32(hq), np.int32(hq // hkv), np.int32(lq), np.int32(lk),
            np.float32(scale * math.log2(math.e)))
    kernel, maps = _kv_maps(kernel, k, v)
    if maps is not None:
        args += (Blob("k_map", MAP_BYTES, MAP_ALIGN), Blob("v_map", MAP_BYTES, MAP_ALIGN))
    kernel, out_map = _rows_map(kernel, "out_tma", "out", q.shape, out_strides, q.dtype.name, 16)
    if out_map is not None:
        args += (Blob("o_map", MAP_BYTES, MAP_ALIGN),)
    kernel, q_map = _rows_map(kernel, "q_tma", "q", q.shape, q.strides, q.dtype.name, kernel.spec.tile.block_m)
    if q_map is not None:
        args += (Blob("q_map", MAP_BYTES, MAP_ALIGN),)
    qblocks = math.ceil(lq / spec.tile.block_m)
    # one consumer warpgroup's block runs two to an SM (prefill_wgmma.cu.j2, BLOCKS_PER_SM)
    per_sm = 2 if spec.tile.warps == 4 else 1
    grid = work_grid(spec, qblocks * hq * b, q.device.id, per_sm) if wgmma else (qblocks, hq, b)
    launch = PackedLaunch(kernel.function(), grid, kernel.threads, kernel.shared_bytes, args, programmatic(spec))
    return _PrefillPlan(launch, (b, hq, lq), maps, out_map, q_map)


def _kv_maps(kernel, k, v):
    """The kernel a call runs and its K and V tensor maps' encoders (None for a kernel without TMA):
    the wgmma kernel (option kv_rows "off") reads K and V tiles by TMA, which needs every stride a
    positive multiple of 16 bytes; for other strides (an axis broadcast with stride 0, a negative
    one) the same spec with kv_rows "on" runs instead, its producer warpgroup gathering rows with
    cp.async."""
    spec = kernel.spec
    if spec.family.values.get("kv_rows") != "off":
        return kernel, None
    try:
        maps = tuple(MapEncoder(swizzled_rows(n, x.shape, x.strides, x.dtype.name, spec.tile.block_n))
                     for x, n in ((k, "k"), (v, "v")))
    except ValueError:
        from ...engine.kernel import build_kernel

        return build_kernel(_kv_rows_spec(spec)), None
    return kernel, maps


def _kv_rows_spec(spec):
    return spec.with_(options={**dict(spec.options), "kv_rows": "on"})


def _tma_off_spec(spec, option):
    return spec.with_(options={**dict(spec.options), option: "off"})


def stride_variants(spec) -> list:
    """The kernels a call may run in spec's place where the TMA cannot address its tensors' strides (K and V, then
    the output, then Q: _kv_maps and _rows_map in turn), so that `qattn compile` builds them too."""
    found = [spec]
    if spec.family.values.get("kv_rows") == "off":
        found.append(_kv_rows_spec(spec))
    for option in ("out_tma", "q_tma"):
        found += [_tma_off_spec(s, option) for s in found if dict(s.options).get(option) == "on"]
    return list(dict.fromkeys(found))[1:]


def _rows_map(kernel, option, tensor, shape, strides, dtype, box_rows):
    """The kernel a call runs and the encoder of a tensor map of `tensor` in boxes of box_rows rows, for a kernel
    with the TMA option `option` "on" (the family settles it "on" only where items chain): out_tma, each warp's 16
    output rows by a TMA store; q_tma, each item's Q rows by the producer's TMA load (engine/tensormap.py,
    swizzled_rows). Where the TMA cannot address the tensor's strides, the same spec with the option "off" runs
    (the threads' own stores and cp.async loads), and the encoder is None, as it is without the option."""
    spec = kernel.spec
    if dict(spec.options).get(option) != "on":
        return kernel, None
    try:
        return kernel, MapEncoder(swizzled_rows(tensor, shape, strides, dtype, box_rows))
    except ValueError:
        from ...engine.kernel import build_kernel

        return build_kernel(_tma_off_spec(spec, option)), None
