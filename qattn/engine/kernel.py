"""Kernel: a built specialization (source, binary, resources) that loads lazily and launches.
build_kernel() is the one path from a KernelSpec to a Kernel: render, key, memory cache, disk
cache, compile on a miss (never when QATTN_NO_JIT=1)."""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import cached_property

from .render import entry_name, main_entry_name, render
from .spec import KernelSpec
from . import compile as compiler
from . import registry
from .cache import KernelCache, KernelNotCached, content_key, jit_disabled

_MEMORY: dict[KernelSpec, "Kernel"] = {}
_LOCK = threading.Lock()


@dataclass
class Kernel:
    spec: KernelSpec
    source: str
    binary: bytes
    resources: dict
    meta: dict = field(default_factory=dict)
    _functions: dict = field(default_factory=dict, repr=False)  # entry suffix -> loaded function
    _module: object = field(default=None, repr=False)
    _resident: dict = field(default_factory=dict, repr=False)  # (device, entry) -> (SMs, blocks per SM)
    launch_shapes: dict = field(default_factory=dict, repr=False)  # a launcher's per-device launch shapes
    # launch plans by call signature (packed.cached_plan), least recently used first
    plans: OrderedDict = field(default_factory=OrderedDict, repr=False)

    @property
    def name(self) -> str:
        return self.spec.name

    @cached_property  # read on every launch
    def threads(self) -> int:
        return self.spec.family.threads(self.spec.tile)

    @cached_property
    def shared_bytes(self) -> int:
        return self.spec.family.smem_bytes(self.spec.tile, self.spec.head_dim)

    def function(self, suffix: str = ""):
        """The loaded device function entry_name(spec) + suffix (needs a GPU of the spec's arch);
        templates with several kernels in one module name the others by suffix."""
        fn = self._functions.get(suffix)
        if fn is None:
            if self.spec.backend != "cuda":
                raise RuntimeError(f"{self.name}: running HIP kernels needs ROCm (CuPy for ROCm with hiprtc); "
                                   "on this machine HIP kernels are compiled offline only")
            import cupy
            from cupy.cuda import driver

            if self._module is None:
                module = cupy.cuda.function.Module()
                module.load(self.binary)
                self._module = module
            fn = self._module.get_function(entry_name(self.spec) + suffix)
            if self.shared_bytes > 48 * 1024:
                driver.funcSetAttribute(fn.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                        self._dynamic_limit(fn))
            self._functions[suffix] = fn
        return fn

    def _dynamic_limit(self, fn) -> int:
        """The dynamic shared memory entry fn may ask for: the spec's, at most what a block can take beside
        fn's static arrays. A module's other entries (quantizers, merges, writers) launch with none of
        their own and may hold static arrays that the main kernel's figure would push over the limit (the
        driver then refuses the attribute)."""
        from cupy.cuda import driver, runtime

        static = driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, fn.ptr)
        optin = runtime.deviceGetAttribute(runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin, runtime.getDevice())
        return min(self.shared_bytes, optin - static)

    def resident(self, device_id: int, suffix: str = "") -> tuple[int, int]:
        """The device's SM count and how many blocks of entry `suffix` one SM holds (the driver's
        occupancy figure for its registers and shared memory)."""
        key = (device_id, suffix)
        if key not in self._resident:
            from cupy.cuda import driver, runtime

            sms = runtime.deviceGetAttribute(runtime.cudaDevAttrMultiProcessorCount, device_id)
            per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(self.function(suffix).ptr, self.threads,
                                                                      self.shared_bytes)
            self._resident[key] = (sms, max(1, per_sm))
        return self._resident[key]

    def __call__(self, *args, **kwargs):
        return registry.LAUNCHERS[self.spec.family.launcher](self, *args, **kwargs)


def build_kernel(spec: KernelSpec, cache: KernelCache | None = None) -> Kernel:
    with _LOCK:
        hit = _MEMORY.get(spec)
    if hit is not None:
        return hit
    source = render(spec)
    if spec.backend == "cuda":
        options, version = compiler.cuda_options(spec.arch), compiler.nvrtc_version()
    else:
        options, version = compiler.hip_options(spec.arch), "clang-offline"
    key = content_key(source, options, version, spec.arch)
    cache = cache or KernelCache()
    entry = cache.load(spec.name, key)
    if entry is None:
        if jit_disabled():
            raise KernelNotCached(f"{spec.name}: not in the kernel cache at {cache.root} and QATTN_NO_JIT=1; "
                                  "build it first (qattn compile ...) or unset QATTN_NO_JIT")
        start = time.perf_counter()
        if spec.backend == "cuda":
            binary = compiler.compile_cuda(source, spec.arch, spec.name, options, entry=main_entry_name(spec))
        else:
            binary = compiler.compile_hip_offline(source, spec.arch, spec.name, entry=main_entry_name(spec))
        resources = binary.resources
        meta = {"spec": spec.as_dict(), "name": spec.name, "options": options, "compiler": version,
                "resources": resources, "build_seconds": round(time.perf_counter() - start, 4),
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        entry = cache.store(spec.name, key, binary.data, source, meta)
    resources = dict(entry.meta.get("resources", {}))
    kernel = Kernel(spec, source, entry.binary, resources, entry.meta)
    resources.update(threads=kernel.threads, dynamic_smem=kernel.shared_bytes)
    with _LOCK:
        _MEMORY[spec] = kernel
    return kernel
