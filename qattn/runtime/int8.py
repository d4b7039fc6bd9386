"""int8-QK attention on the GPU (``i8-f16``, ``i8-i8``, ``i8-f8``; DESIGN §2): the quantization
steps and the attention kernel, all entry points of the one module a spec compiles to.

``qattn.attention(q, k, v, format="i8-f8")`` runs everything through ``prefill_i8``. The steps are
public for callers that keep K (and V) quantized across calls::

    kernel = qattn.build("prefill", format="i8-f8", head_dim=128, causal=True)
    qkv = quantize(q, k, v, kernel=kernel, with_shift=True)     # Q8, K8, V operand, scales
    out, lse = attention_quantized(kernel, qkv, return_lse=True)
    qkv2 = qkv.with_query(q_next, kernel=kernel)                  # new queries, same K/V codes

What a kernel computes is what ``emulate.emulate(fmt, ..., block_m=rows, block_n=keys)`` computes,
with ``(rows, keys) = scale_blocks(kernel.spec)`` (block_m query rows per Q scale, block_n keys per
K scale and per softmax step): 128 x 64 for the default kernels, the emulator's defaults, except
i8-f8 on sm_90a, whose default wgmma tiles take 128 x 128:

- K̄ = mean of K over keys (fp64 partial sums per chunk of keys, finished here, rounded to fp32);
  K̃ = K − K̄; s_K = max|K̃| / 127 per block of block_n keys; K8 = rint(K̃ / s_K). With
  ``smooth_k=False`` (emulate's option of the same name) K̄ is a buffer of zeros: K is quantized as
  given, and the shift (q̃·K̄) is 0.
- q̃ = Q·(τ·log2 e) in fp32; s_Q = max|q̃| / 127 per block of block_m rows; Q8 = rint(q̃ / s_Q);
  optionally shift = q̃·K̄ per row (log2 domain), which the LSE needs.
- V: fp16 rows (i8-f16; bf16 V is rounded to fp16 first), or per-channel codes
  (s_V = max over keys |V_c| / 127 or / 448) stored transposed with the keys of every 16-key group
  permuted into the order the PV MMA's A fragment packs P (see the template). Where i8-f8 runs its
  PV on fp16 MMAs (Hopper: recipes.E4M3_IN_F16_ARCHS), V's e4m3 codes are stored as fp16 rows of
  their values instead: the same numbers, another carrier.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from ..codegen.recipes import recipe
from . import quant
from .arrays import as_device_array, like_input
from .reference import check_shapes

# Keys per partial column sum of the K-mean / V-absmax kernels (one fp64 partial per chunk;
# STATS_CHUNK in quantize_i8.cuh.j2).
COLSTATS_CHUNK = 256
# Threads of the quantization kernels (QT in quantize_i8.cuh.j2).
QUANT_THREADS = 256
# Rows per block of the HIP kernel that rounds bf16 V to fp16 rows (v_to_half_body).
V_ROWS = 64
# Channels per block of the CUDA kernel that finishes the column statistics.
FINISH_CHANNELS = 32
_SUFFIX = {"float16": "f16", "bfloat16": "bf16"}


def module_entries(fmt: str, backend: str | None = None) -> list[str]:
    """The suffixes (after entry_name(spec)) of the kernels an int8-QK module holds: attention per
    output dtype and the quantization kernels per input dtype. The CUDA module runs the quantization
    in three launches (statistics, their finish, Q/K/V codes in one grid), the HIP module step by
    step with CuPy finishing the statistics; both hold _quant_q_* (QuantizedQKV.with_query).
    backend None: the entries both modules hold."""
    names = ["_f16", "_bf16"] + [f"_quant_q_{sfx}" for sfx in _SUFFIX.values()]
    if backend == "cuda":
        names += [f"_{step}_{sfx}" for sfx in _SUFFIX.values() for step in ("stats", "quant_qkv")]
        names.append("_stats_finish")
    elif backend == "hip":
        names += [f"_{step}_{sfx}" for sfx in _SUFFIX.values() for step in ("colstats", "quant_k")]
        if fmt != "i8-f16":
            names += [f"_quant_v_{sfx}" for sfx in _SUFFIX.values()]
        else:
            names.append("_v_to_half_bf16")
    return names


@dataclass(frozen=True)
class QuantizedQKV:
    """Operands of one int8-QK attention call, as the attention kernel reads them.

    q8 int8 [B, Hq, Lq, D] and q_scale float32 [B, Hq, ceil(Lq/block_m)] (q̃ = Q·τ·log2 e);
    k8 int8 [B, Hkv, Lk, D] and k_scale float32 [B, Hkv, ceil(Lk/block_n)] (of K − K̄); for the
    wgmma kernel k8 is [B, Hkv, Lk_pad, D] holding tiles of the tile's block_n keys in wgmma's
    core-matrix order, and v its V^T tiles likewise (see templates/cuda/wgmma.cuh.j2);
    k_mean float32 [B, Hkv, D] (zeros when smooth_k is False); shift float32 [B, Hq, Lq] (q̃·K̄, for
    the LSE) or None;
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
    smooth_k: bool = True  # False: K quantized without subtracting its mean (k_mean is zeros)
    tile_keys: int = 0  # keys per K8 / V^T tile where they are stored as wgmma tiles; 0: plain layouts

    def k8_rows(self):
        """The K codes as rows [B, Hkv, Lk, D], whatever their stored layout."""
        return untile_k8(self.k8, self.dims[4], self.tile_keys) if self.tile_keys else self.k8

    def vt_rows(self):
        """The V^T codes as [B, Hkv, D, Lk_pad] rows (8-bit PV), whatever their stored layout."""
        return untile_vt(self.v, self.tile_keys) if self.tile_keys else self.v

    def with_query(self, q, *, kernel=None, with_shift: bool | None = None, scale: float | None = None,
                   stream=None) -> "QuantizedQKV":
        """The same K and V operands with new queries q [B, Hq', Lq', D] (same batch and head_dim)."""
        kernel = kernel or _default_kernel(self.format, self.dims[5])
        _check_kernel(kernel, self)
        q = _checked(q, "q", self.dtype, fmt=self.format)
        b, hq, lq, d = q.shape
        if b != self.dims[0] or d != self.dims[5]:
            raise ValueError(f"q: expected batch {self.dims[0]} and head_dim {self.dims[5]}, got shape {q.shape}")
        check_shapes(q.shape, self.k8.shape, self.k8.shape)
        with_shift = self.shift is not None if with_shift is None else with_shift
        scale = self.scale if scale is None else _check_scale(scale, d)
        with _on(q, stream):
            q8, q_scale, shift = _quantize_q(kernel, q, self.k_mean, scale, self.dims[2], with_shift, stream)
        return dataclasses.replace(self, dims=(b, hq, self.dims[2], lq, self.dims[4], d), scale=scale,
                                   q8=q8, q_scale=q_scale, shift=shift)


def untile_k8(k8, lk: int, tile_keys: int):
    """K codes stored as tiles of tile_keys keys in wgmma's core-matrix order ([B, Hkv, Lk_pad, D]:
    per tile, 8-row x 16-byte core matrices, rows of 8 first, then 16-byte chunks) back to rows
    [B, Hkv, Lk, D]. NumPy or CuPy arrays."""
    b, h, lk_pad, d = k8.shape
    cores = k8.reshape(b, h, lk_pad // tile_keys, tile_keys // 8, d // 16, 8, 16)
    return cores.transpose(0, 1, 2, 3, 5, 4, 6).reshape(b, h, lk_pad, d)[:, :, :lk]


def untile_vt(vt, tile_keys: int):
    """V^T codes stored per tile of tile_keys keys in wgmma's core-matrix order (channel rows of
    tile_keys bytes) back to [B, Hkv, D, Lk_pad] rows. NumPy or CuPy arrays."""
    b, h, d, lk_pad = vt.shape
    cores = vt.reshape(b, h, lk_pad // tile_keys, d // 8, tile_keys // 16, 8, 16)
    return cores.transpose(0, 1, 3, 5, 2, 4, 6).reshape(b, h, d, lk_pad)


# ---- helpers ---------------------------------------------------------------------------------

def scale_blocks(spec) -> tuple[int, int]:
    """(query rows per Q scale, keys per K scale and softmax step) of a kernel: its tile's block_m x
    block_n, unless its family fixes one (the wgmma kernels' Q scales cover 128 rows whatever the tile)."""
    values = spec.family.values
    return values.get("q_scale_rows", spec.tile.block_m), spec.tile.block_n


def _default_kernel(fmt: str, head_dim: int, causal: bool = False):
    from .api import default_spec
    from .kernel import build_kernel

    return build_kernel(default_spec(fmt, head_dim, causal=causal))


def _check_kernel(kernel, qkv: QuantizedQKV) -> None:
    spec = kernel.spec
    if spec.family.launcher != "prefill_i8":
        raise ValueError(f"kernel: {spec.name} is not an int8-QK kernel")
    if spec.recipe != qkv.format:
        raise ValueError(f"kernel: {spec.name} is format {spec.recipe!r}, the operands are {qkv.format!r}")
    if spec.head_dim != qkv.dims[5]:
        raise ValueError(f"kernel: {spec.name} has head_dim {spec.head_dim}, the operands {qkv.dims[5]}")
    if scale_blocks(spec) != (qkv.block_m, qkv.block_n):
        q_rows, k_keys = scale_blocks(spec)
        raise ValueError(f"kernel: {spec.name} has scale blocks of {q_rows} rows x {k_keys} keys, "
                         f"the operands were quantized with {qkv.block_m} x {qkv.block_n}")
    if _tile_keys(spec) != qkv.tile_keys or _v_layout(spec) != _v_layout_of(qkv):
        raise ValueError(f"kernel: {spec.name} reads K8 and V in another layout than the operands have "
                         f"(quantize them with this kernel)")


def _tile_keys(spec) -> int:
    """Keys per K8 / V^T tile where the kernel reads them as wgmma tiles, else 0."""
    return spec.tile.block_n if spec.family.values["mma_unit"] == "wgmma" else 0


def _v_layout(spec) -> str:
    return "rows" if recipe(spec.recipe).ctype["pv"] == "f16" or spec.family.values["pv_operand"] == "f16" else "vt"


def _v_layout_of(qkv: QuantizedQKV) -> str:
    return "rows" if np.dtype(qkv.v.dtype) == np.float16 else "vt"


def _checked(x, name: str, dtype: str | None, allowed=("float16", "bfloat16"), fmt: str = "int8-QK"):
    from .launch import _check_view

    x = as_device_array(x, name)
    if x.ndim != 4:
        raise ValueError(f"{name}: expected 4 dimensions [batch, heads, seq, head_dim], got shape {x.shape}")
    if x.dtype.name not in allowed:
        raise TypeError(f"{name}: format {fmt!r} takes {' or '.join(allowed)}, got {x.dtype.name}")
    if dtype is not None and x.dtype.name != dtype:
        raise TypeError(f"{name}: expected {dtype} like the other operands, got {x.dtype.name}")
    _check_view(x, name, x.itemsize, 16)
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


@contextlib.contextmanager
def _on(x, stream):
    """Run on x's device, with CuPy's own work on stream (when given)."""
    with x.device:
        if stream is None:
            yield
        else:
            with stream:
                yield


def _grid_check(b: int, h: int) -> None:
    if b > 65535 or h > 65535:
        raise ValueError(f"q: batch and heads must be <= 65535 (grid limits), got batch {b}, heads {h}")


# ---- the quantization steps, CUDA: three launches ---------------------------------------------

def _ptr(x, byte_offset: int = 0):
    return np.uintp(x.data.ptr + byte_offset)


def _quantize_fused(kernel, q, k, v, scale, with_shift, smooth_k, stream):
    """Q8, K8 and the V operand in three launches: the column statistics of K (fp64 sums) and V
    (absmax) per chunk of keys, their finish (K̄, s_V, in a fixed order), and one grid of Q, K and
    V blocks. Returns (q8, q_scale, shift, k8, k_scale, k_mean, v_op, v_scale, v_out_scale)."""
    import cupy

    spec = kernel.spec
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    bn = spec.tile.block_n
    q_rows, k_keys = scale_blocks(spec)
    sfx = _SUFFIX[q.dtype.name]
    v_stats = recipe(spec.recipe).ctype["pv"] != "f16"  # 8-bit PV: per-channel s_V
    v_job = v_stats or v.dtype.name != "float16"  # fp16 V for the fp16 PV passes through
    # K̄, s_V and s_V / P_SCALE in one allocation
    small = (cupy.empty if smooth_k or v_stats else cupy.zeros)((3 if v_stats else 1, b, hkv, d), dtype=cupy.float32)
    k_mean = small[0]
    v_scale, v_out_scale = (small[1], small[2]) if v_stats else (None, None)
    if smooth_k or v_stats:
        nchunks = -(-lk // COLSTATS_CHUNK)
        n_part = b * hkv * nchunks * d
        work = cupy.empty(n_part * ((8 if smooth_k else 0) + (4 if v_stats else 0)), dtype=cupy.uint8)
        part_sum = _ptr(work) if smooth_k else _null()
        part_max = _ptr(work, 8 * n_part if smooth_k else 0) if v_stats else _null()
        kernel.function("_stats_" + sfx)(
            (nchunks, hkv, b), (QUANT_THREADS,),
            (k if smooth_k else _null(), *_strides(k), v if v_stats else _null(), *_strides(v), np.int32(lk),
             part_sum, part_max), stream=stream)
        kernel.function("_stats_finish")(
            (-(-d // FINISH_CHANNELS), hkv, b), (QUANT_THREADS,),
            (part_sum, part_max, np.int32(nchunks), np.int32(lk), k_mean, v_scale if v_stats else _null(),
             v_out_scale if v_stats else _null()), stream=stream)
    q8 = cupy.empty((b, hq, lq, d), dtype=cupy.int8)
    q_scale = cupy.empty((b, hq, -(-lq // q_rows)), dtype=cupy.float32)
    shift = cupy.empty((b, hq, lq), dtype=cupy.float32) if with_shift else None
    nbk = -(-lk // bn)
    lk_pad = nbk * bn
    k_tiles = spec.family.values["mma_unit"] == "wgmma"  # K8 as block tiles of wgmma's layout
    k8 = cupy.empty((b, hkv, lk_pad if k_tiles else lk, d), dtype=cupy.int8)
    k_scale = cupy.empty((b, hkv, -(-lk // k_keys)), dtype=cupy.float32)
    if not v_job:
        v_op = v
    elif spec.family.values["pv_operand"] == "f16":  # fp16 rows (of V, or of its e4m3 codes' values)
        v_op = cupy.empty((b, hkv, lk, d), dtype=cupy.float16)
    else:
        v_op = cupy.empty((b, hkv, d, lk_pad), dtype=cupy.uint8)
    blocks = -(-lq // q_rows) * hq * b + nbk * hkv * b * (2 if v_job else 1)
    mul = np.float32(scale * quant.LOG2E)  # as quant.fold_softmax_scale
    kernel.function("_quant_qkv_" + sfx)(
        (blocks,), (QUANT_THREADS,),
        (q, *_strides(q), np.int32(lq), np.int32(hq), np.int32(hq // hkv), mul, q8, q_scale,
         shift if with_shift else _null(), k, *_strides(k), v, *_strides(v), np.int32(lk), np.int32(hkv),
         np.int32(lk_pad), np.int32(b), k_mean, v_scale if v_stats else _null(), k8, k_scale,
         v_op if v_job else _null()), stream=stream)
    return q8, q_scale, shift, k8, k_scale, k_mean, v_op, v_scale, v_out_scale


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


def _quantize_k(kernel, k, stream, smooth_k=True):
    import cupy

    b, hkv, lk, d = k.shape
    bn = kernel.spec.tile.block_n
    if smooth_k:
        total, _ = _colstats(kernel, k, want_sum=True, want_max=False, stream=stream)
        k_mean = cupy.ascontiguousarray((total / lk).astype(cupy.float32))  # as quant.smooth_k: fp64 mean -> fp32
    else:  # K − 0 = K exactly in the kernel: K quantized as given
        k_mean = cupy.zeros((b, hkv, d), dtype=cupy.float32)
    k8 = cupy.empty((b, hkv, lk, d), dtype=cupy.int8)
    k_scale = cupy.empty((b, hkv, -(-lk // bn)), dtype=cupy.float32)
    fn = kernel.function("_quant_k_" + _SUFFIX[k.dtype.name])
    fn((-(-lk // bn), hkv, b), (QUANT_THREADS,), (k, *_strides(k), np.int32(lk), k_mean, k8, k_scale), stream=stream)
    return k8, k_scale, k_mean


def _quantize_q(kernel, q, k_mean, scale, hkv, with_shift, stream):
    import cupy

    b, hq, lq, d = q.shape
    bm = scale_blocks(kernel.spec)[0]
    if hq % hkv:
        raise ValueError(f"q: {hq} query heads is not a multiple of k's {hkv} kv heads (GQA needs Hq = g*Hkv)")
    q8 = cupy.empty((b, hq, lq, d), dtype=cupy.int8)
    q_scale = cupy.empty((b, hq, -(-lq // bm)), dtype=cupy.float32)
    shift = cupy.empty((b, hq, lq), dtype=cupy.float32) if with_shift else None
    mul = np.float32(scale * quant.LOG2E)  # as quant.fold_softmax_scale
    fn = kernel.function("_quant_q_" + _SUFFIX[q.dtype.name])
    fn((-(-lq // bm), hq, b), (QUANT_THREADS,),
       (q, *_strides(q), np.int32(lq), np.int32(hq // hkv), mul, k_mean, q8, q_scale,
        shift if with_shift else _null()), stream=stream)
    return q8, q_scale, shift


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


def _check_smooth_k(smooth_k) -> bool:
    if not isinstance(smooth_k, (bool, np.bool_)):
        raise ValueError(f"smooth_k: expected True or False, got {smooth_k!r}")
    return bool(smooth_k)


def quantize(q, k, v, *, format: str | None = None, scale: float | None = None, with_shift: bool = False,
             kernel=None, stream=None, smooth_k: bool = True) -> QuantizedQKV:
    """Quantize fp16 or bf16 q [B, Hq, Lq, D], k and v [B, Hkv, Lk, D] (any batch/head/sequence
    strides, channels contiguous) for an int8-QK kernel. Give format (its default kernel for the
    head dim is built) or kernel (its tile sets the scale blocks). with_shift keeps q̃·K̄, which
    attention_quantized needs to return the LSE. smooth_k=False skips K smoothing (K̄ = 0): K is
    quantized as given, as emulate's smooth_k=False does (to measure what smoothing buys)."""
    smooth_k = _check_smooth_k(smooth_k)
    if kernel is None:
        if format is None:
            raise ValueError("format: give format (e.g. 'i8-f8') or kernel")
        q_dev = as_device_array(q, "q")
        if q_dev.ndim != 4:
            raise ValueError(f"q: expected 4 dimensions [batch, heads, seq, head_dim], got shape {q_dev.shape}")
        kernel = _default_kernel(format, int(q_dev.shape[-1]))
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
    b, hq, hkv, lq, lk, d = check_shapes(q.shape, k.shape, v.shape)
    if d != spec.head_dim:
        raise ValueError(f"q: head_dim {d} does not match the kernel's {spec.head_dim} ({spec.name})")
    _grid_check(b, hq)
    scale = _check_scale(scale, d)
    with _on(q, stream):
        if spec.backend == "cuda":
            q8, q_scale, shift, k8, k_scale, k_mean, v_op, v_scale, v_out_scale = _quantize_fused(
                kernel, q, k, v, scale, with_shift, smooth_k, stream)
        else:
            k8, k_scale, k_mean = _quantize_k(kernel, k, stream, smooth_k)
            q8, q_scale, shift = _quantize_q(kernel, q, k_mean, scale, hkv, with_shift, stream)
            v_op, v_scale, v_out_scale = _quantize_v(kernel, v, stream)
    q_rows, k_keys = scale_blocks(spec)
    return QuantizedQKV(format=spec.recipe, dtype=q.dtype.name, dims=(b, hq, hkv, lq, lk, d),
                        block_m=q_rows, block_n=k_keys, scale=scale, q8=q8, q_scale=q_scale,
                        k8=k8, k_scale=k_scale, k_mean=k_mean, shift=shift, v=v_op, v_scale=v_scale,
                        v_out_scale=v_out_scale, smooth_k=smooth_k,
                        tile_keys=_tile_keys(spec))


# ---- attention on quantized operands ---------------------------------------------------------

def attention_quantized(kernel, qkv: QuantizedQKV, *, causal: bool | None = None, return_lse: bool = False,
                        out=None, stream=None):
    """softmax(q kᵀ·τ) v from quantized operands; returns out [B, Hq, Lq, D] in the input dtype
    (and the natural-log LSE [B, Hq, Lq] in fp32 when return_lse). kernel None builds the
    format's default kernel (causal as given); causal, when given, must match the kernel's."""
    import cupy

    if kernel is None:
        kernel = _default_kernel(qkv.format, qkv.dims[5], bool(causal))
    _check_kernel(kernel, qkv)
    spec = kernel.spec
    if causal is not None and bool(causal) != spec.causal:
        raise ValueError(f"causal: {causal} does not match the kernel {spec.name} (causal={spec.causal})")
    if return_lse and qkv.shift is None:
        raise ValueError("return_lse: the LSE needs q̃·K̄; quantize with with_shift=True")
    b, hq, hkv, lq, lk, d = qkv.dims
    _grid_check(b, hq)
    q8 = qkv.q8
    out_dtype = _out_dtype(qkv.dtype)
    if out is None:
        out_arr = cupy.empty((b, hq, lq, d), dtype=out_dtype)
    else:
        from .launch import _check_view

        out_arr = as_device_array(out, "out")
        if out_arr.shape != (b, hq, lq, d) or out_arr.dtype != out_dtype:
            raise ValueError(f"out: expected shape {(b, hq, lq, d)} and dtype {np.dtype(out_dtype).name}, "
                             f"got {out_arr.shape} {out_arr.dtype.name}")
        _check_view(out_arr, "out", out_arr.itemsize, 16)
    lse = cupy.empty((b, hq, lq), dtype=cupy.float32) if return_lse else None
    v = qkv.v
    v_bytes = [np.int64(s) for s in v.strides[:3]]
    args = (q8, qkv.k8, v, qkv.q_scale, qkv.k_scale, qkv.v_out_scale if qkv.v_out_scale is not None else _null(),
            out_arr, lse if return_lse else _null(), qkv.shift if (return_lse and qkv.shift is not None) else _null(),
            *v_bytes, *_strides(out_arr), np.int32(hq), np.int32(hq // hkv), np.int32(lq), np.int32(lk))
    grid = (-(-lq // spec.tile.block_m), hq, b)
    with _on(q8, stream):
        kernel.function("_" + _SUFFIX[qkv.dtype])(grid, (kernel.threads,), args, shared_mem=kernel.shared_bytes,
                                                   stream=stream)
    if return_lse:
        return out_arr, lse
    return out_arr


def _out_dtype(name: str):
    from .arrays import numpy_dtype

    return numpy_dtype(name)


def prefill_i8(kernel, q, k, v, *, scale: float | None = None, return_lse: bool = False, out=None, stream=None,
               smooth_k: bool = True):
    """The launcher of the int8-QK families (launch.LAUNCHERS["prefill_i8"]): quantize, then attend.
    smooth_k=False quantizes K without subtracting its mean (see quantize)."""
    example = q
    qkv = quantize(q, k, v, scale=scale, with_shift=return_lse, kernel=kernel, stream=stream, smooth_k=smooth_k)
    result = attention_quantized(kernel, qkv, return_lse=return_lse, out=out, stream=stream)
    if out is not None:
        return (out, like_input(result[1], example)) if return_lse else out
    if return_lse:
        return like_input(result[0], example), like_input(result[1], example)
    return like_input(result, example)
