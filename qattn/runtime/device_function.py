"""DeviceFunction: one loaded kernel entry, launched through cuLaunchKernel with its arguments
packed into a single buffer in the C layout of the kernel's parameter list. The attention calls
launch several small kernels each; packing once and launching directly keeps the host's share of
a call small next to the kernels themselves.

Arguments, in the kernel's order: CuPy arrays (passed as their device pointer), and NumPy scalars
of the parameter's exact type: np.int32, np.int64, np.uintp (a raw pointer, or 0 for null),
np.float32. Anything else is refused with its position, so a Python int can never reach an int64
parameter as 4 bytes (or the reverse).
"""
from __future__ import annotations

import struct

import numpy as np

_CODES = {np.int32: "i", np.int64: "q", np.uint64: "Q", np.float32: "f"}  # np.uintp is np.uint64 here
_OFFSETS: dict[str, np.ndarray] = {}  # struct format -> byte offset of each argument


def _offsets(fmt: str) -> np.ndarray:
    """Byte offset of each parameter in a native-aligned ('@') struct of format fmt: the layout of
    a CUDA kernel's parameter buffer (each parameter aligned to its size)."""
    offsets = _OFFSETS.get(fmt)
    if offsets is None:
        ends = [struct.calcsize("@" + fmt[:i + 1]) for i in range(len(fmt))]
        offsets = np.array([end - struct.calcsize(code) for end, code in zip(ends, fmt)], dtype=np.uint64)
        _OFFSETS[fmt] = offsets
    return offsets


def pack_args(args) -> tuple[str, list]:
    """The struct format and values of a kernel's arguments (see the module docstring)."""
    import cupy

    codes, values = [], []
    for i, a in enumerate(args):
        code = _CODES.get(type(a))
        if code is not None:
            codes.append(code)
            values.append(a)
        elif isinstance(a, cupy.ndarray):
            codes.append("Q")
            values.append(a.data.ptr)
        else:
            raise TypeError(f"kernel argument {i}: expected a CuPy array or a NumPy int32, int64, uintp or "
                            f"float32 scalar, got {type(a).__name__}")
    return "".join(codes), values


class DeviceFunction:
    """A kernel entry of a loaded module: f(grid, block, args, shared_mem=0, stream=None), grid and
    block tuples of 1 to 3 ints, stream a CuPy stream (default: the current one)."""

    def __init__(self, function):
        self._function = function  # holds the module's function (and the module) alive
        self.ptr = function.ptr

    def __call__(self, grid, block, args, shared_mem: int = 0, stream=None) -> None:
        import cupy
        from cupy.cuda import driver

        fmt, values = pack_args(args)
        buffer = np.frombuffer(struct.pack("@" + fmt, *values), dtype=np.uint8) if fmt else np.zeros(1, np.uint8)
        pointers = _offsets(fmt) + np.uint64(buffer.ctypes.data)  # kernel_params: one pointer per argument
        gx, gy, gz = (tuple(grid) + (1, 1))[:3]
        bx, by, bz = (tuple(block) + (1, 1))[:3]
        stream_ptr = (stream if stream is not None else cupy.cuda.get_current_stream()).ptr
        driver.launchKernel(self.ptr, gx, gy, gz, bx, by, bz, shared_mem, stream_ptr,
                            pointers.ctypes.data if fmt else 0, 0)
