"""Tensor maps (CUDA's CUtensorMap) for the TMA copies of sm_90a kernels: what to hand the driver's
cuTensorMapEncodeTiled, computed in plain Python (TiledMap, core_matrix_rows: testable without a
GPU), and the encode itself through ctypes on libcuda (MapEncoder). A map is 128 opaque bytes that a
kernel takes by value (`const __grid_constant__ TensorMap`, templates/cuda/wgmma.cuh.j2); a launch
passes it as a packed.Blob.

The layout the wgmma pipeline wants (core_matrix_rows): wgmma's no-swizzle operands are made of core
matrices of 8 rows x 16 bytes, 128 contiguous bytes each. A [B, H, L, D] tensor of 16-bit elements
(D contiguous) seen as five dimensions, innermost first,

    (8 elements of a 16-byte chunk, the L rows, the D / 8 chunks, the H heads, the B batches)

with byte strides (row stride, 16, head stride, batch stride), and read as a box of
(8, rows, D / 8, 1, 1), lands in shared memory as [chunk][row][8 elements]: byte (row, chunk) of the
tile at chunk * rows * 16 + row * 16. Eight consecutive rows of one chunk are a core matrix; core
matrices along the rows are 128 B apart, along the chunks rows * 16 B apart. Rows past L are
out of bounds and land as zeros.
"""
from __future__ import annotations

import ctypes
import functools
import threading
from typing import NamedTuple

MAP_BYTES = 128  # sizeof(CUtensorMap)
MAP_ALIGN = 64  # its alignment, on the host (encode) and as a kernel parameter

# cuda.h's CUtensorMapDataType values of the element types the maps carry
DATA_TYPES = {"float16": 6, "bfloat16": 9}
# CUtensorMapL2promotion: the L2 fetch granularity of the copies' requests
L2_PROMOTION = {"none": 0, "64B": 1, "128B": 2, "256B": 3}
MAX_STRIDE = 1 << 40  # global strides are multiples of 16 below 2^40 bytes
MAX_DIM = 1 << 32
MAX_BOX = 256


class TensorMapError(RuntimeError):
    """The driver refused to encode a map (the CUresult and the arguments are in the message)."""


class TiledMap(NamedTuple):
    """The arguments of cuTensorMapEncodeTiled but the tensor map and the global address. Dimensions
    innermost first; strides in bytes for dimensions 1 .. rank - 1 (dimension 0 is contiguous)."""

    data_type: int
    dims: tuple
    strides: tuple
    box: tuple
    element_strides: tuple
    interleave: int = 0  # CU_TENSOR_MAP_INTERLEAVE_NONE
    swizzle: int = 0  # CU_TENSOR_MAP_SWIZZLE_NONE
    l2_promotion: int = L2_PROMOTION["128B"]
    oob_fill: int = 0  # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: out-of-bounds elements read as zero

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def box_bytes(self) -> int:
        """Bytes one copy of the box writes (out-of-bounds elements included): its transaction count."""
        n = 2  # every data type of DATA_TYPES is 16-bit
        for b in self.box:
            n *= b
        return n


def core_matrix_rows(name: str, shape, strides, dtype_name: str, rows: int) -> TiledMap:
    """The map whose box is `rows` rows of one (batch, head) of x [B, H, L, D] (byte strides, D
    contiguous) in wgmma's core-matrix layout, chunk-major (the module's docstring). Coordinates of a
    copy, innermost first: (0, first row, 0, head, batch). ValueError naming `name` where the TMA
    cannot read x: a stride that is not a positive multiple of 16 below 2^40 on an axis of more than
    one element (an axis of one element takes a stride that is never used), D not a multiple of 8.
    The data pointer must be 16-byte aligned (the caller checks it per call)."""
    if dtype_name not in DATA_TYPES:
        raise ValueError(f"{name}: the TMA maps carry {' or '.join(DATA_TYPES)}, got {dtype_name}")
    b, h, length, d = (int(n) for n in shape)
    sb, sh, ss, sd = (int(s) for s in strides)
    if sd != 2 and d > 1:
        raise ValueError(f"{name}: the head_dim axis must be contiguous (stride 2 bytes), got strides {tuple(strides)}")
    if d % 8 or not 8 <= d <= 8 * MAX_BOX:
        raise ValueError(f"{name}: head_dim must be a multiple of 8 for the TMA's 16-byte chunks, got {d}")
    if not 1 <= rows <= MAX_BOX:
        raise ValueError(f"rows: a TMA box holds 1 to {MAX_BOX} rows, got {rows}")
    if min(b, h, length) < 1:
        raise ValueError(f"{name}: the TMA needs a non-empty tensor, got shape {tuple(shape)}")
    # strides an axis of one element never uses: the packed ones (any positive multiple of 16 would do)
    row_bytes = 2 * d
    ss = ss if length > 1 else row_bytes
    sh = sh if h > 1 else ss * length
    sb = sb if b > 1 else sh * h
    for axis, stride in ((0, sb), (1, sh), (2, ss)):
        if stride <= 0 or stride % 16 or stride >= MAX_STRIDE:
            raise ValueError(
                f"{name}: the wgmma kernel loads it by TMA, which needs every stride a positive multiple of 16 "
                f"bytes below 2^40; axis {axis} has {stride} (strides {tuple(strides)} bytes): pass a contiguous "
                "copy, or run the mma.sync kernel (mma='mma.sync')")
    for n in (b, h, length):
        if n > MAX_DIM:
            raise ValueError(f"{name}: the TMA takes at most 2^32 elements an axis, got shape {tuple(shape)}")
    return TiledMap(DATA_TYPES[dtype_name], (8, length, d // 8, h, b), (ss, 16, sh, sb), (8, rows, d // 8, 1, 1),
                    (1, 1, 1, 1, 1))


@functools.lru_cache(maxsize=1)
def _encode_tiled():
    """The driver's cuTensorMapEncodeTiled (CUDA 12+), or None."""
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
    except (OSError, AttributeError):
        return None
    u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return fn


class MapEncoder:
    """Encodes one TiledMap at a global address per call, keeping the maps of the last few addresses
    (a call's K and V pointers repeat from call to call in a serving loop or a benchmark)."""

    KEEP = 256

    def __init__(self, spec: TiledMap):
        self.spec = spec
        self._args = ((ctypes.c_uint64 * spec.rank)(*spec.dims), (ctypes.c_uint64 * (spec.rank - 1))(*spec.strides),
                      (ctypes.c_uint32 * spec.rank)(*spec.box), (ctypes.c_uint32 * spec.rank)(*spec.element_strides))
        self._maps: dict[int, bytes] = {}
        self._lock = threading.Lock()

    def __call__(self, address: int) -> bytes:
        """The 128-byte map of the tensor at `address` (16-byte aligned)."""
        hit = self._maps.get(address)
        if hit is not None:
            return hit
        encode = _encode_tiled()
        if encode is None:
            raise TensorMapError("cuTensorMapEncodeTiled: not found in libcuda.so.1 (the TMA kernels need a CUDA 12+ "
                                 "driver)")
        spec = self.spec
        with self._lock:
            buffer = ctypes.create_string_buffer(MAP_BYTES + MAP_ALIGN)
            at = ctypes.addressof(buffer)
            at += -at % MAP_ALIGN
            status = encode(at, spec.data_type, spec.rank, address, *self._args, spec.interleave, spec.swizzle,
                            spec.l2_promotion, spec.oob_fill)
            if status:
                raise TensorMapError(f"cuTensorMapEncodeTiled returned CUresult {status} for address {address:#x}, "
                                     f"{spec}")
            blob = ctypes.string_at(at, MAP_BYTES)
            if len(self._maps) >= self.KEEP:
                self._maps.clear()
            self._maps[address] = blob
        return blob
