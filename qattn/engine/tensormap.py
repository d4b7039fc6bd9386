"""Tensor maps (CUDA's CUtensorMap) for the TMA copies of sm_90a kernels: what to hand the driver's
cuTensorMapEncodeTiled, computed in plain Python (TiledMap, swizzled_rows: testable without a
GPU), and the encode itself through ctypes on libcuda (MapEncoder). A map is 128 opaque bytes that a
kernel takes by value (`const __grid_constant__ TensorMap`, templates/cuda/wgmma.cuh.j2); a launch
passes it as a packed.Blob.

The layout the wgmma pipeline wants (swizzled_rows): wgmma's 128-byte swizzled operands, made of
atoms of 8 rows x 128 bytes (64 elements of 16 bits) whose 16-byte chunks are permuted by the row:
chunk c of row r of an atom sits at chunk c ^ (r % 8), an XOR of address bits [4, 7) with bits
[7, 10) that the TMA applies as it writes and wgmma as it reads (so the tile must sit at a multiple
of 1024 bytes). A [B, H, L, D] tensor of 16-bit elements (D contiguous) seen as five dimensions,
innermost first,

    (64 elements of a 128-byte line, the L rows, the D / 64 lines of a row, the H heads, the B batches)

with byte strides (row stride, 128, head stride, batch stride), and read as a box of
(64, rows, D / 64, 1, 1), lands in shared memory as [line][row][64 elements], swizzled: byte (row,
channel) of the tile at swz((channel // 64) * rows * 128 + row * 128 + (channel % 64) * 2), swz(a) =
a ^ (((a >> 7) & 7) << 4). Whole 128-byte lines are four L2 sectors each. Rows past L are out of
bounds and land as zeros.
"""
from __future__ import annotations

import ctypes
import threading
from typing import NamedTuple

from .driver_api import driver_entry

MAP_BYTES = 128  # sizeof(CUtensorMap)
MAP_ALIGN = 64  # its alignment, on the host (encode) and as a kernel parameter

# cuda.h's CUtensorMapDataType values of the element types the maps carry
DATA_TYPES = {"float16": 6, "bfloat16": 9}
# CUtensorMapL2promotion: the L2 fetch granularity of the copies' requests
L2_PROMOTION = {"none": 0, "64B": 1, "128B": 2, "256B": 3}
MAX_STRIDE = 1 << 40  # global strides are multiples of 16 below 2^40 bytes
MAX_DIM = 1 << 32
MAX_BOX = 256
SWIZZLE_128B = 3  # CUtensorMapSwizzle
LINE_ELEMENTS = 64  # 16-bit elements of one 128-byte swizzled line


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
    swizzle: int = 0  # CU_TENSOR_MAP_SWIZZLE_NONE; SWIZZLE_128B below
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


def swizzled_rows(name: str, shape, strides, dtype_name: str, rows: int) -> TiledMap:
    """The map whose box is `rows` rows of one (batch, head) of x [B, H, L, D] (byte strides, D
    contiguous) in wgmma's 128-byte swizzled layout, line-major (the module's docstring). Coordinates
    of a copy, innermost first: (0, first row, 0, head, batch). ValueError naming `name` where the TMA
    cannot read x: a stride that is not a positive multiple of 16 below 2^40 on an axis of more than
    one element (an axis of one element takes a stride that is never used), D not a multiple of 64.
    The data pointer must be 16-byte aligned (the caller checks it per call)."""
    if dtype_name not in DATA_TYPES:
        raise ValueError(f"{name}: the TMA maps carry {' or '.join(DATA_TYPES)}, got {dtype_name}")
    b, h, length, d = (int(n) for n in shape)
    sb, sh, ss, sd = (int(s) for s in strides)
    if sd != 2 and d > 1:
        raise ValueError(f"{name}: the head_dim axis must be contiguous (stride 2 bytes), got strides {tuple(strides)}")
    if d % LINE_ELEMENTS or not LINE_ELEMENTS <= d <= LINE_ELEMENTS * MAX_BOX:
        raise ValueError(f"{name}: head_dim must be a multiple of {LINE_ELEMENTS} for the TMA's 128-byte swizzled "
                         f"lines, got {d}")
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
    lines = d // LINE_ELEMENTS
    return TiledMap(DATA_TYPES[dtype_name], (LINE_ELEMENTS, length, lines, h, b), (ss, 2 * LINE_ELEMENTS, sh, sb),
                    (LINE_ELEMENTS, rows, lines, 1, 1), (1, 1, 1, 1, 1), swizzle=SWIZZLE_128B)


def _encode_tiled():
    """The driver's cuTensorMapEncodeTiled (CUDA 12+), or None."""
    u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    return driver_entry("cuTensorMapEncodeTiled", (ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p,
                                                   u64p, u32p, u32p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                                   ctypes.c_int))


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
