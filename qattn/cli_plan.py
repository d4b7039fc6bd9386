"""`qattn plan`: the format to use at an operating point, decode or prefill, from each candidate's error against
FP64 and its time. qattn.cli adds the group to its own."""
from __future__ import annotations

from pathlib import Path

import click

from .cli_support import HELP, _console, _fmt, _json_path, _table, user_errors, write_json
from .data import PRESETS
from .engine.spec import device_arch


@click.group(context_settings=HELP)
def plan():
    """Pick a format for an operating point."""


TABLE_GPUS = ("H200", "H100")  # the GPUs both plans have a measured table of, the default first


def _plan_options(fn):
    """The options both plans take: the head layout, the data the errors are measured on, the timing and --json."""
    for option in reversed((
            click.option("--heads", type=click.IntRange(min=1), default=32, show_default=True, help="query heads"),
            click.option("--kv-heads", type=click.IntRange(min=1), default=8, show_default=True, help="kv heads"),
            click.option("--head-dim", type=click.Choice(["64", "128"]), default="128", show_default=True),
            click.option("--npz", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                         help="captured q, k, v [B, H, L, D] to measure the errors on (default: --preset)"),
            click.option("--preset", type=click.Choice(sorted(PRESETS)), default="normal", show_default=True,
                         help="qattn.data preset for the errors when no --npz is given"),
            click.option("--measure/--no-measure", default=None,
                         help="time the formats on the local GPU [default: when one is present; else a table "
                              "measured on a GPU, --gpu]"),
            click.option("--gpu", type=click.Choice(list(TABLE_GPUS), case_sensitive=False),
                         help="time the formats by the table measured on this GPU (implies --no-measure) [default "
                              "without --measure: the local GPU's table where there is one, else the H200's]"),
            click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True, path_type=Path),
                         callback=_json_path, help="also write the candidates and the choice as JSON to FILE"))):
        fn = option(fn)
    return fn


def table_gpu(device_name: str | None) -> str:
    """The measured table for a GPU by its name as the driver gives it ("NVIDIA H100 80GB HBM3" -> "H100"): the
    first of TABLE_GPUS where no table is of that GPU or there is none."""
    return next((gpu for gpu in TABLE_GPUS if device_name and gpu in device_name.upper()), TABLE_GPUS[0])


def _plan_timing(kind: str, heads: int, kv_heads: int, measure, gpu) -> str | None:
    """How a plan times its candidates: None to time them on the local GPU (--measure's default: when there is
    one), else the TABLE_GPUS key of the measured table to look them up in (--gpu, else the local GPU's); the
    head layout checked."""
    from .engine.tuned import current_device

    if heads % kv_heads:
        raise click.BadParameter(f"{heads} is not a multiple of --kv-heads {kv_heads}", param_hint="'--heads'")
    if gpu is not None and measure:
        raise click.UsageError("--gpu picks a measured table, --measure times on the local GPU: give one of them")
    measure = (device_arch() is not None if measure is None else measure) and gpu is None
    if measure and device_arch() is None:
        raise click.ClickException(f"plan {kind} --measure: no CUDA GPU found")
    if measure:
        return None
    local = current_device()
    return gpu.upper() if gpu else table_gpu(local.gpu if local else None)


def _plan_report(title: str, name_header: str, errors: dict, times: dict, unit: str, chosen: str, why: str,
                 gate: float, data: str, point: dict, json_path, call: str | None = None) -> None:
    """A plan's table (each candidate's error, time and gate), its choice (and the call that runs it), and its JSON:
    the operating point, the data, each candidate (time null where untimed; `time_unit`: ms, or relative to the
    table's reference) and the choice."""
    table = _table(title, name_header, "rel_l2 vs FP64", f"time ({unit})", "within gate", "",
                   right=("rel_l2 vs FP64", f"time ({unit})"))
    for name, err in errors.items():
        table.add_row(name, _fmt(err, ".2e"), _fmt(times.get(name), ".3f"), "yes" if err <= gate else "no",
                      "<- chosen" if name == chosen else "")
    console = _console()
    console.print(table)
    console.print(f"chosen: {chosen} ({why}; gate rel_l2 <= {gate:g})" + (f": {call}" if call else ""))
    if json_path:
        write_json(json_path, {**point, "data": data, "max_rel_l2": gate, "time_unit": unit, "chosen": chosen,
                               "why": why, **({"call": call} if call else {}),
                               "candidates": [{"name": name, "rel_l2": err, "time": times.get(name),
                                               "within_gate": err <= gate} for name, err in errors.items()]})


@plan.command("decode")
@click.option("--batch", type=click.IntRange(min=1), default=8, show_default=True, help="sequences")
@click.option("--ctx", type=click.IntRange(min=1), default=32768, show_default=True, help="cached tokens per sequence")
@click.option("--max-rel-l2", type=click.FloatRange(min=0, min_open=True), default=3e-2, show_default=True,
              help="the quality gate: rel_l2 against FP64 on the original K/V")
@click.option("--page-size", type=click.Choice(["16", "32", "64", "128"]), default="32", show_default=True)
@click.option("--scale", type=click.Choice(("token", "head")), default="token", show_default=True)
@_plan_options
@user_errors
def plan_decode(batch, ctx, max_rel_l2, page_size, scale, heads, kv_heads, head_dim, npz, preset, measure, gpu,
                json_path):
    """For an operating point, each cache format on each QK path (an i8 K also with Q/K channel
    balancing; with the pre-bias residual K where the data has a K bias: an npz's k_bias, the bias
    preset's) with its error against FP64 on
    the original K/V (its CPU emulator, on --npz tensors or a preset, at up to 4096 keys) and its
    decode time (a quick run on the local GPU, else relative to f16-f16 as measured on an H200 or an H100,
    --gpu), and the one to use: the fastest within --max-rel-l2, K16/V8 when no 8-bit K passes."""
    from .formats.decode import plan as planner

    table = _plan_timing("decode", heads, kv_heads, measure, gpu)
    errors = planner.format_errors(npz=npz, preset=preset, ctx=ctx, heads=heads, kv_heads=kv_heads,
                                   head_dim=int(head_dim), page_size=int(page_size), scale=scale)
    if table is None:
        times = planner.measured_times(list(errors), batch=batch, ctx=ctx, heads=heads, kv_heads=kv_heads,
                                       head_dim=int(head_dim), page_size=int(page_size), scale=scale)
        unit, source = "ms", "measured on this GPU"
    else:
        times = planner.table_times(errors, gpu=table)
        unit, source = "x f16-f16", f"relative times measured on the {table} (BENCHMARKS.md)"
    chosen, why = planner.choose(errors, times, max_rel_l2)
    data = str(npz) if npz else f"preset {preset}"
    _plan_report(f"decode at batch {batch}, ctx {ctx}, heads {heads}/{kv_heads}, D {head_dim}: errors on {data}; "
                 f"times {source}", "format / QK path", errors, times, unit, chosen, why, max_rel_l2, data,
                 dict(kind="decode", batch=batch, ctx=ctx, heads=heads, kv_heads=kv_heads, head_dim=int(head_dim),
                      page_size=int(page_size), scale=scale), json_path)


@plan.command("prefill")
@click.option("--batch", type=click.IntRange(min=1), default=4, show_default=True, help="sequences")
@click.option("--seq", type=click.IntRange(min=1), default=4096, show_default=True, help="tokens per sequence")
@click.option("--causal/--no-causal", default=False, show_default=True, help="bottom-right aligned causal mask")
@click.option("--dtype", type=click.Choice(["float16", "bfloat16"]), default="float16", show_default=True,
              help="the inputs' type: f16 or bf16 is the 16-bit format weighed")
@click.option("--max-rel-l2", type=click.FloatRange(min=0, min_open=True), default=5e-2, show_default=True,
              help="the quality gate: rel_l2 against FP64 (SageAttention2's on N(0,1) is 3.4e-2 to 3.9e-2)")
@_plan_options
@user_errors
def plan_prefill(batch, seq, causal, dtype, max_rel_l2, heads, kv_heads, head_dim, npz, preset, measure, gpu,
                 json_path):
    """For an operating point, each prefill format of the inputs' type (the 16-bit one, i8-f16, i8-i8 and
    i8-f8, the int8-QK ones with K smoothing and with Q/K channel balancing too) with its error against
    FP64 (its CPU emulator on --npz tensors or a preset: the last 256 query rows of up to 4096 keys, up to 8
    query heads) and its time (a quick run of whole calls on the local GPU, else relative to cuDNN's as
    measured on an H200 or an H100, --gpu), and the one to use: the fastest within --max-rel-l2, the 16-bit
    format when no timed one is within."""
    from .check import prefill_plan as planner

    table = _plan_timing("prefill", heads, kv_heads, measure, gpu)
    errors = planner.format_errors(dtype=dtype, npz=npz, preset=preset, seq=seq, heads=heads, kv_heads=kv_heads,
                                   head_dim=int(head_dim), causal=causal)
    if table is None:
        times = planner.measured_times(list(errors), batch=batch, seq=seq, heads=heads, head_dim=int(head_dim),
                                       causal=causal)
        unit, source = "ms", "measured on this GPU"
    else:
        times = planner.table_times(errors, head_dim=int(head_dim), causal=causal, seq=seq, gpu=table)
        unit, source = "x cuDNN's", f"relative to cuDNN's as measured on the {table} (BENCHMARKS.md)"
    chosen, why = planner.choose(errors, times, max_rel_l2, dtype)
    data = str(npz) if npz else f"preset {preset}"
    call = f"qattn.attention(q, k, v, {planner.call_of(chosen)}{', causal=True' if causal else ''})"
    _plan_report(f"prefill at batch {batch}, seq {seq}, heads {heads}/{kv_heads}, D {head_dim}, "
                 f"{'causal' if causal else 'non-causal'}, {dtype}: errors on {data}; times {source}", "format",
                 errors, times, unit, chosen, why, max_rel_l2, data,
                 dict(kind="prefill", batch=batch, seq=seq, heads=heads, kv_heads=kv_heads, head_dim=int(head_dim),
                      causal=causal, dtype=dtype), json_path, call)
