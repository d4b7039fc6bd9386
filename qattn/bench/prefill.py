"""The prefill benchmark: qattn kernels and the peers on the same inputs in the same run, timed in
interleaved rounds, with each one's rel_l2 against FP64 (DESIGN §4); and rel_l2 against FP64 on the
qattn.data presets."""
from __future__ import annotations

from .peers import PEERS, peer
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
                  tiles=None, rounds: int = 3, sustained: float | None = None, settle: float = 0.0) -> list[dict]:
    """Time qattn prefill kernels and peers on the same inputs in the same run.
    shapes: iterable of (batch, heads, seq) with Lq = Lk = seq; formats: names, or "name@unit" for
    the format on another matrix unit of the arch (e.g. "i8-f8@wgmma"). Returns one record per
    (shape, implementation) with median ms, TFLOPS, the ratio to each peer and rel_l2 against
    FP64 on the first heads (a GPU FP64 reference of the same inputs).
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
    from ..engine.spec import default_spec

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
            import torch

            torch_inputs = torch_inputs or tuple(torch.from_dlpack(x) for x in (q, k, v))
            try:
                out = fn(*torch_inputs, causal)
            except Exception as exc:  # backend unavailable for this shape/GPU
                records.append(dict(shape_rec, impl=name, error=str(exc).splitlines()[0]))
                continue
            timed.append((dict(shape_rec, impl=name, rel_l2=_rel_l2(out, ref)),
                          lambda fn=fn: fn(*torch_inputs, causal)))
        for entry in formats:
            fmt, _, mma = entry.partition("@")  # "i8-f8@wgmma": the format on a named matrix unit
            spec = default_spec(fmt, head_dim, causal=causal)
            if mma:
                try:
                    spec = spec.with_(mma=mma, tile=None)
                except ValueError as exc:  # this arch does not build the format on that unit
                    records.append(dict(shape_rec, impl=f"qattn:{entry}", error=str(exc)))
                    continue
            if tiles:
                spec = spec.with_(tile=tiles[entry] if isinstance(tiles, dict) else tiles)
            kernel = build_kernel(spec)
            xs = format_inputs(fmt, q, k, v)
            out = cupy.empty_like(xs[0])
            kernel(*xs, out=out)
            rec = dict(shape_rec, impl=f"qattn:{entry}", kernel=spec.name, rel_l2=_rel_l2(out, ref))
            timed.append((rec, lambda kernel=kernel, xs=xs, out=out: kernel(*xs, out=out)))
            if spec.family.launcher == "prefill_i8":  # the share of the call spent quantizing Q, K, V
                from ..formats.int8qk import quantize

                rec["quant_ms"] = time_cuda(lambda: quantize(*xs, kernel=kernel)).median_ms
        timer = None if sustained is None else (lambda fn, _rounds: time_sustained(fn, sustained))
        per_round = time_interleaved([fn for _, fn in timed], rounds, timer, settle=settle)
        for rec in with_ratios(timed, per_round, PEERS):
            rec["tflops"] = flops / rec["ms"] / 1e9
            records.append(rec)
    return records


ACCURACY_PRESETS = ("normal", "outliers", "outliers_token", "bias", "rope")


def accuracy_against_fp64(presets=ACCURACY_PRESETS, contexts=(4096, 32768), formats=("i8-f8",), *, peers=PEERS,
                          heads: int = 2, head_dim: int = 128, max_queries: int = 4096, causal=(False, True),
                          seed: int = 1) -> list[dict]:
    """rel_l2 against FP64 (on the GPU) of qattn formats and peers on the same fp16 inputs, drawn
    from the qattn.data presets: one record per (preset, context, causal, implementation). The
    queries are the last min(ctx, max_queries) positions of the context; causal rows only where
    Lq = Lk (torch's and SageAttention's causal masks align top-left where they differ, qattn's
    bottom-right). A peer that fails on a shape gets a record with its error instead."""
    import cupy

    from .. import data
    from ..api import attention

    for name in presets:
        if name not in data.PRESETS:
            raise ValueError(f"presets: unknown preset {name!r}; expected names from {sorted(data.PRESETS)}")
    if max_queries < 1:
        raise ValueError(f"max_queries: expected a positive number of queries, got {max_queries}")
    peer_fns = {name: fn for name in peers if (fn := peer(name)) is not None}
    records = []
    for name in presets:
        for ctx in contexts:
            lq = min(ctx, max_queries)
            x = data.preset(name, ctx=ctx, queries=lq, heads=heads, head_dim=head_dim, seed=seed)
            q, k, v = (cupy.asarray(x[n]).astype(cupy.float16) for n in ("q", "k", "v"))
            torch_inputs = None
            for is_causal in causal:
                if is_causal and lq != ctx:
                    continue
                ref = fp64_slice(q, k, v, is_causal)
                base = {"preset": name, "ctx": ctx, "queries": lq, "causal": is_causal, "heads": heads,
                        "head_dim": head_dim}
                for fmt in formats:
                    out = attention(*format_inputs(fmt, q, k, v), format=fmt, causal=is_causal)
                    records.append(dict(base, impl=f"qattn:{fmt}", rel_l2=_rel_l2(out, ref)))
                for peer_name, fn in peer_fns.items():
                    import torch

                    torch_inputs = torch_inputs or tuple(torch.from_dlpack(t) for t in (q, k, v))
                    try:
                        out = cupy.from_dlpack(fn(*torch_inputs, is_causal).contiguous())
                    except Exception as exc:  # backend unavailable for this shape/GPU
                        records.append(dict(base, impl=peer_name, error=str(exc).splitlines()[0]))
                        continue
                    records.append(dict(base, impl=peer_name, rel_l2=_rel_l2(out, ref)))
    return records


def format_inputs(fmt: str, q, k, v) -> tuple:
    """The fp16 inputs as the format takes them (fp32 for the fp32 recipes)."""
    dtype = recipe_dtype(fmt)
    return (q, k, v) if dtype == q.dtype else tuple(x.astype(dtype) for x in (q, k, v))


def recipe_dtype(fmt: str):
    from ..engine.registry import recipe
    from ..engine.arrays import numpy_dtype

    return numpy_dtype(recipe(fmt).input_dtypes[0])
