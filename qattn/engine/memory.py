"""Where a call's outputs and temporaries come from, and the stream it launches on, so that every
call can be captured in a CUDA graph.

- torch callers: outputs and temporaries come from torch's caching allocator on the current torch
  stream. Inside ``torch.cuda.graph`` they come from the graph's private pool, which keeps them for
  the replays, so a captured call needs nothing more than a warm-up call before capture.
- CuPy callers: CuPy's memory pool, except while the launch stream is being captured: then nothing is
  allocated (a pool block handed out during capture would be handed out again after it, under the
  replays' feet). Such a call takes its outputs as ``out=`` (and ``lse=``) and its temporaries from a
  ``Workspace`` that an earlier call, outside the capture, has grown to size.

A call never synchronizes the host, never queries a stream and never touches the legacy default
stream while the caller's stream is capturing.
"""
from __future__ import annotations

from .arrays import _torch_view, as_device_array, launch_stream

ALIGN = 256  # bytes: every carved buffer starts on a boundary any kernel's vector loads accept


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def capturing(stream_ptr: int) -> bool:
    """Whether stream_ptr is being captured into a CUDA graph (a capture query, legal during capture)."""
    from cupy.cuda import runtime

    try:
        return runtime.streamIsCapturing(stream_ptr) != runtime.streamCaptureStatusNone
    except runtime.CUDARuntimeError as error:  # the legacy stream while another stream captures
        raise ValueError("stream: the call would run on the legacy default stream while a CUDA graph capture "
                         "is under way; run it on the capturing stream (stream=, or the current torch/CuPy "
                         f"stream) ({error})") from None


class Workspace:
    """Scratch memory for the temporaries of calls (int8-QK codes and scales, kv8 and decode split-K
    partials), reused from call to call on one stream. Outside a CUDA-graph capture it grows to what
    a call needs; inside one it must already be large enough (run the call once before capture)::

        ws = qattn.Workspace()
        qattn.attention(q, k, v, format="i8-f8", out=out, workspace=ws)   # warm-up: compiles, sizes ws
        with graph_capture:
            qattn.attention(q, k, v, format="i8-f8", out=out, workspace=ws)

    Calls on different streams need their own workspaces."""

    def __init__(self, nbytes: int = 0, device: int | None = None):
        import cupy

        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes: expected a non-negative integer, got {nbytes!r}")
        self.device = cupy.cuda.runtime.getDevice() if device is None else int(device)
        self._owner, self._ptr, self.nbytes, self._fixed = None, 0, 0, False
        if nbytes:
            self._grow(nbytes)

    @classmethod
    def over(cls, array, device: int) -> "Workspace":
        """The caller's contiguous 1-D array as a workspace of fixed size."""
        workspace = cls(0, device)
        workspace._owner, workspace._ptr, workspace.nbytes, workspace._fixed = array, array.data.ptr, array.nbytes, True
        return workspace

    def _grow(self, nbytes: int) -> None:
        import cupy

        with cupy.cuda.Device(self.device):
            self._owner = cupy.cuda.alloc(_round_up(nbytes))
        self._ptr, self.nbytes = self._owner.ptr, _round_up(nbytes)

    def pointer(self, nbytes: int, capturing_now: bool) -> int:
        """The workspace's base pointer with at least nbytes behind it."""
        if nbytes > self.nbytes:
            if self._fixed or capturing_now:
                why = ("run the call once before the CUDA graph capture so that the workspace grows to size"
                       if not self._fixed else "give a larger array or a qattn.Workspace(), which grows")
                raise ValueError(f"workspace: the call needs {nbytes} bytes, the workspace holds {self.nbytes}; {why}")
            self._grow(nbytes)
        return self._ptr

    def __repr__(self) -> str:
        return f"Workspace(nbytes={self.nbytes}, device={self.device})"


def as_workspace(workspace, device: int) -> Workspace | None:
    """A Workspace, or a CuPy/torch byte array taken as a fixed-size one (None stays None)."""
    if workspace is None or isinstance(workspace, Workspace):
        return workspace
    array = as_device_array(workspace, "workspace")
    if array.ndim != 1 or array.strides[0] != array.itemsize or array.data.ptr % 16:
        raise ValueError(f"workspace: expected a qattn.Workspace or a contiguous 1-D array, 16-byte aligned, "
                         f"got shape {array.shape} strides {array.strides}")
    return Workspace.over(array, device)


_TORCH_DTYPES = {"float16": "float16", "bfloat16": "bfloat16", "float32": "float32", "int8": "int8",
                 "uint8": "uint8", "int32": "int32"}


class CallMemory:
    """One call's stream and memory: outputs the caller gave or new ones, and its temporaries (see the
    module docstring for where each comes from)."""

    def __init__(self, example, stream=None, workspace=None, device: int | None = None):
        self.stream_ptr = launch_stream(stream, example)
        self.capturing = capturing(self.stream_ptr)
        self._torch = example if type(example).__module__.split(".")[0] == "torch" else None
        self._workspace = as_workspace(workspace, device if device is not None else _device_of(example))

    def output(self, given, shape, dtype, name: str, view=None):
        """(a CuPy view to launch on, what the call returns) for output `name`: the caller's array
        when given (checked by the caller; view: its CuPy view if already made), else a new one in
        the caller's array type."""
        import cupy
        import numpy as np

        if given is not None:
            return (view if view is not None else as_device_array(given, name)), given
        if self._torch is not None:
            import torch

            tensor = torch.empty(shape, dtype=getattr(torch, _TORCH_DTYPES[np.dtype(dtype).name]),
                                 device=self._torch.device)
            return _torch_view(tensor), tensor
        if self.capturing:
            raise ValueError(f"{name}: a call captured into a CUDA graph on a CuPy stream allocates nothing; "
                             f"pass {name}= (an array of shape {tuple(shape)}, {np.dtype(dtype).name})")
        array = cupy.empty(shape, dtype=dtype)
        return array, array

    @property
    def scratch_allowed(self) -> bool:
        """Whether scratch() may hand out memory: not on a CuPy stream under capture without a workspace."""
        return not self.capturing or self._workspace is not None or self._torch is not None

    def scratch(self, nbytes: int):
        """nbytes of temporaries (ALIGN-byte aligned) as a cupy.cuda.MemoryPointer that keeps its
        memory alive, or None for none."""
        import cupy

        if not nbytes:
            return None
        if self._workspace is not None:
            ptr = self._workspace.pointer(nbytes, self.capturing)
            return _pointer(ptr, nbytes, self._workspace, self._workspace.device)
        if self._torch is not None:
            import torch

            tensor = torch.empty(_round_up(nbytes), dtype=torch.uint8, device=self._torch.device)
            return _pointer(tensor.data_ptr(), nbytes, tensor, tensor.device.index)
        if self.capturing:
            raise ValueError("workspace: a call captured into a CUDA graph on a CuPy stream allocates nothing; pass "
                             "workspace=qattn.Workspace() to the call before the capture and inside it")
        return cupy.cuda.alloc(_round_up(nbytes))


def _pointer(ptr: int, nbytes: int, owner, device: int):
    import cupy

    return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(ptr, nbytes, owner, device), 0)


class _RawStream:
    """A stream pointer in the CUDA stream protocol (what cupy.cuda.Stream.from_external takes)."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return 0, self.ptr


def cupy_stream(stream_ptr: int):
    """A CuPy Stream for a raw stream pointer (for CuPy kernel launches on the caller's stream)."""
    import cupy

    return cupy.cuda.Stream.from_external(_RawStream(stream_ptr))


def lse_output(lse, shape) -> None:
    """Check a caller's LSE output: float32, shape [B, Hq, Lq], C-contiguous (the kernels index it so)."""
    if lse is None:
        return
    array = as_device_array(lse, "lse")
    if array.shape != tuple(shape) or array.dtype.name != "float32" or not array.flags.c_contiguous:
        raise ValueError(f"lse: expected a C-contiguous float32 array of shape {tuple(shape)}, got "
                         f"{array.dtype.name} {array.shape} strides {array.strides}")


def _device_of(example) -> int:
    if type(example).__module__.split(".")[0] == "torch":
        return example.device.index
    return as_device_array(example, "q").data.device_id
