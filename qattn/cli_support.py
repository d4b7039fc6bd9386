"""What every qattn command shares: click settings, user errors turned into one-paragraph messages that
name the option, rich tables, notes and progress, JSON output and the common option parsers."""
from __future__ import annotations

import functools
import json
import math
import os
import re
from pathlib import Path

import click

from .engine import registry
from .engine.cache import KernelNotCached
from .engine.compile import CompileError
from .engine.family import KINDS
from .engine.registry import RECIPES

HELP = {"help_option_names": ["-h", "--help"]}


# The leading word of a ValueError raised by the library names the field it is about.
_OPTION_OF_FIELD = {
    "kind": "KIND", "format": "--format", "backend": "--backend", "head_dim": "--head-dim", "arch": "--arch",
    "causal": "--causal", "mma": "--mma", "tile": "--tile", "tile.warps": "--warps", "tile.stages": "--stages",
    "shape": "--shape", "heads": "--heads", "kv_heads": "--kv-heads", "ctx": "--ctx", "preset": "--preset",
    "npz": "--npz", "page_size": "--page-size", "scale_mode": "--scale", "options": "--option",
}


def _template_option(field: str) -> bool:
    """Whether field is a prefill family's template option (an --option name)."""
    return any(field in family.options for rec in RECIPES.values()
               for families in ((*rec.families.values(),), *rec.arch_families.values()) for family in families)


_FIELD = re.compile(r"^([a-z_]+(?:\.[a-z_]+)?)\b")


def _as_click_error(exc: Exception) -> click.ClickException:
    """A library error as a click error: a ValueError about a known field names its option."""
    message = str(exc)
    if isinstance(exc, ValueError):
        match = _FIELD.match(message)
        if match:
            field = match.group(1)
            hint = (_OPTION_OF_FIELD.get(field) or _OPTION_OF_FIELD.get(field.split(".")[0])
                    or ("--option" if _template_option(field) else None))
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


def _fmt(x, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


class _Progress:
    """Progress over `total` steps on stderr: a live bar on a terminal; elsewhere (CI logs, pipes)
    one line per finished step, so a long run shows it is alive and what it has done so far."""

    def __init__(self, label: str, total: int):
        self.label, self.total, self.count = label, total, 0
        self.console = _console(stderr=True)
        self.bar = None

    def __enter__(self):
        if self.console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), console=self.console, transient=True)
            self.bar.__enter__()
            self.task = self.bar.add_task(self.label, total=self.total)
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def start(self, item: str) -> None:
        """Show what the next step works on (on the bar only: a log gets the line when it ends)."""
        if self.bar is not None:
            self.bar.update(self.task, description=f"{self.label} {item}")

    def done(self, line: str) -> None:
        self.count += 1
        if self.bar is not None:
            self.bar.advance(self.task)
        else:
            click.echo(f"[{self.count}/{self.total}] {line}", err=True)


def _finite_or_none(value):
    """JSON has no NaN/Inf: non-finite numbers become null (nonfinite and passed say what happened)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite_or_none(v) for v in value]
    return value


def _json_path(ctx, param, value: Path | None) -> Path | None:
    """Refuse an unwritable --json FILE before the run rather than after it (click.Path only
    checks a file that already exists)."""
    if value is not None:
        folder = value.parent
        if not folder.is_dir():
            raise click.BadParameter(f"folder {str(folder)!r} does not exist")
        if not os.access(folder, os.W_OK):
            raise click.BadParameter(f"folder {str(folder)!r} is not writable")
    return value


def write_json(path: Path, records) -> None:
    path.write_text(json.dumps(_finite_or_none(records), indent=2, allow_nan=False) + "\n")


def _parse_decode_shapes(ctx, param, values):
    shapes = []
    for value in values:
        match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", value)
        if not match or min(int(match.group(1)), int(match.group(2))) < 1:
            raise click.BadParameter(f"expected BATCHxCTX with positive integers, e.g. 8x32768, got {value!r}")
        shapes.append((int(match.group(1)), int(match.group(2))))
    return shapes

# Every format name of every kind, in registration order.
ALL_FORMATS = list(dict.fromkeys(name for kind in KINDS for name in registry.recipes(kind)))


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
