"""`qattn tune`: qattn.tune's command line. It adds itself to qattn.cli's group (which imports this
module at its end): it builds on the helpers there, so the group cannot import it first."""
from __future__ import annotations

import os
from pathlib import Path

import click
from click.core import ParameterSource

from ..cli_support import (HELP, _console, _fmt, _json_path, _note, _parse_decode_shapes, _Progress, _table,
                           user_errors, write_json)
from ..engine import tuned
from ..engine.shape_class import LENGTH_BUCKETS, SEQUENCE_HEAD_BUCKETS
from ..engine.spec import device_arch
from ..engine.tile import Tile
from ..version import __version__
from . import run as tuning
from .candidates import BLOCK_M, BLOCK_N, STAGES, WARPS, tunable_formats
from .case import Shape

DEFAULT_SHAPE = (4, 4096)
# Options of a sweep, by parameter name; --show takes none of them.
SWEEP_OPTIONS = {"causal": "--causal", "shapes": "--shape", "queries": "--queries", "heads": "--heads",
                 "kv_heads": "--kv-heads", "tiles": "--tile", "warps": "--warps", "stages": "--stages", "mma": "--mma",
                 "sweep_options": "--options/--no-options", "rounds": "--rounds", "jobs": "--jobs", "seed": "--seed"}


def _parse_formats(ctx, param, values):
    formats = list(dict.fromkeys(f.strip() for value in values for f in value.split(",") if f.strip()))
    for name in formats:
        if name not in tunable_formats():
            raise click.BadParameter(f"{name!r} is not a tunable format; tunable: {', '.join(tunable_formats())}")
    return formats


def _parse_block_shapes(ctx, param, values):
    try:
        tiles = [Tile.parse(value, warps=1, stages=1) for value in values]
    except ValueError as exc:
        raise click.BadParameter(str(exc).removeprefix("tile: ")) from None
    return list(dict.fromkeys((t.block_m, t.block_n) for t in tiles))


@click.command(context_settings=HELP)
@click.option("--format", "-f", "formats", multiple=True, callback=_parse_formats, metavar="FORMAT[,FORMAT...]",
              help="formats to tune; repeatable, comma lists allowed [default: f16]")
@click.option("--head-dim", "-d", "head_dims", multiple=True, type=click.IntRange(min=1),
              help="head dimension D; repeatable [default: 128]")
@click.option("--causal/--no-causal", default=None, help="tune only the causal kernels, or only the non-causal ones "
                                                          "[default: both]")
@click.option("--shape", "shapes", multiple=True, callback=_parse_decode_shapes, metavar="BATCHxCTX",
              help="a shape to time: BATCH sequences of CTX keys, as many queries (--queries: fewer); its shape "
                   f"class (Lq and Lk in {', '.join(LENGTH_BUCKETS)}; MHA or GQA; BATCH x --heads sequence-heads in "
                   f"{', '.join(SEQUENCE_HEAD_BUCKETS)}) is what the winner is stored under; repeatable "
                   f"[default: {DEFAULT_SHAPE[0]}x{DEFAULT_SHAPE[1]}]")
@click.option("--queries", type=click.IntRange(min=1), help="query rows per sequence [default: CTX]")
@click.option("--heads", type=click.IntRange(min=1), default=32, show_default=True, help="query heads")
@click.option("--kv-heads", type=click.IntRange(min=1), help="KV heads (GQA; must divide --heads) [default: --heads]")
@click.option("--tile", "tiles", multiple=True, callback=_parse_block_shapes, metavar="BLOCK_MxBLOCK_N",
              help="block shapes to sweep; repeatable [default: every BLOCK_M in "
                   f"{', '.join(map(str, BLOCK_M))} with every BLOCK_N in {', '.join(map(str, BLOCK_N))}]")
@click.option("--warps", multiple=True, type=click.IntRange(1, 32),
              help=f"warps per block to sweep; repeatable [default: {', '.join(map(str, WARPS))}]")
@click.option("--stages", multiple=True, type=click.IntRange(1, 4),
              help=f"pipeline stages to sweep; repeatable [default: {', '.join(map(str, STAGES))}]")
@click.option("--mma", multiple=True, type=click.Choice(["mma.sync", "wgmma"]),
              help="matrix units to sweep; repeatable [default: every unit the GPU's arch builds the format with; "
                   "on sm_90a f16, bf16, i8-f16 and i8-f8 have mma.sync and wgmma]")
@click.option("--options/--no-options", "sweep_options", default=True, show_default=True,
              help="also sweep the unit's template options on every tile (the wgmma kernels' pingpong and "
                   "persistent); --no-options keeps each tile at its defaults")
@click.option("--rounds", type=click.IntRange(min=1), default=2, show_default=True,
              help="interleaved timing rounds (every candidate once a round, odd rounds in reverse; the median is "
                   "kept)")
@click.option("--jobs", type=click.IntRange(min=1), default=os.cpu_count() or 1, show_default="CPUs",
              help="processes compiling the candidates")
@click.option("--seed", type=int, default=0, show_default=True, help="seed of the random inputs")
@click.option("--show", is_flag=True, help="print the stored table (no GPU needed; --format and --head-dim filter it)")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True, path_type=Path),
              callback=_json_path, help="also write the entries (every candidate's time, the rejected ones' reasons) "
                                        "as JSON to FILE")
@click.pass_context
@user_errors
def tune(ctx, formats, head_dims, causal, shapes, queries, heads, kv_heads, tiles, warps, stages, mma, sweep_options,
         rounds, jobs, seed, show, json_path):
    """Sweep the tiles of each format's prefill kernel on this GPU (on each matrix unit its arch
    has, with each combination of the unit's template options), check each candidate's output
    against FP64 once (a wrong one is rejected), time the rest in interleaved rounds, and store the
    fastest per format, head dim, causal flag and shape class in the cache directory, keyed by the
    GPU's name, its driver and the qattn version. Each sweep also times the kernel its shape's calls
    run untuned (the built-in tables'), so the stored winner is never one it timed slower.
    qattn.attention runs the stored kernel from then on (QATTN_TUNED=0 ignores the table; the
    built-in tables apply where it has no entry)."""
    if show:
        given = [option for name, option in SWEEP_OPTIONS.items()
                 if ctx.get_parameter_source(name) is not ParameterSource.DEFAULT]
        if given:
            raise click.UsageError(f"--show prints the stored table; leave out {', '.join(given)}")
        _show(formats, head_dims, json_path)
        return
    arch = device_arch()
    if arch is None:
        raise click.ClickException("tune: no CUDA GPU found; timing needs one (`qattn tune --show` prints the "
                                   "stored table without one)")
    heads_kv = heads if kv_heads is None else kv_heads
    sweep_shapes = [Shape(batch, heads, heads_kv, queries or ctx_len, ctx_len) for batch, ctx_len in shapes or
                    [DEFAULT_SHAPE]]
    causals = [False, True] if causal is None else [causal]
    jobs_planned = tuning.plan(formats or ["f16"], head_dims or [128], causals, sweep_shapes, arch,
                               block_shapes=tiles, warps=warps, stages=stages, mma=list(mma) or None,
                               options=sweep_options)
    with _Progress("tune", tuning.steps(jobs_planned, rounds)) as progress:
        entries = tuning.run(jobs_planned, rounds=rounds, seed=seed, build_jobs=jobs, progress=progress.done)
    table = _table(f"tuned on {entries[0].device.gpu} ({arch}, driver {entries[0].device.driver})", "format", "D",
                   "causal", "shape class", "timed at", "winner", "ms", "built-in", "built-in ms", "vs built-in",
                   "rejected", right=("D", "ms", "built-in ms", "vs built-in", "rejected"))
    for e in entries:
        table.add_row(e.format, str(e.head_dim), "yes" if e.causal else "no", e.shape_class.name,
                      Shape(**e.shape).label, e.kernel.name, _fmt(e.ms, ".4f"), e.default_tile,
                      _fmt(e.candidates.get(e.default_tile), ".4f"), _vs_default(e), str(len(e.rejected)))
    console = _console()
    console.print(table)
    console.print(f"stored in {tuned.table_path()}")
    _note_disabled()
    if json_path is not None:
        write_json(json_path, [e.as_json() for e in entries])


def _show(formats, head_dims, json_path) -> None:
    path = tuned.table_path()
    entries = [e for e in tuned.load(path) if (not formats or e.format in formats)
               and (not head_dims or e.head_dim in head_dims)]
    if json_path is not None:
        write_json(json_path, [e.as_json() for e in entries])
    if not entries:
        click.echo(f"no tuned tiles stored in {path}" + (" for the formats and head dims given" if formats or head_dims
                                                          else "; `qattn tune` on a GPU stores them"))
        return
    device = tuned.current_device()
    table = _table(f"tuned kernels in {path}", "GPU", "driver", "qattn", "arch", "format", "D", "causal",
                   "shape class", "kernel", "ms", "vs built-in", "used here", right=("D", "ms", "vs built-in"))
    for e in sorted(entries, key=_order):
        table.add_row(e.device.gpu, e.device.driver, e.device.qattn, e.arch, e.format, str(e.head_dim),
                      "yes" if e.causal else "no", e.shape_class.name, e.kernel.name, _fmt(e.ms, ".4f"), _vs_default(e),
                      _used(e, device))
    console = _console()
    console.print(table)
    classes = {}
    for e in entries:
        if _used(e, device) == "yes":
            classes.setdefault(e.key[:5], []).append(e)
    for (_, _, fmt, d, causal), group in classes.items():
        if len(group) > 1:
            console.print(f"{fmt} d{d} {'causal' if causal else 'non-causal'}: a call that names no shape class "
                          f"(qattn.attention) runs {tuned.best_overall(group).name}, the best over these "
                          f"{len(group)} classes")
    _note_disabled()


def _vs_default(e: tuned.TunedEntry) -> str:
    """How much faster the winner ran than the kernel the shape's calls run untuned, in the same sweep ("-": that
    kernel was not timed)."""
    default_ms = e.candidates.get(e.default_tile)
    return "-" if default_ms is None else f"{default_ms / e.ms:.2f}x"


def _order(e: tuned.TunedEntry) -> tuple:
    return (e.device.gpu, e.device.driver, e.device.qattn, e.arch, e.format, e.head_dim, e.causal, *e.shape_class.order)


def _used(entry: tuned.TunedEntry, device: tuned.Device | None) -> str:
    """Whether calls here would run the entry's tile: its qattn version, GPU and driver must match."""
    if entry.device.qattn != __version__:
        return f"no: qattn is {__version__}"
    if device is None:
        return "- (no GPU)"
    if entry.device.gpu != device.gpu:
        return "no: another GPU"
    if entry.device.driver != device.driver:
        return f"no: driver is {device.driver}"
    return "yes"


def _note_disabled() -> None:
    if not tuned.enabled():
        _note("QATTN_TUNED is off: qattn.attention ignores this table until it is unset")
