"""qattn: flash-attention kernels in low-precision formats, generated from Jinja templates,
compiled at run time (NVRTC / hiprtc), and checked against an FP64 reference."""
from . import formats  # noqa: F401  (registers every format family)
from .api import attention, build, default_spec
from .check import metrics, reference
from .engine.cache import KernelNotCached
from .engine.compile import CompileError
from .engine.memory import Workspace
from .engine.registry import RECIPES, recipe
from .engine.spec import KernelSpec
from .engine.tile import Tile
from .formats.decode import PagedKVCache, RoPE, decode
from .formats.kv8 import KVCacheInt8
from .version import __version__

__all__ = [
    "__version__", "attention", "build", "default_spec", "KernelSpec", "Tile", "RECIPES", "recipe",
    "reference", "metrics", "CompileError", "KernelNotCached", "KVCacheInt8", "PagedKVCache", "RoPE",
    "decode", "Workspace",
]
