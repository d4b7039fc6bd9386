"""The parity job (`qattn parity`, `tools/parity`): run each format on fresh random inputs, on its
GPU kernel or its CPU emulator, compare with FP64 and time the kernel (DESIGN §3, §4).

Each check yields one flat record (a dict, JSON-ready apart from non-finite floats). A GPU result
is only ever reported for a kernel that ran on a GPU: without one, `auto` runs the emulators and
the record says backend "numpy" with ms and tflops None.
"""
from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

from ..bench.timing import attention_flops, time_cuda
from .. import data
from ..engine import registry
from ..engine.arrays import numpy_dtype
from ..engine.registry import RECIPES, recipe
from ..engine.spec import call_spec, default_spec, device_arch
from . import metrics
from .captured import Captured, data_name
from .emulate import emulate
from .reference import attention as reference_attention

BACKENDS = ("auto", "cuda", "numpy")
KIND_SHAPES = {  # (ctx, queries) of the kinds other than prefill: cached tokens, new tokens per sequence
    "decode": {"cuda": ((4096, 1), (2100, 4), (32768, 1)), "numpy": ((1024, 1), (1500, 4), (333, 16))},
}
# The default set: every format with a CUDA kernel (all of them run on their emulators without a GPU).
DEFAULT_FORMATS = tuple(name for name, rec in RECIPES.items() if "cuda" in rec.families)
# (ctx, queries). The GPU set is large enough to fill an H200 for a meaningful time; the CPU set
# keeps a default emulator run to seconds. Both have tails and Lq != Lk.
DEFAULT_SHAPES = {
    "cuda": ((4096, 4096), (2100, 1500), (4097, 129)),
    "numpy": ((1024, 1024), (1500, 500), (4097, 129)),
}


def has_cuda_kernel(fmt: str, kind: str = "prefill") -> bool:
    return "cuda" in recipe(fmt, kind).families


def resolve_backend(fmt: str, backend: str, gpu: bool, kind: str = "prefill") -> str:
    """Which backend runs fmt: `auto` means the CUDA kernel when there is a GPU and a kernel."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "cuda":
        if not has_cuda_kernel(fmt, kind):
            raise ValueError(f"format {fmt!r}: no CUDA kernel yet; run its CPU emulator with backend 'numpy'")
        if not gpu:
            raise ValueError("backend 'cuda': no CUDA GPU found; use backend 'numpy' (or 'auto') for the CPU emulators")
        return "cuda"
    if backend == "auto":
        return "cuda" if gpu and has_cuda_kernel(fmt, kind) else "numpy"
    return "numpy"


_UNSET = object()  # a call option not given: the call's own default


def make_inputs(fmt: str, shapes: tuple, seed, source: str | Captured | None = None
                ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """q, k, v in the format's input dtype, fresh N(0,1), a qattn.data preset's (source: its name) or a window of
    captured ones (a Captured), and the float64 arrays the FP64 reference sees: the same rounded values, or for
    formats over a cache (kv8) K and V read back from it."""
    rng = np.random.default_rng(seed)
    dtype = numpy_dtype(recipe(fmt).input_dtypes[0])
    (batch, heads, queries, head_dim), (_, kv_heads, ctx, _) = shapes[:2]
    if source is None:
        given = [rng.standard_normal(shape, dtype=np.float32).astype(dtype) for shape in shapes]
    elif isinstance(source, Captured):
        given = [x.astype(dtype) for x in source.window(ctx, queries)]
    else:
        x = data.preset(source, ctx=ctx, queries=queries, batch=batch, heads=heads, kv_heads=kv_heads,
                        head_dim=head_dim, seed=int(rng.integers(2 ** 31)))
        given = [x[name].astype(dtype) for name in "qkv"]
    exact = [x.astype(np.float64) for x in given]
    to_cache = registry.family_of(fmt).kv_cache
    if to_cache is not None:  # the kernel and emulator quantize K and V the same way
        exact[1:] = [to_cache(x, name).dequantize() for x, name in zip(given[1:], "kv")]
    return given, exact


def cuda_spec(entry: str, head_dim: int, causal: bool, queries: int, heads: int | None = None):
    """The kernel a call of `queries` rows over `heads` sequence-heads runs for entry, a format or FORMAT@UNIT (the
    format on another matrix unit of the arch, its default tile and options there)."""
    fmt, _, unit = entry.partition("@")
    spec = default_spec(fmt, head_dim, causal=causal)
    if unit:
        return spec.with_(mma=unit, tile=None, options={})
    return call_spec(fmt, head_dim, causal, queries, spec.arch, heads=heads)  # the kernel such a call runs


def _run_cuda(entry, q, k, v, *, head_dim, causal, time_it, **options):
    """Launch the kernel a call of the format runs (with the family's call options, e.g. smoothing) into a
    NaN-poisoned output; return (out, ms, spec name)."""
    import cupy

    from ..engine.kernel import build_kernel

    fmt = entry.partition("@")[0]
    kernel = build_kernel(cuda_spec(entry, head_dim, causal, q.shape[2], q.shape[0] * q.shape[1]))
    q, k, v = (cupy.asarray(x) for x in (q, k, v))
    kernel_inputs = registry.family_of(fmt).kernel_inputs  # a cache is written once: attention alone is timed
    kv = kernel_inputs(k, v) if kernel_inputs is not None else (k, v)
    out = cupy.full(q.shape, float("nan"), dtype=q.dtype)  # any element left unwritten stays NaN
    kernel(q, *kv, out=out, **options)
    result = cupy.asnumpy(out)
    ms = time_cuda(lambda: kernel(q, *kv, out=out, **options)).median_ms if time_it else None
    return result, ms, kernel.name


def _emulator_block_n(fmt: str, head_dim: int) -> int:
    """Model the key tile of the format's CUDA kernel where it has one (the summation order)."""
    family = recipe(fmt).families.get("cuda")
    if family is not None and head_dim in family.default_tiles:
        return family.default_tiles[head_dim].block_n
    return 64


def check(entry: str, ctx: int, queries: int, *, backend: str, batch: int = 1, heads: int = 8,
          kv_heads: int | None = None, head_dim: int = 128, causal: bool = False, seed: int = 0,
          time_it: bool = True, source: str | Captured | None = None, smoothing=_UNSET) -> dict:
    """One parity check of a format (or FORMAT@UNIT, cuda only) on a resolved backend ("cuda" or
    "numpy"), on N(0,1) inputs, a qattn.data preset's (source: its name) or captured ones (a Captured, whose
    dimensions replace batch, heads, kv_heads and head_dim); smoothing (int8-QK formats: "mean", "mean+balance" or
    None; the call's default where not given) goes to the kernel's call and the emulator alike; returns its
    record."""
    fmt = entry.partition("@")[0]
    options = {} if smoothing is _UNSET or "smoothing" not in registry.family_of(fmt).options else {"smoothing": smoothing}
    if isinstance(source, Captured):
        batch, heads, kv_heads, head_dim = (source.dims[n] for n in ("batch", "heads", "kv_heads", "head_dim"))
    kv_heads = heads if kv_heads is None else kv_heads
    tol = recipe(fmt).tolerance
    shapes = ((batch, heads, queries, head_dim), (batch, kv_heads, ctx, head_dim), (batch, kv_heads, ctx, head_dim))
    # Same seed for the same shape in every format: formats are compared on the same draws.
    (q, k, v), (q64, k64, v64) = make_inputs(fmt, shapes, np.random.SeedSequence([seed, ctx, queries]), source)
    ref = reference_attention(q64, k64, v64, causal=causal)
    if backend == "cuda":
        out, ms, kernel_name = _run_cuda(entry, q, k, v, head_dim=head_dim, causal=causal, time_it=time_it, **options)
    else:
        out = emulate(fmt, q, k, v, causal=causal, block_n=_emulator_block_n(fmt, head_dim), **options)
        ms, kernel_name = None, None
    err = metrics.compare(out, ref)
    flops = attention_flops(batch, heads, queries, ctx, head_dim, causal)
    return {
        "format": entry, "ctx": ctx, "queries": queries, "batch": batch, "heads": heads, "kv_heads": kv_heads,
        "head_dim": head_dim, "causal": causal, "backend": backend, "kernel": kernel_name,
        "input_dtype": recipe(fmt).input_dtypes[0], "seed": seed, "data": data_name(source), **options,
        "max_rel": err.max_rel, "rel_l2": err.rel_l2, "cos": err.cos, "nonfinite": err.nonfinite,
        "worst_index": list(err.worst_index), "failures": metrics.failures(out, ref, tol.max_rel),
        "tolerance": {"max_rel": tol.max_rel, "rel_l2": tol.rel_l2},
        "ms": ms, "tflops": flops / (ms * 1e-3) / 1e12 if ms else None,
        "passed": bool(err.nonfinite == 0 and err.max_rel <= tol.max_rel and err.rel_l2 <= tol.rel_l2),
    }


def plan(formats: Iterable[str], shapes: Iterable[tuple[int, int]] | None, *, backend: str = "auto",
         head_dim: int = 128, causal: bool = False, gpu: bool | None = None,
         kind: str = "prefill") -> list[tuple[str, str, int, int]]:
    """Validate everything up front, before any check runs, and list the checks as (format,
    backend, ctx, queries); a format may be FORMAT@UNIT (its CUDA kernel on another matrix unit).
    shapes None (or empty) picks each backend's default shapes."""
    gpu = device_arch() is not None if gpu is None else gpu
    shapes = list(shapes or ())
    for ctx, queries in shapes:
        if ctx < 1 or queries < 1:
            raise ValueError(f"shape: ctx and queries must be >= 1, got {ctx}/{queries}")
    checks = []
    if kind != "prefill":
        for fmt in formats or registry.recipes(kind):
            if "@" in fmt:
                raise ValueError(f"format {fmt!r}: {kind} formats have one matrix unit per arch")
            recipe(fmt, kind)  # an unknown format raises, naming the known ones
            ran = resolve_backend(fmt, backend, gpu, kind)
            checks += [(fmt, ran, ctx, queries) for ctx, queries in shapes or KIND_SHAPES[kind][ran]]
        return checks
    for entry in formats or DEFAULT_FORMATS:
        fmt, _, unit = entry.partition("@")
        recipe(fmt)  # an unknown format raises, naming the known ones
        ran = resolve_backend(fmt, backend, gpu)
        if unit and ran != "cuda":
            raise ValueError(f"format {entry!r}: a matrix unit names a CUDA kernel, which needs a GPU; the CPU "
                             f"emulator of {fmt!r} is the same for every unit")
        if ran == "cuda":
            cuda_spec(entry, head_dim, causal, 1)  # raises if no kernel fits this head_dim (or unit)
        checks += [(entry, ran, ctx, queries) for ctx, queries in shapes or DEFAULT_SHAPES[ran]]
    return checks


def run_parity(formats: Iterable[str], shapes: Iterable[tuple[int, int]] | None, *, batch: int = 1,
               heads: int = 8, kv_heads: int | None = None, head_dim: int = 128, causal: bool = False,
               backend: str = "auto", seed: int = 0, time_it: bool = True,
               progress: Callable[[dict], None] | None = None, kind: str = "prefill", **options) -> list[dict]:
    """Check every format on every shape (ctx, queries) against FP64; one record per check.
    progress, if given, is called with each record as it completes. Prefill checks take two options: source (a
    qattn.data preset's name or a Captured, instead of N(0,1): see check) and smoothing (the int8-QK formats');
    kinds other than prefill run their family's check
    (FormatFamily.parity) with the options of that kind (decode: page_size, scale, preset, ...)."""
    kv_heads = heads if kv_heads is None else kv_heads
    if batch < 1 or heads < 1 or kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"heads: batch, heads and kv_heads must be >= 1 with heads a multiple of kv_heads, "
                         f"got batch {batch}, heads {heads}, kv_heads {kv_heads}")
    if head_dim < 1:
        raise ValueError(f"head_dim: expected a positive integer, got {head_dim}")
    records = []
    source = options.pop("source", None) if kind == "prefill" else None
    smoothing = options.pop("smoothing", _UNSET) if kind == "prefill" else _UNSET
    if options and kind == "prefill":
        raise ValueError(f"options: prefill checks take only source and smoothing, got {', '.join(options)}")
    if isinstance(source, str) and source not in data.PRESETS:
        raise ValueError(f"source: unknown preset {source!r}; expected one of {sorted(data.PRESETS)}")
    for fmt, ran, ctx, queries in plan(list(formats), shapes, backend=backend, head_dim=head_dim, causal=causal,
                                       kind=kind):
        if kind == "prefill":
            record = check(fmt, ctx, queries, backend=ran, batch=batch, heads=heads, kv_heads=kv_heads,
                           head_dim=head_dim, causal=causal, seed=seed, time_it=time_it, source=source,
                           smoothing=smoothing)
        else:
            record = registry.family_of(fmt, kind).parity(fmt, ctx, queries, backend=ran, batch=batch, heads=heads,
                                                           kv_heads=kv_heads, head_dim=head_dim, seed=seed,
                                                           time_it=time_it, **options)
        records.append(record)
        if progress is not None:
            progress(record)
    return records
