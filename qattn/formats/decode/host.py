"""Decode over a paged K-V cache on the GPU: ``qattn.decode`` checks a call, picks the split of the
keys, and launches the decode kernel (and, with splits that do not merge inside a thread-block
cluster, the merge) on the caller's stream.

A call never synchronizes the host, so a decode step (cache writes and decode) can be captured in a
CUDA graph: torch callers as they are, CuPy callers with ``out=`` (``lse=``) and, with more than one
split, ``workspace=`` (a ``qattn.Workspace``, or a byte array of ``workspace_bytes(...)``); see
engine/memory.py. The split count depends only on shapes known on the host (the
batch, heads, the block table's width times the page size, the GPU's SM count), never on the lengths
in ``seq_lens``, which stay on the GPU; schedule.py says how it is chosen.
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from ...engine.arrays import as_device_array, signature
from ...engine.memory import CallMemory, lse_output
from ...engine.packed import NULL, PackedLaunch, Pointer, cached_plan, max_active_clusters, programmatic
from ...engine.registry import recipe
from .cache import PagedKVCache
from .recipes import EIGHT_BIT, MAX_ROWS, TABLE_SLOTS
from .schedule import MAX_SPLITS, auto_splits, cluster_merge, key_bytes, most_blocks_per_sm, occupancy

MAX_QUERIES = 16  # new tokens per sequence and step (speculative decoding)


def keys_per_split(bound: int, splits: int, step: int) -> int:
    """Keys of each split: the bound (table width x page size) spread over splits, whole steps."""
    return -(-bound // splits // step) * step


def least_splits(bound: int, step: int, page_size: int) -> int:
    """The fewest splits whose key ranges each span at most TABLE_SLOTS pages."""
    splits = 1
    while keys_per_split(bound, splits, step) // page_size + 1 > TABLE_SLOTS:
        splits += 1
    return splits


def workspace_bytes(batch: int, heads: int, queries: int, head_dim: int, splits: int) -> int:
    """Bytes of the partials of a call with splits > 1: O rows (fp32) and (m, l) per split."""
    return 0 if splits <= 1 else splits * batch * heads * queries * (head_dim + 2) * 4


def _check_splits(splits) -> int | None:
    if splits is None:
        return None
    if isinstance(splits, bool) or not isinstance(splits, numbers.Integral) or not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits: expected None (automatic) or an integer 1..{MAX_SPLITS}, got {splits!r}")
    return int(splits)


class _Plan:
    """A call signature's launches: the decode kernel and, with splits not merged in clusters, the merge
    kernel; the split count, the workspace bytes, the LSE's shape and the decode kernel's spec name."""

    def __init__(self, decode: PackedLaunch, merge: PackedLaunch | None, splits: int, ws_bytes: int, lse_shape,
                 kernel_name: str):
        self.decode, self.merge, self.splits, self.ws_bytes, self.lse_shape = decode, merge, splits, ws_bytes, lse_shape
        self.kernel_name = kernel_name


def _plan(kernel, cache: PagedKVCache, q, table, lens, out, scale, return_lse, splits) -> _Plan:
    spec = kernel.spec
    b, hq, lq, d = q.shape
    allowed = recipe(spec.recipe, "decode").input_dtypes
    if q.dtype.name not in allowed:
        raise TypeError(f"q: format {spec.recipe} takes {' or '.join(allowed)} queries, got {q.dtype.name}")
    if d != cache.head_dim:
        raise ValueError(f"q: head_dim {d} does not match the cache's {cache.head_dim}")
    if hq % cache.kv_heads:
        raise ValueError(f"q: {hq} heads is not a multiple of the cache's {cache.kv_heads} kv heads")
    if not 1 <= lq <= MAX_QUERIES:
        raise ValueError(f"q: expected 1..{MAX_QUERIES} new tokens per sequence, got {lq}")
    if q.strides[-1] != 2 or any(s % 8 for s in q.strides[:3]) or q.data.ptr % 8:
        raise ValueError(f"q: channels must be contiguous and the other strides multiples of 4 elements, got "
                         f"strides {q.strides}")
    if table.ndim != 2 or table.shape[0] != b or table.dtype != np.int32 or table.strides[1] != 4:
        raise ValueError(f"block_table: expected int32 [{b}, max_pages] with contiguous rows, got "
                         f"{table.dtype.name} {table.shape}")
    if lens.shape != (b,) or lens.dtype != np.int32:
        raise ValueError(f"seq_lens: expected int32 [{b}], got {lens.dtype.name} {lens.shape}")
    for x, name in ((q, "q"), (table, "block_table"), (lens, "seq_lens")):
        if x.data.device_id != cache.device:
            raise ValueError(f"{name}: on device {x.data.device_id}, the cache on {cache.device}")
    if out is not None:
        if out.shape != q.shape or out.dtype != q.dtype or out.strides[-1] != 2 or any(s % 2 for s in out.strides):
            raise ValueError(f"out: expected {q.dtype.name} {q.shape} with contiguous channels, got "
                             f"{out.dtype.name} {out.shape}")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale: expected a positive finite number, got {scale}")
    group = hq // cache.kv_heads
    chunks = -(-(group * lq) // MAX_ROWS)
    blocks = cache.kv_heads * chunks * b
    if blocks > 65535 * 65535 or b > 65535 or cache.kv_heads * chunks > 65535:
        raise ValueError(f"q: batch {b} x {cache.kv_heads * chunks} row blocks exceed the grid")
    step = spec.tile.block_n
    bound = table.shape[1] * cache.page_size
    least = least_splits(bound, step, cache.page_size)
    shape = _occupancy(kernel, cache, _entry(q))
    if splits is None:
        splits = auto_splits(blocks, -(-bound // step), shape.sms, shape.blocks_per_sm, least=least)
    elif splits < least:
        raise ValueError(f"splits: a table of {table.shape[1]} pages of {cache.page_size} needs at least {least} "
                         f"splits (each split stages at most {TABLE_SLOTS} page ids), got {splits}")
    kps = keys_per_split(bound, splits, step)
    grid = (splits, cache.kv_heads * chunks, b)
    fast = programmatic(spec)
    function = kernel.function(_entry(q))
    clustered = fast and cluster_merge(
        splits, blocks, shape.sms * shape.blocks_per_sm,
        lambda size: max_active_clusters(function, grid, kernel.threads, shape.shared_bytes, size))
    merged = splits > 1 and not clustered  # the partials go through the workspace to the merge kernel
    o_strides = (out.strides if out is not None else
                 tuple(int(np.prod(q.shape[i + 1:])) * 2 for i in range(4)))
    ws_rows = splits * b * hq * lq
    args = (Pointer("q"), Pointer("kp"), Pointer("vp"), Pointer("ks"), Pointer("vs"), Pointer("table"), Pointer("kbq"),
            Pointer("mc"), Pointer("ms"), Pointer("lens"), *cache.decode_term_args(), Pointer("out"), Pointer("lse") if return_lse and not merged else NULL,
            Pointer("ws") if merged else NULL, Pointer("ws", ws_rows * d * 4) if merged else NULL,
            *(np.int64(s // 2) for s in q.strides[:3]), *(np.int64(s // 2) for s in o_strides[:3]),
            np.int32(b), np.int32(hq), np.int32(cache.kv_heads), np.int32(lq), np.int32(table.strides[0] // 4),
            np.int32(kps), np.float32(scale * math.log2(math.e)))
    decode = PackedLaunch(function, grid, kernel.threads, shape.shared_bytes, args, fast, splits if clustered else 1)
    merge = None
    if merged:
        merge_args = (Pointer("ws"), Pointer("ws", ws_rows * d * 4), Pointer("out"),
                      Pointer("lse") if return_lse else NULL, *(np.int64(s // 2) for s in o_strides[:3]),
                      np.int32(b), np.int32(hq), np.int32(lq), np.int32(splits))
        merge = PackedLaunch(kernel.function(f"_merge{_entry(q)}"), (b * hq * lq, 1, 1), d, 0, merge_args, fast)
    return _Plan(decode, merge, splits, workspace_bytes(b, hq, lq, d, splits if merged else 1), (b, hq, lq), spec.name)


def _entry(q) -> str:
    return "_bf16" if q.dtype.name == "bfloat16" else "_f16"


def _occupancy(kernel, cache: PagedKVCache, entry: str):
    """The kernel entry's launch shape: blocks per SM capped at what streams K/V fastest (schedule.py)."""
    tile = kernel.spec.tile
    return occupancy(kernel, entry, cache.device, tile.stages * tile.block_n * key_bytes(cache.format, cache.head_dim),
                     most_blocks_per_sm(cache.format, cache.head_dim))


def decode(q, cache: PagedKVCache, block_table, seq_lens, *, qk: str = "auto", splits: int | None = None,
           scale: float | None = None, out=None, return_lse: bool = False, lse=None, workspace=None, stream=None,
           tile=None):
    """softmax(q Kᵀ·scale) V over each sequence's cached tokens. q [B, Hq, Lq, D] fp16 or bf16 (Lq
    1..16 new tokens, bottom-right causal among them; Hq a multiple of the cache's kv heads);
    block_table int32 [B, max_pages] (page ids of each sequence, in order); seq_lens int32 [B] (tokens
    cached per sequence, the new ones included). Returns out [B, Hq, Lq, D] (and the natural-log LSE
    [B, Hq, Lq] fp32 when return_lse). splits: None picks from the shapes and the GPU (see the module
    docstring). qk, the QK path over an 8-bit K: "transform" (codes converted on chip to the query's
    type), "fp8" (e4m3 K) or "int8" (i8 K): Q quantized per row and S on the 8-bit MMA; "auto" picks by
    arch and by the query rows of a kv head, GQA x Lq (recipes.resolve_qk). lse: an fp32 [B, Hq, Lq]
    array to write the LSE to (implies return_lse).
    workspace: a qattn.Workspace (or a byte array of workspace_bytes(...)) for the split-K partials;
    with it and out= (and lse=) a call allocates nothing (see engine/memory.py)."""
    import cupy

    return_lse = return_lse or lse is not None
    example = q
    q, table, lens, splits = _call_inputs(cache, q, block_table, seq_lens, qk, splits)
    out_given = None if out is None else as_device_array(out, "out")
    plan = _call_plan(cache, q, table, lens, out_given, qk, splits, scale, return_lse, tile)
    lse_output(lse, plan.lse_shape)
    with cupy.cuda.Device(cache.device):
        memory = CallMemory(example, stream, workspace, cache.device)
        partials = memory.scratch(plan.ws_bytes)
        out_arr, out_result = memory.output(out, q.shape, q.dtype, "out", out_given)
        lse_arr, lse_result = memory.output(lse, plan.lse_shape, "float32", "lse") if return_lse else (None, None)
    pointers = {"q": q.data.ptr, "kp": cache.k_pool.data.ptr, "vp": cache.v_pool.data.ptr,
                "ks": 0 if cache.k_scale is None else cache.k_scale.data.ptr,
                "vs": 0 if cache.v_scale is None else cache.v_scale.data.ptr, "table": table.data.ptr,
                **cache.k_term_pointers(),
                "lens": lens.data.ptr, "out": out_arr.data.ptr, "lse": 0 if lse_arr is None else lse_arr.data.ptr,
                "ws": 0 if partials is None else partials.ptr}
    plan.decode(pointers, memory.stream_ptr)
    if plan.merge is not None:
        plan.merge(pointers, memory.stream_ptr)
    return (out_result, lse_result) if return_lse else out_result


def _call_inputs(cache, q, block_table, seq_lens, qk, splits):
    """A call's cache, q, block_table, seq_lens, qk and splits checked: (q, table, lens) as device arrays
    and the split count (None: automatic)."""
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache: expected a qattn.PagedKVCache, got {type(cache).__name__}")
    splits = _check_splits(splits)
    q = as_device_array(q, "q")
    if q.ndim != 4:
        raise ValueError(f"q: expected [batch, heads, new tokens, head_dim], got shape {q.shape}")
    if not isinstance(qk, str):
        raise ValueError(f"qk: expected 'auto', 'transform', 'fp8' or 'int8', got {qk!r}")
    return q, as_device_array(block_table, "block_table"), as_device_array(seq_lens, "seq_lens"), splits


def _call_plan(cache: PagedKVCache, q, table, lens, out, qk, splits, scale, return_lse, tile) -> _Plan:
    """The launches of a call (device arrays), built once per call signature on the kernel it runs."""
    kernel = cache.kernel(tile, qk, max(1, q.shape[1] // cache.kv_heads) * q.shape[2])
    key = ("decode", cache.kv_heads, signature(q), signature(table), signature(lens),
           None if out is None else signature(out), scale, bool(return_lse), splits)
    return cached_plan(kernel, key, lambda: _plan(kernel, cache, q, table, lens, out, scale, return_lse, splits))


def launch_shape(q, cache: PagedKVCache, block_table, seq_lens, *, qk: str = "auto", splits: int | None = None,
                 tile=None) -> dict:
    """How decode(q, cache, block_table, seq_lens, ...) runs on the cache's GPU, without running it: the
    kernel's spec name, the split count, and where the splits' partials merge: "cluster" (inside
    thread-block clusters, schedule.cluster_merge), "kernel" (a merge launch) or "none" (one split)."""
    q, table, lens, splits = _call_inputs(cache, q, block_table, seq_lens, qk, splits)
    plan = _call_plan(cache, q, table, lens, None, qk, splits, None, False, tile)
    merge = "none" if plan.splits == 1 else "kernel" if plan.merge is not None else "cluster"
    return {"kernel": plan.kernel_name, "splits": plan.splits, "merge": merge}


def splits_for(cache: PagedKVCache, batch: int, heads: int, queries: int, max_pages: int, tile=None,
               qk: str = "auto") -> int:
    """The split count decode(...) picks for these shapes on the cache's GPU (for sizing a workspace)."""
    kernel = cache.kernel(tile, qk, max(1, heads // cache.kv_heads) * queries)
    chunks = -(-(heads // cache.kv_heads * queries) // MAX_ROWS)
    step, bound = kernel.spec.tile.block_n, max_pages * cache.page_size
    shape = _occupancy(kernel, cache, "_f16" if "bf16" not in cache.format else "_bf16")
    return auto_splits(cache.kv_heads * chunks * batch, -(-bound // step), shape.sms, shape.blocks_per_sm,
                       least=least_splits(bound, step, cache.page_size))


def launch(kernel, q, cache: PagedKVCache, block_table, seq_lens, **options):
    """kernel(q, cache, block_table, seq_lens, ...): decode with this kernel (its tile), which must be
    the cache's (format, head dim, page size, scale granularity)."""
    qk = dict(kernel.spec.options).get("qk", "transform")
    want = cache.spec(kernel.spec.arch, kernel.spec.tile, qk if cache.k_dtype in EIGHT_BIT else "auto")
    if kernel.spec != want:
        raise ValueError(f"kernel: {kernel.spec.name} does not read this cache ({want.name})")
    return decode(q, cache, block_table, seq_lens, tile=kernel.spec.tile, qk=qk, **options)
