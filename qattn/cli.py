"""The qattn command line: list, gen, inspect, compile, parity, bench, probe, cache.

Kernel specs are given the same way everywhere (KIND, --format, --head-dim, --tile, --warps,
--stages, --causal, --backend, --mma, --arch). User errors (a bad option, a spec that does not fit, a
failed compile) end in a one-paragraph message that names the option, never a traceback.
"""
from __future__ import annotations

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
from .bench.peers import PEERS
from .data import PRESETS
from .cli_support import (HELP, _console, _fmt, _json_path, _note, _parse_decode_shapes, _Progress,
                          _table, user_errors, write_json)
from .tune.command import tune

FALLBACK_ARCH = {"cuda": "sm_90a", "hip": "gfx942"}
ALL_FORMATS = list(dict.fromkeys(name for kind in KINDS for name in registry.recipes(kind)))


def _default_arch(backend: str) -> str:
    """The current GPU's arch, else a fallback named on stderr (compiling needs no GPU)."""
    arch = device_arch() if backend == "cuda" else None
    if arch is None:
        arch = FALLBACK_ARCH[backend]
        _note(f"no {backend.upper()} GPU found; compiling for --arch {arch}")
    return arch


# ---- kernel specs ---------------------------------------------------------------------------

DEFAULT_FORMAT = {"prefill": "f16", "decode": "f16-f16"}


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


def make_spec(kind: str, fmt: str | None, head_dim: int, tile: str | None, warps: int | None, stages: int | None,
              causal: bool, backend: str, arch: str, mma: str | None = None, options: dict | None = None) -> KernelSpec:
    """A validated KernelSpec from command-line values. Without --tile the family's tuned tile is
    used; --warps and --stages override its warps and stages."""
    fmt = fmt or DEFAULT_FORMAT[kind]
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
                     help="bottom-right aligned causal mask" + (" (default: off; both with --all)" if repeatable
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


@main.command("list")
def list_():
    """Show kernel kinds, formats, and for each backend its head dims, default tiles and archs."""
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
        from .formats.decode.recipes import QK_CODE, SM90_TILES, TWO_WARP_PAGES_AT, tolerance, two_warp_pages

        paths = ", ".join(f"{path} ({code} K; tolerance {tolerance('i8-i8', path).max_rel:g} / "
                          f"{tolerance('i8-i8', path).rel_l2:g})" for path, code in QK_CODE.items())
        def pages(k, v, d=128):
            return " and ".join(map(str, two_warp_pages((k, v), d)))

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
                entry[2].append(arch)
    kernels = _table("kernels", "backend", "formats", "head dims", "default tiles (m BLOCK_M n BLOCK_N w warps s stages)", "archs")
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
    console.print(kernels)


@main.command()
@spec_options()
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True, path_type=Path),
              help="write the source to FILE instead of printing it")
@user_errors
def gen(kind, fmt, head_dim, tile, warps, stages, causal, backend, mma, page_size, scale, qk, k_mean, k_balance, k_rope,
        arch, output):
    """Print the rendered kernel source of one spec (KIND: prefill or decode)."""
    from .engine.render import render

    spec = make_spec(kind, fmt, head_dim, tile, warps, stages, bool(causal), backend, arch or _default_arch(backend), mma,
                     decode_options(kind, page_size, scale, qk, k_mean, k_balance, k_rope))
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
            arch,
            as_json):
    """Compile one spec and show its resources (CUDA: registers, shared memory, stack, spills,
    blocks/SM; HIP: VGPRs, SGPRs, LDS, scratch, spills, waves/SIMD) and its matrix and conversion
    instructions."""
    spec = make_spec(kind, fmt, head_dim, tile, warps, stages, bool(causal), backend, arch or _default_arch(backend), mma,
                     decode_options(kind, page_size, scale, qk, k_mean, k_balance, k_rope))
    report = inspect_spec(spec)
    named_tile = tile is not None or warps is not None or stages is not None
    # prefill only: a decode kernel's tile is fixed by its format
    listed = () if spec.kind != "prefill" or named_tile or backend != "cuda" or spec.mma is not None else \
        registry.launch_choices(spec.recipe, spec.head_dim, spec.arch, spec.causal)
    if listed:  # what qattn.attention runs instead of the default shown here, by the call's query rows
        report["launch_tiles"] = [{"tile": c.tile.name, "least_queries": c.least_queries,
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
        upper = listed[i + 1].least_queries - 1 if i + 1 < len(listed) else None
        calls = ("calls" if least <= 1 else f"calls of at least {least} query rows") if upper is None else \
            f"calls of {least} to {upper} query rows"
        on_unit = f" on {unit}" if unit else ""
        options = "".join(f", {name} {value}" for name, value in choice.options)
        console.print(f"note: on {spec.arch}, qattn.attention {calls} run {t.name}{on_unit}{options} instead "
                      f"(inspect it with --tile {t.block_m}x{t.block_n} --warps {t.warps} --stages {t.stages}"
                      f"{f' --mma {unit}' if unit else ''})")
    if "scale_blocks" in report:
        blocks = report["scale_blocks"]
        rows = "one Q scale per query row" if blocks["q_rows"] == 1 else f"{blocks['q_rows']} query rows per Q scale"
        groups = "" if blocks["k_groups"] == 1 else f" in {blocks['k_groups']} K scale groups"
        options = ", ".join(f"{k}={v!r}" for k, v in blocks["emulator"].items())
        console.print(f"format blocks: {rows}, {blocks['k_keys']} keys per K scale block{groups} and softmax step "
                      f"(the emulator's {options})")
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
                   mma=None, options=None) -> list[KernelSpec]:
    """The specs of `qattn compile`. With every (--all), an option left out means all its supported
    values (formats with a kernel, the family's head dims and archs, both causal settings), and a
    format that --all picked is built for those of the given head dims and archs it supports."""
    picked = every and not formats
    if not formats:
        formats = ([n for n, r in registry.recipes(kind).items() if backend in r.families] if every
                   else [DEFAULT_FORMAT[kind]])
    if not archs and not every:
        archs = [_default_arch(backend)]
    causals = [causal] if causal is not None else [False, True] if every else [False]
    specs = []
    for fmt in formats:
        family = recipe(fmt, kind).family(backend)
        dims, targets = head_dims or (family.head_dims if every else [128]), archs or family.archs
        if picked:  # e.g. --all --arch sm_80 skips a format whose kernel needs sm_89
            dims = [d for d in dims if d in family.head_dims]
            targets = [a for a in targets if a in family.archs]
        for d, arch, c in itertools.product(dims, targets, causals):
            specs.append(make_spec(kind, fmt, d, tile, warps, stages, c, backend, arch, mma, options))
    if not specs:
        given = {"--head-dim": ", ".join(map(str, head_dims)), "--arch": ", ".join(archs)}
        given = {option: values for option, values in given.items() if values}
        raise click.BadParameter(f"no format with a {backend} kernel supports " +
                                 " with ".join(f"{option} {values}" for option, values in given.items()),
                                 param_hint=" / ".join(f"'{option}'" for option in given) or None)
    return list(dict.fromkeys(specs))


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
              help="every supported combination of the formats with a kernel (options given narrow it)")
@user_errors
def compile_(kind, fmt, head_dim, tile, warps, stages, causal, backend, mma, page_size, scale, qk, k_mean, k_balance, k_rope,
             arch,
             every):
    """Compile a matrix of specs x archs into the kernel cache (no GPU needed); exit 1 if any fails."""
    from .engine.kernel import build_kernel

    specs = compile_matrix(kind, list(fmt), list(head_dim), tile, warps, stages, causal, backend, list(arch), every, mma,
                           decode_options(kind, page_size, scale, qk, k_mean, k_balance, k_rope))
    regs, spills = ("regs", "spills (B)") if backend == "cuda" else ("VGPRs", "spilled regs")
    summary = _table(None, "spec", "status", "s", regs, "smem (B)", spills, right=("s", regs, "smem (B)", spills))
    failed, start = [], time.perf_counter()
    with _Progress("compiling", len(specs)) as progress:
        for spec in specs:
            progress.start(spec.name)
            t0 = time.perf_counter()
            try:
                kernel = build_kernel(spec)
            except Exception as exc:  # one bad spec must not stop the matrix; it is reported below
                failed.append((spec, exc))
                seconds = f"{time.perf_counter() - t0:.2f}"
                summary.add_row(spec.name, "[red]FAILED[/red]", seconds, "-", "-", "-")
                progress.done(f"{spec.name} FAILED ({seconds} s)")
            else:
                res, seconds = kernel.resources, f"{time.perf_counter() - t0:.2f}"
                summary.add_row(spec.name, "ok", seconds, _fmt(res.get("registers"), "d"),
                                str(res.get("static_smem", 0) + res["dynamic_smem"]), _fmt(_spilled(backend, res), "d"))
                progress.done(f"{spec.name} ok ({seconds} s)")
    console = _console()
    console.print(summary)
    console.print(f"{len(specs) - len(failed)} of {len(specs)} compiled, {len(failed)} failed "
                  f"in {time.perf_counter() - start:.1f} s (cache: {KernelCache().root})")
    for spec, exc in failed:
        click.echo(f"FAILED {spec.name}: {type(exc).__name__}: {_first_error_line(exc)}", err=True)
    if failed:
        click.echo("`qattn inspect` with the same options shows the full compiler log.", err=True)
        sys.exit(1)


# ---- parity -----------------------------------------------------------------------------------

def _split_formats(ctx, param, values):
    """FORMAT[,FORMAT...] lists; FORMAT@UNIT names the format's kernel on another matrix unit (e.g.
    i8-f8@mma.sync), which the arch that runs it must build."""
    formats = [f.strip() for value in values for f in value.split(",") if f.strip()]
    units = sorted({fam.values["mma_unit"] for rec in RECIPES.values() for options in rec.arch_families.values()
                    for fam in options if "mma_unit" in fam.values})
    for f in formats:
        name, at, unit = f.partition("@")
        if name not in ALL_FORMATS:  # which kind a name belongs to is checked where the kind is known
            raise click.BadParameter(f"unknown format {name!r}; known formats: {', '.join(ALL_FORMATS)}")
        if at and unit not in units:
            raise click.BadParameter(f"{f!r}: unknown matrix unit {unit!r}; units: {', '.join(units)}")
    return formats


def _split_kernel_entries(ctx, param, values):
    """FORMAT[@UNIT][+OPTION[=VALUE]...][:TILE] lists (bench.prefill.kernel_entry): the format on a
    matrix unit, with template options and a tile; each part but the format optional."""
    from .bench.prefill import kernel_entry

    entries = [e.strip() for value in values for e in value.split(",") if e.strip()]
    for entry in entries:
        try:
            kernel_entry(entry)
        except ValueError as exc:
            raise click.BadParameter(str(exc).removeprefix("tile: ")) from None
        _split_formats(ctx, param, [entry.split("+")[0].split(":")[0]])
    return entries


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
@click.option("--preset", type=click.Choice(sorted(PRESETS)), help="decode: K/V from a qattn.data preset "
                                                                  "[default: N(0,1)]")
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
def parity(formats, shapes, batch, heads, kv_heads, head_dim, causal, backend, json_path, seed, time_it, kind, page_size,
           scale, preset, qk_paths, k_bias, k_mean, k_balance, k_rope):
    """Check formats against FP64 on fresh random inputs and time their kernels; exit 1 if any
    check fails its format's tolerance. With --kind decode, each format's paged decode against FP64
    on the dequantized cache (its tolerance) and on the original K/V (format_rel_l2: the format's cost)."""
    from .check import parity as job

    if kv_heads is not None and heads % kv_heads:
        raise click.BadParameter(f"{kv_heads} does not divide --heads {heads}", param_hint="'--kv-heads'")
    options = {}
    if kind == "decode":
        if causal:
            raise click.BadParameter("decode rows are always bottom-right causal among the new tokens",
                                     param_hint="'--causal'")
        options = {"page_size": int(page_size or 32), "scale": scale or "token", "preset": preset,
                   "k_bias": bool(k_bias), "k_mean": k_mean or "off", "k_balance": bool(k_balance),
                   "k_rope": k_rope or "off"}
    elif page_size or scale or preset or qk_paths or any(x is not None for x in (k_bias, k_mean, k_balance, k_rope)):
        raise click.BadParameter("--page-size, --scale, --preset, --qk, --k-bias, --k-mean, --k-balance and --k-rope "
                                 "are decode options",
                                 param_hint="'--kind'")
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
    if kind == "decode":
        title = (f"decode parity vs FP64: batch {batch}, heads {heads}/{kv}, D {head_dim}, page {options['page_size']}, "
                 f"{options['scale']} scales, {preset or 'N(0,1)'} K/V{', pre-bias residual K' if k_bias else ''}"
                 f"{', page means of K' if options['k_mean'] == 'page' else ''}"
                 f"{', balanced K channels' if options['k_balance'] else ''}"
                 f"{'' if options['k_rope'] == 'off' else ', ' + options['k_rope'] + '-RoPE residual K'}")
        speed = ("GB/s", "gbs", ".0f")
        extra = ("format rel_l2",)
    else:
        title = f"parity vs FP64: batch {batch}, heads {heads}/{kv}, D {head_dim}, {'causal' if causal else 'non-causal'}"
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


# ---- bench -------------------------------------------------------------------------------------

def _parse_bench_shapes(ctx, param, values):
    shapes = []
    for value in values:
        match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*/\s*(\d+)\s*", value)
        if not match or min(map(int, match.groups())) < 1:
            raise click.BadParameter(f"expected BATCH/HEADS/SEQ with positive integers, e.g. 4/32/4096, got {value!r}")
        shapes.append(tuple(map(int, match.groups())))
    return shapes


@main.group(invoke_without_command=True)
@click.pass_context
@click.option("--format", "-f", "formats", multiple=True, callback=_split_kernel_entries, metavar="FORMAT[,FORMAT...]",
              help="qattn formats to time, each as FORMAT[@UNIT][+OPTION[=VALUE]...][:TILE] for the format on a "
                   "matrix unit, with template options or on a tile (e.g. f16@wgmma+persistent, "
                   "i8-f16+pingpong=off:m128n64w8s3); repeatable, comma lists allowed [default: f16]")
@click.option("--shape", "shapes", multiple=True, callback=_parse_bench_shapes, metavar="BATCH/HEADS/SEQ",
              help="Lq = Lk = SEQ; repeatable [default: 4/32/4096 and 1/32/32768]")
@click.option("--head-dim", "-d", type=click.IntRange(min=1), default=128, show_default=True, help="head dimension D")
@click.option("--causal/--no-causal", default=False, show_default=True, help="bottom-right aligned causal mask")
@click.option("--peer", "peers", multiple=True, type=click.Choice(PEERS),
              help="peers to time beside qattn: torch SDPA flash or cuDNN, SageAttention's sageattn (1.0.6) or "
                   "SageAttention2's (sageattn2: the package sageattention2, or sageattention when it is v2); repeatable "
                   "[default: all whose library is importable]")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True, path_type=Path),
              callback=_json_path, help="also write the records as JSON to FILE")
@click.option("--seed", type=int, default=0, show_default=True, help="seed of the random inputs")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True,
              help="interleaved timing rounds per shape (every implementation once a round, odd rounds in reverse; the median is kept)")
@click.option("--sustained", type=click.FloatRange(min=0, min_open=True), metavar="SECONDS",
              help="time each implementation over SECONDS of back-to-back calls per round (the power-capped "
                   "steady state) instead of single calls")
@click.option("--settle", type=click.FloatRange(min=0), default=0.0, show_default=True, metavar="SECONDS",
              help="idle the GPU this long before each implementation's timing, so that none is timed in the "
                   "wake of a power-hungry one")
@user_errors
def bench(ctx, formats, shapes, head_dim, causal, peers, json_path, seed, rounds, sustained, settle):
    """Time qattn prefill kernels and their peers (torch SDPA flash and cuDNN, SageAttention) on the
    same inputs in the same run; rel_l2 is each one's error against FP64 on the first heads.
    `qattn bench decode` times the paged decode instead (its own options)."""
    if ctx.invoked_subcommand is not None:
        return
    from .bench import prefill as timing

    if device_arch() is None:
        raise click.ClickException("bench: no CUDA GPU found; timing needs one")
    records = timing.bench_prefill(shapes or [(4, 32, 4096), (1, 32, 32768)], formats or ("f16",), head_dim=head_dim,
                                   causal=causal, peers=peers or PEERS, seed=seed, rounds=rounds,
                                   sustained=sustained, settle=settle)
    ratios = sorted({k for r in records for k in r if k.startswith("vs_")})
    table = _table(f"prefill, D {head_dim}, {'causal' if causal else 'non-causal'}", "batch/heads/seq", "impl", "ms",
                   "TFLOPS", "rel_l2", *ratios, right=("ms", "TFLOPS", "rel_l2", *ratios))
    for r in records:
        cells = [_fmt(r.get(k), ".2f") for k in ratios]
        table.add_row(f"{r['batch']}/{r['heads']}/{r['seq']}", r["impl"], _fmt(r.get("ms"), ".3f"),
                      _fmt(r.get("tflops"), ".1f") if "error" not in r else r["error"], _fmt(r.get("rel_l2"), ".2e"),
                      *cells)
    _console().print(table)
    if json_path is not None:
        write_json(json_path, records)


_SIZE = re.compile(r"\s*(\d+)\s*([kKmM]?)\s*")


def _parse_sizes(ctx, param, values):
    """Repeatable comma lists of positive sizes; K and M mean 1024 and 1024² (32K = 32768)."""
    sizes = []
    for value in values:
        for item in value.split(","):
            match = _SIZE.fullmatch(item)
            if not match or int(match.group(1)) < 1:
                raise click.BadParameter(f"expected positive sizes such as 8, 4096 or 32K, got {item!r}")
            sizes.append(int(match.group(1)) << {"": 0, "k": 10, "m": 20}[match.group(2).lower()])
    return list(dict.fromkeys(sizes))


def _decode_shapes(shapes, batches, ctxs) -> list[tuple[int, int]]:
    """--shape pairs, then every --batch at every --ctx; the default shapes when none is given."""
    if bool(batches) != bool(ctxs):
        raise click.BadParameter("--batch and --ctx go together (every batch at every context)",
                                 param_hint="'--batch' / '--ctx'")
    from .bench.decode import DEFAULT_SHAPES

    return list(dict.fromkeys([*shapes, *itertools.product(batches, ctxs)])) or list(DEFAULT_SHAPES)


def _kv_head_counts(heads: int, kv_heads, gqa) -> list[int]:
    """--kv-heads and heads / --gqa ratio for each ratio; 8 when neither is given."""
    counts = list(kv_heads)
    for ratio in gqa:
        if heads % ratio:
            raise click.BadParameter(f"{ratio} does not divide --heads {heads}", param_hint="'--gqa'")
        counts.append(heads // ratio)
    for kv in counts:
        if heads % kv:
            raise click.BadParameter(f"{heads} is not a multiple of --kv-heads {kv}", param_hint="'--heads'")
    return list(dict.fromkeys(counts)) or [8]


def _decode_runs(preset, shapes, batches, ctxs, heads, kv_heads, gqa, head_dims, page_sizes, cold):
    """The runs of a bench decode call: a preset's, or the grid of the shape options in one L2 mode."""
    from .bench import decode as timing

    if preset:
        given = [name for name, value in (("--shape", shapes), ("--batch", batches), ("--ctx", ctxs),
                                          ("--heads", heads), ("--kv-heads", kv_heads), ("--gqa", gqa),
                                          ("--head-dim", head_dims), ("--page-size", page_sizes), ("--cold", cold))
                 if value]
        if given:
            raise click.BadParameter(f"the preset sets the grid and the L2 modes; leave out {', '.join(given)}",
                                     param_hint="'--preset'")
        return timing.preset_runs(preset)
    heads = heads or 32
    points = timing.grid(_decode_shapes(shapes, batches, ctxs), heads=heads,
                         kv_heads=_kv_head_counts(heads, kv_heads, gqa),
                         head_dims=[int(d) for d in head_dims] or [128],
                         page_sizes=[int(p) for p in page_sizes] or [32])
    return [timing.Run(point, ("cold",) if cold else ("warm",)) for point in points]


def _decode_variants(preset, formats, qk_paths):
    """(format, QK path) pairs: every requested path on the formats that have it; one path named
    for formats named is checked on each of them."""
    from .bench import decode as timing

    default_formats = timing.contract_formats() if preset else timing.DEFAULT_FORMATS
    default_paths = ("transform", "fp8", "int8") if preset else ("auto",)
    strict = bool(formats) and len(qk_paths) == 1 and qk_paths[0] != "auto"
    try:
        return timing.qk_variants(formats or default_formats, qk_paths or default_paths, strict=strict)
    except ValueError as exc:
        raise click.BadParameter(str(exc).removeprefix("qk: "), param_hint="'--qk'") from None


def _parse_tile_name(ctx, param, value):
    """--tile NAME -> Tile (None when not given)."""
    if value is None:
        return None
    try:
        return Tile.from_name(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc).removeprefix("tile: "), ctx=ctx, param=param) from None


def _command_line() -> str:
    """This command as typed (the program name as click knows it), for the markdown header."""
    import shlex

    return " ".join([click.get_current_context().find_root().info_name, *map(shlex.quote, sys.argv[1:])])


@bench.command("decode")
@click.option("--shape", "shapes", multiple=True, callback=_parse_decode_shapes, metavar="BATCHxCTX",
              help="sequences x cached tokens each; repeatable [default: 8x32768, 64x4096, 1x131072]")
@click.option("--batch", "batches", multiple=True, callback=_parse_sizes, metavar="N[,N...]",
              help="sequences, timed at every --ctx; repeatable, comma lists allowed")
@click.option("--ctx", "ctxs", multiple=True, callback=_parse_sizes, metavar="L[,L...]",
              help="cached tokens per sequence, e.g. 1K,4K,32K,128K; repeatable, comma lists allowed")
@click.option("--preset", type=click.Choice(["smoke", "contract"]),
              help="a grid with its L2 modes: contract (batch 1-256 x context 1K-128K warm and cold, GQA 1/4/8, "
                   "every page size and D64 at 8x32768; the K16/V16, K8/V16, K16/V8, K8/V8 formats of e4m3 and i8 on "
                   "every QK path) or smoke (the same, small)")
@click.option("--format", "-f", "formats", multiple=True, type=click.Choice(list(registry.recipes("decode"))),
              help="decode format K-V; repeatable [default: f16-f16, e4m3-e4m3, i8-i8, e4m3-f16, f16-e4m3; the "
                   "contract's seven with --preset]")
@click.option("--qk", "qk_paths", multiple=True, type=click.Choice(["auto", "transform", "fp8", "int8"]),
              help="QK paths to time each format on (those it has; one path named for formats named must be theirs); "
                   "repeatable [default: auto; every path with --preset]")
@click.option("--k-term", "k_terms", multiple=True, type=click.Choice(["plain", "balance", "bias", "rope-post", "rope-pre"]),
              help="what an 8-bit K cache carries beside its codes: nothing, Q/K channel balancing, a pre-bias residual "
                   "K, or one under RoPE (post- or pre-RoPE keys); repeatable [default: plain]")
@click.option("--heads", type=click.IntRange(min=1), help="query heads [default: 32]")
@click.option("--kv-heads", "kv_heads", multiple=True, type=click.IntRange(min=1),
              help="kv heads; repeatable [default: 8]")
@click.option("--gqa", multiple=True, type=click.IntRange(min=1),
              help="query heads per kv head (kv heads = heads / GQA), beside --kv-heads; repeatable")
@click.option("--head-dim", "-d", "head_dims", multiple=True, type=click.Choice(["64", "128"]),
              help="head dimension; repeatable [default: 128]")
@click.option("--page-size", "page_sizes", multiple=True, type=click.Choice(["16", "32", "64", "128"]),
              help="tokens per page; repeatable [default: 32]")
@click.option("--queries", type=click.IntRange(1, 16), default=1, show_default=True,
              help="new tokens per sequence (the peers run only for 1)")
@click.option("--scale", type=click.Choice(("token", "head")), default="token", show_default=True,
              help="scales of the 8-bit sides")
@click.option("--cold", is_flag=True,
              help="HBM-cold timing: L2 evicted (a read of 4x its size) before every timed call [default: L2-warm]")
@click.option("--max-kv-gib", type=click.FloatRange(min=0, min_open=True), default=8.0, show_default=True,
              help="skip points whose fp16 K and V exceed this (every format's cache of a point lives at once)")
@click.option("--splits", type=click.IntRange(1, 128), help="split count [default: chosen per shape]")
@click.option("--page-order", type=click.Choice(("shuffled", "in-order")), default="shuffled", show_default=True,
              help="the block table: the pool's pages shuffled (as an engine's allocator leaves them) or each "
                   "sequence's pages in order (a fresh cache); qattn and the paged peers read the same pages")
@click.option("--stages", type=click.IntRange(2, 4), help="K/V slots in flight [default: the format's tile]")
@click.option("--tile", callback=_parse_tile_name, metavar="NAME",
              help="run every variant on this tile, e.g. m8n32w2s3 (block_m 8, 16 keys a warp, 2-4 slots) "
                   "[default: each format's own]")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True, help="interleaved timing rounds")
@click.option("--write-tokens", type=click.IntRange(min=0), default=65536, show_default=True,
              help="tokens of the cache-write timing, as a prompt and as scattered single tokens, then decode "
                   "steps of 8, 64 and 256 sequences timed on the GPU alone (0: skip it)")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True, path_type=Path),
              callback=_json_path, help="also write the records as JSON to FILE")
@click.option("--markdown", is_flag=True, help="also print the table as markdown for BENCHMARKS.md")
@user_errors
def bench_decode(shapes, batches, ctxs, preset, formats, qk_paths, k_terms, heads, kv_heads, gqa, head_dims, page_sizes,
                 queries, scale, cold, max_kv_gib, splits, page_order, stages, tile, rounds, write_tokens, json_path,
                 markdown):
    """Time the paged decode in each cache format and QK path beside torch SDPA (flash, cuDNN) on the
    same queries over the same K/V in fp16 and, where it is installed, FlashInfer's paged decode over
    the same pages (fp16, and e4m3 with one scale per tensor), L2-warm or HBM-cold, and the one-launch
    cache write beside a copy of the same bytes; GB/s of the bytes a step must read, as a fraction of
    the copy bandwidth measured in the same run, the ratio to the faster SDPA backend and to FlashInfer
    (its e4m3 cache for K8/V8 formats)."""
    from .bench import decode as timing

    if tile is not None and stages is not None:
        raise click.BadParameter("give --tile or --stages, not both (a tile names its slots)", param_hint="'--tile'")
    runs = _decode_runs(preset, shapes, batches, ctxs, heads, kv_heads, gqa, head_dims, page_sizes, cold)
    variants = timing.with_k_terms(_decode_variants(preset, formats, qk_paths), k_terms or ("plain",))
    if not variants:
        raise click.BadParameter("only an 8-bit K carries a K term: add a format with an e4m3 or i8 K, or 'plain'",
                                 param_hint="'--k-term'")
    if device_arch() is None:
        raise click.ClickException("bench decode: no CUDA GPU found; timing needs one")
    runs, skipped = timing.within_cap(runs, int(max_kv_gib * (1 << 30)))
    if skipped:
        _note(f"skipped over --max-kv-gib {max_kv_gib:g}: {', '.join(r.point.label for r in skipped)}")
    if not runs:
        raise click.BadParameter(f"every point's fp16 K/V exceeds {max_kv_gib:g} GiB", param_hint="'--max-kv-gib'")
    with _Progress("bench decode", len(runs)) as progress:
        records = timing.bench_sweep(runs, variants, queries=queries, scale=scale, rounds=rounds, splits=splits,
                                     stages=stages, page_order=page_order,
                                     tiles=None if tile is None else {run.point.head_dim: tile for run in runs},
                                     progress=lambda run, recs: progress.done(
                                         f"{run.point.label} {'+'.join(run.modes)}: {len(recs)} records"))
    first = runs[0].point
    writes = timing.bench_write(write_tokens, kv_heads=first.kv_heads, head_dim=first.head_dim,
                                page_size=first.page_size, scale=scale) if write_tokens else []
    meta = {"date": time.strftime("%Y-%m-%d"), "gpu": timing.gpu_name(), "command": _command_line()}
    copy = records[0]["copy_gbs"] if records else float("nan")
    table = _table(f"decode, {queries} new token(s) per sequence, {scale} scales, copy {copy:.0f} GB/s",
                   *timing.COLUMNS, right=timing.NUMERIC_COLUMNS)
    for r in records:
        table.add_row(*timing.row_cells(r))
    console = _console()
    console.print(table)
    if writes:
        wtable = _table("cache write", "format", "slots", "tokens", "write ms", "copy ms", "ratio",
                        right=("tokens", "write ms", "copy ms", "ratio"))
        for w in writes:
            wtable.add_row(w["format"], w["slots"], str(w["tokens"]), _fmt(w["write_ms"], ".4f"),
                           _fmt(w["copy_ms"], ".4f"), _fmt(w["ratio"], ".2f"))
        console.print(wtable)
    if markdown:
        click.echo(timing.markdown_table(records, **meta))
    if json_path is not None:
        write_json(json_path, {"meta": meta, "decode": records, "write": writes})


@bench.command("paged-read")
@click.option("--format", "-f", "formats", multiple=True, type=click.Choice(list(registry.recipes("decode"))),
              help="cache format K-V (its K and V piece sizes); repeatable [default: e4m3-e4m3, f16-f16]")
@click.option("--page-size", "page_sizes", multiple=True, type=click.Choice(["16", "32", "64", "128"]),
              help="tokens per page; repeatable [default: 16, 32, 64, 128]")
@click.option("--head-dim", "-d", "head_dims", multiple=True, type=click.Choice(["64", "128"]),
              help="head dimension; repeatable [default: 128]")
@click.option("--kv-heads", type=click.IntRange(min=1), default=8, show_default=True,
              help="kv heads (the blocks streaming one page side by side)")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True, path_type=Path),
              callback=_json_path, help="also write the records as JSON to FILE")
@user_errors
def bench_paged_read(formats, page_sizes, head_dims, kv_heads, json_path):
    """What a plain reader of a paged cache attains on this GPU: a kernel that only streams the pools'
    pages, in the decode kernel's pattern and piece sizes, at several depths of its copy ring; GB/s of
    the fastest depth and of each, as a fraction of the copy bandwidth measured in the same run (the
    reference for `qattn bench decode`'s "of copy": a decode well below it is bound by its own work)."""
    from .bench import paged_read as reader

    if device_arch() is None:
        raise click.ClickException("bench paged-read: no CUDA GPU found; timing needs one")
    points = list(itertools.product(formats or ("e4m3-e4m3", "f16-f16"), map(int, page_sizes or (16, 32, 64, 128)),
                                    map(int, head_dims or (128,))))
    table = _table(f"paged read: a reader that only streams the pages, {kv_heads} kv heads", "format", "page", "D", "pieces", "GB/s",
                   "of copy", "slots x blocks/SM", "each depth (of copy)",
                   right=("page", "D", "GB/s", "of copy"))
    records = []
    with _Progress("bench paged-read", len(points)) as progress:
        for fmt, page, d in points:
            found = reader.paged_read(fmt, page, d, kv_heads=kv_heads)
            best = reader.fastest(found)
            table.add_row(fmt, str(page), str(d), f"{best['k_piece']} + {best['v_piece']} B", f"{best['gbs']:.0f}",
                          f"{best['of_copy']:.3f}", f"{best['stages']} x {best['blocks_per_sm']}",
                          "  ".join(f"{r['stages']}x{r['blocks_per_sm']} {r['of_copy']:.2f}" for r in found))
            records += found
            progress.done(f"{fmt} pages of {page}, D{d}: {best['of_copy']:.3f} of copy")
    _console().print(table)
    if json_path is not None:
        write_json(json_path, {"meta": {"date": time.strftime("%Y-%m-%d"), "command": _command_line()},
                               "paged_read": records})


# ---- plan -------------------------------------------------------------------------------------

@main.group()
def plan():
    """Pick a format for an operating point."""


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
                         help="time the formats on the local GPU [default: when one is present; else the H200 table]"),
            click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True, path_type=Path),
                         callback=_json_path, help="also write the candidates and the choice as JSON to FILE"))):
        fn = option(fn)
    return fn


def _plan_measuring(kind: str, heads: int, kv_heads: int, measure) -> bool:
    """Whether a plan times on the local GPU (--measure's default: when there is one); the head layout checked."""
    if heads % kv_heads:
        raise click.BadParameter(f"{heads} is not a multiple of --kv-heads {kv_heads}", param_hint="'--heads'")
    measure = device_arch() is not None if measure is None else measure
    if measure and device_arch() is None:
        raise click.ClickException(f"plan {kind} --measure: no CUDA GPU found")
    return measure


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
def plan_decode(batch, ctx, max_rel_l2, page_size, scale, heads, kv_heads, head_dim, npz, preset, measure, json_path):
    """For an operating point, each cache format on each QK path (an i8 K also with Q/K channel
    balancing; with the pre-bias residual K where the data has a K bias: an npz's k_bias, the bias
    preset's) with its error against FP64 on
    the original K/V (its CPU emulator, on --npz tensors or a preset, at up to 4096 keys) and its
    decode time (a quick run on the local GPU, else relative to f16-f16 as measured on the H200), and
    the one to use: the fastest within --max-rel-l2, K16/V8 when no 8-bit K passes."""
    from .formats.decode import plan as planner

    measure = _plan_measuring("decode", heads, kv_heads, measure)
    errors = planner.format_errors(npz=npz, preset=preset, ctx=ctx, heads=heads, kv_heads=kv_heads,
                                   head_dim=int(head_dim), page_size=int(page_size), scale=scale)
    if measure:
        times = planner.measured_times(list(errors), batch=batch, ctx=ctx, heads=heads, kv_heads=kv_heads,
                                       head_dim=int(head_dim), page_size=int(page_size), scale=scale)
        unit, source = "ms", "measured on this GPU"
    else:
        times = planner.table_times(errors)
        unit, source = "x f16-f16", "relative times measured on the H200 (BENCHMARKS.md)"
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
def plan_prefill(batch, seq, causal, dtype, max_rel_l2, heads, kv_heads, head_dim, npz, preset, measure, json_path):
    """For an operating point, each prefill format of the inputs' type (the 16-bit one, i8-f16, i8-i8 and
    i8-f8, the int8-QK ones with K smoothing and with Q/K channel balancing too) with its error against
    FP64 (its CPU emulator on --npz tensors or a preset: the last 256 query rows of up to 4096 keys, up to 8
    query heads) and its time (a quick run of whole calls on the local GPU, else relative to cuDNN's as
    measured on the H200), and the one to use: the fastest within --max-rel-l2, the 16-bit format when no
    timed one is within."""
    from .check import prefill_plan as planner

    measure = _plan_measuring("prefill", heads, kv_heads, measure)
    errors = planner.format_errors(dtype=dtype, npz=npz, preset=preset, seq=seq, heads=heads, kv_heads=kv_heads,
                                   head_dim=int(head_dim), causal=causal)
    if measure:
        times = planner.measured_times(list(errors), batch=batch, seq=seq, heads=heads, head_dim=int(head_dim),
                                       causal=causal)
        unit, source = "ms", "measured on this GPU"
    else:
        times = planner.table_times(errors, head_dim=int(head_dim), causal=causal, seq=seq)
        unit, source = "x cuDNN's", "relative to cuDNN's as measured on the H200 (BENCHMARKS.md)"
    chosen, why = planner.choose(errors, times, max_rel_l2, dtype)
    data = str(npz) if npz else f"preset {preset}"
    call = f"qattn.attention(q, k, v, {planner.call_of(chosen)}{', causal=True' if causal else ''})"
    _plan_report(f"prefill at batch {batch}, seq {seq}, heads {heads}/{kv_heads}, D {head_dim}, "
                 f"{'causal' if causal else 'non-causal'}, {dtype}: errors on {data}; times {source}", "format",
                 errors, times, unit, chosen, why, max_rel_l2, data,
                 dict(kind="prefill", batch=batch, seq=seq, heads=heads, kv_heads=kv_heads, head_dim=int(head_dim),
                      causal=causal, dtype=dtype), json_path, call)


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


main.add_command(tune)  # qattn tune (qattn/tune/command.py)


if __name__ == "__main__":
    main()
