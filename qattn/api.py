"""The public entry points: attention() routes a call to its format's family (through the registry)
or builds the format's kernel and runs it; build() turns a spec description into a Kernel."""
from __future__ import annotations

from .engine import registry
from .engine.arrays import as_device_array
from .engine.kernel import Kernel, build_kernel
from .engine.shape_class import ShapeClass
from .engine.spec import KernelSpec, builtin_spec, call_spec, default_spec, device_arch
from .engine.tile import Tile

# The format a call without format= runs, by the queries' dtype.
DEFAULT_FORMATS = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}


def default_format(dtype_name: str) -> str:
    """The format of a call without format=: f16, bf16 or f32 by the queries' dtype (f16 for any
    other dtype, whose kernel then names the dtypes it takes)."""
    return DEFAULT_FORMATS.get(dtype_name, "f16")


_UNSET = object()  # an option the caller did not give

# attention()'s kernels by (format, head_dim, causal, tile, device, shape class, launch band): a repeated
# call looks its kernel up instead of building and validating a KernelSpec (microseconds of host time
# before the GPU starts).
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


def build(kind: str = "prefill", *, queries: int | None = None, heads: int | None = None, **spec) -> Kernel:
    """Build (or fetch from the cache) one kernel: build("prefill", format="f16", head_dim=128,
    causal=True, tile=(128, 64, 8, 2), arch="sm_90a"). The arch defaults to the current GPU's. With
    queries (prefill, no tile, mma or options named), the kernel listed for attention() calls of that many
    query rows per sequence (on sm_90a it depends on them), over `heads` sequence-heads (batch x query heads;
    default: many): what they run where `qattn tune` stored none."""
    if heads is not None and queries is None:
        raise ValueError("heads: give queries too (the kernel a call runs depends on its rows first)")
    if queries is None:
        return build_kernel(_spec_from(kind, spec))
    for name, value in (("queries", queries), ("heads", heads)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    if kind != "prefill":
        raise ValueError(f"queries: {kind} kernels do not depend on a call's query rows (a decode call's QK path does)")
    named = [name for name in ("tile", "mma", "options") if spec.get(name) is not None]
    if named:
        raise ValueError(f"queries: the kernel is named by {', '.join(named)}; give one or the other")
    base = _spec_from(kind, spec)  # validates the rest and settles the arch
    return build_kernel(builtin_spec(base.recipe, base.head_dim, base.causal, queries, base.arch, heads))


def _check_options(options: dict, format: str | None, k) -> None:
    """Options such as smoothing belong to some formats' families only (FormatFamily.options)."""
    name = "f16" if format is None else format
    family = registry.family_for_cache(k) or registry.family_of(name)
    for option in options:
        if option not in family.options:
            takers = registry.formats_with_option(option)
            raise ValueError(f"{option}: format {name!r} does not take it; only {', '.join(takers)} do")


def attention(q, k, v=None, *, format: str | None = None, causal: bool = False, scale: float | None = None,
              return_lse: bool = False, out=None, lse=None, tile: Tile | None = None, smoothing=_UNSET,
              smooth_k: bool | None = None, workspace=None, stream=None):
    """softmax(q kᵀ·scale) v on the GPU in the given format (default: f16, bf16 or f32 by q's dtype,
    see default_format). q [B, Hq, Lq, D], k and v
    [B, Hkv, Lk, D] (any strides on batch, head and sequence; D contiguous), Hq a multiple of
    Hkv; causal masks are bottom-right aligned. Returns out (and the natural-log LSE [B, Hq, Lq]
    in fp32 when return_lse). With an int8 KV cache, attention(q, cache, ...) (a qattn.KVCacheInt8)
    runs a kv8 format: see qattn/formats/kv8/host.py for how it is chosen (format=, $QATTN_PREFILL_KV8).
    smoothing (int8-QK formats only): "mean" (default) subtracts K's channel mean before quantizing it;
    "mean+balance" also balances Q's and K's channels (q·α, K̃/α: exact, for scale-type K outliers);
    None quantizes K as given. smooth_k: its deprecated alias (True: "mean", False: None).
    lse: an fp32 [B, Hq, Lq] array to write the LSE to (implies return_lse). workspace: a
    qattn.Workspace for the call's temporaries (quantized operands, split-K partials). stream: where
    to launch (a CuPy or torch stream, or a pointer); default: the current stream of q's array type.
    Every path can be captured in a CUDA graph (after one call outside the capture): torch callers
    as they are, CuPy callers with out= (and lse=) and workspace= (see engine/memory.py)."""
    options = {} if smoothing is _UNSET else {"smoothing": smoothing}
    if smooth_k is not None:
        options["smooth_k"] = smooth_k
    _check_options(options, format, k)
    family = registry.family_for_cache(k) or (registry.family_of(format) if format is not None else None)
    if family is not None and family.call is not None:
        return family.call(q, k, v, format=format, causal=causal, scale=scale, return_lse=return_lse, out=out,
                           lse=lse, tile=tile, workspace=workspace, stream=stream, **options)
    if v is None:
        raise ValueError("v: expected V [B, Hkv, Lk, D] (or pass a qattn.KVCacheInt8 as k)")
    q_dev = as_device_array(q, "q")
    if q_dev.ndim != 4:
        raise ValueError(f"q: expected 4 dimensions [batch, heads, seq, head_dim], got shape {q_dev.shape}")
    format = default_format(q_dev.dtype.name) if format is None else format
    return _call_kernel(format, q_dev, k, causal, tile)(q, k, v, scale=scale, return_lse=return_lse, out=out, lse=lse,
                                                     workspace=workspace, stream=stream, **options)


def _shape_class(q, k) -> ShapeClass | None:
    """The call's shape class, which picks a tile `qattn tune` stored for it (None for malformed
    shapes, which the launcher's checks then name)."""
    k_shape = tuple(getattr(k, "shape", ()))
    if len(k_shape) != 4 or min(q.shape[:3]) < 1 or min(k_shape[1:3]) < 1 or q.shape[1] % k_shape[1]:
        return None
    return ShapeClass.of(int(q.shape[2]), int(k_shape[2]), int(q.shape[1]), int(k_shape[1]), batch=int(q.shape[0]))


def _launch_band(format: str, q, causal) -> tuple | None:
    """Which of the format's listed kernels (registry.launch_choice) a call's rows and sequence-heads reach."""
    try:
        return registry.launch_band(format, int(q.shape[-1]), _queries(q), bool(causal), _heads(q))
    except (KeyError, ValueError, TypeError):  # an unknown format: the spec's checks name it
        return None


def _queries(q) -> int:
    """Query rows per sequence of q [B, H, Lq, D] (0 for another rank, which the launcher's checks name)."""
    return int(q.shape[2]) if len(q.shape) == 4 else 0


def _heads(q) -> int:
    """Sequence-heads (batch x query heads) of q [B, H, Lq, D] (0 for another rank)."""
    return int(q.shape[0]) * int(q.shape[1]) if len(q.shape) == 4 else 0


def _call_kernel(format: str, q, k, causal, tile) -> Kernel:
    shape = _shape_class(q, k)
    try:
        # causal=1 is refused, not taken for True; a recipe re-registered under the name is looked up anew
        key = (format, id(registry.RECIPES.get(format)), q.shape[-1], causal, type(causal), tile, q.data.device_id,
               shape, _launch_band(format, q, causal))
        kernel = _CALL_KERNELS.get(key)
    except TypeError:  # an unhashable argument: the spec's validation names it
        kernel, key = None, None
    if kernel is None:
        with q.device:
            spec = call_spec(format, int(q.shape[-1]), causal, _queries(q), device_arch(), tile, shape=shape,
                             heads=_heads(q))
            kernel = build_kernel(spec)
        if key is not None:
            _CALL_KERNELS[key] = kernel
    return kernel
