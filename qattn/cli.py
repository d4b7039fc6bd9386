"""The qattn command line: list, gen, inspect, compile, parity, bench, probe, cache.

Kernel specs are given the same way everywhere (KIND, --format, --head-dim, --tile, --warps,
--stages, --causal, --backend, --arch). User errors (a bad option, a spec that does not fit, a
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
from .codegen.recipes import BACKENDS, KINDS, RECIPES, recipe
from .codegen.spec import KernelSpec, device_arch
from .codegen.tile import Tile
from .runtime.cache import KernelCache, KernelNotCached
from .runtime.compile import CompileError

FALLBACK_ARCH = {"cuda": "sm_90a", "hip": "gfx942"}
HELP = {"help_option_names": ["-h", "--help"]}

# The leading word of a ValueError raised by the library names the field it is about.
_OPTION_OF_FIELD = {
    "kind": "KIND", "format": "--format", "backend": "--backend", "head_dim": "--head-dim", "arch": "--arch",
    "causal": "--causal", "tile": "--tile", "tile.warps": "--warps", "tile.stages": "--stages",
    "shape": "--shape", "heads": "--heads", "kv_heads": "--kv-heads", "ctx": "--ctx", "preset": "--preset",
    "npz": "--npz",
}
_FIELD = re.compile(r"^([a-z_]+(?:\.[a-z_]+)?)\b")


def _as_click_error(exc: Exception) -> click.ClickException:
    """A library error as a click error: a ValueError about a known field names its option."""
    message = str(exc)
    if isinstance(exc, ValueError):
        match = _FIELD.match(message)
        if match:
            field = match.group(1)
            hint = _OPTION_OF_FIELD.get(field) or _OPTION_OF_FIELD.get(field.split(".")[0])
            if hint:
                return click.BadParameter(message, param_hint=f"'{hint}'")
    return click.ClickException(message)


def user_errors(fn):
    """Run a command body, turning user errors into click errors (message, exit status, no traceback)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (ValueError, TypeError, CompileError, KernelNotCached) as exc:
            raise _as_click_error(exc) from None
    return wrapper


def _console(stderr: bool = False):
    from rich.console import Console

    console = Console(stderr=stderr, highlight=False)
    if not console.is_terminal:  # piped or captured: keep spec names whole instead of folding at 80 columns
        console.width = 160
    return console


def _table(title: str | None, *columns: str, right: tuple[str, ...] = ()):
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for name in columns:
        table.add_column(name, justify="right" if name in right else "left", overflow="fold")
    return table


def _note(message: str) -> None:
    click.echo(f"note: {message}", err=True)


def _default_arch(backend: str) -> str:
    """The current GPU's arch, else a fallback named on stderr (compiling needs no GPU)."""
    arch = device_arch() if backend == "cuda" else None
    if arch is None:
        arch = FALLBACK_ARCH[backend]
        _note(f"no {backend.upper()} GPU found; compiling for --arch {arch}")
    return arch


def _fmt(x, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


# ---- kernel specs ---------------------------------------------------------------------------

def make_spec(kind: str, fmt: str, head_dim: int, tile: str | None, warps: int | None, stages: int | None,
              causal: bool, backend: str, arch: str) -> KernelSpec:
    """A validated KernelSpec from command-line values. Without --tile the family's tuned tile is
    used; --warps and --stages override its warps and stages."""
    spec = KernelSpec(kind=kind, recipe=fmt, head_dim=head_dim, causal=causal, backend=backend, arch=arch)
    if tile is None and warps is None and stages is None:
        return spec
    base = spec.tile
    warps, stages = warps or base.warps, stages or base.stages
    new = Tile.parse(tile, warps, stages) if tile else Tile(base.block_m, base.block_n, warps, stages)
    return spec.with_(tile=new)


def spec_options(repeatable: bool = False):
    """KIND and the spec options; `repeatable` makes --format, --head-dim and --arch repeatable."""
    many = "; repeatable" if repeatable else ""
    decorators = [
        click.argument("kind", type=click.Choice(KINDS), default="prefill", required=False, metavar="[KIND]"),
        click.option("--format", "-f", "fmt", type=click.Choice(list(RECIPES)), multiple=repeatable,
                     default=None if repeatable else "f16", show_default=not repeatable,
                     help=f"operand format (see `qattn list`){many}"),
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
    families: dict[tuple, tuple] = {}  # (backend, template) -> (family, formats using it)
    for name, rec in RECIPES.items():
        for backend, family in rec.families.items():
            families.setdefault((backend, family.template), (family, []))[1].append(name)
    kernels = _table("kernels", "backend", "formats", "head dims", "default tiles (m BLOCK_M n BLOCK_N w warps s stages)", "archs")
    for (backend, _), (family, names) in sorted(families.items(), key=lambda item: item[0]):
        tiles = [f"d{d}: {t.name}" for d, t in sorted(family.default_tiles.items())]
        tuned: dict[tuple, list] = {}  # (head_dim, causal, tile) -> archs where it replaces the default
        for (d, causal, arch), t in family.tuned.items():
            tuned.setdefault((d, causal, t.name), []).append(arch)
        tiles += [f"d{d}{' causal' if c else ''} on {', '.join(archs)}: {t}" for (d, c, t), archs in sorted(tuned.items())]
        tiles = "\n".join(tiles)
        kernels.add_row(backend, ", ".join(names), ", ".join(map(str, family.head_dims)), tiles,
                        ", ".join(family.archs))
    console.print(kernels)


@main.command()
@spec_options()
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True, path_type=Path),
              help="write the source to FILE instead of printing it")
@user_errors
def gen(kind, fmt, head_dim, tile, warps, stages, causal, backend, arch, output):
    """Print the rendered kernel source of one spec (KIND: prefill)."""
    from .codegen.render import render

    spec = make_spec(kind, fmt, head_dim, tile, warps, stages, bool(causal), backend, arch or _default_arch(backend))
    source = render(spec)
    if output is None:
        click.echo(source, nl=False)
    else:
        output.write_text(source)
        click.echo(f"wrote {spec.name} to {output}", err=True)


# ---- inspect: resources and instruction counts ---------------------------------------------

# CUDA C++ Programming Guide, "Technical Specifications per Compute Capability": resident blocks
# and threads per SM, shared memory per SM and per block (KiB). Every arch: 64K registers per SM
# in 4 partitions, allocated per warp in units of 256; 1 KiB of shared memory reserved per block.
_SM_LIMITS = {
    "sm_80": (32, 2048, 164, 163), "sm_86": (16, 1536, 100, 99), "sm_89": (24, 1536, 100, 99),
    "sm_90": (32, 2048, 228, 227), "sm_90a": (32, 2048, 228, 227), "sm_100a": (32, 2048, 228, 227),
    "sm_120": (32, 1536, 128, 99),
}


def blocks_per_sm(arch: str, threads: int, registers: int, smem_bytes: int) -> int | None:
    """Resident blocks per SM (0: the block cannot launch), or None for an arch not in the table."""
    if arch not in _SM_LIMITS:
        return None
    max_blocks, max_threads, smem_sm_kib, smem_block_kib = _SM_LIMITS[arch]
    if smem_bytes > smem_block_kib * 1024 or registers > 255:
        return 0
    warps = math.ceil(threads / 32)
    regs_per_warp = math.ceil(max(registers, 1) * 32 / 256) * 256
    by_regs = 4 * (16384 // regs_per_warp) // warps
    by_smem = smem_sm_kib * 1024 // (smem_bytes + 1024)
    return min(max_blocks, max_threads // threads, by_regs, by_smem)


_OPCODE = {
    "sass": re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]\s+)?([A-Z][A-Z0-9_.]*)", re.M),
    "ptx": re.compile(r"^\s*(?:@!?%p\d+\s+)?([a-z][a-z0-9_]*(?:\.[a-z0-9_]+)*)", re.M),
    "amdgpu": re.compile(r"^\s+([vs]_[a-z0-9_]+)", re.M),
}
_MATRIX = {"sass": r"(HMMA|IMMA|HGMMA|IGMMA|QGMMA|QMMA|OMMA)\b", "ptx": r"(mma\.|wgmma\.mma_async|tcgen05\.mma)",
           "amdgpu": r"v_(mfma|smfmac|wmma)"}
_CONVERT = {"sass": r"(F2F|F2FP|I2F|F2I|I2FP|F2IP)\b", "ptx": r"cvt\.", "amdgpu": r"v_cvt"}


def count_instructions(text: str, listing: str) -> dict:
    """Matrix and conversion instructions in a SASS, PTX or AMDGPU listing, by full opcode."""
    counts = {"matrix": {}, "convert": {}}
    for op in _OPCODE[listing].findall(text):
        for group, pattern in (("matrix", _MATRIX[listing]), ("convert", _CONVERT[listing])):
            if re.match(pattern, op):
                counts[group][op] = counts[group].get(op, 0) + 1
    return counts


def inspect_spec(spec: KernelSpec) -> dict:
    """Compile one spec and report its resources, occupancy and instruction counts."""
    from .codegen.render import render
    from .runtime import compile as compiler

    source = render(spec)
    if spec.backend == "cuda":
        binary = compiler.compile_cuda(source, spec.arch, spec.name)
    else:
        binary = compiler.compile_hip_offline(source, spec.arch, spec.name)
    family = spec.family
    resources = dict(binary.resources, threads=family.threads(spec.tile),
                     dynamic_smem=family.smem_bytes(spec.tile, spec.head_dim))
    if spec.backend == "cuda":
        resources["blocks_per_sm"] = blocks_per_sm(spec.arch, resources["threads"], resources["registers"],
                                                   resources["static_smem"] + resources["dynamic_smem"])
    text = compiler.disassemble(binary.data, spec.backend)
    listing = ("sass" if spec.backend == "cuda" else "amdgpu") if text is not None else None
    if text is None and spec.backend == "cuda":
        ptx = binary.ptx
        text, listing = ptx.decode() if isinstance(ptx, bytes) else ptx, "ptx"
    counts = count_instructions(text, listing) if listing else {"matrix": {}, "convert": {}}
    return {"name": spec.name, "spec": spec.as_dict(), "resources": resources,
            "instructions": dict(counts, listing=listing)}


_LISTING_NOTE = {
    "sass": "counted in the SASS (cuobjdump)",
    "ptx": "counted in the PTX: no cuobjdump found (pip install nvidia-cuda-cuobjdump for SASS)",
    "amdgpu": "counted in the AMDGPU disassembly (llvm-objdump)",
    None: "not counted: no disassembler found (llvm-objdump)",
}


@main.command()
@spec_options()
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
@user_errors
def inspect(kind, fmt, head_dim, tile, warps, stages, causal, backend, arch, as_json):
    """Compile one spec and show its resources (registers, shared memory, stack, spills, blocks/SM)
    and its matrix and conversion instructions."""
    spec = make_spec(kind, fmt, head_dim, tile, warps, stages, bool(causal), backend, arch or _default_arch(backend))
    report = inspect_spec(spec)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    console = _console()
    res = report["resources"]
    table = _table(spec.name, "resource", "value", right=("value",))
    rows = [("registers / thread", res.get("registers")), ("threads / block", res["threads"]),
            ("shared memory, static (B)", res.get("static_smem")), ("shared memory, dynamic (B)", res["dynamic_smem"]),
            ("stack frame (B)", res.get("stack")), ("spill stores (B)", res.get("spill_stores")),
            ("spill loads (B)", res.get("spill_loads")), ("blocks / SM", res.get("blocks_per_sm"))]
    for label, value in rows:
        table.add_row(label, "-" if value is None else str(value))
    console.print(table)
    instr = report["instructions"]
    counts = _table(f"instructions, {_LISTING_NOTE[instr['listing']]}", "kind", "opcode", "count", right=("count",))
    for group in ("matrix", "convert"):
        for op, n in sorted(instr[group].items()):
            counts.add_row(group, op, str(n))
    console.print(counts)


# ---- compile: a matrix of specs ---------------------------------------------------------------

def compile_matrix(kind, formats, head_dims, tile, warps, stages, causal, backend, archs, every) -> list[KernelSpec]:
    """The specs of `qattn compile`. With every (--all), an option left out means all its supported
    values (formats with a kernel, the family's head dims and archs, both causal settings)."""
    if not formats:
        formats = [n for n, r in RECIPES.items() if backend in r.families] if every else ["f16"]
    if not archs and not every:
        archs = [_default_arch(backend)]
    causals = [causal] if causal is not None else [False, True] if every else [False]
    specs = []
    for fmt in formats:
        family = recipe(fmt).family(backend)
        dims = head_dims or (family.head_dims if every else [128])
        for d, arch, c in itertools.product(dims, archs or family.archs, causals):
            specs.append(make_spec(kind, fmt, d, tile, warps, stages, c, backend, arch))
    return list(dict.fromkeys(specs))


def _first_error_line(exc: Exception) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return next((ln for ln in lines if "error" in ln.lower() and not ln.startswith("failed")), lines[0] if lines else "")


@main.command("compile")
@spec_options(repeatable=True)
@click.option("--all", "every", is_flag=True,
              help="every supported combination of the formats with a kernel (options given narrow it)")
@user_errors
def compile_(kind, fmt, head_dim, tile, warps, stages, causal, backend, arch, every):
    """Compile a matrix of specs x archs into the kernel cache (no GPU needed); exit 1 if any fails."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .runtime.kernel import build_kernel

    specs = compile_matrix(kind, list(fmt), list(head_dim), tile, warps, stages, causal, backend, list(arch), every)
    summary = _table(None, "spec", "status", "s", "regs", "smem (B)", "spills (B)", right=("s", "regs", "smem (B)", "spills (B)"))
    failed, start = [], time.perf_counter()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=_console(stderr=True), transient=True) as progress:
        task = progress.add_task("compiling", total=len(specs))
        for spec in specs:
            progress.update(task, description=spec.name)
            t0 = time.perf_counter()
            try:
                kernel = build_kernel(spec)
            except Exception as exc:  # one bad spec must not stop the matrix; it is reported below
                failed.append((spec, exc))
                summary.add_row(spec.name, "[red]FAILED[/red]", f"{time.perf_counter() - t0:.2f}", "-", "-", "-")
            else:
                res = kernel.resources
                spills = res.get("spill_stores", 0) + res.get("spill_loads", 0) if "registers" in res else None
                summary.add_row(spec.name, "ok", f"{time.perf_counter() - t0:.2f}", _fmt(res.get("registers"), "d"),
                                str(res.get("static_smem", 0) + res["dynamic_smem"]), _fmt(spills, "d"))
            progress.advance(task)
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
    formats = [f.strip() for value in values for f in value.split(",") if f.strip()]
    for f in formats:
        if f not in RECIPES:
            raise click.BadParameter(f"unknown format {f!r}; known formats: {', '.join(RECIPES)}")
    return formats


def _parse_shapes(ctx, param, values):
    shapes = []
    for value in values:
        match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", value)
        if not match or min(int(match.group(1)), int(match.group(2))) < 1:
            raise click.BadParameter(f"expected CTX/QUERIES with positive integers, e.g. 4096/4096, got {value!r}")
        shapes.append((int(match.group(1)), int(match.group(2))))
    return shapes


def _finite_or_none(value):
    """JSON has no NaN/Inf: non-finite numbers become null (nonfinite and passed say what happened)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite_or_none(v) for v in value]
    return value


def write_json(path: Path, records) -> None:
    path.write_text(json.dumps(_finite_or_none(records), indent=2, allow_nan=False) + "\n")


@main.command(context_settings=HELP)  # also run standalone by tools/parity
@click.option("--format", "-f", "formats", multiple=True, callback=_split_formats, metavar="FORMAT[,FORMAT...]",
              help="formats to check; repeatable, comma lists allowed (default: the formats with a CUDA kernel)")
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
              help="also write the records as JSON to FILE")
@click.option("--seed", type=int, default=0, show_default=True, help="seed of the random inputs")
@click.option("--time/--no-time", "time_it", default=True, show_default=True, help="time each kernel (GPU only)")
@user_errors
def parity(formats, shapes, batch, heads, kv_heads, head_dim, causal, backend, json_path, seed, time_it):
    """Check formats against FP64 on fresh random inputs and time their kernels; exit 1 if any
    check fails its format's tolerance."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .runtime import parity as job

    if kv_heads is not None and heads % kv_heads:
        raise click.BadParameter(f"{kv_heads} does not divide --heads {heads}", param_hint="'--kv-heads'")
    checks = job.plan(formats, shapes, backend=backend, head_dim=head_dim, causal=causal)
    if backend == "auto" and device_arch() is None:
        _note("no CUDA GPU found: running the CPU emulators (backend numpy); nothing is timed")
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=_console(stderr=True), transient=True) as progress:
        task = progress.add_task("parity", total=len(checks))
        records = job.run_parity(formats, shapes, batch=batch, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                 causal=causal, backend=backend, seed=seed, time_it=time_it,
                                 progress=lambda r: progress.advance(task))
    kv = heads if kv_heads is None else kv_heads
    title = f"parity vs FP64: batch {batch}, heads {heads}/{kv}, D {head_dim}, {'causal' if causal else 'non-causal'}"
    table = _table(title, "format", "ctx/queries", "backend", "max_rel", "rel_l2", "failures", "ms", "TFLOPS",
                   "result", right=("max_rel", "rel_l2", "failures", "ms", "TFLOPS"))
    for r in records:
        table.add_row(r["format"], f"{r['ctx']}/{r['queries']}", r["backend"], _fmt(r["max_rel"], ".2e"),
                      _fmt(r["rel_l2"], ".2e"), str(r["failures"]), _fmt(r["ms"], ".3f"), _fmt(r["tflops"], ".1f"),
                      "pass" if r["passed"] else "[red]FAIL[/red]")
    _console().print(table)
    if json_path is not None:
        write_json(json_path, records)
    bad = [r for r in records if not r["passed"]]
    if bad:
        click.echo(f"{len(bad)} of {len(records)} checks failed their format's tolerance", err=True)
        sys.exit(1)


# ---- bench -------------------------------------------------------------------------------------

def _parse_bench_shapes(ctx, param, values):
    shapes = []
    for value in values:
        match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*/\s*(\d+)\s*", value)
        if not match or min(map(int, match.groups())) < 1:
            raise click.BadParameter(f"expected BATCH/HEADS/SEQ with positive integers, e.g. 4/32/4096, got {value!r}")
        shapes.append(tuple(map(int, match.groups())))
    return shapes


@main.command()
@click.option("--format", "-f", "formats", multiple=True, callback=_split_formats, metavar="FORMAT[,FORMAT...]",
              help="qattn formats to time; repeatable, comma lists allowed [default: f16]")
@click.option("--shape", "shapes", multiple=True, callback=_parse_bench_shapes, metavar="BATCH/HEADS/SEQ",
              help="Lq = Lk = SEQ; repeatable [default: 4/32/4096 and 1/32/32768]")
@click.option("--head-dim", "-d", type=click.IntRange(min=1), default=128, show_default=True, help="head dimension D")
@click.option("--causal/--no-causal", default=False, show_default=True, help="bottom-right aligned causal mask")
@click.option("--peer", "peers", multiple=True, type=click.Choice(["sdpa_flash", "sdpa_cudnn"]),
              help="torch SDPA backends to time beside qattn; repeatable [default: both, when torch is importable]")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True, path_type=Path),
              help="also write the records as JSON to FILE")
@click.option("--seed", type=int, default=0, show_default=True, help="seed of the random inputs")
@user_errors
def bench(formats, shapes, head_dim, causal, peers, json_path, seed):
    """Time qattn prefill kernels and torch SDPA (flash, cuDNN) on the same inputs in the same run."""
    from .runtime import bench as timing

    if device_arch() is None:
        raise click.ClickException("bench: no CUDA GPU found; timing needs one")
    records = timing.bench_prefill(shapes or [(4, 32, 4096), (1, 32, 32768)], formats or ("f16",), head_dim=head_dim,
                                   causal=causal, peers=peers or timing.PEERS, seed=seed)
    ratios = sorted({k for r in records for k in r if k.startswith("vs_")})
    table = _table(f"prefill, D {head_dim}, {'causal' if causal else 'non-causal'}", "batch/heads/seq", "impl", "ms",
                   "TFLOPS", *ratios, right=("ms", "TFLOPS", *ratios))
    for r in records:
        cells = [_fmt(r.get(k), ".2f") for k in ratios]
        table.add_row(f"{r['batch']}/{r['heads']}/{r['seq']}", r["impl"], _fmt(r.get("ms"), ".3f"),
                      _fmt(r.get("tflops"), ".1f") if "error" not in r else r["error"], *cells)
    _console().print(table)
    if json_path is not None:
        write_json(json_path, records)


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


if __name__ == "__main__":
    main()
