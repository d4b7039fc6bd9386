"""The public entry points: attention() picks or builds the right kernel and runs it; build()
turns a spec description into a Kernel."""
from __future__ import annotations

from ..codegen.recipes import RECIPES, recipe
from ..codegen.spec import KernelSpec, device_arch
from ..codegen.tile import Tile
from .arrays import as_device_array
from .kernel import Kernel, build_kernel

# attention()'s kernels by (format, head_dim, causal, tile, device): a repeated call looks its kernel
# up instead of building and validating a KernelSpec (microseconds of host time before the GPU starts).
_CALL_KERNELS: dict[tuple, Kernel] = {}


def _spec_from(kind: str, fields: dict) -> KernelSpec:
    fields = dict(fields)
    if "format" in fields:
        if "recipe" in fields:
            raise ValueError("format: give format or recipe, not both")
        fields["recipe"] = fields.pop("format")
    tile = fields.get("tile")
    if isinstance(tile, (tuple, list)):
        fields["tile"] = Tile(*tile)
    return KernelSpec(kind=kind, **fields)


def build(kind: str = "prefill", **spec) -> Kernel:
    """Build (or fetch from the cache) one kernel: build("prefill", format="f16", head_dim=128,
    causal=True, tile=(128, 64, 8, 2), arch="sm_90a"). The arch defaults to the current GPU's."""
    return build_kernel(_spec_from(kind, spec))


def default_spec(format: str, head_dim: int, *, causal: bool = False, arch: str | None = None) -> KernelSpec:
    rec = recipe(format)
    if "cuda" not in rec.families:
        raise ValueError(f"format {format!r} has no CUDA kernel yet; its CPU emulator is "
                         f"qattn.runtime.emulate.emulate({format!r}, ...)")
    return KernelSpec(kind="prefill", recipe=format, head_dim=head_dim, causal=causal,
                      arch=arch or device_arch())


def _check_smooth_k(format: str | None, k) -> None:
    """smooth_k is an option of the int8-QK formats only."""
    from .kvcache import KVCacheInt8

    name = "f16" if format is None else format
    if isinstance(k, KVCacheInt8) or name.startswith("kv8") or not any(
            fam.launcher == "prefill_i8" for fam in recipe(name).families.values()):
        raise ValueError(f"smooth_k: format {name!r} has no K smoothing; only the int8-QK formats "
                         f"(i8-f16, i8-i8, i8-f8) take it")


def attention(q, k, v=None, *, format: str | None = None, causal: bool = False, scale: float | None = None,
              return_lse: bool = False, out=None, tile: Tile | None = None, smooth_k: bool | None = None):
    """softmax(q kᵀ·scale) v on the GPU in the given format (default "f16"). q [B, Hq, Lq, D], k and v
    [B, Hkv, Lk, D] (any strides on batch, head and sequence; D contiguous), Hq a multiple of
    Hkv; causal masks are bottom-right aligned. Returns out (and the natural-log LSE [B, Hq, Lq]
    in fp32 when return_lse). With an int8 KV cache, attention(q, cache, ...) (a qattn.KVCacheInt8)
    runs a kv8 format: see runtime/kv8.py for how it is chosen (format=, $QATTN_PREFILL_KV8).
    smooth_k (int8-QK formats only, default True): False quantizes K without subtracting its mean."""
    from .kvcache import KVCacheInt8

    options = {}
    if smooth_k is not None:
        _check_smooth_k(format, k)
        options["smooth_k"] = smooth_k

    if isinstance(k, KVCacheInt8) or (format is not None and format.startswith("kv8")):
        from .kv8 import attention_kv8

        return attention_kv8(q, k, v, format=format, causal=causal, scale=scale, return_lse=return_lse, out=out,
                             tile=tile)
    if v is None:
        raise ValueError("v: expected V [B, Hkv, Lk, D] (or pass a qattn.KVCacheInt8 as k)")
    format = "f16" if format is None else format
    q_dev = as_device_array(q, "q")
    if q_dev.ndim != 4:
        raise ValueError(f"q: expected 4 dimensions [batch, heads, seq, head_dim], got shape {q_dev.shape}")
    return _call_kernel(format, q_dev, causal, tile)(q, k, v, scale=scale, return_lse=return_lse, out=out, **options)


def _call_kernel(format: str, q, causal, tile) -> Kernel:
    try:
        # causal=1 is refused, not taken for True; a recipe re-registered under the name is looked up anew
        key = (format, id(RECIPES.get(format)), q.shape[-1], causal, type(causal), tile, q.data.device_id)
        kernel = _CALL_KERNELS.get(key)
    except TypeError:  # an unhashable argument: the spec's validation names it
        kernel, key = None, None
    if kernel is None:
        with q.device:
            spec = default_spec(format, int(q.shape[-1]), causal=causal)
            kernel = build_kernel(spec if tile is None else spec.with_(tile=tile))
        if key is not None:
            _CALL_KERNELS[key] = kernel
    return kernel
