"""int8-QK attention on the GPU (``i8-f16``, ``i8-i8``, ``i8-f8``; DESIGN §2): the quantization
steps and the attention kernel, all entry points of the one module a spec compiles to.

``qattn.attention(q, k, v, format="i8-f8")`` runs everything through ``prefill_i8``. The steps are
public for callers that keep K (and V) quantized across calls::

    kernel = qattn.build("prefill", format="i8-f8", head_dim=128, causal=True)
    qkv = quantize(q, k, v, kernel=kernel, with_shift=True)     # Q8, K8, V operand, scales
    out, lse = attention_quantized(kernel, qkv, return_lse=True)
    qkv2 = qkv.with_query(q_next, kernel=kernel)                  # new queries, same K/V codes

What a kernel computes is what ``emulate.emulate(fmt, ..., **emulator_options(kernel.spec))``
computes: block_m query rows per Q scale, block_n keys per K scale block and per softmax step, and
the K scale groups. The default kernels take 128 x 64 with one K scale per block, the emulator's
defaults, except i8-f8 on sm_90a, whose wgmma kernels take one Q scale per row and 128-key blocks
of four K scales each (quant's "thread" groups):

- K̄ = mean of K over keys (fp64 partial sums per chunk of keys, combined in a fixed order, rounded to fp32);
  K̃ = K − K̄; s_K = max|K̃| / 127 per block of block_n keys (or per group of them); K8 = rint(K̃ / s_K). With
  ``smoothing=None`` (emulate's option of the same name) K̄ is a buffer of zeros: K is quantized as
  given, and the shift (q̃·K̄) is 0. With ``smoothing="mean+balance"`` Q's and K̃'s channels
  are balanced first: q̃·α and K̃ / α are quantized, α [B, Hkv, D] as quant.balance_factors computes
  it with the "outliers" rule (from K's column max and min and Q's column absmax over each GQA
  group: on CUDA by the module's kernels, on HIP by CuPy, quant.balance_from_ranges); the shift stays q̃·K̄.
- q̃ = Q·(τ·log2 e) in fp32; s_Q = max|q̃| / 127 per block of block_m rows; Q8 = rint(q̃ / s_Q);
  optionally shift = q̃·K̄ per row (log2 domain), which the LSE needs.
- V: fp16 rows (i8-f16; bf16 V is rounded to fp16 first; fp16 V passes through, and the wgmma kernel reads it by
  the TMA; with its option v_tiles "on" the quantizer copies it into block tiles of 128-byte swizzled lines,
  which ``QuantizedQKV.v_rows`` reads back), or per-channel codes
  (s_V = max over keys |V_c| / 127 or / 448) stored transposed with the keys of every 16-key group
  permuted into the order the PV MMA's A fragment packs P (see the template). Where i8-f8 runs its
  PV on fp16 MMAs (Hopper: recipes.E4M3_IN_F16_ARCHS), V's e4m3 codes are stored as fp16 rows of
  their values instead: the same numbers, another carrier.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from ...engine.registry import recipe
from ...engine.arrays import as_device_array, check_view, like_input, on_device
from ...engine.memory import CallMemory, cupy_stream, lse_output
from .launch import (COLSTATS_CHUNK, QUANT_THREADS, QuantPlan, attention_launch, contiguous_strides,
                          describe_scales, emulator_options, k_scale_groups, q_quant_rows, scale_blocks,
                          scale_options, v_by_tma, v_map_encoder)
from .launch import SUFFIX as _SUFFIX
from ...engine.packed import cached_plan
from .launch import tile_keys as _tile_keys
from ...engine.packed import Pointer
from ...check import quant
from ...check.reference import check_shapes
from .quant import UNSET, balance_from_ranges, default_smoothing, smoothing_option

# Rows per block of the HIP kernel that rounds bf16 V to fp16 rows (v_to_half_body).
V_ROWS = 64


def module_entries(fmt: str, backend: str | None = None) -> list[str]:
    """The suffixes (after entry_name(spec)) of the kernels an int8-QK module holds: attention per
    output dtype and the quantization kernels per input dtype. The CUDA module runs the quantization
    in three launches (statistics, their finish, Q/K/V codes in one grid), the HIP module step by
    step with CuPy finishing the statistics; both hold _quant_q_* (QuantizedQKV.with_query).
    backend None: the entries both modules hold."""
    names = ["_f16", "_bf16"] + [f"_quant_q_{sfx}" for sfx in _SUFFIX.values()]
    if backend == "cuda":
        names += [f"_{step}_{sfx}" for sfx in _SUFFIX.values()
                  for step in ("stats", "quant_qkv", "stats_balance", "quant_qkv_balance")]
        names += ["_stats_finish", "_balance"]
    elif backend == "hip":
        names += [f"_{step}_{sfx}" for sfx in _SUFFIX.values()
                  for step in ("colstats", "quant_k", "quant_q_balance", "quant_k_balance")]
        if fmt != "i8-f16":
            names += [f"_quant_v_{sfx}" for sfx in _SUFFIX.values()]
        else:
            names.append("_v_to_half_bf16")
    return names


@dataclass(frozen=True)
class QuantizedQKV:
    """Operands of one int8-QK attention call, as the attention kernel reads them.

    q8 int8 [B, Hq, Lq, D] and q_scale float32 [B, Hq, ceil(Lq/block_m)] (q̃ = Q·τ·log2 e);
    k8 int8 [B, Hkv, Lk, D] and k_scale float32 [B, Hkv, ceil(Lk/block_n)·k_groups] (of K − K̄); for the
    wgmma kernel k8 is [B, Hkv, Lk_pad, D] holding tiles of the tile's block_n keys in wgmma's
    core-matrix order, and v its V^T tiles likewise (see templates/cuda/wgmma.cuh.j2), or its fp16 V as
    swizzled tiles where v_tiles;
    k_mean float32 [B, Hkv, D] (zeros when smoothing is None); shift float32 [B, Hq, Lq] (q̃·K̄, for
    the LSE) or None; alpha float32 [B, Hkv, D], the balancing factors (smoothing "mean+balance";
    else None): q8 holds codes of q̃·α, k8 of K̃ / α;
    v: fp16 V [B, Hkv, Lk, D] (i8-f16) or V^T codes uint8 [B, Hkv, D, Lk_pad] (i8-i8: int8 bytes,
    i8-f8: e4m3 bytes; keys permuted within each 16-key group, zero past Lk), or for i8-f8 on an
    arch that carries e4m3 in fp16, fp16 [B, Hkv, Lk, D] holding the e4m3 codes' values;
    v_scale float32 [B, Hkv, D] (s_V) and v_out_scale (s_V / 127 or / 448), None for i8-f16.
    """

    format: str
    dtype: str  # input (and output) dtype name: "float16" or "bfloat16"
    dims: tuple  # (B, Hq, Hkv, Lq, Lk, D)
    block_m: int  # query rows per Q scale
    block_n: int  # keys per K scale
    scale: float  # the softmax scale τ folded into q8
    q8: object
    q_scale: object
    k8: object
    k_scale: object
    k_mean: object
    shift: object
    v: object
    v_scale: object = None
    v_out_scale: object = None
    smoothing: str | None = "mean"  # quant.SMOOTHINGS: None quantizes K as given (k_mean is zeros)
    alpha: object = None
    tile_keys: int = 0  # keys per K8 / V^T tile where they are stored as wgmma tiles; 0: plain layouts
    k_groups: int = 1  # K scales per key block (4: quant's "thread" groups)
    v_tiles: bool = False  # fp16 V stored as the wgmma kernel's swizzled tiles of tile_keys keys

    def emulator_options(self) -> dict:
        """The emulate() options that compute what these operands' kernel computes."""
        return {**scale_options(self.block_m, self.block_n, self.k_groups), **smoothing_options(self.smoothing)}

    def k8_rows(self):
        """The K codes as rows [B, Hkv, Lk, D], whatever their stored layout."""
        return untile_k8(self.k8, self.dims[4], self.tile_keys) if self.tile_keys else self.k8

    def v_rows(self):
        """The fp16 V operand as rows [B, Hkv, Lk, D] (fp16 PV), whatever its stored layout."""
        return untile_v16(self.v, self.dims[4], self.tile_keys) if self.v_tiles else self.v

    def vt_rows(self):
        """The V^T codes as [B, Hkv, D, Lk_pad] rows (8-bit PV), whatever their stored layout."""
        return untile_vt(self.v, self.tile_keys) if self.tile_keys else self.v

    def with_query(self, q, *, kernel=None, with_shift: bool | None = None, scale: float | None = None,
                   stream=None, workspace=None) -> "QuantizedQKV":
        """The same K and V operands with new queries q [B, Hq', Lq', D] (same batch and head_dim);
        the new Q operands in workspace when given (see quantize)."""
        if self.alpha is not None:
            raise ValueError("q: operands quantized with smoothing='mean+balance' take no new queries "
                             "(α depends on the queries): quantize q, k and v together")
        example = q
        kernel = kernel or _default_kernel(self.format, self.dims[5])
        _check_kernel(kernel, self)
        q = _checked(q, "q", self.dtype, fmt=self.format)
        b, hq, lq, d = q.shape
        if b != self.dims[0] or d != self.dims[5]:
            raise ValueError(f"q: expected batch {self.dims[0]} and head_dim {self.dims[5]}, got shape {q.shape}")
        check_shapes(q.shape, self.k8.shape, self.k8.shape)
        with_shift = self.shift is not None if with_shift is None else with_shift
        scale = self.scale if scale is None else _check_scale(scale, d)
        with on_device(q, stream):
            memory = CallMemory(example, stream, workspace) if kernel.spec.backend == "cuda" else None
            q8, q_scale, shift = _quantize_q(kernel, q, self.k_mean, scale, self.dims[2], with_shift, stream, memory)
        return dataclasses.replace(self, dims=(b, hq, self.dims[2], lq, self.dims[4], d), scale=scale,
                                   q8=q8, q_scale=q_scale, shift=shift)


def untile_k8(k8, lk: int, tile_keys: int):
    """K codes stored as tiles of tile_keys keys in wgmma's core-matrix order ([B, Hkv, Lk_pad, D]:
    per tile, 8-row x 16-byte core matrices, rows of 8 first, then 16-byte chunks) back to rows
    [B, Hkv, Lk, D]. NumPy or CuPy arrays."""
    b, h, lk_pad, d = k8.shape
    cores = k8.reshape(b, h, lk_pad // tile_keys, tile_keys // 8, d // 16, 8, 16)
    return cores.transpose(0, 1, 2, 3, 5, 4, 6).reshape(b, h, lk_pad, d)[:, :, :lk]


def untile_v16(v, lk: int, tile_keys: int):
    """fp16 V stored as tiles of tile_keys keys in 128-byte swizzled lines ([B, Hkv, Lk_pad, D]: per
    tile, 64-channel lines of tile_keys rows of 128 bytes, 16-byte chunk c of row r stored at chunk
    c ^ (r % 8)) back to rows [B, Hkv, Lk, D]. NumPy or CuPy arrays."""
    xp = np if isinstance(v, np.ndarray) else __import__("cupy")
    b, h, lk_pad, d = v.shape
    lines = v.reshape(b, h, lk_pad // tile_keys, d // 64, tile_keys, 8, 8)
    rows = xp.arange(tile_keys)[:, None, None] % 8
    stored = xp.arange(8)[None, :, None] ^ rows  # where logical chunk c of row r sits
    lines = xp.take_along_axis(lines, xp.broadcast_to(stored, (b, h, lk_pad // tile_keys, d // 64, tile_keys, 8, 1)),
                               axis=5)
    return lines.transpose(0, 1, 2, 4, 3, 5, 6).reshape(b, h, lk_pad, d)[:, :, :lk]


def untile_vt(vt, tile_keys: int):
    """V^T codes stored per tile of tile_keys keys in wgmma's core-matrix order (channel rows of
    tile_keys bytes) back to [B, Hkv, D, Lk_pad] rows. NumPy or CuPy arrays."""
    b, h, d, lk_pad = vt.shape
    cores = vt.reshape(b, h, lk_pad // tile_keys, d // 8, tile_keys // 16, 8, 16)
    return cores.transpose(0, 1, 3, 5, 2, 4, 6).reshape(b, h, d, lk_pad)


# ---- helpers ---------------------------------------------------------------------------------

def _default_kernel(fmt: str, head_dim: int, causal: bool = False):
    from ...engine.kernel import build_kernel
    from ...engine.spec import default_spec

    return build_kernel(default_spec(fmt, head_dim, causal=causal))


def _check_kernel(kernel, qkv: QuantizedQKV) -> None:
    spec = kernel.spec
    if spec.family.launcher != "prefill_i8":
        raise ValueError(f"kernel: {spec.name} is not an int8-QK kernel")
    if spec.recipe != qkv.format:
        raise ValueError(f"kernel: {spec.name} is format {spec.recipe!r}, the operands are {qkv.format!r}")
    if spec.head_dim != qkv.dims[5]:
        raise ValueError(f"kernel: {spec.name} has head_dim {spec.head_dim}, the operands {qkv.dims[5]}")
    if emulator_options(spec) != scale_options(qkv.block_m, qkv.block_n, qkv.k_groups):
        raise ValueError(f"kernel: {spec.name} takes {describe_scales(*scale_blocks(spec), k_scale_groups(spec))}; "
                         f"the operands were quantized with {describe_scales(qkv.block_m, qkv.block_n, qkv.k_groups)}")
    if _tile_keys(spec) != qkv.tile_keys or _v_layout(spec) != _v_layout_of(qkv):
        raise ValueError(f"kernel: {spec.name} reads K8 and V in another layout than the operands have "
                         f"(quantize them with this kernel)")


def _v_layout(spec) -> str:
    if recipe(spec.recipe).ctype["pv"] != "f16" and spec.family.values["pv_operand"] != "f16":
        return "vt"
    return "tiles" if _tile_keys(spec) and not v_by_tma(spec) else "rows"


def _v_layout_of(qkv: QuantizedQKV) -> str:
    return "vt" if np.dtype(qkv.v.dtype) != np.float16 else "tiles" if qkv.v_tiles else "rows"


def _checked(x, name: str, dtype: str | None, allowed=("float16", "bfloat16"), fmt: str = "int8-QK"):
    x = as_device_array(x, name)
    if x.ndim != 4:
        raise ValueError(f"{name}: expected 4 dimensions [batch, heads, seq, head_dim], got shape {x.shape}")
    if x.dtype.name not in allowed:
        raise TypeError(f"{name}: format {fmt!r} takes {' or '.join(allowed)}, got {x.dtype.name}")
    if dtype is not None and x.dtype.name != dtype:
        raise TypeError(f"{name}: expected {dtype} like the other operands, got {x.dtype.name}")
    check_view(x, name, x.itemsize, 16)
    return x


def _check_scale(scale, d: int) -> float:
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale: expected a positive finite number, got {scale}")
    return scale


def _strides(x) -> list:
    return [np.int64(s // x.itemsize) for s in x.strides[:3]]


def _null():
    return np.uintp(0)


def _grid_check(b: int, h: int) -> None:
    if b > 65535 or h > 65535:
        raise ValueError(f"q: batch and heads must be <= 65535 (grid limits), got batch {b}, heads {h}")


# ---- the quantization steps, HIP: one kernel a step, CuPy finishing the statistics ---------------

def _colstats(kernel, x, *, want_sum: bool, want_max: bool, stream):
    """Per-channel fp64 sum and/or absmax over the key axis of x [B, H, L, D] (partials per chunk
    of keys on the GPU, finished here; deterministic)."""
    import cupy

    b, h, length, d = x.shape
    nchunks = -(-length // COLSTATS_CHUNK)
    part_sum = cupy.empty((b, h, nchunks, d), dtype=cupy.float64) if want_sum else None
    part_max = cupy.empty((b, h, nchunks, d), dtype=cupy.float32) if want_max else None
    fn = kernel.function("_colstats_" + _SUFFIX[x.dtype.name])
    fn((nchunks, h, b), (d,), (x, *_strides(x), np.int32(length), np.int32(COLSTATS_CHUNK),
                               part_sum if want_sum else _null(), part_max if want_max else _null()), stream=stream)
    total = part_sum.sum(axis=2) if want_sum else None
    amax = part_max.max(axis=2) if want_max else None
    return total, amax


def _k_mean(kernel, k, stream, smooth_k: bool):
    """K̄ [B, Hkv, D] fp32 (zeros without K smoothing: K − 0 = K exactly in the kernel, K quantized as given)."""
    import cupy

    b, hkv, lk, d = k.shape
    if not smooth_k:
        return cupy.zeros((b, hkv, d), dtype=cupy.float32)
    total, _ = _colstats(kernel, k, want_sum=True, want_max=False, stream=stream)
    return cupy.ascontiguousarray((total / lk).astype(cupy.float32))  # as quant.smooth_k: fp64 mean -> fp32


def _quantize_k(kernel, k, k_mean, alpha, stream):
    """K's codes and scales (of (K − K̄) / α where alpha, the balancing factors [B, Hkv, D], is given)."""
    import cupy

    b, hkv, lk, d = k.shape
    bn = kernel.spec.tile.block_n
    k8 = cupy.empty((b, hkv, lk, d), dtype=cupy.int8)
    k_scale = cupy.empty((b, hkv, -(-lk // bn)), dtype=cupy.float32)
    step = "_quant_k_balance_" if alpha is not None else "_quant_k_"
    fn = kernel.function(step + _SUFFIX[k.dtype.name])
    fn((-(-lk // bn), hkv, b), (QUANT_THREADS,),
       (k, *_strides(k), np.int32(lk), k_mean, k8, k_scale) + ((alpha,) if alpha is not None else ()), stream=stream)
    return k8, k_scale


def _quantize_q(kernel, q, k_mean, scale, hkv, with_shift, stream, memory=None, alpha=None):
    """Q's codes, scales and (with_shift) q̃·K̄; in one scratch of memory (a CallMemory) when given; of q̃·α where
    alpha, the balancing factors [B, Hkv, D], is given (HIP)."""
    import cupy

    b, hq, lq, d = q.shape
    bm = scale_blocks(kernel.spec)[0]
    if hq % hkv:
        raise ValueError(f"q: {hq} query heads is not a multiple of k's {hkv} kv heads (GQA needs Hq = g*Hkv)")
    shapes = {"q8": ((b, hq, lq, d), np.int8), "q_scale": ((b, hq, -(-lq // bm)), np.float32)}
    if with_shift:
        shapes["shift"] = ((b, hq, lq), np.float32)
    if memory is None:
        arrays = {name: cupy.empty(shape, dtype=dtype) for name, (shape, dtype) in shapes.items()}
    else:
        arrays = _carve(memory, shapes)
        stream = cupy_stream(memory.stream_ptr)
    mul = np.float32(scale * quant.LOG2E)  # as quant.fold_softmax_scale
    fn = kernel.function(("_quant_q_balance_" if alpha is not None else "_quant_q_") + _SUFFIX[q.dtype.name])
    fn((-(-lq // q_quant_rows(kernel.spec)), hq, b), (QUANT_THREADS,),
       (q, *_strides(q), np.int32(lq), np.int32(hq // hkv), mul, k_mean, arrays["q8"], arrays["q_scale"],
        arrays.get("shift", _null())) + ((alpha,) if alpha is not None else ()), stream=stream)
    return arrays["q8"], arrays["q_scale"], arrays.get("shift")


def _carve(memory, shapes: dict) -> dict:
    """CuPy arrays of the given (shape, dtype) by name, side by side in one scratch of memory."""
    import cupy

    sizes = {name: -(-int(np.prod(shape)) * np.dtype(dtype).itemsize // 256) * 256
             for name, (shape, dtype) in shapes.items()}
    base, arrays, offset = memory.scratch(sum(sizes.values())), {}, 0
    for name, (shape, dtype) in shapes.items():
        arrays[name] = cupy.ndarray(shape, dtype=dtype, memptr=base + offset)
        offset += sizes[name]
    return arrays


def _quantize_v(kernel, v, stream):
    """The PV operand (HIP): (v, v_scale, v_out_scale)."""
    import cupy

    b, hkv, lk, d = v.shape
    pv = recipe(kernel.spec.recipe).ctype["pv"]
    if pv == "f16":
        if v.dtype.name == "float16":
            return v, None, None
        v16 = cupy.empty((b, hkv, lk, d), dtype=cupy.float16)
        fn = kernel.function("_v_to_half_bf16")
        fn((-(-lk // V_ROWS), hkv, b), (QUANT_THREADS,), (v, *_strides(v), np.int32(lk), v16), stream=stream)
        return v16, None, None
    _, amax = _colstats(kernel, v, want_sum=False, want_max=True, stream=stream)
    amax = cupy.ascontiguousarray(amax)
    v_scale = cupy.empty((b, hkv, d), dtype=cupy.float32)
    v_out_scale = cupy.empty((b, hkv, d), dtype=cupy.float32)
    fn = kernel.function("_quant_v_" + _SUFFIX[v.dtype.name])
    bn = kernel.spec.tile.block_n
    lk_pad = -(-lk // bn) * bn
    vt = cupy.empty((b, hkv, d, lk_pad), dtype=cupy.uint8)
    fn((lk_pad // bn, hkv, b), (QUANT_THREADS,),
       (v, *_strides(v), np.int32(lk), np.int32(lk_pad), amax, v_scale, v_out_scale, vt), stream=stream)
    return vt, v_scale, v_out_scale


def smoothing_options(smoothing) -> dict:
    """emulate()'s options for operands quantized under smoothing: the GPU computes α by the
    "outliers" rule only."""
    return {"smoothing": smoothing, **({"alpha_rule": "outliers"} if smoothing == "mean+balance" else {})}


def _checked_inputs(kernel, q, k, v, format: str | None = None):
    """q, k, v as CuPy arrays checked against an int8-QK kernel; returns them and their dims
    (B, Hq, Hkv, Lq, Lk, D)."""
    spec = kernel.spec
    if spec.family.launcher != "prefill_i8":
        raise ValueError(f"kernel: {spec.name} is not an int8-QK kernel")
    if format is not None and format != spec.recipe:
        raise ValueError(f"format: {format!r} does not match the kernel's {spec.recipe!r}")
    allowed = recipe(spec.recipe).input_dtypes
    q = _checked(q, "q", None, allowed, spec.recipe)
    k = _checked(k, "k", None, allowed, spec.recipe)
    v = _checked(v, "v", None, allowed, spec.recipe)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v: expected one dtype, got {q.dtype.name}, {k.dtype.name}, {v.dtype.name}")
    for x, n in ((k, "k"), (v, "v")):
        if x.device.id != q.device.id:
            raise ValueError(f"{n}: on device {x.device.id}, but q is on device {q.device.id}")
    dims = check_shapes(q.shape, k.shape, v.shape)
    if dims[5] != spec.head_dim:
        raise ValueError(f"q: head_dim {dims[5]} does not match the kernel's {spec.head_dim} ({spec.name})")
    _grid_check(dims[0], dims[1])
    return q, k, v, dims


def _quant_plan(kernel, q, k, v, dims, scale: float, with_shift: bool, smoothing) -> QuantPlan:
    key = ("quant", dims, q.dtype.name, q.strides, k.strides, v.strides, scale, with_shift, smoothing)
    return cached_plan(kernel, key, lambda: QuantPlan(kernel, dims, q.dtype.name, (q.strides, k.strides, v.strides),
                                                      scale, with_shift, smoothing))


def quantize(q, k, v, *, format: str | None = None, scale: float | None = None, with_shift: bool = False,
             kernel=None, stream=None, smoothing=UNSET, smooth_k: bool | None = None, workspace=None) -> QuantizedQKV:
    """Quantize fp16 or bf16 q [B, Hq, Lq, D], k and v [B, Hkv, Lk, D] (any batch/head/sequence
    strides, channels contiguous) for an int8-QK kernel. Give format (its default kernel for the
    head dim is built) or kernel (its tile sets the scale blocks). with_shift keeps q̃·K̄, which
    attention_quantized needs to return the LSE. smoothing (as emulate's): "mean" (default) subtracts
    K̄; None skips it (K̄ = 0: K quantized as given, to measure what smoothing buys); "mean+balance"
    also balances Q's and K̃'s channels (see the module docstring). smooth_k=True / False is its
    deprecated alias ("mean" / None).
    On CUDA the operands are views of one allocation: of workspace (a qattn.Workspace, e.g. inside a
    CUDA graph capture; the operands then last until the workspace's next use) when given."""
    smoothing = smoothing_option(smoothing, smooth_k)
    example = q
    if kernel is None:
        if format is None:
            raise ValueError("format: give format (e.g. 'i8-f8') or kernel")
        q_dev = as_device_array(q, "q")
        if q_dev.ndim != 4:
            raise ValueError(f"q: expected 4 dimensions [batch, heads, seq, head_dim], got shape {q_dev.shape}")
        kernel = _default_kernel(format, int(q_dev.shape[-1]))
    q, k, v, dims = _checked_inputs(kernel, q, k, v, format)
    spec = kernel.spec
    scale = _check_scale(scale, dims[5])
    alpha = None
    with on_device(q, stream):
        if spec.backend == "cuda":
            plan = _quant_plan(kernel, q, k, v, dims, scale, with_shift, smoothing)
            call = CallMemory(example, stream, workspace)
            memory = call.scratch(plan.nbytes)
            plan.launch({"q": q.data.ptr, "k": k.data.ptr, "v": v.data.ptr, "ws": memory.ptr}, call.stream_ptr)
            ops = plan.arrays(memory)
            small = ops["small"]
            q8, q_scale, shift, k8, k_scale = ops["q8"], ops["q_scale"], ops.get("shift"), ops["k8"], ops["k_scale"]
            k_mean, v_op, alpha = small[0], ops.get("v_op", v), ops.get("alpha")
            v_scale, v_out_scale = (small[1], small[2]) if plan.v_stats else (None, None)
        else:
            k_mean = _k_mean(kernel, k, stream, smoothing is not None)
            if smoothing == "mean+balance":  # α by CuPy from Q's and K's column ranges
                import cupy

                alpha = cupy.ascontiguousarray(balance_from_ranges(q, k, k_mean, np.float32(scale * quant.LOG2E),
                                                                   smoothing_options(smoothing)["alpha_rule"], cupy))
            k8, k_scale = _quantize_k(kernel, k, k_mean, alpha, stream)
            q8, q_scale, shift = _quantize_q(kernel, q, k_mean, scale, dims[2], with_shift, stream, alpha=alpha)
            v_op, v_scale, v_out_scale = _quantize_v(kernel, v, stream)
    q_rows, k_keys = scale_blocks(spec)
    return QuantizedQKV(format=spec.recipe, dtype=q.dtype.name, dims=dims, block_m=q_rows, block_n=k_keys,
                        scale=scale, q8=q8, q_scale=q_scale, k8=k8, k_scale=k_scale, k_mean=k_mean, shift=shift,
                        v=v_op, v_scale=v_scale, v_out_scale=v_out_scale, smoothing=smoothing, alpha=alpha,
                        tile_keys=_tile_keys(spec), k_groups=k_scale_groups(spec),
                        v_tiles=_v_layout(spec) == "tiles")


# ---- attention on quantized operands ---------------------------------------------------------

_OPERANDS = {name: Pointer(name) for name in ("q8", "k8", "v", "q_scale", "k_scale", "v_out_scale", "shift")}


def _checked_out(out, dims, dtype):
    """out (an array to write, or None) as a CuPy array of shape [B, Hq, Lq, D] in dtype, checked."""
    b, hq, _, lq, _, d = dims
    if out is None:
        return None
    out_arr = as_device_array(out, "out")
    if out_arr.shape != (b, hq, lq, d) or out_arr.dtype != dtype:
        raise ValueError(f"out: expected shape {(b, hq, lq, d)} and dtype {np.dtype(dtype).name}, "
                         f"got {out_arr.shape} {out_arr.dtype.name}")
    check_view(out_arr, "out", out_arr.itemsize, 16)
    return out_arr


def attention_quantized(kernel, qkv: QuantizedQKV, *, causal: bool | None = None, return_lse: bool = False,
                        out=None, lse=None, stream=None):
    """softmax(q kᵀ·τ) v from quantized operands; returns out [B, Hq, Lq, D] in the input dtype
    (and the natural-log LSE [B, Hq, Lq] in fp32 when return_lse, or written to lse). kernel None
    builds the format's default kernel (causal as given); causal, when given, must match the
    kernel's. Runs on stream, else on the current stream of out's array type (torch or CuPy)."""
    return_lse = return_lse or lse is not None
    if kernel is None:
        kernel = _default_kernel(qkv.format, qkv.dims[5], bool(causal))
    _check_kernel(kernel, qkv)
    spec = kernel.spec
    if causal is not None and bool(causal) != spec.causal:
        raise ValueError(f"causal: {causal} does not match the kernel {spec.name} (causal={spec.causal})")
    if return_lse and qkv.shift is None:
        raise ValueError("return_lse: the LSE needs q̃·K̄; quantize with with_shift=True")
    dims = qkv.dims
    _grid_check(dims[0], dims[1])
    lse_shape = (dims[0], dims[1], dims[3])
    lse_output(lse, lse_shape)
    with on_device(qkv.q8, stream):
        memory = CallMemory(out if out is not None else qkv.q8, stream)
        out_arr, out_result = memory.output(out, (dims[0], dims[1], dims[3], dims[5]), _out_dtype(qkv.dtype), "out",
                                            None if out is None else _checked_out(out, dims, _out_dtype(qkv.dtype)))
        lse_arr, lse_result = memory.output(lse, lse_shape, "float32", "lse") if return_lse else (None, None)
        key = ("attention", dims, qkv.dtype, qkv.v.strides, out_arr.strides, return_lse)
        launch, v_map = cached_plan(kernel, key, lambda: (attention_launch(
            kernel, dims, qkv.dtype, _OPERANDS, qkv.v.strides, _strides(out_arr), return_lse, qkv.q8.device.id),
            _v_map(kernel, qkv.v)))
        pointers = {name: (getattr(qkv, name).data.ptr if getattr(qkv, name) is not None else 0)
                    for name in _OPERANDS}
        if v_map is not None:
            pointers["v_map"] = v_map(qkv.v.data.ptr)
        pointers.update(out=out_arr.data.ptr, lse=lse_arr.data.ptr if return_lse else 0)
        launch(pointers, memory.stream_ptr)
    return (out_result, lse_result) if return_lse else out_result


def _v_map(kernel, v):
    """The TMA map encoder of the operands' V for a kernel that reads V by the TMA (else None)."""
    if not v_by_tma(kernel.spec):
        return None
    encoder = v_map_encoder(kernel.spec, v.shape, v.strides)
    if encoder is None:
        raise ValueError(f"v: {kernel.spec.name} reads V by the TMA, which cannot address strides {v.strides} "
                         "(bytes): quantize the operands with this kernel")
    return encoder


def _out_dtype(name: str):
    from ...engine.arrays import numpy_dtype

    return numpy_dtype(name)


class _CallPlan:
    """A whole int8-QK call on CUDA for one signature: the quantization launches and the attention
    launch on the operands they leave in the workspace."""

    def __init__(self, kernel, q, k, v, dims, scale, return_lse, smoothing, out_arr):
        b, hq, _, lq, _, d = dims
        self.out_shape, self.out_dtype, self.lse_shape = (b, hq, lq, d), q.dtype, (b, hq, lq)
        # the caller's out, or a new C-order array
        out_strides = _strides(out_arr) if out_arr is not None else [np.int64(hq * lq * d), np.int64(lq * d),
                                                                     np.int64(d)]
        self.quant = _quant_plan(kernel, q, k, v, dims, scale, return_lse, smoothing)
        operands = self.quant.operands()
        v_buffer = self.quant.buffers.get("v_op")
        v_strides = contiguous_strides(v_buffer) if v_buffer is not None else v.strides
        self.attention = attention_launch(kernel, dims, q.dtype.name, operands, v_strides, out_strides, return_lse,
                                          q.device.id)


def _call_key(q, k, v, scale, return_lse, smoothing, out):
    out_sig = None if out is None else (out.shape, out.strides, out.dtype)
    return ("call", q.shape, q.strides, q.dtype, k.shape, k.strides, k.dtype, v.shape, v.strides, v.dtype,
            q.data.device_id, k.data.device_id, v.data.device_id, scale, bool(return_lse), smoothing, out_sig)


def prefill_i8(kernel, q, k, v, *, scale: float | None = None, return_lse: bool = False, out=None, lse=None,
               stream=None, smoothing=UNSET, smooth_k: bool | None = None, workspace=None):
    """The launcher of the int8-QK families (launch.LAUNCHERS["prefill_i8"]): quantize, then attend.
    smoothing: "mean", "mean+balance" or None, smooth_k its deprecated alias (see quantize); by default
    "mean+balance" from quant.BALANCE_FROM_KEYS keys on, "mean" below (quant.default_smoothing).
    On CUDA a call's launches are planned once per signature (shapes, strides, dtypes, options): a repeated call checks only
    its pointers' alignment and launches. The quantized operands are temporaries (memory.CallMemory:
    from workspace when given)."""
    return_lse = return_lse or lse is not None
    smoothing = smoothing_option(smoothing, smooth_k, default_smoothing(_keys(k)))
    if kernel.spec.backend != "cuda":
        example = q
        qkv = quantize(q, k, v, scale=scale, with_shift=return_lse, kernel=kernel, stream=stream, smoothing=smoothing)
        result = attention_quantized(kernel, qkv, return_lse=return_lse, out=out, lse=lse, stream=stream)
        if return_lse:
            return (out if out is not None else like_input(result[0], example)), \
                (lse if lse is not None else like_input(result[1], example))
        return out if out is not None else like_input(result, example)
    return _whole_call(kernel, q, k, v, scale, return_lse, out, lse, stream, smoothing, workspace)


def _keys(k) -> int:
    """Lk of k [B, Hkv, Lk, D] (0 for a malformed k, which the call's checks then name)."""
    shape = tuple(getattr(k, "shape", ()))
    return int(shape[2]) if len(shape) == 4 else 0


def _whole_call(kernel, q, k, v, scale, return_lse, out, lse, stream, smoothing, workspace):
    example = q
    q, k, v = (as_device_array(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    out_given = None if out is None else as_device_array(out, "out")
    scale = None if scale is None else _check_scale(scale, 0)

    def build():  # the full checks, once per signature
        q_, k_, v_, dims = _checked_inputs(kernel, q, k, v)
        with on_device(q_, stream):
            out_checked = _checked_out(out_given, dims, _out_dtype(q_.dtype.name))
        return _CallPlan(kernel, q_, k_, v_, dims, _check_scale(scale, dims[5]), return_lse, smoothing, out_checked)

    plan = cached_plan(kernel, _call_key(q, k, v, scale, return_lse, smoothing, out_given), build)
    pointers = {"q": q.data.ptr, "k": k.data.ptr, "v": v.data.ptr}
    if out_given is not None:
        pointers["out"] = out_given.data.ptr
    if any(p % 16 for p in pointers.values()):  # the plan fixed all else: name the misaligned one
        _checked_out(out_given, _checked_inputs(kernel, q, k, v)[3], q.dtype)
    lse_output(lse, plan.lse_shape)
    with on_device(q, stream):
        memory = CallMemory(example, stream, workspace)
        operands = memory.scratch(plan.quant.nbytes)
        pointers["ws"] = operands.ptr
        plan.quant.launch(pointers, memory.stream_ptr)  # first: the GPU starts while the outputs are allocated
        if plan.quant.v_map is not None:
            pointers["v_map"] = plan.quant.v_map_bytes(pointers)
        out_arr, out_result = memory.output(out, plan.out_shape, plan.out_dtype, "out", out_given)
        lse_arr, lse_result = memory.output(lse, plan.lse_shape, "float32", "lse") if return_lse else (None, None)
        pointers.update(out=out_arr.data.ptr, lse=lse_arr.data.ptr if return_lse else 0)
        plan.attention(pointers, memory.stream_ptr)
    return (out_result, lse_result) if return_lse else out_result
