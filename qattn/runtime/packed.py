"""Kernel launches whose parameters are packed once.

A call of a CuPy RawKernel converts every argument on every launch; for the int8-QK path's four
launches of 7 to 30 arguments that host time exceeds what the short quantization kernels take on
the GPU, and the GPU waits for it. A PackedLaunch lays its parameters out once (the values that do
not change between calls written in place) and each call writes only its device pointers before
one cuLaunchKernel, which copies the parameters before it returns (so one buffer serves every call).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Pointer:
    """A pointer parameter filled in per call: pointers[name] + offset bytes (name None: null)."""

    name: str | None
    offset: int = 0


NULL = Pointer(None)


class PackedLaunch:
    """One kernel launch with its grid, block, shared memory and parameters fixed: args are numpy
    scalars (np.int32, np.int64, np.float32, np.uintp: written once) or Pointers (written per call)."""

    def __init__(self, function, grid, block: int, shared_mem: int, args):
        if len(grid) != 3:
            raise ValueError(f"grid: expected 3 dimensions, got {tuple(grid)}")
        self._function = function  # held: its module must outlive the launches
        self._function_ptr = function.ptr
        self._dims = (*(int(g) for g in grid), int(block), 1, 1, int(shared_mem))
        if min(self._dims[:4]) < 1:
            raise ValueError(f"grid {tuple(grid)} x block {block}: every dimension must be >= 1")
        offsets, end = [], 0
        for arg in args:
            size = 8 if isinstance(arg, Pointer) else np.asarray(arg).itemsize
            end = -(-end // size) * size
            offsets.append(end)
            end += size
        self._words = np.zeros(-(-end // 8), dtype=np.uint64)  # the parameters, patched in place per call
        raw = self._words.view(np.uint8)
        self._slots = []  # (word index, name, offset)
        for arg, at in zip(args, offsets):
            if isinstance(arg, Pointer):
                if arg.name is not None:
                    self._slots.append((at // 8, arg.name, arg.offset))
            else:
                value = np.asarray(arg)
                raw[at:at + value.itemsize] = np.frombuffer(value.tobytes(), dtype=np.uint8)
        base = self._words.__array_interface__["data"][0]
        self._params = np.array([base + at for at in offsets], dtype=np.uint64)  # void*[]: each parameter's address
        self._params_ptr = self._params.__array_interface__["data"][0]
        self._lock = threading.Lock()  # one caller at a time patches the words

    def __call__(self, pointers: dict, stream_ptr: int) -> None:
        """Launch with each Pointer's pointers[name] + offset (the launch copies the parameters)."""
        from cupy.cuda import driver

        with self._lock:
            words = self._words
            for index, name, offset in self._slots:
                words[index] = pointers[name] + offset
            driver.launchKernel(self._function_ptr, *self._dims, stream_ptr, self._params_ptr, 0)
