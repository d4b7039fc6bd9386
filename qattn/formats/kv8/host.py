"""Attention over an int8 KV cache on the GPU (``kv8-f32``, ``kv8-split``, ``kv8-imma``; DESIGN §2):
the launcher of the kv8 kernel families and the choice of format.

``qattn.attention(q, cache, ...)`` with a ``KVCacheInt8`` (or ``format="kv8..."`` with float K/V,
which are written into a temporary cache first, as parity runs do) lands in ``attention_kv8``:

- ``format=None`` or ``"kv8"``: ``$QATTN_PREFILL_KV8`` (``imma``, ``split`` or ``f32``) when set,
  else the arch's default (``kv8-imma`` on sm_80 and later and on the HIP targets: every arch with a kv8 kernel);
- ``format="kv8-imma"`` etc.: that format, whatever the variable says.

With no ``tile=``, a call runs its spec's default tile (kv8-imma at d128 on sm_90a: three slots),
or where a kernel is listed for its query count, that one (``registry.launch_choice`` over ``recipes.LAUNCH_TILES``: on sm_90a
kv8-split at d128 runs 128-row blocks from 256 queries, and kv8-imma its wgmma kernel's 128-row
blocks from 256 queries at d128 and from 2048 at d64). Neither the tile nor the matrix unit changes
the arithmetic: with the same key block and splits the output bits are the same.

q is float32 [B, Hq, Lq, D] (D = 64 or 128), out float32, LSE float32 natural-log. The launches are
deterministic (no atomics): the same inputs give the same bytes on every run.

Split over keys (kv8-split, kv8-imma; flash-decoding style): when the plain grid, one block per
(query block, head, batch), would fill at most half the GPU's resident block slots, each query
block's key range is split over several blocks (``auto_splits``); each stores its unnormalized
output with its row max and sum in a workspace, and a merge kernel combines the splits in a fixed
order. ``splits=`` on the launcher (``kernel(q, cache, splits=n)``, ``attention_kv8(...,
splits=n)``) overrides the choice; ``splits=1`` is the plain kernel (no workspace, no merge).
kv8-f32, the fp32 baseline, does not split.

What each kernel computes is what ``emulate.emulate(fmt, q, cache.k, cache.v, **launch.emulator_options(spec))``
computes: with the kernel's key tile BN (64 for the CUDA tensor-core kernels, 32 for kv8-f32) and, for kv8-imma on
HIP, the split's low byte signed (``signed_low``, the digits AMD's signed-only int8 ops take): the same operand
splits and scales, the same exact integer sums, the fp32 operations in the same order (the
tensor-core fp16 accumulation of kv8-split and the exp2 of every kernel round differently).
The emulator runs the unsplit key loop only. With splits > 1 the kernel differs from it by what
the split changes in fp32, not by the format: each split's online softmax starts from its own
running max (so its p values and rescalings are rounded from other exponents), and the merge adds
a few roundings per row (2^(m_s - M) per split, one FMA per split into the sum and the output,
one division). The operands, scales and exact integer sums per key block are the same.
"""
from __future__ import annotations

import math
import numbers
import os

import numpy as np

from .recipes import MMA_FORMATS
from ...engine.family import HIP_ARCHS
from ...engine.arrays import as_device_array, on_device, signature
from ...engine.memory import CallMemory, lse_output
from .launch import Kv8Plan
from .cache import CODE_ALIGN, KVCacheInt8
from ...engine.packed import cached_plan, element_strides
from ...check.reference import check_shapes

KV8_FORMATS = ("kv8-f32", "kv8-split", "kv8-imma")
ENV_VAR = "QATTN_PREFILL_KV8"
ENV_CHOICES = {"imma": "kv8-imma", "split": "kv8-split", "f32": "kv8-f32"}
MAX_SPLITS = 256  # bounds a forced choice's workspace (splits x B·Hq·Lq·D floats); auto stays in one wave
# Each split pays a fixed cost (its Q operand, the pipeline fill, its partial store and the merge's
# read of it), about a key block or two of work: four key blocks per split keep that small.
MIN_KEY_BLOCKS_PER_SPLIT = 4


def default_format(arch: str | None = None) -> str:
    """The kv8 format an arch runs by default: kv8-imma on sm_80+ (int8 mma.sync) and on the HIP targets (int8
    MFMA / iu8 WMMA), else kv8-f32."""
    if arch is None:
        from ...engine.spec import device_arch

        arch = device_arch()
    if arch is None:
        raise ValueError("arch: no GPU found to pick a kv8 format for; name an arch")
    if arch in HIP_ARCHS:
        return "kv8-imma"
    if not arch.startswith("sm_"):
        raise ValueError(f"arch: expected a CUDA arch such as sm_90a or a HIP target ({', '.join(HIP_ARCHS)}), "
                         f"got {arch!r}")
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


def check_splits(splits, fmt: str) -> int | None:
    """splits as given to the launcher: None (the launcher picks) or an integer 1..MAX_SPLITS; the
    fp32 baseline kv8-f32 takes only 1."""
    if splits is None:
        return None
    if isinstance(splits, bool) or not isinstance(splits, numbers.Integral) or not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits: expected None (automatic) or an integer 1..{MAX_SPLITS}, got {splits!r}")
    if splits > 1 and fmt not in MMA_FORMATS:
        raise ValueError(f"splits: {fmt} (the fp32 baseline) does not split over keys; pass None or 1, got {splits}")
    return int(splits)


def auto_splits(blocks: int, key_blocks: int, sms: int, blocks_per_sm: int) -> int:
    """Splits of each query block's key range for a plain grid of `blocks` blocks (query blocks x
    heads x batch) whose longest key range is `key_blocks` key blocks, on `sms` SMs holding
    `blocks_per_sm` blocks each. As many as keep the split grid within one wave of resident blocks
    (a partial second wave would cost a whole split's time), so 1 whenever the plain grid fills
    more than half the slots; at most one per MIN_KEY_BLOCKS_PER_SPLIT key blocks."""
    one_wave = (sms * blocks_per_sm) // blocks
    worth_it = key_blocks // MIN_KEY_BLOCKS_PER_SPLIT
    return max(1, min(one_wave, worth_it, MAX_SPLITS))


def choose_splits(kernel, b: int, hq: int, lq: int, lk: int, device_id: int = 0) -> int:
    """The launcher's automatic choice for batch b, hq query heads, lq queries and lk keys on a
    device: auto_splits on its figures (1 for kv8-f32)."""
    if kernel.spec.recipe not in MMA_FORMATS:
        return 1
    blocks = math.ceil(lq / kernel.spec.tile.block_m) * hq * b
    return auto_splits(blocks, math.ceil(lk / kernel.spec.tile.block_n), *kernel.resident(device_id))


def prefill_kv8(kernel, q, k, v=None, *, scale: float | None = None, return_lse: bool = False, out=None, lse=None,
                stream=None, splits: int | None = None, workspace=None):
    """out = softmax(q kᵀ·scale) v over an int8 KV cache with one kv8 kernel; returns out or
    (out, lse). k: a KVCacheInt8 (v None), (codes, scales) pairs, or float K and V (quantized into
    a temporary cache). splits: blocks per query block over the key range (None: auto_splits).
    The launches are planned once per signature (kv8_launch.Kv8Plan): a repeated call checks only
    its code arrays' alignment, allocates what the caller did not give (memory.CallMemory: the split-K
    partials from workspace when given) and launches."""
    splits = check_splits(splits, kernel.spec.recipe)
    return_lse = return_lse or lse is not None
    example = q
    q = as_device_array(q, "q")
    memory = CallMemory(example, stream, workspace, q.data.device_id)
    if memory.capturing and not isinstance(k, (KVCacheInt8, tuple)):
        raise ValueError("k: float K and V are quantized into a new cache on every call, which a CUDA graph capture "
                         "cannot allocate; build a qattn.KVCacheInt8 before the capture and pass it")
    cache = as_cache(k, v)
    out_given = None if out is None else as_device_array(out, "out")
    scale = None if scale is None else float(scale)
    # The whole code and scale arrays (their first Lk tokens are the cache's views, same pointers and
    # strides): slicing views on every call costs more host time than the small kernels take.
    arrays = kc, ks, vc, vs = cache.k_codes, cache.k_scales, cache.v_codes, cache.v_scales
    key = ("kv8", signature(q), cache.length, *map(signature, arrays),
           None if out_given is None else signature(out_given), scale, bool(return_lse), splits)
    plan = cached_plan(kernel, key, lambda: _plan(kernel, q, cache, out_given, scale, return_lse, splits))
    if kc.data.ptr % CODE_ALIGN or vc.data.ptr % CODE_ALIGN:
        raise ValueError(f"k: cache code arrays must be {CODE_ALIGN}-byte aligned")
    lse_output(lse, plan.lse_shape)
    with on_device(q, stream):
        out_arr, out_result = memory.output(out, q.shape, "float32", "out", out_given)
        lse_arr, lse_result = memory.output(lse, plan.lse_shape, "float32", "lse") if return_lse else (None, None)
        partials = memory.scratch(plan.nbytes)
        pointers = {"q": q.data.ptr, "kc": kc.data.ptr, "ks": ks.data.ptr, "vc": vc.data.ptr, "vs": vs.data.ptr,
                    "out": out_arr.data.ptr, "lse": lse_arr.data.ptr if lse_arr is not None else 0,
                    "ws": partials.ptr if partials is not None else 0}
        plan.launch(pointers, memory.stream_ptr)
    return (out_result, lse_result) if return_lse else out_result


def _plan(kernel, q, cache, out, scale, return_lse, splits) -> Kv8Plan:
    """The full checks of a call signature, then its launches."""
    import cupy

    spec = kernel.spec
    if q.dtype != cupy.float32:
        raise TypeError(f"q: format {spec.recipe!r} takes float32 queries, got {q.dtype.name}")
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
    if out is None:
        out_strides = tuple(int(np.prod(q.shape[i + 1:])) * 4 for i in range(4))  # a new C-order array
    else:
        if out.shape != q.shape or out.dtype != cupy.float32:
            raise ValueError(f"out: expected shape {q.shape} and dtype float32, got {out.shape} {out.dtype.name}")
        if out.strides[-1] != 4:
            raise ValueError(f"out: the head_dim axis must be contiguous, got strides {out.strides}")
        if out.device.id != q.device.id:
            raise ValueError(f"out: on device {out.device.id}, but q is on device {q.device.id}")
        out_strides = out.strides
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale: expected a positive finite number, got {scale}")
    n = splits if splits is not None else choose_splits(kernel, b, hq, lq, lk, q.device.id)
    strides = (element_strides(q.strides, 4), element_strides(cache.k_codes.strides, 1),
               element_strides(cache.k_scales.strides, 4), element_strides(cache.v_codes.strides, 1),
               element_strides(cache.v_scales.strides, 4), element_strides(out_strides, 4))
    return Kv8Plan(kernel, (b, hq, hkv, lq, lk, d), strides, return_lse, scale * math.log2(math.e), n)


def attention_kv8(q, k, v=None, *, format: str | None = None, causal: bool = False, scale: float | None = None,
                  return_lse: bool = False, out=None, lse=None, tile=None, splits: int | None = None, stream=None,
                  workspace=None):
    """qattn.attention for an int8 KV cache (see the module docstring for how the format is chosen and
    for splits)."""
    from ...engine.kernel import build_kernel
    from ...engine.spec import call_spec, device_arch
    from ...engine.tile import Tile

    q_dev = as_device_array(q, "q")
    if q_dev.ndim != 4:
        raise ValueError(f"q: expected 4 dimensions [batch, heads, seq, head_dim], got shape {q_dev.shape}")
    with q_dev.device:
        arch = device_arch()
    fmt = resolve_format(format, arch)
    if isinstance(tile, (tuple, list)):
        tile = Tile(*tile)
    spec = call_spec(fmt, int(q_dev.shape[-1]), causal, int(q_dev.shape[2]), arch, tile)
    return build_kernel(spec)(q, k, v, scale=scale, return_lse=return_lse, out=out, lse=lse, splits=splits,
                              stream=stream, workspace=workspace)
