"""The CUDA driver entries that CuPy does not wrap (cuLaunchKernelEx, cuOccupancyMaxActiveClusters,
cuTensorMapEncodeTiled), looked up in libcuda through ctypes once each."""
from __future__ import annotations

import ctypes
import functools


@functools.lru_cache(maxsize=None)
def driver_entry(name: str, argtypes: tuple):
    """The driver's function `name` returning a CUresult (an int), with these ctypes argument types; None
    where there is no driver or it lacks the function (older than CUDA 12)."""
    try:
        fn = getattr(ctypes.CDLL("libcuda.so.1"), name)
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = list(argtypes)
    return fn
