"""The qattn command line: list, gen, inspect, compile, parity, probe, cache here; bench (cli_bench.py), plan
(cli_plan.py) and tune (tune/command.py) added to the group from their own modules.

Kernel specs are given the same way everywhere (KIND, --format, --head-dim, --tile, --warps,
--stages, --causal, --backend, --mma, --arch). User errors (a bad option, a spec that does not fit, a
failed compile) end in a one-paragraph message that names the option, never a traceback.
"""
from __future__ import annotations

import functools
import itertools
import json
import math
import re
import sys
import time
from pathlib import Path

import click

from . import __version__
from .engine import registry
from .engine.family import BACKENDS, KINDS
from .engine.registry import RECIPES, recipe
from .engine.spec import KernelSpec, device_arch
from .engine.tile import Tile
from .engine.cache import KernelCache
from .engine.compile import CompileError
from .data import PRESETS
from .cli_support import (ALL_FORMATS, HELP, _console, _fmt, _json_path, _note, _Progress,
                          _split_formats, _table, user_errors, write_json)
from .cli_bench import bench
from .cli_plan import plan
from .tune.command import tune

FALLBACK_ARCH = {"cuda": "sm_90a", "hip": "gfx942"}


def _default_arch(backend: str) -> str:
    """The current GPU's arch, else a fallback named on stderr (compiling needs no GPU)."""
    arch = device_arch() if backend == "cuda" else None
    if arch is None:
        arch = FALLBACK_ARCH[backend]
        _note(f"no {backend.upper()} GPU found; compiling for --arch {arch}")
    return arch


# ---- kernel specs ---------------------------------------------------------------------------

DEFAULT_FORMAT = {"prefill": "f16", "decode": "f16-f16"}


def _parse_template_options(ctx, param, values) -> dict:
    """--option NAME=VALUE pairs as a dict (a name once)."""
    options = {}
    for value in values:
        name, eq, setting = value.partition("=")
        name, setting = name.strip(), setting.strip()
        if not eq or not name or not setting:
            raise click.BadParameter(f"expected NAME=VALUE, e.g. persistent=on, got {value!r}")
        if name in options:
            raise click.BadParameter(f"{name} given twice ({options[name]!r} and {setting!r})")
        options[name] = setting
    return options


def template_options(kind: str, options: dict) -> dict:
    """The prefill template options of --option (a decode kernel's are its own flags, --page-size to --k-rope)."""
    if options and kind != "prefill":
        raise click.BadParameter(f"{kind} kernels take their options as --page-size, --scale, --qk, --k-mean, "
                                 "--k-balance and --k-rope", param_hint="'--option'")
    return options


def decode_options(kind: str, page_size: int | None, scale: str | None, qk: str | None,
                   k_mean: str | None = None, k_balance: bool | None = None, k_rope: str | None = None) -> dict:
    """The spec options of --page-size, --scale, --qk, --k-mean, --k-balance and --k-rope: decode kernels only."""
    given = {name: value for name, value in (("--page-size", page_size), ("--scale", scale), ("--qk", qk),
                                             ("--k-mean", k_mean), ("--k-balance", k_balance), ("--k-rope", k_rope))
             if value is not None}
    if kind != "decode":
        if given:
            raise click.BadParameter(f"{kind} kernels take no {', '.join(given)}; they are decode options",
                                     param_hint=" / ".join(f"'{name}'" for name in given))
        return {}
    balance = None if k_balance is None else "on" if k_balance else "off"
    options = {"page_size": page_size, "scale_mode": scale, "k_mean": k_mean, "k_balance": balance, "k_rope": k_rope,
               "qk": qk or "auto"}
    return {name: value for name, value in options.items() if value is not None}


def _resolve_qk(fmt: str, backend: str, arch: str, options: dict) -> dict:
    """A decode spec's options with --qk resolved for its backend and arch ("auto": the path a call
    runs there); a format without QK paths (16-bit K) takes auto or transform and no option."""
    from .formats.decode.recipes import resolve_qk

    rest = {name: value for name, value in options.items() if name != "qk"}
    qk = options.get("qk", "auto")
    paths = recipe(fmt, "decode").family(backend).options.get("qk")
    if paths is None:
        if qk not in ("auto", "transform"):
            raise click.BadParameter(f"{fmt} on {backend} has only the transform path, got {qk!r}", param_hint="'--qk'")
        return rest
    try:
        path = resolve_qk(fmt, arch, qk) if backend == "cuda" else (paths[0] if qk == "auto" else qk)
    except ValueError as exc:
        raise click.BadParameter(str(exc).removeprefix("qk: "), param_hint="'--qk'") from None
    return {**rest, "qk": path}


def check_queries(kind: str, queries, tile=None, warps=None, stages=None, mma=None, options=None,
                  heads=None) -> None:
    """--queries picks a prefill kernel by the calls' query rows (and --heads, their sequence-heads): refused with a
    decode kind or a kernel named; --heads alone is refused too."""
    if heads and not queries:
        raise click.BadParameter("the kernel a call runs depends on its query rows first: give --queries too",
                                 param_hint="'--heads'")
    if not queries:
        return
    if kind != "prefill":
        raise click.BadParameter(f"{kind} kernels do not depend on a call's query rows (a decode call's QK path "
                                 "does: --qk, or --all for every path)", param_hint="'--queries'")
    named = [name for name, value in (("--tile", tile), ("--warps", warps), ("--stages", stages), ("--mma", mma),
                                      ("--option", options)) if value]
    if named:
        raise click.BadParameter(f"the kernel is named by {', '.join(named)}; --queries picks the one calls of "
                                 "that many query rows run: give one or the other", param_hint="'--queries'")


def make_spec(kind: str, fmt: str | None, head_dim: int, tile: str | None, warps: int | None, stages: int | None,
              causal: bool, backend: str, arch: str, mma: str | None = None, options: dict | None = None,
              queries: int | None = None, heads: int | None = None) -> KernelSpec:
    """A validated KernelSpec from command-line values. Without --tile the family's tuned tile is
    used; --warps and --stages override its warps and stages; with queries (CUDA prefill), the kernel
    that calls of that many query rows run over `heads` sequence-heads (None: many)."""
    check_queries(kind, queries, tile, warps, stages, mma, options, heads)
    fmt = fmt or DEFAULT_FORMAT[kind]
    if queries and backend == "cuda":
        from .engine.spec import builtin_spec

        recipe(fmt, kind).family(backend)  # an unknown or kernel-less format is named first
        return builtin_spec(fmt, head_dim, causal, queries, arch, heads)
    if kind == "decode":
        options = _resolve_qk(fmt, backend, arch, options or {})
    spec = KernelSpec(kind=kind, recipe=fmt, head_dim=head_dim, causal=causal,
                      backend=backend, arch=arch, mma=mma, options=options or {})
    given = [name for name, value in (("--tile", tile), ("--warps", warps), ("--stages", stages)) if value is not None]
    if not given:
        return spec
    base = spec.tile
    warps, stages = warps or base.warps, stages or base.stages
    try:
        new = Tile.parse(tile, warps, stages) if tile else Tile(base.block_m, base.block_n, warps, stages)
        return spec.with_(tile=new)
    except ValueError as exc:  # the tile comes from up to three options: name the ones given
        raise click.BadParameter(str(exc), param_hint=" / ".join(f"'{name}'" for name in given)) from None


def spec_options(repeatable: bool = False):
    """KIND and the spec options; `repeatable` makes --format, --head-dim and --arch repeatable."""
    many = "; repeatable" if repeatable else ""
    decorators = [
        click.argument("kind", type=click.Choice(KINDS), default="prefill", required=False, metavar="[KIND]"),
        click.option("--format", "-f", "fmt", type=click.Choice(ALL_FORMATS), multiple=repeatable, default=None,
                     help=f"operand format (see `qattn list`; default: f16, or f16-f16 for decode){many}"),
        click.option("--head-dim", "-d", type=int, multiple=repeatable, default=None if repeatable else 128,
                     show_default=not repeatable, help=f"head dimension D{many}"),
        click.option("--tile", metavar="BMxBN", help="BLOCK_M x BLOCK_N, e.g. 128x64 (default: the tuned tile)"),
        click.option("--warps", type=click.IntRange(min=1), help="warps (waves on HIP) per block"),
        click.option("--stages", type=click.IntRange(min=1), help="K/V tiles in flight (pipeline depth)"),
        click.option("--causal/--no-causal", default=None,
                     help="bottom-right aligned causal mask (prefill; decode rows always are)" +
                          (" (default: off; both with --all)" if repeatable
                                                                else " [default: no-causal]")),
        click.option("--backend", type=click.Choice(BACKENDS), default="cuda", show_default=True,
                     help="code generator and compiler: cuda (NVRTC) or hip (clang, offline)"),
        click.option("--mma", metavar="UNIT", help="matrix unit where the arch offers a choice, e.g. wgmma for "
                                                   "i8-f8 on sm_90a (default: the arch's default)"),
        click.option("--page-size", type=int, help="decode: tokens per cache page (default 32)"),
        click.option("--scale", type=click.Choice(("token", "head")),
                     help="decode: scales of an 8-bit cache side, per token or per kv head (default token)"),
        click.option("--qk", type=click.Choice(("auto", "transform", "fp8", "int8")),
                     help="decode: the QK path over an 8-bit K: transform (codes converted on chip), fp8 / int8 "
                          "(Q quantized, 8-bit MMA), or auto (the arch's pick for up to 8 query rows per kv head, GQA x "
                          "new tokens; default)"),
        click.option("--k-mean", type=click.Choice(("off", "page")),
                     help="decode: an 8-bit K's page means (K - μ_page stored, q·μ_page added back) or off (default)"),
        click.option("--k-balance/--no-k-balance", "k_balance", default=None,
                     help="decode: Q/K channel balancing of an 8-bit K (K / α stored, q·α at the Q load) [default: off]"),
        click.option("--k-rope", type=click.Choice(("off", "post", "pre")),
                     help="decode: the residual K of an 8-bit K with a pre-RoPE bias: post-RoPE keys (K - R_p b stored, "
                          "q·R_p b added back per key), pre-RoPE keys (k_pre - b stored, turned on chip; transform "
                          "path) or off (default)"),
        click.option("--option", "options", multiple=True, metavar="NAME=VALUE", callback=_parse_template_options,
                     help="prefill: a template option of the kernel's family, e.g. persistent=on or pingpong=off on the "
                          "sm_90a wgmma kernels (`qattn list` names each family's); repeatable"),
        click.option("--queries", type=click.IntRange(min=1), multiple=repeatable, metavar="N",
                     help="prefill: the kernel that qattn.attention calls of N query rows per sequence run on the arch "
                          "(on sm_90a it depends on them; with compile, also any `qattn tune` stored for such calls on "
                          f"this GPU) instead of the family's default{many}"),
        click.option("--heads", type=click.IntRange(min=1), metavar="N",
                     help="prefill, with --queries: the calls' sequence-heads (batch x query heads), on which the "
                          "kernel of 512-1023 rows depends on sm_90a [default: many]"),
        click.option("--arch", "arch", multiple=repeatable, metavar="ARCH",
                     help=f"target, e.g. sm_90a or gfx942 (default: the current GPU's, else "
                          f"{FALLBACK_ARCH['cuda']} / {FALLBACK_ARCH['hip']}){many}"),
    ]

    def decorate(fn):
        for deco in reversed(decorators):
            fn = deco(fn)
        return fn
    return decorate


@click.group(context_settings=HELP)
@click.version_option(__version__, prog_name="qattn")
def main():
    """qattn: low-precision flash-attention kernels generated from Jinja templates, compiled at run
    time and checked against an FP64 reference."""


def _option_choices(family, name: str) -> str:
    """An option's values, with the head dims whose default is not the first (pingpong off|on (d128: on))."""
    first = family.options[name][0]
    other = [f"d{d}: {family.option_default(name, d)}" for d in family.head_dims if family.option_default(name, d) != first]
    return f"{name} {'|'.join(map(str, family.options[name]))}" + (f" ({', '.join(other)})" if other else "")


@main.command("list")
def list_():
    """Show kernel kinds, formats, and for each backend its head dims, default tiles, template options and archs."""
    console = _console()
    console.print(f"kinds: {', '.join(KINDS)}")
    formats = _table("formats", "format", "summary", "inputs", "kernels", "max_rel / rel_l2")
    for name, rec in RECIPES.items():
        formats.add_row(name, rec.summary, ", ".join(rec.input_dtypes), ", ".join(rec.families) or "-",
                        f"{rec.tolerance.max_rel:g} / {rec.tolerance.rel_l2:g}")
    console.print(formats)
    console.print("Every format runs on its CPU emulator (parity --backend numpy); "
                  "'kernels' lists the backends with generated kernels.")
    decode = _table("decode formats (K-V: the cache's K and V dtypes)", "format", "summary", "queries", "kernels",
                    "max_rel / rel_l2")
    for name, rec in registry.recipes("decode").items():
        family = rec.families.get("cuda")
        decode.add_row(name, rec.summary, ", ".join(rec.input_dtypes), ", ".join(rec.families) or "-",
                       f"{rec.tolerance.max_rel:g} / {rec.tolerance.rel_l2:g}")
    console.print(decode)
    if family is not None:
        from .formats.decode.recipes import PAGE_SIZES, QK_CODE, SM90_TILES, TWO_WARP_PAGES_AT, tolerance, two_warp_pages

        paths = ", ".join(f"{path} ({code} K; tolerance {tolerance('i8-i8', path).max_rel:g} / "
                          f"{tolerance('i8-i8', path).rel_l2:g})" for path, code in QK_CODE.items())
        def pages(k, v, d=128):
            sizes = sorted(two_warp_pages((k, v), d))
            if sizes == sorted(PAGE_SIZES):
                return "every size"
            return " and ".join(filter(None, (", ".join(map(str, sizes[:-1])), str(sizes[-1])))) if sizes else ""

        def where(k, v):
            by_dim = [f"{pages(k, v, d)} at d{d}" for (bits, d) in TWO_WARP_PAGES_AT if bits == (k, v)]
            return f"{pages(k, v)}{''.join(f' ({p})' for p in by_dim)}" if pages(k, v) else "; ".join(by_dim)

        sm90 = ", ".join(f"K{k}/V{v} {tile.name} on pages of {where(k, v)}" for (k, v), tile in SM90_TILES.items())
        console.print(f"decode kernels: head dims {', '.join(map(str, family.head_dims))}; "
                      + "; ".join(f"{k} {', '.join(map(str, v))}" for k, v in family.options.items() if k != "qk")
                      + f"; qk transform, {paths}, auto (per arch, format and query rows of a kv head); tile "
                        f"{family.default_tiles[128].name}, on sm_90a {sm90} (the 8-bit QK paths keep four warps); "
                        f"archs {', '.join(family.archs)} (e4m3 sides from sm_89)")
    # One row per Family object: formats share a row only where they share head dims, tiles and archs.
    # A family that some archs build instead of the backend's (Recipe.arch_families) lists those archs.
    families: dict[tuple, tuple] = {}  # (backend, id(family)) -> (family, formats using it, archs or None)
    for name, rec in RECIPES.items():
        for backend, family in rec.families.items():
            families.setdefault((backend, id(family)), (family, [], None))[1].append(name)
        for (backend, arch), options in rec.arch_families.items():
            for i, family in enumerate(options):
                if family is rec.families.get(backend):
                    continue  # the backend's own family: its row lists this arch too
                unit = family.values["mma_unit"]
                label = f"{name} ({'default: ' + unit if i == 0 else '--mma ' + unit})"
                entry = families.setdefault((backend, id(family)), (family, [], []))
                if label not in entry[1]:
                    entry[1].append(label)
                if arch not in entry[2]:  # (formats that share the family name its archs once)
                    entry[2].append(arch)
    kernels = _table("kernels", "backend", "formats", "head dims", "default tiles (m BLOCK_M n BLOCK_N w warps s stages)", "archs")
    options = _table("template options of the prefill kernels (--option NAME=VALUE; the default first, or as named "
                     "for a head dim)", "backend", "formats", "options")
    for (backend, _), (family, names, used_on) in sorted(families.items(), key=lambda item: (item[0][0], item[1][1][0])):
        if used_on is None:  # the backend's family: on the archs that do not build another one
            used_on = [a for a in family.archs
                       if all(family in RECIPES[n].arch_families.get((backend, a), (family,)) for n in names)]
        tiles = [f"d{d}: {t.name}" for d, t in sorted(family.default_tiles.items())]
        # (head_dim, causal, tile) -> archs where a tuned tile, or a smaller one that fits the
        # arch's shared memory, replaces the default
        replaced: dict[tuple, list] = {}
        for d, causal, arch in itertools.product(family.head_dims, (False, True), used_on):
            t = family.default_tile(d, causal, arch)
            if t != family.default_tiles[d]:
                replaced.setdefault((d, causal, t.name), []).append(arch)
        tiles += [f"d{d}{' causal' if c else ''} on {', '.join(archs)}: {t}" for (d, c, t), archs in sorted(replaced.items())]
        tiles = "\n".join(tiles)
        kernels.add_row(backend, ", ".join(names), ", ".join(map(str, family.head_dims)), tiles,
                        ", ".join(used_on))
        if family.options:
            options.add_row(backend, ", ".join(names), "; ".join(_option_choices(family, name) for name in family.options))
    console.print(kernels)
    console.print(options)


@main.command()
@spec_options()
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True, path_type=Path),
              help="write the source to FILE instead of printing it")
@user_errors
def gen(kind, fmt, head_dim, tile, warps, stages, causal, backend, mma, page_size, scale, qk, k_mean, k_balance, k_rope,
        options, queries, heads, arch, output):
    """Print the rendered kernel source of one spec (KIND: prefill or decode)."""
    from .engine.render import render

    spec = make_spec(kind, fmt, head_dim, tile, warps, stages, bool(causal), backend, arch or _default_arch(backend), mma,
                     {**template_options(kind, options),
                      **decode_options(kind, page_size, scale, qk, k_mean, k_balance, k_rope)}, queries, heads)
    source = render(spec)
    if output is None:
        click.echo(source, nl=False)
    else:
        output.write_text(source)
        click.echo(f"wrote {spec.name} to {output}", err=True)


# ---- inspect: resources and instruction counts ---------------------------------------------

def inspect_spec(spec: KernelSpec) -> dict:
    """engine.inspect.inspect_spec, with a missing clang reported as a usage problem."""
    from .engine.inspect import inspect_spec as inspect_compiled

    try:
        return inspect_compiled(spec)
    except CompileError:
        raise
    except RuntimeError as exc:  # no clang: a setup problem with an install hint, not a crash
        raise click.ClickException(str(exc)) from None


_LISTING_NOTE = {
    "sass": "counted in the SASS (nvdisasm)",
    "ptx": "counted in the PTX: no nvdisasm found (pip install nvidia-cuda-nvdisasm for SASS)",
    "amdgpu": "counted in the AMDGPU disassembly (llvm-objdump)",
    None: "not counted: no disassembler found (llvm-objdump)",
}


def _resource_rows(backend: str, res: dict) -> list[tuple[str, object]]:
    """(label, value) rows of `inspect`, in each compiler's terms: ptxas's per-thread registers,
    shared memory and spill bytes; clang's per-lane VGPRs, per-wave SGPRs, LDS, scratch and
    spilled registers."""
    if backend == "cuda":
        hand_over = ([("registers after setmaxnreg: producer / consumers",
                       f"{res['registers_released']} / {res['registers_claimed']}")]
                     if "registers_claimed" in res else [])
        return [("registers / thread", res.get("registers")), *hand_over, ("threads / block", res["threads"]),
                ("shared memory, static (B)", res.get("static_smem")),
                ("shared memory, dynamic (B)", res["dynamic_smem"]), ("stack frame (B)", res.get("stack")),
                ("spill stores (B)", res.get("spill_stores")), ("spill loads (B)", res.get("spill_loads")),
                ("blocks / SM", res.get("blocks_per_sm"))]
    return [("VGPRs / lane", res.get("registers")), ("SGPRs / wave", res.get("sgprs")),
            ("threads / block", res["threads"]), ("LDS, dynamic (B)", res["dynamic_smem"]),
            ("scratch (B / lane)", res.get("scratch")), ("VGPRs spilled", res.get("vgpr_spills")),
            ("SGPRs spilled", res.get("sgpr_spills")), ("occupancy (waves / SIMD)", res.get("occupancy_waves"))]


@main.command()
@spec_options()
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
@user_errors
def inspect(kind, fmt, head_dim, tile, warps, stages, causal, backend, mma, page_size, scale, qk, k_mean, k_balance, k_rope,
            options, queries, heads, arch, as_json):
    """Compile one spec and show its resources (CUDA: registers, shared memory, stack, spills,
    blocks/SM; HIP: VGPRs, SGPRs, LDS, scratch, spills, waves/SIMD) and its matrix and conversion
    instructions."""
    spec = make_spec(kind, fmt, head_dim, tile, warps, stages, bool(causal), backend, arch or _default_arch(backend), mma,
                     {**template_options(kind, options),
                      **decode_options(kind, page_size, scale, qk, k_mean, k_balance, k_rope)}, queries, heads)
    report = inspect_spec(spec)
    named_tile = tile is not None or warps is not None or stages is not None or bool(options) or bool(queries)
    # prefill only: a decode kernel's tile is fixed by its format
    listed = () if spec.kind != "prefill" or named_tile or backend != "cuda" or spec.mma is not None else \
        registry.launch_choices(spec.recipe, spec.head_dim, spec.arch, spec.causal)
    if listed:  # what qattn.attention runs instead of the default shown here, by the call's query rows
        report["launch_tiles"] = [{"tile": c.tile.name, "least_queries": c.least_queries, "least_heads": c.least_heads,
                                   "mma": c.mma or spec.family.values.get("mma_unit"), "options": dict(c.options)}
                                  for c in listed]
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    console = _console()
    table = _table(spec.name, "resource", "value", right=("value",))
    for label, value in _resource_rows(spec.backend, report["resources"]):
        table.add_row(label, "-" if value is None else str(value))
    console.print(table)
    for i, choice in enumerate(listed):
        least, t, unit = choice.least_queries, choice.tile, choice.mma
        upper = next((c.least_queries - 1 for c in listed[i + 1:] if c.least_queries > least), None)
        calls = ("calls" if least <= 1 else f"calls of at least {least} query rows") if upper is None else \
            f"calls of {least} to {upper} query rows"
        if choice.least_heads > 1:
            calls += f" over at least {choice.least_heads} sequence-heads (batch x heads)"
        on_unit = f" on {unit}" if unit else ""
        options = "".join(f", {name} {value}" for name, value in choice.options)
        heads = f" --heads {choice.least_heads}" if choice.least_heads > 1 else ""
        console.print(f"note: on {spec.arch}, qattn.attention {calls} run {t.name}{on_unit}{options} instead "
                      f"(inspect it with --queries {max(least, 1)}{heads})")
    if "scale_blocks" in report:
        blocks = report["scale_blocks"]
        rows = "one Q scale per query row" if blocks["q_rows"] == 1 else f"{blocks['q_rows']} query rows per Q scale"
        groups = "" if blocks["k_groups"] == 1 else f" in {blocks['k_groups']} K scale groups"
        options = ", ".join(f"{k}={v!r}" for k, v in blocks["emulator"].items())
        console.print(f"format blocks: {rows}, {blocks['k_keys']} keys per K scale block{groups} and softmax step "
                      f"(the emulator's {options})")
    if "emulator" in report:
        options = ", ".join(f"{k}={v!r}" for k, v in report["emulator"].items())
        console.print(f"emulator: emulate({spec.recipe!r}, q, k, v, {options}) models this kernel")
    instr = report["instructions"]
    counts = _table(f"instructions, {_LISTING_NOTE[instr['listing']]}", "kind", "opcode", "count", right=("count",))
    for group in ("matrix", "convert"):
        for op, n in sorted(instr[group].items()):
            counts.add_row(group, op, str(n))
    console.print(counts)
    if (wg := instr.get("warpgroup_mmas")) and (wg["placeholders"] or wg["sass"] < wg["ptx"]):
        console.print(f"[red]warning[/red]: {wg['ptx']} warpgroup MMAs in the PTX, {wg['sass']} in the SASS and "
                      f"{wg['placeholders']} placeholders onto RZ: ptxas dropped products it saw as dead "
                      "(an accumulator read before it was written)")


# ---- compile: a matrix of specs ---------------------------------------------------------------

def compile_matrix(kind, formats, head_dims, tile, warps, stages, causal, backend, archs, every,
                   mma=None, options=None, queries=(), heads=None) -> list[KernelSpec]:
    """The specs of `qattn compile`. With every (--all), an option left out means all its supported
    values (formats with a kernel, the family's head dims and archs, both causal settings of a prefill
    kernel), and a format that --all picked is built for those of the given head dims and archs it supports.
    Where no kernel is named (no tile, warps, stages, unit or template option), --all and --queries
    build what calls run (spec.call_specs): a CUDA prefill call's kernel depends on its query rows
    per sequence (and on sm_90a their sequence-heads, `heads`; None: every count), a decode call's QK path ("auto")
    on its rows per kv head."""
    prefill_options = kind == "prefill" and options
    check_queries(kind, queries, tile, warps, stages, mma, prefill_options, heads)
    routed = (every or queries) and not any((tile, warps, stages, mma, prefill_options))
    picked = every and not formats
    if not formats:
        formats = ([n for n, r in registry.recipes(kind).items() if backend in r.families] if every
                   else [DEFAULT_FORMAT[kind]])
    if not archs and not every:
        archs = [_default_arch(backend)]
    causals = [causal] if causal is not None else [False, True] if every and kind == "prefill" else [False]
    specs = []
    for fmt in formats:
        family = recipe(fmt, kind).family(backend)
        dims, targets = head_dims or (family.head_dims if every else [128]), archs or family.archs
        if picked:  # e.g. --all --arch sm_80 skips a format whose kernel needs sm_89
            dims = [d for d in dims if d in family.head_dims]
            targets = [a for a in targets if a in family.archs]
        for d, arch, c in itertools.product(dims, targets, causals):
            spec = make_spec(kind, fmt, d, tile, warps, stages, c, backend, arch, mma, options)
            specs += _called_specs(spec, options, queries, heads) if routed else [spec]
    if not specs:
        given = {"--head-dim": ", ".join(map(str, head_dims)), "--arch": ", ".join(archs)}
        given = {option: values for option, values in given.items() if values}
        raise click.BadParameter(f"no format with a {backend} kernel supports " +
                                 " with ".join(f"{option} {values}" for option, values in given.items()),
                                 param_hint=" / ".join(f"'{option}'" for option in given) or None)
    return list(dict.fromkeys(specs))


def _called_specs(spec: KernelSpec, options: dict, queries, heads=None) -> list[KernelSpec]:
    """What calls run in place of spec, the family's default kernel: on CUDA a prefill call's kernel for
    its query rows (each of queries, or any count) and sequence-heads (heads, or any count), a decode call's every
    QK path "auto" picks."""
    from .engine.spec import call_specs
    from .formats.decode.recipes import auto_paths

    if spec.backend != "cuda":
        return [spec]
    if spec.kind == "prefill":
        return [s for n in queries or [None]
                for s in call_specs(spec.recipe, spec.head_dim, spec.causal, spec.arch, n, heads)]
    options = options or {}
    if options.get("qk", "auto") != "auto" or options.get("k_rope") == "pre":  # pre-RoPE keys: transform only
        return [spec]
    return [make_spec("decode", spec.recipe, spec.head_dim, None, None, None, spec.causal, "cuda", spec.arch,
                      options={**options, "qk": path}) for path in auto_paths(spec.recipe, spec.arch)]


def companions(spec: KernelSpec) -> dict:
    """{name: build() -> resources} of the modules the spec's family builds beside its kernels on spec's arch."""
    hook = registry.family_of(spec.recipe, spec.kind).companions
    return hook(spec.arch) if hook else {}


def _spilled(backend: str, res: dict) -> int | None:
    """What spilled: bytes stored plus loaded (ptxas), or VGPRs plus SGPRs (clang); None when the
    compiler reported nothing (a cache entry without resources)."""
    keys = ("spill_stores", "spill_loads") if backend == "cuda" else ("vgpr_spills", "sgpr_spills")
    if not any(k in res for k in keys):
        return None
    return sum(res.get(k, 0) for k in keys)


def _first_error_line(exc: Exception) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return next((ln for ln in lines if "error" in ln.lower() and not ln.startswith("failed")), lines[0] if lines else "")


@main.command("compile")
@spec_options(repeatable=True)
@click.option("--all", "every", is_flag=True,
              help="every supported combination of the formats with a kernel (options given narrow it); where no "
                   "kernel is named, every kernel calls of any query count run")
@user_errors
def compile_(kind, fmt, head_dim, tile, warps, stages, causal, backend, mma, page_size, scale, qk, k_mean, k_balance, k_rope,
             options, queries, heads, arch, every):
    """Compile a matrix of specs x archs into the kernel cache (no GPU needed); exit 1 if any fails.

    Deployments that run with QATTN_NO_JIT=1 build what their calls run: `--queries N` for calls of N query rows
    per sequence, or `--all`."""
    from .engine.kernel import build_kernel

    specs = compile_matrix(kind, list(fmt), list(head_dim), tile, warps, stages, causal, backend, list(arch), every, mma,
                           {**template_options(kind, options),
                            **decode_options(kind, page_size, scale, qk, k_mean, k_balance, k_rope)}, list(queries),
                           heads)
    def resources(spec):
        return build_kernel(spec).resources

    builds = {spec.name: functools.partial(resources, spec) for spec in specs}
    for spec in specs:  # e.g. a cache's writer, which the family's calls build beside their kernels
        builds.update(companions(spec))
    regs, spills = ("regs", "spills (B)") if backend == "cuda" else ("VGPRs", "spilled regs")
    summary = _table(None, "spec", "status", "s", regs, "smem (B)", spills, right=("s", regs, "smem (B)", spills))
    failed, start = [], time.perf_counter()
    with _Progress("compiling", len(builds)) as progress:
        for name, build in builds.items():
            progress.start(name)
            t0 = time.perf_counter()
            try:
                res = build()
            except Exception as exc:  # one bad spec must not stop the matrix; it is reported below
                failed.append((name, exc))
                seconds = f"{time.perf_counter() - t0:.2f}"
                summary.add_row(name, "[red]FAILED[/red]", seconds, "-", "-", "-")
                progress.done(f"{name} FAILED ({seconds} s)")
            else:
                seconds = f"{time.perf_counter() - t0:.2f}"
                summary.add_row(name, "ok", seconds, _fmt(res.get("registers"), "d"),
                                str(res.get("static_smem", 0) + res.get("dynamic_smem", 0)),
                                _fmt(_spilled(backend, res), "d"))
                progress.done(f"{name} ok ({seconds} s)")
    console = _console()
    console.print(summary)
    console.print(f"{len(builds) - len(failed)} of {len(builds)} compiled, {len(failed)} failed "
                  f"in {time.perf_counter() - start:.1f} s (cache: {KernelCache().root})")
    for name, exc in failed:
        click.echo(f"FAILED {name}: {type(exc).__name__}: {_first_error_line(exc)}", err=True)
    if failed:
        click.echo("`qattn inspect` with the same options shows the full compiler log.", err=True)
        sys.exit(1)


# ---- parity -----------------------------------------------------------------------------------

def _parse_shapes(ctx, param, values):
    shapes = []
    for value in values:
        match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", value)
        if not match or min(int(match.group(1)), int(match.group(2))) < 1:
            raise click.BadParameter(f"expected CTX/QUERIES with positive integers, e.g. 4096/4096, got {value!r}")
        shapes.append((int(match.group(1)), int(match.group(2))))
    return shapes


def _verdict(record: dict) -> str:
    """pass, or FAIL with what broke the format's tolerance (NaN compares false: it fails too)."""
    if record["passed"]:
        return "pass"
    tol = record["tolerance"]
    why = [key for key in ("max_rel", "rel_l2") if not record[key] <= tol[key]]
    if record["nonfinite"]:
        why.append("nonfinite")
    return f"FAIL {' '.join(why)}".strip()


@main.command(context_settings=HELP)  # also run standalone by tools/parity
@click.option("--format", "-f", "formats", multiple=True, callback=_split_formats, metavar="FORMAT[,FORMAT...]",
              help="formats to check; repeatable, comma lists allowed [default: every format with a CUDA kernel]")
@click.option("--shape", "shapes", multiple=True, callback=_parse_shapes, metavar="CTX/QUERIES",
              help="keys/queries per sequence; repeatable (default: a small set with tails, per backend)")
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True, help="batch size")
@click.option("--heads", type=click.IntRange(min=1), default=8, show_default=True, help="query heads")
@click.option("--kv-heads", type=click.IntRange(min=1), help="KV heads (GQA; must divide --heads) [default: --heads]")
@click.option("--head-dim", "-d", type=click.IntRange(min=1), default=128, show_default=True, help="head dimension D")
@click.option("--causal/--no-causal", default=False, show_default=True, help="bottom-right aligned causal mask")
@click.option("--backend", type=click.Choice(["auto", "cuda", "numpy"]), default="auto", show_default=True,
              help="cuda: the GPU kernel; numpy: the format's CPU emulator; auto: the kernel when a GPU is present")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True, path_type=Path),
              callback=_json_path, help="also write the records as JSON to FILE")
@click.option("--seed", type=int, default=0, show_default=True, help="seed of the random inputs")
@click.option("--time/--no-time", "time_it", default=True, show_default=True, help="time each kernel (GPU only)")
@click.option("--kind", type=click.Choice(KINDS), default="prefill", show_default=True,
              help="prefill formats, or decode formats over a paged cache (CTX/QUERIES: cached / new tokens)")
@click.option("--page-size", type=click.Choice(["16", "32", "64", "128"]), help="decode: tokens per page [default: 32]")
@click.option("--scale", type=click.Choice(("token", "head")), help="decode: scales of 8-bit sides [default: token]")
@click.option("--preset", type=click.Choice(sorted(PRESETS)),
              help="Q, K and V from a qattn.data preset (outlier channels, a K bias, RoPE, ...) instead of N(0,1); "
                   "the tolerances hold on N(0,1), and a format may fail them on a preset's data: the answer to "
                   "whether it is accurate enough there")
@click.option("--npz", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="captured q, k and v [B, H, L, D] to check on, its batch, heads and head dim taken from the "
                   "file: each CTX/QUERIES the file's last keys and rows (prefill; default: all of them) or its last "
                   "keys cached, the last QUERIES of them new (decode; default: all keys, one new)")
@click.option("--smoothing", type=click.Choice(("mean", "mean+balance", "none")),
              help="prefill: the int8-QK formats' K smoothing: mean (K's channel mean subtracted), mean+balance (then Q's "
                   "and K's channels balanced: for scale-type K outliers) or none [default: a call's, mean below "
                   "32768 keys]")
@click.option("--qk", "qk_paths", multiple=True, type=click.Choice(("auto", "transform", "fp8", "int8")),
              help="decode: QK paths over an 8-bit K, each checked on the formats that have it; repeatable "
                   "[default: auto]")
@click.option("--k-bias/--no-k-bias", "k_bias", default=None,
              help="decode: a pre-bias residual K cache (K - b stored, q·b added back), given the preset's K "
                   "bias (bias) or K's channel mean [default: off]")
@click.option("--k-mean", type=click.Choice(("off", "page")),
              help="decode: page means of an 8-bit K (K - μ_page stored, q·μ_page added back; the cache written as "
                   "a prompt, then pieces) [default: off]")
@click.option("--k-balance/--no-k-balance", "k_balance", default=None,
              help="decode: Q/K channel balancing of an 8-bit K, α calibrated from the first write (K / α stored, "
                   "q·α at the Q load) [default: off]")
@click.option("--k-rope", type=click.Choice(("off", "post", "pre")),
              help="decode: the residual K under RoPE with the data's pre-RoPE K bias (--preset bias_rope): post "
                   "(post-RoPE keys, K - R_p b stored, q·R_p b added back per key) or pre (pre-RoPE keys, k_pre - b "
                   "stored, turned on chip; transform path) [default: off]")
@user_errors
@click.pass_context
def parity(ctx, formats, shapes, batch, heads, kv_heads, head_dim, causal, backend, json_path, seed, time_it, kind,
           page_size, scale, preset, npz, smoothing, qk_paths, k_bias, k_mean, k_balance, k_rope):
    """Check formats against FP64 on fresh random inputs and time their kernels; exit 1 if any
    check fails its format's tolerance. With --kind decode, each format's paged decode against FP64
    on the dequantized cache (its tolerance) and on the original K/V (format_rel_l2: the format's cost)."""
    from .check import parity as job

    if kv_heads is not None and heads % kv_heads:
        raise click.BadParameter(f"{kv_heads} does not divide --heads {heads}", param_hint="'--kv-heads'")
    options = {}
    if smoothing and kind != "prefill":
        raise click.BadParameter("decode caches take their K terms as --k-mean, --k-balance and --k-bias",
                                 param_hint="'--smoothing'")
    if smoothing:
        smoothed = [name for name in RECIPES if "smoothing" in registry.family_of(name).options]
        if formats and not {entry.partition("@")[0] for entry in formats} & set(smoothed):
            raise click.BadParameter(f"only the int8-QK formats ({', '.join(smoothed)}) smooth K; none is checked",
                                     param_hint="'--smoothing'")
        options["smoothing"] = None if smoothing == "none" else smoothing
    if preset and npz:
        raise click.BadParameter("give --preset or --npz, not both", param_hint="'--npz'")
    if kind == "decode":
        if causal:
            raise click.BadParameter("decode rows are always bottom-right causal among the new tokens",
                                     param_hint="'--causal'")
        options = {"page_size": int(page_size or 32), "scale": scale or "token", "k_bias": bool(k_bias),
                   "k_mean": k_mean or "off", "k_balance": bool(k_balance), "k_rope": k_rope or "off"}
    elif page_size or scale or qk_paths or any(x is not None for x in (k_bias, k_mean, k_balance, k_rope)):
        raise click.BadParameter("--page-size, --scale, --qk, --k-bias, --k-mean, --k-balance and --k-rope "
                                 "are decode options",
                                 param_hint="'--kind'")
    if npz:
        options["source"] = captured = _captured(ctx, npz, shapes)
        dims = captured.dims
        batch, heads, kv_heads, head_dim = dims["batch"], dims["heads"], dims["kv_heads"], dims["head_dim"]
        shapes = shapes or [(dims["keys"], 1 if kind == "decode" else dims["queries"])]
    elif preset:
        options["source"] = preset
    runs = _qk_runs(formats, qk_paths) if kind == "decode" else [(formats, {})]
    gpu = device_arch() is not None
    checks = [c for fmts, _ in runs
              for c in job.plan(fmts, shapes, backend=backend, head_dim=head_dim, causal=causal, gpu=gpu, kind=kind)]
    if backend == "auto":
        if not gpu:
            _note("no CUDA GPU found: running the CPU emulators (backend numpy); nothing is timed")
        elif emulated := sorted({fmt for fmt, ran, *_ in checks if ran == "numpy"}):
            _note(f"no CUDA kernel for {', '.join(emulated)}: running the CPU emulator there; not timed")
    with _Progress("parity", len(checks)) as progress:
        records = [r for fmts, path in runs
                   for r in job.run_parity(fmts, shapes, batch=batch, heads=heads, kv_heads=kv_heads,
                                           head_dim=head_dim, causal=causal, backend=backend, seed=seed,
                                           time_it=time_it, kind=kind,
                                           progress=lambda r: progress.done(f"{r['format']} {r['ctx']}/{r['queries']} "
                                                                            f"{r['backend']}: {_verdict(r)}"),
                                           **options, **path)]
    kv = heads if kv_heads is None else kv_heads
    data = npz.name if npz else preset or "N(0,1)"
    if kind == "decode":
        title = (f"decode parity vs FP64: batch {batch}, heads {heads}/{kv}, D {head_dim}, page {options['page_size']}, "
                 f"{options['scale']} scales, {data} K/V{', pre-bias residual K' if k_bias else ''}"
                 f"{', page means of K' if options['k_mean'] == 'page' else ''}"
                 f"{', balanced K channels' if options['k_balance'] else ''}"
                 f"{'' if options['k_rope'] == 'off' else ', ' + options['k_rope'] + '-RoPE residual K'}")
        speed = ("GB/s", "gbs", ".0f")
        extra = ("format rel_l2",)
    else:
        title = (f"parity vs FP64: batch {batch}, heads {heads}/{kv}, D {head_dim}, {'causal' if causal else 'non-causal'}, "
                 f"{data} Q/K/V{f', int8-QK smoothing {smoothing}' if smoothing else ''}")
        speed = ("TFLOPS", "tflops", ".1f")
        extra = ()
    table = _table(title, "format", "ctx/queries", "backend", "max_rel", "rel_l2", *extra, "failures", "ms", speed[0],
                   "tolerance", "result",
                   right=("max_rel", "rel_l2", *extra, "failures", "ms", speed[0], "tolerance"))
    for r in records:
        tol = r["tolerance"]
        verdict = _verdict(r)
        cells = [_fmt(r["format_rel_l2"], ".2e")] if extra else []
        table.add_row(r["format"] + (f" ({r['qk']})" if r.get("qk", "transform") != "transform" else ""),
                      f"{r['ctx']}/{r['queries']}", r["backend"], _fmt(r["max_rel"], ".2e"),
                      _fmt(r["rel_l2"], ".2e"), *cells, str(r["failures"]), _fmt(r["ms"], ".3f"),
                      _fmt(r[speed[1]], speed[2]), f"{tol['max_rel']:g} / {tol['rel_l2']:g}",
                      verdict if r["passed"] else f"[red]{verdict}[/red]")
    _console().print(table)
    if json_path is not None:
        write_json(json_path, records)
    bad = [r for r in records if not r["passed"]]
    if bad:
        click.echo(f"{len(bad)} of {len(records)} checks failed their format's tolerance", err=True)
        sys.exit(1)


def _captured(ctx, npz: Path, shapes):
    """parity --npz: the file's tensors, which fix batch, heads and head dim and bound the shapes checked."""
    from .check.captured import Captured

    given = [f"--{name.replace('_', '-')}" for name in ("batch", "heads", "kv_heads", "head_dim")
             if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE]
    if given:
        raise click.BadParameter(f"{', '.join(given)}: the captured tensors fix them", param_hint="'--npz'")
    try:
        captured = Captured.load(npz)
    except ValueError as exc:
        raise click.BadParameter(str(exc).removeprefix("npz: "), param_hint="'--npz'") from None
    keys, queries = captured.dims["keys"], captured.dims["queries"]
    too_long = [f"{c}/{q}" for c, q in shapes if c > keys or q > queries]
    if too_long:
        raise click.BadParameter(f"{', '.join(too_long)}: {npz.name} holds {keys} keys and {queries} queries",
                                 param_hint="'--shape'")
    return captured


def _qk_runs(formats, qk_paths) -> list[tuple[tuple, dict]]:
    """(formats, options) per QK path: a path other than auto or transform runs on the given formats
    that have it (all decode formats that have it when none are given); a format given without it is
    an error."""
    from .formats.decode.recipes import FORMATS, qk_paths as paths_of

    runs = []
    for path in qk_paths or ("auto",):
        if path in ("auto", "transform"):
            runs.append((formats, {"qk": path}))
            continue
        lacking = [fmt for fmt in formats if path not in paths_of(fmt)]
        if lacking:
            raise click.BadParameter(f"{', '.join(lacking)} has no {path} path", param_hint="'--qk'")
        runs.append((tuple(formats) or tuple(f for f in FORMATS if path in paths_of(f)), {"qk": path}))
    return runs


# ---- probe ------------------------------------------------------------------------------------

def _parse_grids(ctx, param, values):
    grids = {}
    for value in values:
        name, _, text = value.partition("=")
        try:
            floor = float(text)
        except ValueError:
            floor = math.nan  # fails the range check below
        if not name.strip() or not 0 < floor <= 1:
            raise click.BadParameter(f"expected NAME=FLOOR with 0 < FLOOR <= 1, e.g. int4=0.0714, got {value!r}")
        grids[name.strip()] = floor
    return grids


@main.command()
@click.option("--npz", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="tensors to probe: an .npz with q, k and optionally v (BHSD; optional scalar scale); "
                   "each context is its last CTX keys")
@click.option("--preset", metavar="NAME", help=f"synthetic tensors from qattn.data: {', '.join(PRESETS)}")
@click.option("--ctx", "contexts", multiple=True, type=click.IntRange(min=1),
              help="context length (keys); repeatable [default: 4096 and 32768; for --npz those shorter than "
                   "the file, and the whole file]")
@click.option("--format", "-f", "formats", multiple=True, callback=_split_formats, metavar="FORMAT[,FORMAT...]",
              help="recipes whose emulated error vs FP64 is reported; repeatable [default: i8-f16, i8-i8, i8-f8]")
@click.option("--smoothing", "smoothings", multiple=True, type=click.Choice(["mean", "mean+balance", "none"]),
              help="what the int8-QK formats do to Q and K before quantizing (mean: subtract K's channel mean; "
                   "mean+balance: then balance Q's and K's channels; none: nothing); each is reported as "
                   "FORMAT+SMOOTHING; repeatable [default: mean and mean+balance]")
@click.option("--grid", "grids", multiple=True, callback=_parse_grids, metavar="NAME=FLOOR",
              help="another P grid: the p below which it rounds to zero; repeatable (int8 and e4m3 are always shown)")
@click.option("--queries", type=click.IntRange(min=1), default=128, show_default=True,
              help="query rows sampled per context")
@click.option("--key-block", type=click.IntRange(min=1), default=64, show_default=True,
              help="keys per K scale and per softmax step of the int8-QK formats (the i8-f8 wgmma kernels on "
                   "sm_90a use 128)")
@click.option("--seed", type=int, default=0, show_default=True, help="seed of the presets and of the row sample")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True, path_type=Path),
              help="also write the report as JSON to FILE (keys: see qattn.check.probe)")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, writable=True, path_type=Path),
              help="also write a two-panel PNG to FILE: mass by decade with both 8-bit grids; K channels "
                   "as given, smoothed and balanced (needs matplotlib)")
@user_errors
def probe(npz, preset, contexts, formats, smoothings, grids, queries, key_block, seed, json_path, plot_path):
    """Where attention rows keep their probability mass, how much of it the int8 and e4m3 P grids
    flush to zero, how K smoothing and Q/K channel balancing tame K's outlier channels, and what each
    format's emulator costs against FP64 under each smoothing, by context length. Runs on the CPU."""
    from .check import probe as probing

    if (npz is None) == (preset is None):
        raise click.UsageError("give exactly one of --npz FILE or --preset NAME")
    if plot_path is not None:
        try:
            probing.require_matplotlib()
        except RuntimeError as exc:
            raise click.ClickException(str(exc)) from None
    report = probing.run_probe(npz=None if npz is None else str(npz), preset=preset, ctx=list(contexts) or None,
                               formats=formats or probing.PROBE_FORMATS, grids=grids, queries=queries,
                               key_block=key_block, seed=seed,
                               smoothings=[None if s == "none" else s for s in smoothings]
                               or probing.DEFAULT_SMOOTHINGS)
    console = _console()
    for table in probing.format_tables(report):
        console.print(table)
    if json_path is not None:
        write_json(json_path, report)
    if plot_path is not None:
        probing.plot(report, plot_path)
        click.echo(f"wrote {plot_path}", err=True)


# ---- cache ------------------------------------------------------------------------------------

@main.group()
def cache():
    """The on-disk kernel cache ($QATTN_CACHE_DIR, default ~/.cache/qattn)."""


@cache.command("path")
def cache_path():
    """Print the cache directory."""
    click.echo(str(KernelCache().root))


@cache.command("list")
def cache_list():
    """List the cached kernels with their resources and build times."""
    store = KernelCache()
    entries = store.entries()
    table = _table(f"{len(entries)} kernels in {store.root}", "kernel", "regs", "build s", "built at", "KiB",
                   right=("regs", "build s", "KiB"))
    for meta in entries:
        size = sum(p.stat().st_size for p in Path(meta["path"]).iterdir())
        table.add_row(meta.get("name", "?"), _fmt(meta.get("resources", {}).get("registers"), "d"),
                      _fmt(meta.get("build_seconds"), ".2f"), meta.get("built_at", "-"), f"{size / 1024:.0f}")
    _console().print(table)


@cache.command("clear")
def cache_clear():
    """Delete every cached kernel (they are rebuilt on next use)."""
    store = KernelCache()
    click.echo(f"removed {store.clear()} kernels from {store.root}")


main.add_command(bench)  # qattn bench (cli_bench.py)
main.add_command(plan)  # qattn plan (cli_plan.py)
main.add_command(tune)  # qattn tune (qattn/tune/command.py)


if __name__ == "__main__":
    main()
