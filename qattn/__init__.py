"""qattn: flash-attention kernels in low-precision formats, generated from Jinja templates,
compiled at run time (NVRTC / hiprtc), and checked against an FP64 reference."""
__version__ = "0.1.0"

from .codegen.recipes import RECIPES, recipe  # noqa: E402
from .codegen.spec import KernelSpec, Tile  # noqa: E402
from .runtime import metrics, reference  # noqa: E402
from .runtime.api import attention, build, default_spec  # noqa: E402
from .runtime.compile import CompileError  # noqa: E402
from .runtime.cache import KernelNotCached  # noqa: E402
from .runtime.kvcache import KVCacheInt8  # noqa: E402

__all__ = [
    "__version__", "attention", "build", "default_spec", "KernelSpec", "Tile", "RECIPES", "recipe",
    "reference", "metrics", "CompileError", "KernelNotCached", "KVCacheInt8",
]
