"""The int8-KV-cache formats: exact attention over an int8 KV cache (kv8-imma on int8 tensor cores with
a 24-bit operand split, kv8-split, kv8-f32), and the cache they read (``KVCacheInt8``)."""
from pathlib import Path

from ...engine import registry
from .cache import KVCacheInt8, build_writer, writer_name
from .emulate import EMULATORS, as_int8_cache
from .host import attention_kv8, prefill_kv8
from .launch import inspect_fields
from .recipes import LAUNCH_TILES, LAUNCHER, RECIPES


def _kernel_inputs(k, v) -> tuple:
    """Float K and V written once into a cache, as an engine's cache is (parity times attention alone)."""
    return (KVCacheInt8.from_kv(k, v),)


def _companions(arch: str) -> dict:
    """The cache's writer, which KVCacheInt8.from_kv and append launch."""
    return {writer_name(arch): lambda: build_writer(arch)[1]["resources"]}


FAMILY = registry.register(registry.FormatFamily(
    name="kv8",
    recipes=RECIPES,
    templates=Path(__file__).resolve().parent / "templates",
    launchers={LAUNCHER: prefill_kv8},
    emulators=EMULATORS,
    call=attention_kv8,
    call_names=("kv8",),
    cache_types=(KVCacheInt8,),
    kv_cache=as_int8_cache,
    launch_tiles=LAUNCH_TILES,
    kernel_inputs=_kernel_inputs,
    inspect=inspect_fields,
    companions=_companions,
))

__all__ = ["FAMILY", "KVCacheInt8", "attention_kv8"]
