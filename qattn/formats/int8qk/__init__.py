"""The int8-QK formats: i8-f16, i8-i8 and i8-f8 (int8 QKᵀ with exact K smoothing; PV in fp16, int8 or
fp8 e4m3). ``quantize`` and ``attention_quantized`` run the two steps of a call apart, for callers
that keep K and V quantized."""
from pathlib import Path

from ...engine import registry
from .emulate import EMULATORS
from .host import QuantizedQKV, attention_quantized, prefill_i8, quantize
from .launch import inspect_fields
from .recipes import LAUNCH_TILES, RECIPES

FAMILY = registry.register(registry.FormatFamily(
    name="int8qk",
    recipes=RECIPES,
    templates=Path(__file__).resolve().parent / "templates",
    launchers={"prefill_i8": prefill_i8},
    emulators=EMULATORS,
    options=frozenset({"smoothing", "smooth_k"}),
    inspect=inspect_fields,
    launch_tiles=LAUNCH_TILES,
))

__all__ = ["FAMILY", "QuantizedQKV", "attention_quantized", "quantize"]
