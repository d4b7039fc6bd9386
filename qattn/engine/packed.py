"""Kernel launches whose parameters are packed once.

A call of a CuPy RawKernel converts every argument on every launch; for the int8-QK path's four
launches of 7 to 30 arguments that host time exceeds what the short quantization kernels take on
the GPU, and the GPU waits for it. A PackedLaunch lays its parameters out once (the values that do
not change between calls written in place) and each call writes only its device pointers before
one cuLaunchKernel, which copies the parameters before it returns (so one buffer serves every call).

A programmatic launch (sm_90 and newer) goes through cuLaunchKernelEx with programmatic stream
serialization: the GPU may start the kernel while the one ahead of it in the stream is still
draining, which hides the launch gap between the dependent kernels of one call. Such a kernel must
wait for its predecessor on the device before it touches memory (grid_dependency_wait in
common.cuh.j2); where the driver lacks cuLaunchKernelEx the launch is an ordinary one.

Every launcher (launch.prefill, the int8-QK and kv8 calls) keeps its launches in plans cached on
the kernel per call signature (cached_plan): the full argument checks run when a plan is built,
and a repeated call only checks its pointers, allocates and launches.

A parameter passed by value that is more than a scalar (a CUtensorMap, engine/tensormap.py) is a
Blob: its bytes are given per call, like a Pointer's address, and copied into the buffer at an
offset aligned as the kernel's parameter is.
"""
from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

import numpy as np

from .driver_api import driver_entry


@dataclass(frozen=True)
class Pointer:
    """A pointer parameter filled in per call: pointers[name] + offset bytes (name None: null)."""

    name: str | None
    offset: int = 0


NULL = Pointer(None)


@dataclass(frozen=True)
class Blob:
    """A by-value parameter of `size` bytes (a struct, such as a 128-byte CUtensorMap) filled in per
    call from pointers[name], a bytes object of exactly that size (the object of the call before,
    the same by identity, is not copied again), at an offset of the parameter buffer aligned to
    `align` bytes."""

    name: str
    size: int = 128
    align: int = 64

    def __post_init__(self):
        if self.size < 1 or self.align < 1 or self.align & (self.align - 1):
            raise ValueError(f"Blob {self.name!r}: size must be positive and align a power of two, "
                             f"got size {self.size}, align {self.align}")

# Plans kept per kernel (least recently used dropped first).
PLANS_PER_KERNEL = 64
_PLANS_LOCK = threading.Lock()


def cached_plan(kernel, key, build):
    """The plan for key on kernel, built by build() on a miss (a build that raises caches nothing)."""
    plans = kernel.plans
    with _PLANS_LOCK:
        plan = plans.get(key)
        if plan is not None:
            plans.move_to_end(key)
            return plan
    plan = build()
    with _PLANS_LOCK:
        plans[key] = plan
        if len(plans) > PLANS_PER_KERNEL:
            plans.popitem(last=False)
    return plan


def element_strides(strides, itemsize: int) -> tuple:
    """The first three byte strides (batch, head, sequence) as the int64 element strides kernels take."""
    return tuple(np.int64(s // itemsize) for s in strides[:3])


def programmatic(spec) -> bool:
    """Whether a kernel's launches may be programmatic (CUDA, sm_90 and newer). The int8-QK and kv8
    templates' entries all pass grid_dependency_wait (common.cuh.j2) before touching memory."""
    return spec.backend == "cuda" and int(spec.arch[3:].rstrip("a")) >= 90

# cuda.h: CUlaunchAttributeIDs CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION and
# CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION.
_CLUSTER_DIMENSION = 4
_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class LaunchError(RuntimeError):
    """A launch the driver refused: its error, grid, block and shared memory are in the message."""


def _status_text(status: int) -> str:
    """A CUresult as the driver names it (CuPy's text), or its number where the driver cannot say."""
    try:
        from cupy.cuda import driver

        return str(driver.CUDADriverError(status))
    except Exception:  # no driver to ask
        return f"CUresult {status}"


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: an id, then a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 16)]


def _attributes(programmatic: bool, cluster: int):
    """The launch attributes of a programmatic launch and of a cluster of `cluster` blocks along x."""
    chosen = []
    if programmatic:
        chosen.append(_LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=(ctypes.c_uint * 16)(1)))
    if cluster > 1:
        chosen.append(_LaunchAttribute(id=_CLUSTER_DIMENSION, value=(ctypes.c_uint * 16)(cluster, 1, 1)))
    return (_LaunchAttribute * max(1, len(chosen)))(*chosen), len(chosen)


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


def _launch_kernel_ex():
    """The driver's cuLaunchKernelEx (CUDA 12+), or None."""
    return driver_entry("cuLaunchKernelEx", (ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p,
                                             ctypes.c_void_p))


def _max_active_clusters():
    """The driver's cuOccupancyMaxActiveClusters (CUDA 12+), or None."""
    return driver_entry("cuOccupancyMaxActiveClusters", (ctypes.POINTER(ctypes.c_int), ctypes.c_void_p,
                                                         ctypes.POINTER(_LaunchConfig)))


def max_active_clusters(function, grid, block: int, shared_mem: int, cluster: int) -> int:
    """How many clusters of `cluster` blocks (along x) of this kernel the GPU runs at once with this grid,
    block and dynamic shared memory; 0 where the driver cannot launch such clusters (or has no
    cuOccupancyMaxActiveClusters)."""
    fn = _max_active_clusters()
    if fn is None or cluster < 2 or int(grid[0]) % cluster:
        return 0
    attrs, count = _attributes(False, cluster)
    config = _LaunchConfig((ctypes.c_uint * 3)(*(int(g) for g in grid)), (ctypes.c_uint * 3)(int(block), 1, 1),
                           int(shared_mem), None, attrs, count)
    found = ctypes.c_int(0)
    return found.value if fn(ctypes.byref(found), function.ptr, ctypes.byref(config)) == 0 else 0


class PackedLaunch:
    """One kernel launch with its grid, block, shared memory and parameters fixed: args are numpy
    scalars (np.int32, np.int64, np.float32, np.uintp: written once), Pointers or Blobs (written per
    call). cluster > 1: the blocks run as thread-block clusters of that many along x (sm_90 and newer;
    grid x a multiple of it)."""

    def __init__(self, function, grid, block: int, shared_mem: int, args, programmatic: bool = False,
                 cluster: int = 1):
        if len(grid) != 3:
            raise ValueError(f"grid: expected 3 dimensions, got {tuple(grid)}")
        self._function = function  # held: its module must outlive the launches
        self._function_ptr = function.ptr
        self._dims = (*(int(g) for g in grid), int(block), 1, 1, int(shared_mem))
        if min(self._dims[:4]) < 1:
            raise ValueError(f"grid {tuple(grid)} x block {block}: every dimension must be >= 1")
        offsets, end, align = [], 0, 8
        for arg in args:
            if isinstance(arg, Blob):
                size, step = arg.size, arg.align
            else:
                size = step = 8 if isinstance(arg, Pointer) else np.asarray(arg).itemsize
            end = -(-end // step) * step
            offsets.append(end)
            end += size
            align = max(align, step)
        # the parameters, patched in place per call, from an address aligned as the most aligned one
        spare = align // 8 - 1
        store = np.zeros(-(-end // 8) + spare, dtype=np.uint64)
        first = (-store.__array_interface__["data"][0] % align) // 8
        self._words = store[first:first + len(store) - spare]
        raw = self._words.view(np.uint8)
        base = self._words.__array_interface__["data"][0]
        self._slots = []  # (word index, name, offset)
        self._blobs = []  # (address, name, size)
        self._blob_bytes = {}  # name -> the bytes object written last (held: an unchanged one is not copied again)
        for arg, at in zip(args, offsets):
            if isinstance(arg, Pointer):
                if arg.name is not None:
                    self._slots.append((at // 8, arg.name, arg.offset))
            elif isinstance(arg, Blob):
                self._blobs.append((base + at, arg.name, arg.size))
            else:
                value = np.asarray(arg)
                raw[at:at + value.itemsize] = np.frombuffer(value.tobytes(), dtype=np.uint8)
        self._params = np.array([base + at for at in offsets], dtype=np.uint64)  # void*[]: each parameter's address
        self._params_ptr = self._params.__array_interface__["data"][0]
        self._lock = threading.Lock()  # one caller at a time patches the words
        from cupy.cuda import driver

        self._launch = driver.launchKernel
        if cluster > 1 and self._dims[0] % cluster:
            raise ValueError(f"grid {tuple(grid)}: x is not a multiple of the cluster's {cluster} blocks")
        self._ex = _launch_kernel_ex() if programmatic or cluster > 1 else None
        if self._ex is None and cluster > 1:
            raise LaunchError("a cluster launch needs the driver's cuLaunchKernelEx (CUDA 12 or newer)")
        self._programmatic = programmatic and self._ex is not None
        self.cluster = int(cluster)
        if self._ex is not None:
            self._attrs, count = _attributes(programmatic, cluster)
            self._config = _LaunchConfig((ctypes.c_uint * 3)(*self._dims[:3]), (ctypes.c_uint * 3)(*self._dims[3:6]),
                                         self._dims[6], None, self._attrs, count)
            self._config_ref = ctypes.byref(self._config)

    @property
    def programmatic(self) -> bool:
        """Whether the launch lets the GPU start the kernel before its predecessor has drained."""
        return self._programmatic

    def __call__(self, pointers: dict, stream_ptr: int) -> None:
        """Launch with each Pointer's pointers[name] + offset and each Blob's bytes pointers[name] (the
        launch copies the parameters)."""
        with self._lock:
            words = self._words
            for index, name, offset in self._slots:
                words[index] = pointers[name] + offset
            for address, name, size in self._blobs:
                value = pointers[name]
                if value is not self._blob_bytes.get(name):
                    if len(value) != size:
                        raise ValueError(f"{name}: expected {size} bytes, got {len(value)}")
                    ctypes.memmove(address, value, size)
                    self._blob_bytes[name] = value
            if self._ex is None:
                try:
                    self._launch(self._function_ptr, *self._dims, stream_ptr, self._params_ptr, 0)
                except RuntimeError as exc:  # CuPy's CUDADriverError
                    raise self._refused(f"cuLaunchKernel: {exc}") from exc
                return
            self._config.stream = stream_ptr
            status = self._ex(self._config_ref, self._function_ptr, self._params_ptr, None)
        if status:
            raise self._refused(f"cuLaunchKernelEx: {_status_text(status)}")

    def _refused(self, what: str) -> LaunchError:
        return LaunchError(f"{what} (grid {self._dims[:3]}, {self._dims[3]} threads, {self._dims[6]} B of dynamic "
                           "shared memory)")
