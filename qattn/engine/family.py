"""What a format is to the engine: a Recipe (operand format, input dtypes, tolerance) and the kernel
Families (one template each: head dims, tiles, shared memory, threads) that build it per backend.

The engine knows these shapes, never a particular format: each folder under ``qattn/formats``
defines its recipes and families and registers them (``registry``). DESIGN §2 defines every format.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from .tile import Tile

CUDA_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_90a", "sm_100a", "sm_120")
HIP_ARCHS = ("gfx90a", "gfx942", "gfx1100", "gfx1201")
BACKENDS = ("cuda", "hip")
KINDS = ("prefill", "decode")
SMEM_LIMIT = {"cuda": 227 * 1024, "hip": 64 * 1024}  # the most any arch of the backend has
# Shared memory (LDS) one block may opt into, by arch: a tile over it cannot launch there.
SMEM_PER_BLOCK = {"sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_89": 99 * 1024, "sm_90": 227 * 1024,
                  "sm_90a": 227 * 1024, "sm_100a": 227 * 1024, "sm_120": 99 * 1024,
                  **{arch: 64 * 1024 for arch in HIP_ARCHS}}


@dataclass(frozen=True)
class Tolerance:
    """Pass thresholds against FP64: rows over max_rel count as failures; rel_l2 bounds the whole."""

    max_rel: float
    rel_l2: float


@dataclass(frozen=True)
class Family:
    """One kernel template and the tiles it can be specialised to."""

    template: str
    head_dims: tuple[int, ...]
    default_tiles: dict  # head_dim -> Tile
    tile_problem: Callable[[Tile, int], str | None]  # why a (tile, head_dim) does not fit, or None
    smem_bytes: Callable[[Tile, int], int]
    archs: tuple[str, ...]
    align_bytes: int = 16  # pointer and row-stride alignment the loads need (16: cp.async / vector)
    tuned: dict = field(default_factory=dict)  # (head_dim, causal, arch) -> Tile, where it beats the default
    # head_dim -> tiles to fall back on, in order, on archs with too little shared memory per block
    # for the default (unmeasured: chosen to fit, and to keep the default's shape where they can).
    smaller_tiles: dict = field(default_factory=dict)
    # (head_dim, causal, arch) whose default tile ptxas spills a little (<= 64 B; <= 96 B for the
    # wgmma kernels' 160-register consumers) but which measured faster than every spill-free tile
    # (docs/notes/<family>.md); everywhere else defaults must not spill.
    measured_spills: frozenset = frozenset()
    producer_warps: int = 0  # warps beside tile.warps that only load (warp-specialized kernels)
    launcher: str = "prefill"  # key of registry.LAUNCHERS: the function that runs this family's kernels
    # Suffix of the entry point (entry_name(spec) + suffix) whose ptxas figures a Kernel reports,
    # for templates whose module holds several kernels.
    main_entry: str = ""
    values: dict = field(default_factory=dict)  # extra template constants of this family
    # template constants a spec chooses (KernelSpec.options): name -> allowed values, the default first
    options: dict = field(default_factory=dict)
    # head_dim -> {option: value}: where a head dim's default differs from the first allowed value
    # (measured faster there; docs/notes/<family>.md)
    option_defaults: dict = field(default_factory=dict)
    # why a spec's options do not build on its arch and head dim (a message that names the option), or None:
    # for option values that need an instruction only some of the family's archs have, or room that only
    # some head dims leave
    option_problem: Callable[[dict, str, int], str | None] | None = None
    # the default tile where it depends on a spec's options (e.g. a QK path that runs a whole warpgroup):
    # (head_dim, arch, options) -> Tile, or None for the tuned tile or the head dim's default
    option_tile: Callable[[int, str, dict], Tile | None] | None = None
    # the options as the kernel builds them once its tile is known: (options, tile, head_dim) -> options, those that
    # the tile or other options leave without effect set to their first value, so that one kernel has one spec
    settled_options: Callable[[dict, Tile, int], dict] | None = None

    def option_default(self, name: str, head_dim: int):
        """The value a spec at head_dim takes for option `name` where it names none."""
        return self.option_defaults.get(head_dim, {}).get(name, self.options[name][0])

    def default_tile(self, head_dim: int, causal: bool, arch: str, options: dict | None = None) -> Tile:
        """The options' tile (option_tile), else the tuned tile for (head_dim, causal, arch), else the
        head dim's default; where the arch has too little shared memory for it, the first of
        smaller_tiles that fits (or it, and the spec's check says so)."""
        tile = (self.option_tile and self.option_tile(head_dim, arch, options or {})) or \
            self.tuned.get((head_dim, causal, arch), self.default_tiles[head_dim])
        fits = [t for t in (tile, *self.smaller_tiles.get(head_dim, ()))
                if self.smem_bytes(t, head_dim) <= SMEM_PER_BLOCK[arch]]
        return fits[0] if fits else tile

    def threads(self, tile: Tile) -> int:
        return 32 * (tile.warps + self.producer_warps)


class LaunchChoice(NamedTuple):
    """A kernel that calls of at least least_queries query rows a sequence, over at least least_heads
    sequence-heads (batch x query heads), run instead of the default: its tile, matrix unit (None: the arch's
    default unit) and template options ((name, value) pairs over the spec's defaults); causal True or False: for
    those calls only (None: both). Of several choices listed for a key, a call takes the one of the highest
    thresholds it reaches (registry.launch_choice)."""

    least_queries: int
    tile: Tile
    mma: str | None = None
    options: tuple = ()
    causal: bool | None = None
    least_heads: int = 1

    def reached_by(self, queries: int, heads: int | None) -> bool:
        """Whether a call of `queries` rows over `heads` sequence-heads (None: as many as any threshold asks)
        runs this kernel rather than one of a lower threshold."""
        return queries >= self.least_queries and (heads is None or heads >= self.least_heads)


@dataclass(frozen=True)
class Recipe:
    name: str
    summary: str
    input_dtypes: tuple[str, ...]  # NumPy dtype names the kernel takes for q, k, v
    tolerance: Tolerance
    families: dict = field(default_factory=dict)  # backend -> Family, for kinds with a kernel
    ctype: dict = field(default_factory=dict)  # template values: element type names per backend
    # (backend, arch) -> the Families that arch builds the format with, the default first, where
    # it differs from families[backend] (another template variant or matrix unit)
    arch_families: dict = field(default_factory=dict)
    kind: str = "prefill"  # the kernel kind the format is for; names are unique within a kind

    def arch_options(self, backend: str, arch: str | None) -> tuple:
        if backend not in self.families:
            have = ", ".join(self.families) or "none yet (emulator only)"
            raise ValueError(f"format {self.name!r}: no {backend} kernel; backends with a kernel: {have}")
        return self.arch_families.get((backend, arch), (self.families[backend],))

    def family(self, backend: str, arch: str | None = None, mma: str | None = None,
               head_dim: int | None = None) -> Family:
        """The backend's family; with arch, the one that arch builds by default (for head_dim where
        given: the first that has it), or the one on the matrix unit mma names
        (Family.values["mma_unit"], e.g. "mma.sync" or "wgmma")."""
        options = self.arch_options(backend, arch)
        if mma is None:
            return next((f for f in options if head_dim is None or head_dim in f.head_dims), options[0])
        units = [f.values.get("mma_unit") for f in options]
        if mma not in units:
            have = ", ".join(u for u in units if u) or "no choice of unit"
            raise ValueError(f"mma: {self.name} on {backend} {arch} builds with {have}, got {mma!r}")
        fam = options[units.index(mma)]
        if head_dim is not None and head_dim not in fam.head_dims:
            raise ValueError(f"head_dim: {self.name} on {mma} ({backend} {arch}) supports "
                             f"{', '.join(map(str, fam.head_dims))}, got {head_dim!r}")
        return fam

