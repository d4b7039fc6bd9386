"""The probe: how much of a row's probability mass a P format can represent at a context
length, what that costs each format, and how far K smoothing and Q/K channel balancing tame K's
outlier channels.

``run_probe`` takes attention tensors per context length (given, from an ``.npz`` holding q,
k and optionally v, BHSD, or from a ``qattn.data`` preset), samples query rows (every query
row sees every key: the rows stand for the end of the context), and returns a
JSON-serialisable report (``qattn probe --json FILE`` writes it, non-finite numbers as null):

``source``      where the tensors came from ("tensors", "npz:PATH" or "preset:NAME").
``v``           "given", or "random" when the .npz holds no v (N(0, 1), seeded): the mass and
                K figures do not use V; the output errors then measure the formats on it.
``floors``      {grid: p below which the grid rounds to zero}. ``int8``: 0.5/127 ≈ 3.9e-3
                (P8 = rint(127·p)). ``e4m3``: 2⁻¹⁰/448 ≈ 2.2e-6, half the smallest subnormal
                2⁻⁹ over the static scale 448; RNE sends 448·p ≤ 2⁻¹⁰ to zero, so this is the
                mass e4m3 loses outright, the counterpart of int8's floor (the smallest p it
                keeps is 2⁻⁹/448 ≈ 4.4e-6). User grids (``--grid NAME=FLOOR``) are added as given.
``decades``     the bin edges of ``mass_by_decade``: 0, 1e-8, 1e-7, …, 0.1, 1.
``formats``     the recipes whose errors are reported.
``smoothings``  the smoothings the int8-QK formats' errors are reported under ("mean", "mean+balance",
                "none": see qattn.formats.int8qk.quant.SMOOTHINGS).
``key_block``   keys per K scale and per online-softmax step of the int8-QK formats (the
                emulators' ``block_n``; 64 by default, 128 as the i8-f8 wgmma kernels on sm_90a).
``contexts``    one entry per context length, in increasing order:
  ``ctx``              keys in the context; ``rows`` query rows sampled; ``heads`` query heads.
  ``mass_below``       {grid: mean over rows of the fraction of the row's mass in entries with
                       p < floor}, where p = exp(s − row max) is the value the kernel rounds
                       (the row's largest entry is 1), computed in FP64.
  ``mass_by_decade``   mean fraction of a row's mass in each decade bin of p.
  ``errors``           {format: {max_rel, rel_l2, cos, kl}} of the emulated output against
                       FP64 (``qattn.check.metrics``); ``kl`` is the mean over rows of
                       KL(P_ref ‖ softmax of the format's scores), the cost of its QK path,
                       while the rounding of P shows in ``mass_below`` and the output errors.
                       The int8-QK formats appear once per smoothing, as "FORMAT+SMOOTHING"
                       (e.g. "i8-f8+mean+balance"), and as plain "FORMAT" for their default,
                       "mean", when it is among the smoothings.
  ``k_channel_ratio``  {raw, smoothed, balanced}: worst channel absmax over the median channel
                       absmax of K (as given / after subtracting the mean over keys / then divided
                       by the balancing factors α of the sampled query rows), the worst over heads.
  ``k_channel_absmax`` {raw, smoothed, balanced}: every channel's absmax over the median
                       channel's, for the kv head with the worst raw ratio (the plot's right panel).
  ``k_int8_levels``    {raw, smoothed, balanced}: {per_tensor, per_block}: int8 levels the median channel
                       spans, 127 · median channel absmax / absmax of the scale's group, with one
                       scale per (batch, kv head) tensor or per block of ``key_block`` keys
                       (mean over blocks and heads).
"""
from __future__ import annotations

import numpy as np

from ..formats.int8qk.quant import SMOOTHINGS, smooth
from . import emulate, metrics, quant
from .reference import check_shapes, softmax_rows

FLOORS = {"int8": 0.5 / quant.INT8_MAX, "e4m3": 2.0 ** -10 / quant.E4M3_MAX}
DECADES = [0.0] + [10.0 ** e for e in range(-8, 1)]
PROBE_FORMATS = ("i8-f16", "i8-i8", "i8-f8")
DEFAULT_CTX = (4096, 32768)
DEFAULT_SMOOTHINGS = ("mean", "mean+balance")
K_VARIANTS = ("raw", "smoothed", "balanced")  # K as given, after smoothing, after balancing


def grid_points(grid: str) -> np.ndarray:
    """The positive values of p that a static-scale 8-bit P grid represents: k/127 for int8,
    every positive e4m3 value over 448 for e4m3."""
    if grid == "int8":
        return np.arange(1, quant.INT8_MAX + 1) / quant.INT8_MAX
    if grid == "e4m3":
        values = np.arange(256, dtype=np.uint8).view(quant.E4M3).astype(np.float64)
        return np.unique(values[np.isfinite(values) & (values > 0)]) / quant.E4M3_MAX
    raise ValueError(f"grid: expected 'int8' or 'e4m3', got {grid!r}")


def _npz_contexts(npz, ctx, seed) -> tuple[str, dict[int, dict]]:
    """Each context is the file's last ctx keys (the queries close the context)."""
    with np.load(npz) as f:
        stored = {name: f[name] for name in f.files}
    missing = [name for name in ("q", "k") if name not in stored]
    if missing:
        raise ValueError(f"npz: {npz} holds no {' or '.join(missing)} (expected arrays q, k and optionally v, BHSD)")
    q, k = stored["q"], stored["k"]
    given_v = "v" in stored
    v = stored["v"] if given_v else np.random.default_rng(seed).standard_normal(k.shape, dtype=np.float32)
    try:
        check_shapes(q.shape, k.shape, v.shape)
    except ValueError as exc:
        raise ValueError(f"npz: {npz}: {exc}") from None
    length = k.shape[-2]
    ctx = ctx or [c for c in DEFAULT_CTX if c < length] + [length]
    too_long = [c for c in ctx if c > length]
    if too_long:
        raise ValueError(f"ctx: {too_long} longer than the {length} keys in {npz}")
    extra = {"scale": float(stored["scale"])} if "scale" in stored else {}
    contexts = {int(c): dict(q=q, k=k[..., length - c:, :], v=v[..., length - c:, :], **extra) for c in ctx}
    return ("given" if given_v else "random"), contexts


def _load(tensors_by_ctx, npz, preset, ctx, queries, seed) -> tuple[str, str, dict[int, dict]]:
    """(source, v, {ctx: dict(q, k, v[, scale])}) from the one source given."""
    sources = (("tensors_by_ctx", tensors_by_ctx), ("npz", npz), ("preset", preset))
    given = [name for name, x in sources if x is not None]
    if len(given) != 1:
        raise ValueError(f"npz: give exactly one source of tensors (tensors_by_ctx, npz or preset), "
                         f"got {given or 'none'}")
    if any(int(c) < 1 for c in ctx or ()):
        raise ValueError(f"ctx: expected positive context lengths, got {list(ctx)}")
    if tensors_by_ctx is not None:
        return "tensors", "given", {int(c): dict(t) for c, t in tensors_by_ctx.items()}
    if preset is not None:
        from .. import data

        return f"preset:{preset}", "given", {int(c): data.preset(preset, ctx=int(c), queries=queries, seed=seed)
                                             for c in ctx or DEFAULT_CTX}
    v, contexts = _npz_contexts(npz, ctx, seed)
    return f"npz:{npz}", v, contexts


def _sample_rows(q: np.ndarray, count: int, rng) -> np.ndarray:
    rows = q.shape[-2]
    if rows <= count:
        return q
    return q[..., np.sort(rng.choice(rows, count, replace=False)), :]


def _channel_absmax(k: np.ndarray) -> np.ndarray:
    """Per-channel absmax over keys relative to the median channel's, [B, H, D]."""
    absmax = np.abs(k).max(axis=-2)
    return absmax / np.median(absmax, axis=-1, keepdims=True)


def _int8_levels(k: np.ndarray, key_block: int) -> dict:
    """int8 levels the median channel spans with one scale per tensor vs per block of keys."""
    absmax = np.abs(k).max(axis=-2)  # [B, H, D]
    per_tensor = float((quant.INT8_MAX * np.median(absmax, axis=-1) / absmax.max(axis=-1)).mean())
    n_blocks = -(-k.shape[-2] // key_block)
    padded = np.pad(np.abs(k), [(0, 0), (0, 0), (0, n_blocks * key_block - k.shape[-2]), (0, 0)])
    block_absmax = padded.reshape(k.shape[:2] + (n_blocks, key_block, k.shape[-1])).max(axis=-2)  # [B, H, n, D]
    per_block = float((quant.INT8_MAX * np.median(block_absmax, axis=-1) / block_absmax.max(axis=-1)).mean())
    return {"per_tensor": per_tensor, "per_block": per_block}


def _k_stats(q: np.ndarray, k: np.ndarray, key_block: int) -> dict:
    """K's channel statistics as given, smoothed and balanced (α from q, k; the softmax scale cancels
    in α's normalization)."""
    keys = {"raw": k, "smoothed": smooth(q, k, "mean")[1], "balanced": smooth(q, k, "mean+balance")[1]}
    rel = {name: _channel_absmax(x) for name, x in keys.items()}
    worst = np.unravel_index(int(np.argmax(rel["raw"].max(axis=-1))), rel["raw"].shape[:2])
    return {
        "k_channel_ratio": {name: float(r.max()) for name, r in rel.items()},
        "k_channel_absmax": {name: r[worst].tolist() for name, r in rel.items()},
        "k_int8_levels": {name: _int8_levels(x, key_block) for name, x in keys.items()},
    }


def smoothing_name(smoothing: str | None) -> str:
    """A smoothing as the report and the CLI spell it: None is "none"."""
    return "none" if smoothing is None else smoothing


def _errors(fmt: str, q, k, v, scale, p_ref, key_block: int, **opts) -> dict:
    out = emulate.emulate(fmt, q, k, v, scale=scale, block_n=key_block, **opts)
    errors = metrics.compare(out, emulate.reference(fmt, q, k, v, scale=scale))
    s2 = emulate.scores(fmt, q, k, v, scale=scale, block_n=key_block, **opts).astype(np.float64)
    p_fmt = np.exp2(s2 - s2.max(axis=-1, keepdims=True))
    p_fmt /= p_fmt.sum(axis=-1, keepdims=True)
    return {"max_rel": errors.max_rel, "rel_l2": errors.rel_l2, "cos": errors.cos,
            "kl": float(metrics.kl_rows(p_ref, p_fmt).mean())}


def _format_errors(formats, smoothings, q, k, v, scale, p_ref, key_block: int) -> dict:
    """Each format's errors; an int8-QK format's under each smoothing, as "FORMAT+SMOOTHING", and as
    plain "FORMAT" under its default, "mean"."""
    errors = {}
    for fmt in formats:
        if not emulate.takes_option(fmt, "smoothing"):
            errors[fmt] = _errors(fmt, q, k, v, scale, p_ref, key_block)
            continue
        for smoothing in smoothings:
            errors[f"{fmt}+{smoothing_name(smoothing)}"] = _errors(fmt, q, k, v, scale, p_ref, key_block,
                                                                   smoothing=smoothing)
        if "mean" in smoothings:
            errors[fmt] = errors[f"{fmt}+mean"]
    return errors


def _probe_context(ctx: int, tensors: dict, formats, smoothings, floors: dict, queries: int, key_block: int,
                   rng) -> dict:
    q = _sample_rows(np.asarray(tensors["q"], np.float32), queries, rng)
    k, v = np.asarray(tensors["k"], np.float32), np.asarray(tensors["v"], np.float32)
    scale = tensors.get("scale")
    p_ref = softmax_rows(q, k, scale=scale)
    p_rel = p_ref / p_ref.max(axis=-1, keepdims=True)  # the kernel's p: the row max is 1
    return {
        "ctx": ctx, "rows": int(q.shape[-2]), "heads": int(q.shape[1]),
        "mass_below": {name: float(metrics.mass_below(p_rel, floor).mean()) for name, floor in floors.items()},
        "mass_by_decade": metrics.mass_histogram(p_rel, DECADES).reshape(-1, len(DECADES) - 1).mean(axis=0).tolist(),
        "errors": _format_errors(formats, smoothings, q, k, v, scale, p_ref, key_block),
        **_k_stats(q, k, key_block),
    }


def run_probe(tensors_by_ctx: dict[int, dict] | None = None, *, npz: str | None = None, preset: str | None = None,
              ctx=None, formats=PROBE_FORMATS, grids: dict[str, float] | None = None, queries: int = 128,
              key_block: int = 64, seed: int = 0, smoothings=DEFAULT_SMOOTHINGS) -> dict:
    """Probe the tensors at each context length; see the module docstring for the report.
    Give exactly one of tensors_by_ctx ({ctx: dict(q, k, v[, scale])}), npz (a file holding
    q, k and optionally v, BHSD, whose last ctx keys make each context) or preset (a qattn.data
    preset name, generated at each ctx). ctx defaults to 4096 and 32768 (for an npz, those
    shorter than the file, and the whole file). queries bounds the query rows sampled per context;
    key_block is the int8-QK formats' keys per K scale and softmax step; smoothings (of SMOOTHINGS,
    None for none) those their errors are reported under."""
    unknown = [f for f in formats if f not in emulate.formats()]
    if unknown:
        raise ValueError(f"format: unknown recipes {unknown}; expected names from {sorted(emulate.formats())}")
    smoothings = list(smoothings)
    if not smoothings or any(s not in SMOOTHINGS for s in smoothings):
        raise ValueError(f"smoothing: expected one or more of {SMOOTHINGS}, got {smoothings}")
    if queries < 1:
        raise ValueError(f"queries: expected a positive number of rows, got {queries}")
    if not isinstance(key_block, (int, np.integer)) or key_block < 1:
        raise ValueError(f"key_block: expected a positive number of keys, got {key_block!r}")
    floors = dict(FLOORS)
    for name, floor in (grids or {}).items():
        if not 0 < float(floor) <= 1:
            raise ValueError(f"grid: floor of {name!r} must be in (0, 1], got {floor}")
        floors[name] = float(floor)
    source, v, by_ctx = _load(tensors_by_ctx, npz, preset, ctx, queries, seed)
    rng = np.random.default_rng(seed)
    contexts = [_probe_context(c, by_ctx[c], formats, smoothings, floors, queries, key_block, rng)
                for c in sorted(by_ctx)]
    return {"source": source, "v": v, "floors": floors, "decades": DECADES, "formats": list(formats),
            "smoothings": [smoothing_name(s) for s in smoothings], "key_block": int(key_block),
            "contexts": contexts}


def _share(fraction: float) -> str:
    """A fraction as a percentage, small ones in scientific notation rather than 0.00%."""
    return f"{fraction:.2%}" if fraction == 0 or fraction >= 1e-4 else f"{fraction * 100:.1e}%"


def format_tables(report: dict) -> list:
    """Two rich Tables: per context length, where the mass lies and how K's channels look; per
    (context length, format), the emulated output's errors against FP64."""
    from rich.table import Table

    mass = Table(title=f"qattn probe — {report['source']}: probability mass and K channels", title_justify="left")
    mass.add_column("ctx", justify="right")
    for name, floor in report["floors"].items():
        mass.add_column(f"mass < {name}\nfloor ({floor:.2g})", justify="right")
    mass.add_column("K worst/median channel\nraw → smoothed → balanced", justify="right")
    mass.add_column(f"int8 levels, median channel\nper tensor / per {report['key_block']} keys\n"
                    "raw → smoothed → balanced", justify="right")
    for entry in report["contexts"]:
        ratio, levels = entry["k_channel_ratio"], entry["k_int8_levels"]
        level_cells = [f"{levels[s]['per_tensor']:.0f} / {levels[s]['per_block']:.0f}" for s in K_VARIANTS]
        mass.add_row(f"{entry['ctx']}", *[_share(entry["mass_below"][name]) for name in report["floors"]],
                     " → ".join(f"{ratio[s]:.1f}×" for s in K_VARIANTS), " → ".join(level_cells))
    errors = Table(title=f"emulated formats vs FP64 ({report['key_block']} keys per K scale and softmax step)",
                   title_justify="left")
    for name in ("ctx", "format", "max_rel", "rel_l2", "cos", "KL(P_ref ‖ P)"):
        errors.add_column(name, justify="left" if name == "format" else "right")
    for entry in report["contexts"]:
        for fmt, e in entry["errors"].items():
            if f"{fmt}+mean" in entry["errors"]:  # the default's plain name: shown as FORMAT+mean
                continue
            errors.add_row(f"{entry['ctx']}", fmt, f"{e['max_rel']:.2e}", f"{e['rel_l2']:.2e}", f"{e['cos']:.6f}",
                           f"{e['kl']:.2e}")
    return [mass, errors] if report["formats"] else [mass]


def require_matplotlib():
    """matplotlib's Figure class, or a RuntimeError that says how to install it."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib, which is not installed: pip install 'qattn[plot]' "
                           "(or pip install matplotlib)") from exc
    return Figure


def _plot_mass(ax, report: dict) -> None:
    """Mass by decade of p for the shortest and longest context, the floors, and both 8-bit
    grids' representable points as rugs along the bottom of the same log axis."""
    edges = np.asarray(report["decades"])
    edges[0] = edges[1] / 10  # the [0, 1e-8) bin is drawn as [1e-9, 1e-8)
    entries = report["contexts"]
    for entry in entries[:1] + entries[1:][-1:]:
        ax.stairs(entry["mass_by_decade"], edges, label=f"ctx {entry['ctx']}", linewidth=1.8)
    ax.axvline(report["floors"]["int8"], color="tab:red", linestyle="--", label="int8 floor (0.5/127)")
    ax.axvline(report["floors"]["e4m3"], color="tab:purple", linestyle=":", label="e4m3 floor (2⁻¹⁰/448)")
    for grid, height, color in (("int8", 0.03, "tab:red"), ("e4m3", 0.09, "tab:purple")):
        points = grid_points(grid)
        ax.plot(points, np.full(points.shape, height), "|", color=color, markersize=7,
                transform=ax.get_xaxis_transform(), label=f"{grid} grid ({len(points)} points)")
    ax.set(xscale="log", xlim=(edges[0], 1.0), xlabel="p = exp(s − row max)  (first bin: p < 1e-8)",
           ylabel="fraction of row mass per decade", title="Where a row's probability mass lies")
    ax.legend(fontsize=7, loc="upper left")


def _plot_channels(ax, report: dict) -> None:
    """Every K channel's absmax over the median channel's: as given, smoothed, balanced."""
    entry = report["contexts"][-1]
    ratio = entry["k_channel_ratio"]
    for key, color in zip(K_VARIANTS, ("tab:orange", "tab:blue", "tab:green")):
        values = np.asarray(entry["k_channel_absmax"][key])
        ax.bar(np.arange(len(values)), values, width=1.0, color=color, alpha=0.6,
               label=f"{key}: worst {ratio[key]:.1f}× the median")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set(yscale="log", xlabel="channel", ylabel="channel absmax / median channel",
           title=f"K channels as given, smoothed, balanced (ctx {entry['ctx']})")
    ax.legend(fontsize=8)


def plot(report: dict, path) -> None:
    """Write the two-panel PNG: left, where a row's mass lies by decade of p at the shortest and
    longest context, with the floors and the int8 / e4m3 grids marked; right, K's channel
    magnitudes as given, after smoothing and after balancing."""
    figure_class = require_matplotlib()
    fig = figure_class(figsize=(12, 4.5), layout="constrained")
    mass_ax, channel_ax = fig.subplots(1, 2)
    _plot_mass(mass_ax, report)
    _plot_channels(channel_ax, report)
    fig.suptitle(f"qattn probe — {report['source']}")
    fig.savefig(path, dpi=110, format="png")
