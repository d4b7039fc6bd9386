"""The dense formats' launcher (f16, bf16, f32): check a call's arguments against the kernel's spec,
allocate the outputs and launch. Errors name the argument and what was expected. A chained wgmma launch whose last
round tail.plan_tail splits gives each block its pieces of that round in a table, and merges the split items' rows
with a second kernel of the module."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ...engine.registry import recipe
from ...engine.arrays import as_device_array, check_view, on_device, signature
from ...engine.grid import work_grid
from ...engine.memory import CallMemory, lse_output
from ...engine.packed import NULL, Blob, PackedLaunch, Pointer, cached_plan, element_strides, programmatic
from ...engine.tensormap import MAP_ALIGN, MAP_BYTES, MapEncoder, swizzled_rows
from ...check.reference import check_shapes
from .tail import TailPlan, plan_tail

MERGE_THREADS = 256  # the merge kernel's block (prefill_wgmma.cu.j2)


@dataclass(frozen=True)
class _Pieces:
    """A chained launch's piece table on the device (its pointers and the arrays behind them), the workspace bytes of
    the split items' rows and LSE, and the merge of those rows (None: no split, an empty table)."""

    pointers: dict
    arrays: tuple
    rows_bytes: int = 0
    bytes: int = 0
    merge: PackedLaunch | None = None


@dataclass(frozen=True)
class _PrefillPlan:
    launch: PackedLaunch
    lse_shape: tuple
    maps: tuple | None = None  # the K and V tensor maps' encoders (TMA kernels), by data pointer
    out_map: MapEncoder | None = None  # the output's (chained kernels' TMA stores), by data pointer
    q_map: MapEncoder | None = None  # Q's (chained kernels' Q boxes by TMA), by data pointer
    split: PackedLaunch | None = None  # a chained launch with its last round split (tail.py)
    pieces: Callable[[bool], _Pieces] | None = None  # chained launches' tables, split or not (made at the first call)


def prefill(kernel, q, k, v, *, scale: float | None = None, return_lse: bool = False, out=None, lse=None,
            stream=None, workspace=None):
    """out = softmax(q kᵀ·scale) v for one prefill kernel; returns out or (out, lse). The launch is
    planned once per signature (shapes, strides, dtypes, options; packed.cached_plan): a repeated
    call checks its pointers' alignment, allocates what the caller did not give (memory.CallMemory)
    and launches. A launch with its last round split (tail.py) takes the split items' rows from the workspace; a
    call captured on a CuPy stream without one runs the launch unsplit."""
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
        if plan.pieces is None:
            plan.launch(params, memory.stream_ptr)
        else:
            split = plan.split is not None and memory.scratch_allowed
            pieces = plan.pieces(split)
            params.update(pieces.pointers, part_o=0, part_lse=0)
            if split:
                parts = memory.scratch(pieces.bytes)
                params.update(part_o=parts.ptr, part_lse=parts.ptr + pieces.rows_bytes)
            (plan.split if split else plan.launch)(params, memory.stream_ptr)
            if split:
                pieces.merge(params, memory.stream_ptr)
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
    kernel, maps = _kv_maps(kernel, k, v)
    kernel, out_map = _rows_map(kernel, "out_tma", "out", q.shape, out_strides, q.dtype.name, 16)
    kernel, q_map = _rows_map(kernel, "q_tma", "q", q.shape, q.strides, q.dtype.name, kernel.spec.tile.block_m)
    spec = kernel.spec
    with_pieces = wgmma and dict(spec.options).get("tail") == "split"  # (the family settles it so where items chain)
    args = (Pointer("q"), Pointer("k"), Pointer("v"), Pointer("out"), Pointer("lse") if return_lse else NULL,
            *element_strides(q.strides, q.itemsize), *element_strides(k.strides, q.itemsize),
            *element_strides(v.strides, q.itemsize), *element_strides(out_strides, q.itemsize), np.int64(lq),
            *((np.int32(b),) if wgmma else ()), np.int32(hq), np.int32(hq // hkv), np.int32(lq), np.int32(lk),
            np.float32(scale * math.log2(math.e)))
    maps_args = (Blob("k_map", MAP_BYTES, MAP_ALIGN), Blob("v_map", MAP_BYTES, MAP_ALIGN)) if maps is not None else ()
    maps_args += tuple(Blob(name, MAP_BYTES, MAP_ALIGN) for name, m in (("o_map", out_map), ("q_map", q_map)) if m)
    qblocks = math.ceil(lq / spec.tile.block_m)
    items = qblocks * hq * b
    # one consumer warpgroup's block runs two to an SM (prefill_wgmma.cu.j2, BLOCKS_PER_SM)
    per_sm = 2 if spec.tile.warps == 4 else 1
    grid = work_grid(spec, items, q.device.id, per_sm) if wgmma else (qblocks, hq, b)

    def launch(item_end=None):  # item_end: the bound on the items of the main rounds (tail "split")
        pieces = (np.int32(item_end), Pointer("pieces"), Pointer("pieces_first"), Pointer("part_o"),
                  Pointer("part_lse")) if with_pieces else ()
        return PackedLaunch(kernel.function(), grid, kernel.threads, kernel.shared_bytes, args + pieces + maps_args,
                            programmatic(spec))

    if not with_pieces:
        return _PrefillPlan(launch(), (b, hq, lq), maps, out_map, q_map)
    tail = plan_tail(items=items, qblocks=qblocks, lq=lq, lk=lk, block_m=spec.tile.block_m,
                     block_n=spec.tile.block_n, causal=spec.causal, grid=grid[0])
    pieces = functools.cache(functools.partial(_pieces, kernel, tail, grid[0], out_strides, q.itemsize, return_lse,
                                               (hq, hkv, lq)))
    return _PrefillPlan(launch(items), (b, hq, lq), maps, out_map, q_map,
                        None if tail is None else launch(tail.main_items), pieces)


def _pieces(kernel, tail: TailPlan | None, grid: int, out_strides, itemsize, return_lse, heads, split: bool) -> _Pieces:
    """The device tables of a chained launch: split, the plan's pieces and their merge; else none (every block's
    table empty)."""
    import cupy

    if not split:
        empty = cupy.zeros(grid + 1, cupy.int32)
        return _Pieces({"pieces": empty.data.ptr, "pieces_first": empty.data.ptr}, (empty,))
    spec = kernel.spec
    hq, hkv, lq = heads
    arrays = {name: cupy.asarray(array) for name, array in
              (("pieces", tail.entries), ("pieces_first", tail.first), ("merges", tail.merges))}
    merges = len(tail.merges)
    merge_grid = (math.ceil(merges * spec.tile.block_m * (spec.head_dim // 8) / MERGE_THREADS), 1, 1)
    merge = PackedLaunch(kernel.function("_merge"), merge_grid, MERGE_THREADS, 0,
                         (Pointer("part_o"), Pointer("part_lse"), Pointer("merges"), np.int32(merges), Pointer("out"),
                          *element_strides(out_strides, itemsize), Pointer("lse") if return_lse else NULL,
                          np.int64(lq), np.int32(hq), np.int32(hq // hkv), np.int32(lq)), programmatic(spec))
    rows = spec.tile.block_m * tail.slots
    return _Pieces({name: array.data.ptr for name, array in arrays.items()}, tuple(arrays.values()),
                   rows * spec.head_dim * itemsize, rows * (spec.head_dim * itemsize + 4), merge)


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
