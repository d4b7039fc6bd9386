"""The kernels `qattn tune` sweeps: a grid of block shapes, warps and stages on each matrix unit the
arch builds the format with (on sm_90a f16 and bf16: mma.sync and wgmma; i8-f16 and i8-f8: wgmma and
mma.sync), kept where that unit's kernel family takes them (KernelSpec's validation: the family's
tile rules and the arch's shared memory per block)."""
from __future__ import annotations

import itertools

from ..engine import registry
from ..engine.spec import KernelSpec
from ..engine.tile import Tile

BLOCK_M = (32, 64, 128, 192, 256)
# Template options a sweep also tries on every tile, where the unit's kernel family has them: the
# wgmma kernels' turns between consumer warpgroups, persistent blocks, chained items, their rows by TMA stores and
# their Q rows by TMA loads, and their grid's last round split by key tiles (kv_rows, the TMA kernel's fallback for
# strides it cannot read, is never faster and stays out).
SWEPT_OPTIONS = ("pingpong", "persistent", "chain", "out_tma", "q_tma", "tail")
BLOCK_N = (32, 64, 128)
# From one warp per SM scheduler up, as every built-in default has; --warps names fewer.
WARPS = (4, 8, 12, 16)
STAGES = (1, 2, 3, 4)


def tunable_formats() -> list[str]:
    """The prefill formats whose calls take their kernel from default_spec: those with a CUDA kernel
    and no call of their own (kv8 calls choose by query count over an int8 cache)."""
    return [name for name, rec in registry.recipes("prefill").items()
            if "cuda" in rec.families and registry.family_of(name).call is None]


def check_tunable(fmt: str) -> None:
    registry.recipe(fmt)  # an unknown name raises, naming the known formats
    if fmt not in tunable_formats():
        raise ValueError(f"format {fmt!r}: tune covers {', '.join(tunable_formats())} (the formats whose "
                         "qattn.attention calls run default_spec's kernel)")


def units(fmt: str, head_dim: int, arch: str) -> list[str]:
    """The matrix units the arch builds the format with at head_dim, its default first (names as
    Family.values["mma_unit"]; [] where the family names none: one kernel to sweep)."""
    rec = registry.recipe(fmt)
    default = rec.family("cuda", arch, head_dim=head_dim)
    found = [f.values.get("mma_unit") for f in (default, *rec.arch_options("cuda", arch))
             if head_dim in f.head_dims]
    return [unit for unit in dict.fromkeys(found) if unit]


def option_variants(spec: KernelSpec) -> list[KernelSpec]:
    """spec under every combination of the SWEPT_OPTIONS its family has, spec's own first, each kernel once (the
    family settles options that take no effect); turns are left out for a single consumer warpgroup (nothing to
    take turns with), chained items where the family's `chains` says the variant has none to chain (its kernel is
    the one without)."""
    fam = spec.family
    names = [n for n in SWEPT_OPTIONS if n in fam.options and not (n == "pingpong" and spec.tile.warps <= 4)]
    chains = fam.values.get("chains")
    variants = [spec]
    for values in itertools.product(*(fam.options[n] for n in names)):
        options = {**dict(spec.options), **dict(zip(names, values))}
        chained = bool(chains and chains(spec.tile, spec.head_dim, options))
        if options.get("chain") == "on" and not chained:
            continue
        variant = spec.with_(options=options)
        if variant not in variants:
            variants.append(variant)
    return variants


def candidate_specs(fmt: str, head_dim: int, causal: bool, arch: str, *, block_shapes=None, warps=None,
                    stages=None, mma=None, options: bool = True) -> list[KernelSpec]:
    """Every tile of the grid (BLOCK_M x BLOCK_N, WARPS, STAGES; each axis replaced where given,
    block_shapes as (block_m, block_n) pairs) on every matrix unit in mma (default: each the arch has
    for the format, units()) that the unit's kernel takes at head_dim on arch, with options each
    combination of the unit's SWEPT_OPTIONS (option_variants), the built-in default first where the
    grid holds it."""
    check_tunable(fmt)
    default = KernelSpec(kind="prefill", recipe=fmt, head_dim=head_dim, causal=causal, arch=arch)
    have = units(fmt, head_dim, arch)
    for unit in mma or ():
        if unit not in have:
            raise ValueError(f"mma: {fmt} d{head_dim} on {arch} builds with {', '.join(have) or 'one kernel'}, "
                             f"got {unit!r}")
    specs = []
    for unit in (mma or have or [None]):
        base = KernelSpec(kind="prefill", recipe=fmt, head_dim=head_dim, causal=causal, arch=arch, mma=unit)
        for (block_m, block_n), w, s in itertools.product(block_shapes or itertools.product(BLOCK_M, BLOCK_N),
                                                          warps or WARPS, stages or STAGES):
            try:
                spec = base.with_(tile=Tile(block_m, block_n, w, s))
            except ValueError:  # the family does not take this tile (its reason is in KernelSpec's message)
                continue
            specs += option_variants(spec) if options else [spec]
    if not specs:
        raise ValueError(f"tile: no tile of the grid fits {fmt} d{head_dim} on {arch}; widen --tile, --warps "
                         f"or --stages (the default tile is {default.tile.name})")
    return sorted(specs, key=lambda spec: spec != default)  # stable: grid order after the default
