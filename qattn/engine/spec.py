"""KernelSpec: what to build. Frozen, validated at construction, with a readable name and a hash key."""
from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import asdict, dataclass, replace

from . import tuned
from .family import BACKENDS, KINDS, SMEM_PER_BLOCK
from .registry import family_of, launch_choice, launch_choices, launch_heads, recipe
from .shape_class import ShapeClass, length_bucket
from .tile import Tile


def rocm_runtime() -> bool:
    """Whether CuPy runs on ROCm (HIP), where qattn renders and compiles HIP kernels but launches none."""
    try:
        import cupy

        return bool(cupy.cuda.runtime.is_hip)
    except Exception:  # no CuPy runtime at all
        return False


def device_arch() -> str | None:
    """The current CUDA device's arch as NVRTC names it (sm_90 -> sm_90a), or None without an NVIDIA GPU
    (a ROCm device included: see rocm_runtime)."""
    try:
        import cupy

        if cupy.cuda.runtime.is_hip or not cupy.cuda.is_available():
            return None
        major, minor = cupy.cuda.Device().compute_capability[:-1], cupy.cuda.Device().compute_capability[-1]
    except Exception:  # no driver, no device
        return None
    arch = f"sm_{major}{minor}"
    return "sm_90a" if arch == "sm_90" else arch


@dataclass(frozen=True)
class KernelSpec:
    kind: str = "prefill"
    recipe: str = "f16"
    head_dim: int = 128
    tile: Tile | None = None  # None: the family's tuned default for head_dim, causal and arch
    causal: bool = False
    backend: str = "cuda"
    arch: str | None = None  # None: the current device's (CUDA only)
    mma: str | None = None  # matrix unit where an arch has a choice ("mma.sync", "wgmma"); None: its default
    # template constants the family lets a spec choose (Family.options), as a dict or (name, value)
    # pairs; held as pairs in the family's order, every option given (defaults filled in)
    options: tuple = ()

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind: expected one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {', '.join(BACKENDS)}, got {self.backend!r}")
        fam = recipe(self.recipe, self.kind).family(self.backend)
        if not isinstance(self.head_dim, int) or self.head_dim not in fam.head_dims:
            raise ValueError(f"head_dim: {self.recipe} on {self.backend} supports "
                             f"{', '.join(map(str, fam.head_dims))}, got {self.head_dim!r}")
        if not isinstance(self.causal, bool):
            raise ValueError(f"causal: expected a bool, got {self.causal!r}")
        if self.causal and self.kind == "decode":
            raise ValueError("causal: decode rows are always bottom-right causal among the new tokens; a decode spec "
                             "takes causal=False")
        if self.arch is None:
            arch = device_arch() if self.backend == "cuda" else None
            if arch is None:
                rocm = (" (this CuPy runs on ROCm, where qattn compiles HIP kernels offline but launches none: "
                        "`qattn compile --backend hip`)") if rocm_runtime() else ""
                raise ValueError(f"arch: no {self.backend} device found to default to{rocm}; name one of "
                                 f"{', '.join(fam.archs)}")
            object.__setattr__(self, "arch", arch)
        if self.arch not in fam.archs:
            raise ValueError(f"arch: {self.recipe} on {self.backend} supports {', '.join(fam.archs)}, got {self.arch!r}")
        rec = recipe(self.recipe, self.kind)
        if self.mma is not None:
            if self.mma == rec.family(self.backend, self.arch, head_dim=self.head_dim).values.get("mma_unit"):
                object.__setattr__(self, "mma", None)  # the default, spelled out: one spec, one key
        object.__setattr__(self, "options", self._checked_options(rec.family(
            self.backend, self.arch, self.mma, self.head_dim)))
        fam = self.family
        problem = fam.option_problem and fam.option_problem(dict(self.options), self.arch, self.head_dim)
        if problem:
            raise ValueError(problem)
        if self.tile is None:
            object.__setattr__(self, "tile", fam.default_tile(self.head_dim, self.causal, self.arch,
                                                                dict(self.options)))
        if not isinstance(self.tile, Tile):
            raise ValueError(f"tile: expected a qattn.Tile, got {self.tile!r}")
        problem = fam.tile_problem(self.tile, self.head_dim)
        if problem:
            raise ValueError(f"tile {self.tile.name} for {self.recipe} d{self.head_dim} on {self.backend}: {problem}")
        need, limit = fam.smem_bytes(self.tile, self.head_dim), SMEM_PER_BLOCK[self.arch]
        if need > limit:
            raise ValueError(f"tile {self.tile.name} for {self.recipe} d{self.head_dim} needs {need} B of shared "
                             f"memory per block; {self.arch} allows {limit}: choose a smaller tile")
        if fam.settled_options:
            settled = fam.settled_options(dict(self.options), self.tile, self.head_dim)
            object.__setattr__(self, "options", tuple(settled.items()))

    def _checked_options(self, fam) -> tuple:
        given = dict(self.options) if isinstance(self.options, (dict, tuple, list)) else None
        if given is None:
            raise ValueError(f"options: expected a dict of template options, got {self.options!r}")
        unknown = set(given) - set(fam.options)
        if unknown:
            have = ", ".join(fam.options) or "none"
            # another matrix unit of this arch whose kernel takes them all (f16's wgmma kernel on sm_90a)
            units = [f.values["mma_unit"] for f in recipe(self.recipe, self.kind).arch_options(self.backend, self.arch)
                     if f is not fam and "mma_unit" in f.values and set(given) <= set(f.options)]
            elsewhere = f"; its {units[0]} kernel does (mma={units[0]!r})" if units else ""
            unit = f" on {fam.values['mma_unit']}" if units and "mma_unit" in fam.values else ""
            raise ValueError(f"options: {self.recipe}{unit} takes {have}, got {', '.join(sorted(map(str, unknown)))}"
                             f"{elsewhere}")
        for name, allowed in fam.options.items():
            if name in given and given[name] not in allowed:
                raise ValueError(f"{name}: {self.recipe} takes one of {', '.join(map(str, allowed))}, "
                                 f"got {given[name]!r}")
        return tuple((name, given.get(name, fam.option_default(name, self.head_dim))) for name in fam.options)

    @property
    def family(self):
        fam = recipe(self.recipe, self.kind).family(self.backend, self.arch, self.mma, self.head_dim)
        return replace(fam, values={**fam.values, **dict(self.options)}) if self.options else fam

    @property
    def name(self) -> str:
        """Greppable identifier, e.g. prefill_f16_d128_m128n64w4s2_causal_sm90a; also the cache dir stem."""
        parts = [self.kind, self.recipe, f"d{self.head_dim}", self.tile.name]
        if self.causal:
            parts.append("causal")
        if self.mma is not None:
            parts.append(self.mma.replace(".", ""))
        parts += [_option_tag(name, value) for name, value in self.options if value != "off"]
        parts.append(self.arch.replace("_", ""))
        return "_".join(parts)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["tile"] = asdict(self.tile)
        if self.options:
            d["options"] = dict(self.options)
        else:
            del d["options"]  # the prefill specs' dicts (and keys) stay as they were
        return d

    @property
    def key(self) -> str:
        return hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()[:16]

    def with_(self, **changes) -> "KernelSpec":
        return replace(self, **changes)


def _option_tag(name: str, value) -> str:
    """An option in a spec name: page_size 32 -> p32, k_mean page -> kmean-page, k_rope post -> krope-post, tail
    split -> tail-split, k_balance on -> kbal, an on/off option's "on" as its name without underscores (kv_rows ->
    kvrows, out_tma -> outtma),
    other values as they are (an option left "off" is left out, so that adding one renames no existing
    kernel)."""
    if name == "page_size":
        return f"p{value}"
    if name == "k_balance":
        return "kbal"
    if name in ("kv_rows", "pingpong", "persistent", "chain", "out_tma", "q_tma", "v_tiles"):
        return name.replace("_", "")
    if name in ("k_mean", "k_rope", "tail"):
        return f"{name.replace('_', '')}-{value}"
    return str(value)


def default_spec(format: str, head_dim: int, *, causal: bool = False, arch: str | None = None,
                 shape: ShapeClass | None = None) -> KernelSpec:
    """The prefill kernel a call of format runs by default on arch (default: the current GPU's): the
    tile `qattn tune` stored for this GPU (with_tuned_tile; of shape's class where shape is given),
    else the family's built-in default."""
    _check_cuda_kernel(format)
    return with_tuned_tile(KernelSpec(kind="prefill", recipe=format, head_dim=head_dim, causal=causal,
                                      arch=arch or device_arch()), shape)


def call_spec(format: str, head_dim: int, causal: bool, queries: int, arch: str, tile: Tile | None = None,
              mma: str | None = None, shape: ShapeClass | None = None, heads: int | None = None) -> KernelSpec:
    """The kernel a call of `queries` query rows a sequence over `heads` sequence-heads (batch x query heads;
    None: many) runs: the given tile and matrix unit (each None: the arch's default); where neither is named, the
    tile `qattn tune` stored for this GPU (of shape's class where shape is given: a measurement on this machine),
    else the kernel its family lists for the call (registry.launch_choice: measured on the arch's reference GPU),
    else the family's default."""
    _check_cuda_kernel(format)
    spec = KernelSpec(kind="prefill", recipe=format, head_dim=head_dim, causal=causal, arch=arch, mma=mma,
                      **({"tile": tile} if tile is not None else {}))
    if tile is not None or mma is not None:
        return spec
    return _tuned_spec(spec, shape) or builtin_spec(format, head_dim, causal, queries, arch, heads)


def builtin_spec(format: str, head_dim: int, causal: bool, queries: int, arch: str,
                 heads: int | None = None) -> KernelSpec:
    """The kernel a call of `queries` query rows a sequence over `heads` sequence-heads (None: many) runs where
    `qattn tune` stored nothing: the one its family lists for the call (registry.launch_choice), else the
    family's default."""
    _check_cuda_kernel(format)
    choice = launch_choice(format, head_dim, arch, queries, causal, heads)
    if choice is None:
        return KernelSpec(kind="prefill", recipe=format, head_dim=head_dim, causal=causal, arch=arch)
    return KernelSpec(kind="prefill", recipe=format, head_dim=head_dim, causal=causal, arch=arch, mma=choice.mma,
                      tile=choice.tile, options=dict(choice.options))


def call_specs(format: str, head_dim: int, causal: bool, arch: str, queries: int | None = None,
               heads: int | None = None) -> list[KernelSpec]:
    """The prefill kernels that calls naming no tile or unit run on arch, to build ahead of the first call
    (`qattn compile --queries/--all`, deployments with QATTN_NO_JIT=1): for calls of `queries` query rows per
    sequence the kernel listed for that count (builtin_spec), for queries None the family's default and every
    kernel listed for a query count, each for calls of `heads` sequence-heads (None: any number); and the
    kernels `qattn tune` stored for such calls on this machine's GPU (a call runs its shape class's winner); and
    with each, the kernels its launcher runs in its place for arguments whose strides the TMA cannot address
    (FormatFamily.variants)."""
    counts = [queries] if queries is not None else [1] + [c.least_queries for c in
                                                            launch_choices(format, head_dim, arch, causal)]
    specs = [builtin_spec(format, head_dim, causal, n, arch, h) for n in counts
             for h in ([heads] if heads is not None else launch_heads(format, head_dim, arch, causal))]
    base = KernelSpec(kind="prefill", recipe=format, head_dim=head_dim, causal=causal, arch=arch)
    bucket = None if queries is None else length_bucket(queries)
    specs += filter(None, (_with_stored(base, stored) for stored in tuned.stored(format, head_dim, causal, arch, bucket)))
    variants = family_of(format).variants
    return list(dict.fromkeys(specs + [v for s in specs for v in (variants(s) if variants else ())]))


def _check_cuda_kernel(format: str) -> None:
    if "cuda" not in recipe(format).families:
        raise ValueError(f"format {format!r} has no CUDA kernel yet; its CPU emulator is "
                         f"qattn.check.emulate.emulate({format!r}, ...)")


def with_tuned_tile(spec: KernelSpec, shape: ShapeClass | None = None) -> KernelSpec:
    """spec with the kernel (tile, and matrix unit where the arch has a choice) `qattn tune` stored for
    it on this GPU (engine/tuned.py: the winner of shape's class where shape is given, else the best
    over the classes tuned), where there is one."""
    return _tuned_spec(spec, shape) or spec


def _tuned_spec(spec: KernelSpec, shape: ShapeClass | None) -> KernelSpec | None:
    """spec with its stored kernel, or None where nothing usable is stored."""
    stored = tuned.lookup(spec.recipe, spec.head_dim, spec.causal, spec.arch, shape)
    return None if stored is None else _with_stored(spec, stored)


def _with_stored(spec: KernelSpec, stored: tuned.TunedKernel) -> KernelSpec | None:
    """spec on a stored kernel, or None where the family's rules no longer admit it."""
    if stored == tuned.TunedKernel.of(spec):
        return spec
    try:
        return spec.with_(tile=stored.tile, mma=stored.mma, options=dict(stored.options))
    except ValueError as exc:  # stored before the family's rules changed: the built-in default stands
        warnings.warn(f"qattn: ignoring the tuned kernel {stored.name} for {spec.name}: {exc}", stacklevel=5)
        return None
