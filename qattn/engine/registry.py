"""The registry the engine reads and the format families write: each folder under ``qattn/formats``
registers one FormatFamily (its recipes, launchers, templates, emulators and call hooks), so that the
engine, the checks and the public calls reach every format without importing any family.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .family import KINDS, LaunchChoice, Recipe

SHARED_TEMPLATES = Path(__file__).resolve().parent.parent / "templates"  # device code several families include


@dataclass(frozen=True)
class FormatFamily:
    """One format family as the rest of qattn sees it. Only name and recipes are required; every hook
    left None means the generic behaviour named beside it."""

    name: str
    recipes: tuple[Recipe, ...]
    templates: Path | None = None  # its template folder (cuda/, hip/ below it), searched after the shared one
    launchers: dict = field(default_factory=dict)  # Family.launcher key -> launch(kernel, q, k, v, **options)
    emulators: dict = field(default_factory=dict)  # recipe name -> tiles builder (check/emulate.py)
    # keyword options of qattn.attention that its formats take (e.g. smoothing), passed on as given
    options: frozenset = frozenset()
    # qattn.attention for its formats (None: build the format's default kernel and call it); with
    # call_names, further format names it answers to, and cache_types, cache objects passed as k.
    call: Callable | None = None
    call_names: tuple[str, ...] = ()
    cache_types: tuple[type, ...] = ()
    # K or V (float) -> the cache its kernels read, with .dequantize() (the values the FP64 reference
    # and the emulator see); None: K and V are taken as given.
    kv_cache: Callable | None = None
    # Kernels that depend on a call's query count, which a spec does not know: (format, head_dim,
    # arch) -> a LaunchChoice or a tuple of them (bands of query counts, causal or not), run by calls
    # of at least least_queries rows that name no tile or unit (launch_choice).
    launch_tiles: dict = field(default_factory=dict)
    kernel_inputs: Callable | None = None  # (k, v) -> the K/V arguments its kernels take (None: k, v)
    inspect: Callable | None = None  # spec -> extra fields of `qattn inspect` for its kernels
    # the parity job's check of one of its formats at one shape, for kinds other than prefill (whose
    # check is check/parity.py's): (format, ctx, queries, *, backend, batch, heads, kv_heads, head_dim,
    # seed, time_it, **options) -> record
    parity: Callable | None = None
    # spec -> the specs its launcher may run in spec's place for some arguments (strides the TMA cannot address)
    variants: Callable | None = None
    # arch -> {name: build() -> resources}: modules its calls build beside their kernels (a cache's writer),
    # which `qattn compile` builds with them
    companions: Callable | None = None


KIND_RECIPES: dict[str, dict[str, Recipe]] = {}  # kind -> format name -> Recipe
RECIPES = KIND_RECIPES.setdefault("prefill", {})  # the prefill formats: what qattn.attention runs
FAMILIES: dict[str, FormatFamily] = {}
LAUNCHERS: dict[str, Callable] = {}
_OWNER: dict[tuple[str, str], FormatFamily] = {}  # (kind, format or call name) -> its family


def register(family: FormatFamily) -> FormatFamily:
    """Add a family; a name already taken (family, recipe, launcher or call name) is an error."""
    if family.name in FAMILIES:
        raise ValueError(f"family {family.name!r} is already registered")
    names = [(r.kind, r.name) for r in family.recipes] + [("prefill", n) for n in family.call_names]
    for kind, name in names:
        if kind not in KINDS:
            raise ValueError(f"family {family.name!r}: format {name!r} has kind {kind!r}; kinds: {', '.join(KINDS)}")
        if (kind, name) in _OWNER:
            raise ValueError(f"family {family.name!r}: {kind} format {name!r} is already registered by "
                             f"{_OWNER[kind, name].name!r}")
    for key in family.launchers:
        if key in LAUNCHERS:
            raise ValueError(f"family {family.name!r}: launcher {key!r} is already registered")
    unknown = set(family.emulators) - {r.name for r in family.recipes}
    if unknown:
        raise ValueError(f"family {family.name!r}: emulators for formats it does not define: {sorted(unknown)}")
    FAMILIES[family.name] = family
    LAUNCHERS.update(family.launchers)
    for r in family.recipes:
        KIND_RECIPES.setdefault(r.kind, {})[r.name] = r
    _OWNER.update({key: family for key in names})
    return family


def recipes(kind: str = "prefill") -> dict[str, Recipe]:
    """The formats of a kernel kind, by name, in registration order."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {', '.join(KINDS)}, got {kind!r}")
    return KIND_RECIPES.get(kind, {})


def recipe(name: str, kind: str = "prefill") -> Recipe:
    known = recipes(kind)
    if name not in known:
        what = "formats" if kind == "prefill" else f"{kind} formats"
        raise ValueError(f"format: unknown {name!r}; known {what}: {', '.join(known) or 'none'}")
    return known[name]


def family_of(name: str, kind: str = "prefill") -> FormatFamily:
    """The family that defines format (or call name) `name` of a kind."""
    if (kind, name) not in _OWNER:
        recipe(name, kind)  # raises, naming the known formats
    return _OWNER[kind, name]


def family_for_cache(obj) -> FormatFamily | None:
    """The family whose cache type obj is (qattn.attention(q, cache)), or None."""
    return next((f for f in FAMILIES.values() if f.cache_types and isinstance(obj, f.cache_types)), None)


def launch_choices(fmt: str, head_dim: int, arch: str, causal: bool | None = None) -> tuple[LaunchChoice, ...]:
    """The kernels the format's family lists for calls by their query rows (and sequence-heads) at (head_dim,
    arch), lowest thresholds first; with causal, those that apply to such calls."""
    listed = family_of(fmt).launch_tiles.get((fmt, head_dim, arch), ())
    listed = (listed,) if isinstance(listed, LaunchChoice) else tuple(listed)
    return tuple(sorted((c for c in listed if causal is None or c.causal in (None, causal)),
                        key=lambda c: (c.least_queries, c.least_heads)))


def launch_choice(fmt: str, head_dim: int, arch: str, queries: int, causal: bool = False,
                  heads: int | None = None) -> LaunchChoice | None:
    """What a call of `queries` query rows a sequence over `heads` sequence-heads (batch x query heads; None: as
    many as any threshold asks) that names no tile or unit runs: of its family's listed kernels for such calls,
    the one of the highest thresholds the call reaches, else None (the arch's default family and its default
    tile)."""
    reached = [c for c in launch_choices(fmt, head_dim, arch, causal) if c.reached_by(queries, heads)]
    return reached[-1] if reached else None


def launch_band(fmt: str, head_dim: int, queries: int, causal: bool = False, heads: int | None = None) -> tuple:
    """Which of the format's listed kernels at head_dim (on any arch) for such calls a call of `queries` rows over
    `heads` sequence-heads reaches: calls in one band run one kernel, so a cache of the kernel per call can key on
    it."""
    archs = sorted({a for (f, d, a) in family_of(fmt).launch_tiles if f == fmt and d == head_dim})
    return tuple(c.reached_by(queries, heads) for a in archs for c in launch_choices(fmt, head_dim, a, causal))


def launch_heads(fmt: str, head_dim: int, arch: str, causal: bool | None = None) -> list[int | None]:
    """The sequence-head counts at which the format's listed kernels at (head_dim, arch) differ (None: many):
    with each, launch_choice names every kernel calls of some query count may run."""
    return [None, *sorted({1} | {c.least_heads for c in launch_choices(fmt, head_dim, arch, causal)})]


def formats_with_option(option: str) -> list[str]:
    return [r.name for f in FAMILIES.values() if option in f.options for r in f.recipes if r.kind == "prefill"]


def template_dirs() -> tuple[Path, ...]:
    """Where templates are looked up, in order: the shared device code, then each family's folder."""
    return (SHARED_TEMPLATES, *(f.templates for f in FAMILIES.values() if f.templates is not None))
