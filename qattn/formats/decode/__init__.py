"""The decode formats: attention of a few new tokens over a paged K-V cache whose K and V are each
16-bit or 8-bit (e4m3, int8), at the bandwidth limit (``decode``), and the cache with its one-launch
writer (``PagedKVCache``)."""
from pathlib import Path

from ...engine import registry
from .cache import PagedKVCache
from .host import decode, launch, launch_shape, workspace_bytes
from .parity import check
from .recipes import LAUNCHER, RECIPES
from .rope import RoPE

FAMILY = registry.register(registry.FormatFamily(
    name="decode",
    recipes=RECIPES,
    templates=Path(__file__).resolve().parent / "templates",
    launchers={LAUNCHER: launch},
    parity=check,
))

__all__ = ["FAMILY", "PagedKVCache", "RoPE", "decode", "launch_shape", "workspace_bytes"]
