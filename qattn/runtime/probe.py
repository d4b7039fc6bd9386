"""The probe: how much of a row's probability mass a P format can represent at a context
length, what that costs each format, and how far K smoothing tames K's outlier channels.

``run_probe`` takes attention tensors per context length (given, from an ``.npz`` holding q,
k, v BHSD and optionally ``scale``, or from a ``qattn.data`` preset), samples query rows, and
returns a JSON-serialisable report:

``source``      where the tensors came from ("tensors", "npz:PATH" or "preset:NAME").
``floors``      {grid: p below which the grid rounds to zero}. ``int8``: 0.5/127 ≈ 3.9e-3
                (P8 = rint(127·p)). ``e4m3``: 2⁻¹⁰/448 ≈ 2.2e-6, half the smallest subnormal
                2⁻⁹ over the static scale 448; RNE sends 448·p ≤ 2⁻¹⁰ to zero, so this is the
                mass e4m3 loses outright, the counterpart of int8's floor (the smallest p it
                keeps is 2⁻⁹/448 ≈ 4.4e-6). User grids are added as given.
``decades``     the bin edges of ``mass_by_decade``: 0, 1e-8, 1e-7, …, 0.1, 1.
``formats``     the recipes whose errors are reported.
``contexts``    one entry per context length, in increasing order:
  ``ctx``              keys in the context; ``rows`` query rows sampled; ``heads`` query heads.
  ``mass_below``       {grid: mean over rows of the fraction of the row's mass in entries with
                       p < floor}, where p = exp(s − row max) is the value the kernel rounds
                       (the row's largest entry is 1), computed in FP64.
  ``mass_by_decade``   mean fraction of a row's mass in each decade bin of p.
  ``errors``           {format: {max_rel, rel_l2, cos, kl}} of the emulated output against
                       FP64 (``qattn.runtime.metrics``); ``kl`` is the mean over rows of
                       KL(P_ref ‖ softmax of the format's scores), the cost of its QK path,
                       while the rounding of P shows in ``mass_below`` and the output errors.
  ``k_channel_ratio``  {raw, smoothed}: worst channel absmax over the median channel absmax of
                       K (before / after subtracting the mean over keys), the worst over heads.
  ``k_int8_levels``    {raw, smoothed}: {per_tensor, per_block}: int8 levels the median channel
                       spans, 127 · median channel absmax / absmax of the scale's group, with one
                       scale per (batch, kv head) tensor or per block of ``block_n`` keys
                       (mean over blocks and heads).
"""
from __future__ import annotations

import numpy as np

from . import emulate, metrics, quant
from .reference import softmax_rows

FLOORS = {"int8": 0.5 / quant.INT8_MAX, "e4m3": 2.0 ** -10 / quant.E4M3_MAX}
DECADES = [0.0] + [10.0 ** e for e in range(-8, 1)]
PROBE_FORMATS = ("i8-f16", "i8-i8", "i8-f8")
BLOCK_N = 64


def _load(tensors_by_ctx, npz, preset, ctx, queries, seed) -> tuple[str, dict[int, dict]]:
    given = [name for name, x in (("tensors_by_ctx", tensors_by_ctx), ("npz", npz), ("preset", preset)) if x is not None]
    if len(given) != 1:
        raise ValueError(f"tensors_by_ctx/npz/preset: give exactly one source of tensors, got {given or 'none'}")
    if tensors_by_ctx is not None:
        return "tensors", {int(c): dict(t) for c, t in tensors_by_ctx.items()}
    if preset is not None:
        from .. import data

        return f"preset:{preset}", {int(c): data.preset(preset, ctx=int(c), queries=queries, seed=seed) for c in ctx}
    with np.load(npz) as f:
        stored = {name: f[name] for name in f.files}
    length = stored["k"].shape[-2]
    too_long = [c for c in ctx if c > length]
    if too_long:
        raise ValueError(f"ctx: {too_long} longer than the {length} keys in {npz}")
    extra = {"scale": float(stored["scale"])} if "scale" in stored else {}
    # The queries close the context: keep its last c keys.
    return f"npz:{npz}", {int(c): dict(q=stored["q"], k=stored["k"][..., length - c:, :],
                                       v=stored["v"][..., length - c:, :], **extra) for c in ctx}


def _sample_rows(q: np.ndarray, count: int, rng) -> np.ndarray:
    rows = q.shape[-2]
    if rows <= count:
        return q
    return q[..., np.sort(rng.choice(rows, count, replace=False)), :]


def _channel_stats(k: np.ndarray) -> tuple[float, dict]:
    """(worst/median channel absmax ratio over heads, int8 levels of the median channel)."""
    absmax = np.abs(k).max(axis=-2)  # [B, H, D]
    median = np.median(absmax, axis=-1)
    ratio = float((absmax.max(axis=-1) / median).max())
    per_tensor = float((quant.INT8_MAX * median / absmax.max(axis=-1)).mean())
    n_blocks = -(-k.shape[-2] // BLOCK_N)
    padded = np.pad(np.abs(k), [(0, 0), (0, 0), (0, n_blocks * BLOCK_N - k.shape[-2]), (0, 0)])
    block_absmax = padded.reshape(k.shape[:2] + (n_blocks, BLOCK_N, k.shape[-1])).max(axis=-2)  # [B, H, n, D]
    per_block = float((quant.INT8_MAX * np.median(block_absmax, axis=-1) / block_absmax.max(axis=-1)).mean())
    return ratio, {"per_tensor": per_tensor, "per_block": per_block}


def _errors(fmt: str, q, k, v, scale, p_ref) -> dict:
    out = emulate.emulate(fmt, q, k, v, scale=scale, block_n=BLOCK_N)
    errors = metrics.compare(out, emulate.reference(fmt, q, k, v, scale=scale))
    s2 = emulate.scores(fmt, q, k, v, scale=scale, block_n=BLOCK_N).astype(np.float64)
    p_fmt = np.exp2(s2 - s2.max(axis=-1, keepdims=True))
    p_fmt /= p_fmt.sum(axis=-1, keepdims=True)
    return {"max_rel": errors.max_rel, "rel_l2": errors.rel_l2, "cos": errors.cos,
            "kl": float(metrics.kl_rows(p_ref, p_fmt).mean())}


def _probe_context(ctx: int, tensors: dict, formats, floors: dict, queries: int, rng) -> dict:
    q = _sample_rows(np.asarray(tensors["q"], np.float32), queries, rng)
    k, v = np.asarray(tensors["k"], np.float32), np.asarray(tensors["v"], np.float32)
    scale = tensors.get("scale")
    p_ref = softmax_rows(q, k, scale=scale)
    p_rel = p_ref / p_ref.max(axis=-1, keepdims=True)  # the kernel's p: the row max is 1
    smoothed, _ = quant.smooth_k(k)
    raw_ratio, raw_levels = _channel_stats(k)
    smooth_ratio, smooth_levels = _channel_stats(smoothed)
    return {
        "ctx": ctx, "rows": int(q.shape[-2]), "heads": int(q.shape[1]),
        "mass_below": {name: float(metrics.mass_below(p_rel, floor).mean()) for name, floor in floors.items()},
        "mass_by_decade": metrics.mass_histogram(p_rel, DECADES).reshape(-1, len(DECADES) - 1).mean(axis=0).tolist(),
        "errors": {fmt: _errors(fmt, q, k, v, scale, p_ref) for fmt in formats},
        "k_channel_ratio": {"raw": raw_ratio, "smoothed": smooth_ratio},
        "k_int8_levels": {"raw": raw_levels, "smoothed": smooth_levels},
    }


def run_probe(tensors_by_ctx: dict[int, dict] | None = None, *, npz: str | None = None, preset: str | None = None,
              ctx=(4096, 32768), formats=PROBE_FORMATS, grids: dict[str, float] | None = None, queries: int = 128,
              seed: int = 0) -> dict:
    """Probe the tensors at each context length; see the module docstring for the report.
    Give exactly one of tensors_by_ctx ({ctx: dict(q, k, v[, scale])}), npz (a file holding
    q, k, v BHSD, whose last ctx keys make each context) or preset (a qattn.data preset name,
    generated at each ctx). queries bounds the query rows sampled per context."""
    unknown = [f for f in formats if f not in emulate.EMULATORS]
    if unknown:
        raise ValueError(f"formats: unknown recipes {unknown}; expected names from {sorted(emulate.EMULATORS)}")
    if queries < 1:
        raise ValueError(f"queries: expected a positive number of rows, got {queries}")
    floors = dict(FLOORS)
    for name, floor in (grids or {}).items():
        if not 0 < float(floor) <= 1:
            raise ValueError(f"grids: floor of {name!r} must be in (0, 1], got {floor}")
        floors[name] = float(floor)
    source, by_ctx = _load(tensors_by_ctx, npz, preset, ctx, queries, seed)
    rng = np.random.default_rng(seed)
    contexts = [_probe_context(c, by_ctx[c], formats, floors, queries, rng) for c in sorted(by_ctx)]
    return {"source": source, "floors": floors, "decades": DECADES, "formats": list(formats), "contexts": contexts}


def format_table(report: dict):
    """A rich Table: one row per context length: K's channel ratio, mass below each floor,
    and each format's rel_l2 (max_rel)."""
    from rich.table import Table

    table = Table(title=f"qattn probe — {report['source']}")
    table.add_column("ctx", justify="right")
    table.add_column("K worst/median\nraw → smoothed", justify="right")
    for name, floor in report["floors"].items():
        table.add_column(f"mass < {name}\n({floor:.2g})", justify="right")
    for fmt in report["formats"]:
        table.add_column(f"{fmt}\nrel_l2 (max_rel)", justify="right")
    for entry in report["contexts"]:
        ratio = entry["k_channel_ratio"]
        cells = [f"{entry['ctx']}", f"{ratio['raw']:.1f}× → {ratio['smoothed']:.1f}×"]
        cells += [f"{entry['mass_below'][name]:.1%}" for name in report["floors"]]
        cells += [f"{e['rel_l2']:.2e} ({e['max_rel']:.1e})" for e in (entry["errors"][f] for f in report["formats"])]
        table.add_row(*cells)
    return table


def plot(report: dict, path) -> None:
    """Write the two-panel PNG: left, where a row's mass lies by decade of p with the int8 and
    e4m3 floors marked; right, each format's rel_l2 against FP64 by context length."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise RuntimeError("matplotlib is needed for --plot: pip install 'qattn[plot]'") from exc
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    mass_ax, err_ax = fig.subplots(1, 2)
    edges = np.asarray(report["decades"])
    centers = np.sqrt(np.maximum(edges[:-1], edges[1] / 10) * edges[1:])  # the [0, 1e-8) bin sits at 3e-9
    for entry in report["contexts"]:
        mass_ax.plot(centers, entry["mass_by_decade"], marker="o", label=f"ctx {entry['ctx']}")
    for name, style in (("int8", "--"), ("e4m3", ":")):
        mass_ax.axvline(report["floors"][name], color="gray", linestyle=style, label=f"{name} floor")
    mass_ax.set(xscale="log", xlabel="p = exp(s − row max)", ylabel="fraction of row mass per decade",
                title="Where the probability mass lies")
    mass_ax.legend(fontsize=8)
    contexts = [entry["ctx"] for entry in report["contexts"]]
    for fmt in report["formats"]:
        err_ax.plot(contexts, [entry["errors"][fmt]["rel_l2"] for entry in report["contexts"]], marker="o", label=fmt)
    err_ax.set(xscale="log", yscale="log", xlabel="context length (keys)", ylabel="rel_l2 vs FP64",
               title="Output error by format")
    err_ax.set_xticks(contexts, [str(c) for c in contexts])
    err_ax.legend(fontsize=8)
    fig.suptitle(report["source"])
    fig.savefig(path, dpi=110)
