"""Zero-copy interop: accept CuPy arrays and anything exposing DLPack or __cuda_array_interface__
(torch tensors), and hand results back in the caller's array type."""
from __future__ import annotations

import contextlib


# What a caller holding host arrays can do instead.
HOST_HINT = ("copy it to the GPU first (cupy.asarray(x), or x.cuda() for torch); "
             "qattn.check.emulate.emulate(format, q, k, v) computes a format on the CPU")


def as_device_array(x, name: str):
    """A CuPy view of x on the GPU, or TypeError naming the argument."""
    import cupy

    if isinstance(x, cupy.ndarray):
        return x
    if type(x).__module__.split(".")[0] == "torch" and getattr(x, "is_cuda", False):
        return _torch_view(x)
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        device_type = x.__dlpack_device__()[0]
        if int(device_type) not in (2, 13):  # kDLCUDA, kDLCUDAManaged
            raise TypeError(f"{name}: expected a CUDA array, got a {type(x).__module__}.{type(x).__name__} "
                            f"on a non-CUDA device (DLPack device type {int(device_type)}); {HOST_HINT}")
        try:
            return cupy.from_dlpack(x)
        except Exception:  # older exporters: fall back to the CUDA array interface below
            pass
    if hasattr(x, "__cuda_array_interface__"):
        return cupy.asarray(x)
    raise TypeError(f"{name}: expected a CUDA array (CuPy, or an object with DLPack/__cuda_array_interface__ "
                    f"such as a torch CUDA tensor), got {type(x).__module__}.{type(x).__name__}; {HOST_HINT}")


def like_input(result, example):
    """Return result as the array type of example (torch in, torch out); CuPy otherwise."""
    module = type(example).__module__.split(".")[0]
    if module == "torch":
        import torch

        return torch.from_dlpack(result)
    return result


def numpy_dtype(name: str):
    """np.dtype for a recipe's dtype name; bfloat16 comes from ml_dtypes."""
    import numpy as np

    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def on_device(x, stream):
    """A context running on x's device, with CuPy's own work on stream (when given); nothing to
    switch in the common case (x on the current device, no stream given)."""
    from cupy.cuda import runtime

    if stream is None and x.data.device_id == runtime.getDevice():
        return contextlib.nullcontext()
    return _switched(x, stream)


@contextlib.contextmanager
def _switched(x, stream):
    with x.device:
        if stream is None:
            yield
        else:
            with stream:
                yield


def signature(x) -> tuple:
    """What a launch plan fixes about an array: shape, byte strides, dtype and device."""
    return x.shape, x.strides, x.dtype, x.data.device_id


def check_view(x, name: str, itemsize: int, align: int, *, pointer: bool = True) -> None:
    """x's layout (and, with pointer, its data pointer's alignment, which a plan checks per call)."""
    if x.ndim == 4 and x.strides[-1] != itemsize:
        raise ValueError(f"{name}: the head_dim axis must be contiguous (stride {itemsize} bytes), "
                         f"got strides {x.strides}")
    if pointer and x.data.ptr % align:
        raise ValueError(f"{name}: data pointer must be {align}-byte aligned")
    for axis, stride in enumerate(x.strides[:3]):
        if stride % align and x.shape[axis] > 1:
            raise ValueError(f"{name}: stride of axis {axis} ({stride} bytes) must be a multiple of {align} bytes")


def launch_stream(stream, example) -> int:
    """The stream a call launches on, as a pointer: the one given (a CuPy or torch stream, or a raw
    pointer), else torch's current stream when the caller passes torch tensors (so a torch.cuda.graph
    capture sees the launches), else CuPy's current stream."""
    if stream is not None:
        for attr in ("ptr", "cuda_stream"):
            if hasattr(stream, attr):
                return int(getattr(stream, attr))
        return int(stream)
    if type(example).__module__.split(".")[0] == "torch":
        import torch

        return int(torch.cuda.current_stream(example.device).cuda_stream)
    import cupy

    return int(cupy.cuda.get_current_stream().ptr)


def _torch_view(t):
    """A CuPy view of a CUDA torch tensor made from its pointer, shape and strides: no stream
    handshake (DLPack makes the consumer's stream wait on torch's, and the legacy stream it would
    use invalidates a CUDA graph capture), so a call inside torch.cuda.graph captures cleanly."""
    import cupy
    import numpy as np

    dtype = numpy_dtype(str(t.dtype).removeprefix("torch."))
    itemsize = dtype.itemsize
    extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1 if t.numel() else 0
    memory = cupy.cuda.UnownedMemory(t.data_ptr(), extent * itemsize, t, t.device.index)
    return cupy.ndarray(tuple(t.shape), dtype, cupy.cuda.MemoryPointer(memory, 0),
                        strides=tuple(s * itemsize for s in t.stride())) if t.numel() else \
        cupy.empty(tuple(t.shape), dtype=np.dtype(dtype))
