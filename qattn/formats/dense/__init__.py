"""The dense formats: f16 and bf16 flash attention on tensor cores, and f32, the fp32 SIMT noise floor."""
from pathlib import Path

from ...engine import registry
from .emulate import EMULATORS
from .launch import prefill, stride_variants
from .recipes import LAUNCH_TILES, RECIPES

FAMILY = registry.register(registry.FormatFamily(
    name="dense",
    recipes=RECIPES,
    templates=Path(__file__).resolve().parent / "templates",
    launchers={"prefill": prefill},
    emulators=EMULATORS,
    launch_tiles=LAUNCH_TILES,
    variants=stride_variants,
))
