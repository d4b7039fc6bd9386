"""The prefill benchmark: qattn kernels and the peers on the same inputs in the same run, timed in
interleaved rounds, with each one's rel_l2 against FP64 (DESIGN §4); and rel_l2 against FP64 on the
qattn.data presets and captured tensors (bench.sources)."""
from __future__ import annotations

from .peers import PEERS, peer
from .sources import SOURCES, inputs
from .timing import attention_flops, time_cuda, time_interleaved, time_sustained, with_ratios


_CHECK_HEADS = 2  # heads of batch 0 whose output is compared with FP64 (all rows)


def fp64_slice(q, k, v, causal):
    """FP64 attention (on the GPU) of the first _CHECK_HEADS query heads of batch 0 (with their kv
    heads under GQA): the accuracy yardstick every implementation in a run is measured against."""
    import cupy

    kv_heads = [h // (q.shape[1] // k.shape[1]) for h in range(min(_CHECK_HEADS, q.shape[1]))]
    qs = q[0, :_CHECK_HEADS].astype(cupy.float64)
    ks, vs = (x[0, kv_heads].astype(cupy.float64) for x in (k, v))
    s = qs @ ks.swapaxes(-1, -2) / float(q.shape[-1]) ** 0.5
    if causal:
        lq, lk = s.shape[-2:]
        s = cupy.where(cupy.arange(lk)[None, :] <= cupy.arange(lq)[:, None] + (lk - lq), s, -cupy.inf)
    p = cupy.exp(s - s.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ vs


def _rel_l2(out, ref) -> float:
    import cupy

    o = cupy.asarray(out)[0, :_CHECK_HEADS].astype(cupy.float64)
    return float(cupy.linalg.norm(o - ref) / cupy.linalg.norm(ref))


def bench_prefill(shapes, formats=("f16",), *, head_dim=128, causal=False, peers=PEERS, seed=0,
                  tiles=None, rounds: int = 3, sustained: float | None = None, settle: float = 0.0,
                  smoothings=()) -> list[dict]:
    """Time qattn prefill kernels and peers on the same inputs in the same run.
    shapes: iterable of (batch, heads, seq) with Lq = Lk = seq; formats: names, or "name@unit" for
    the format on another matrix unit of the arch (e.g. "i8-f8@wgmma"). Returns one record per
    (shape, implementation) with median ms, TFLOPS, the ratio to each peer and rel_l2 against
    FP64 on the first heads (a GPU FP64 reference of the same inputs). smoothings: the int8-QK
    formats run (and are timed) once under each (call_variants); the int8-QK calls' records also
    hold quant_ms, the time of their quantization alone.
    The implementations of a shape are timed in `rounds` interleaved rounds (each round times every
    one in turn) and each reports the median of its round medians, so that clock and power drift
    over the run, which on a power-bound GPU favours whoever runs first or last, is shared by all.
    sustained (seconds): time each implementation in each round over that long a back-to-back
    stretch (time_sustained) instead of a median of single calls. settle (seconds): an idle pause
    before each implementation's timing (time_interleaved), which makes single-call times those of
    a GPU at its idle clock rather than in the wake of the implementation timed before."""
    if sustained is not None and not sustained > 0:
        raise ValueError(f"sustained: expected a positive number of seconds, got {sustained}")
    if not settle >= 0:
        raise ValueError(f"settle: expected a non-negative number of seconds, got {settle}")
    import cupy

    from ..engine.kernel import build_kernel
    from ..engine.spec import call_spec, device_arch

    records = []
    rng = cupy.random.default_rng(seed)
    for batch, heads, seq in shapes:
        flops = attention_flops(batch, heads, seq, seq, head_dim, causal)
        shape_rec = {"batch": batch, "heads": heads, "seq": seq, "head_dim": head_dim, "causal": causal}
        q, k, v = (rng.standard_normal((batch, heads, seq, head_dim), dtype=cupy.float32).astype(cupy.float16)
                   for _ in range(3))
        ref = fp64_slice(q, k, v, causal)
        timed = []  # (record, callable to time)
        torch_inputs = None
        for name in peers:
            fn = peer(name)
            if fn is None:
                continue
            torch_inputs = torch_inputs or torch_copies(q, k, v)
            try:
                out = fn(*torch_inputs, causal)
            except Exception as exc:  # backend unavailable for this shape/GPU
                records.append(dict(shape_rec, impl=name, error=str(exc).splitlines()[0]))
                continue
            timed.append((dict(shape_rec, impl=name, rel_l2=_rel_l2(out, ref)),
                          lambda fn=fn: fn(*torch_inputs, causal)))
        for entry in formats:
            fmt, mma, entry_options, entry_tile = kernel_entry(entry)
            try:  # the kernel qattn.attention runs for these rows (or the one on the named unit)
                spec = call_spec(fmt, head_dim, causal, seq, device_arch(), mma=mma, heads=batch * heads)
                if entry_options:
                    spec = spec.with_(options={**dict(spec.options), **entry_options})
            except ValueError as exc:  # this arch does not build the format on that unit, or that option
                records.append(dict(shape_rec, impl=f"qattn:{entry}", error=str(exc)))
                continue
            if entry_tile is not None:
                spec = spec.with_(tile=entry_tile)
            elif tiles:
                spec = spec.with_(tile=tiles[entry] if isinstance(tiles, dict) else tiles)
            kernel = build_kernel(spec)
            xs = format_inputs(fmt, q, k, v)
            for options in call_variants(fmt, smoothings):
                out = cupy.empty_like(xs[0])
                kernel(*xs, out=out, **options)
                rec = dict(shape_rec, impl=impl_name(entry, options), kernel=spec.name, **options,
                           rel_l2=_rel_l2(out, ref))
                timed.append((rec, lambda kernel=kernel, xs=xs, out=out, options=options:
                               kernel(*xs, out=out, **options)))
                if spec.family.launcher == "prefill_i8":  # the share of the call spent quantizing Q, K, V
                    from ..formats.int8qk import quantize

                    rec["quant_ms"] = time_cuda(lambda: quantize(*xs, kernel=kernel, **options)).median_ms
        timer = None if sustained is None else (lambda fn, _rounds: time_sustained(fn, sustained))
        per_round = time_interleaved([fn for _, fn in timed], rounds, timer, settle=settle)
        for rec in with_ratios(timed, per_round, PEERS):
            rec["tflops"] = flops / rec["ms"] / 1e9
            records.append(rec)
    return records


ACCURACY_PRESETS = ("normal", "outliers", "outliers_token", "bias", "rope")


def accuracy_against_fp64(sources=ACCURACY_PRESETS, contexts=(4096, 32768), formats=("i8-f8",), *, smoothings=(),
                          peers=PEERS, heads: int = 2, kv_heads: int | None = None, head_dim: int = 128,
                          max_queries: int = 4096, causal=(False, True), seed: int = 1) -> list[dict]:
    """rel_l2 against FP64 (on the GPU) of qattn formats and peers on the same fp16 inputs, drawn
    from bench.sources (the qattn.data presets at heads, kv_heads (default: heads) and head_dim;
    MiniLM's captured tensors at their own shape): one record per (source, context, causal,
    implementation), the int8-QK formats' once per smoothing (call_variants). The queries are the
    last min(ctx, max_queries) positions of the context (MiniLM's: its rows); causal rows only where
    Lq = Lk (torch's and SageAttention's causal masks align top-left where they differ, qattn's
    bottom-right). An implementation that fails on a shape gets a record with its error instead."""
    import cupy

    from ..api import attention

    for name in sources:
        if name not in SOURCES:
            raise ValueError(f"sources: unknown source {name!r}; expected names from {list(SOURCES)}")
    if max_queries < 1:
        raise ValueError(f"max_queries: expected a positive number of queries, got {max_queries}")
    peer_fns = {name: fn for name in peers if (fn := peer(name)) is not None}
    records = []
    for name in sources:
        for ctx in contexts:
            q, k, v = fp16_on_device(inputs(name, ctx=ctx, queries=min(ctx, max_queries), heads=heads,
                                            kv_heads=kv_heads, head_dim=head_dim, seed=seed))
            lq = q.shape[-2]
            for is_causal in causal:
                if is_causal and lq != ctx:
                    continue
                ref = fp64_slice(q, k, v, is_causal)
                base = {"source": name, "ctx": ctx, "queries": lq, "causal": is_causal, "heads": q.shape[1],
                        "kv_heads": k.shape[1], "head_dim": q.shape[-1]}
                for fmt in formats:
                    for options in call_variants(fmt, smoothings):
                        rec = dict(base, impl=impl_name(fmt, options), format=fmt, **options)
                        records.append(_measured(rec, ref, lambda: attention(
                            *format_inputs(fmt, q, k, v), format=fmt, causal=is_causal, **options)))
                for peer_name, fn in peer_fns.items():
                    records.append(_measured(dict(base, impl=peer_name), ref, lambda: cupy.from_dlpack(
                        fn(*torch_copies(q, k, v), is_causal).contiguous())))
    return records


def _measured(rec: dict, ref, run) -> dict:
    """rec with the rel_l2 against ref of run()'s output, or with the error run() raised."""
    try:
        rec["rel_l2"] = _rel_l2(run(), ref)
    except Exception as exc:  # a shape this GPU or implementation does not take
        rec["error"] = str(exc).splitlines()[0]
    return rec


# The least head dimension of every implementation the accuracy table compares (qattn's int8-QK
# kernels take 64 and 128, SageAttention 1.0.6 64, 96 and 128).
LEAST_HEAD_DIM = 64


def fp16_on_device(x: dict) -> tuple:
    """A source's q, k, v as fp16 CuPy arrays that every implementation takes at its default scale
    1/√D: a head dimension under LEAST_HEAD_DIM (MiniLM's 32) is padded with zero channels to it,
    which changes no score and no quantization scale (a zero channel's α is 1 and K̄ 0), and where
    the source has its own softmax scale, q is multiplied by scale·√D so that 1/√D applied to it is
    that scale."""
    import cupy
    import numpy as np

    q, k, v = (np.asarray(x[n], np.float32) for n in ("q", "k", "v"))
    pad = max(0, LEAST_HEAD_DIM - q.shape[-1])
    q, k, v = (np.pad(t, [(0, 0)] * (t.ndim - 1) + [(0, pad)]) for t in (q, k, v))
    if "scale" in x:
        q = q * np.float32(x["scale"] * q.shape[-1] ** 0.5)
    return tuple(cupy.asarray(t).astype(cupy.float16) for t in (q, k, v))


def torch_copies(q, k, v) -> tuple:
    """torch copies of CuPy q, k, v for a peer: SageAttention 1.0.6 subtracts K's mean from the k it
    is given, in place, which the implementations after it must not see."""
    import torch

    return tuple(torch.from_dlpack(x).clone() for x in (q, k, v))


def call_variants(fmt: str, smoothings) -> list[dict]:
    """The call options a format runs under: one per smoothing where its family takes the option
    (the int8-QK formats; "mean", "mean+balance" or None), else its default call alone."""
    from ..engine import registry

    if not smoothings or "smoothing" not in registry.family_of(fmt).options:
        return [{}]
    return [{"smoothing": s} for s in smoothings]


def kernel_entry(entry: str) -> tuple:
    """A benchmark entry FORMAT[@UNIT][+OPTION[=VALUE]...][:TILE] as (format, unit or None, options,
    Tile or None): "i8-f8@mma.sync" is the format on another matrix unit, "f16@wgmma+persistent" with
    a template option on, "+pingpong=off" with one off, ":m128n160w8s2" on a named tile."""
    from ..engine.tile import Tile

    head, _, tile = entry.partition(":")
    head, *named = head.split("+")
    fmt, _, mma = head.partition("@")
    options = {}
    for option in named:
        name, eq, value = option.partition("=")
        if not name or (eq and not value):
            raise ValueError(f"{entry!r}: expected +OPTION or +OPTION=VALUE after the format, got {option!r}")
        options[name] = value if eq else "on"
    return fmt, mma or None, options, Tile.from_name(tile) if tile else None


def impl_name(entry: str, options: dict) -> str:
    """A qattn call's name in the records: qattn:FORMAT[@UNIT], with /SMOOTHING where one was given."""
    if "smoothing" not in options:
        return f"qattn:{entry}"
    return f"qattn:{entry}/{smoothing_label(options['smoothing'])}"


# The smoothings by their names on the tools' command lines and in the records' impl.
SMOOTHINGS = {"mean": "mean", "mean+balance": "mean+balance", "none": None}


def smoothing_label(smoothing) -> str:
    """A smoothing's name in the records' impl and on the tools' command lines ("none": None)."""
    return "none" if smoothing is None else smoothing


def format_inputs(fmt: str, q, k, v) -> tuple:
    """The fp16 inputs as the format takes them (fp32 for the fp32 recipes)."""
    dtype = recipe_dtype(fmt)
    return (q, k, v) if dtype == q.dtype else tuple(x.astype(dtype) for x in (q, k, v))


def recipe_dtype(fmt: str):
    from ..engine.registry import recipe
    from ..engine.arrays import numpy_dtype

    return numpy_dtype(recipe(fmt).input_dtypes[0])
