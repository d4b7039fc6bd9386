"""The TMA path of the f16 / bf16 wgmma kernel on the CPU: the tensor map's encode arguments
(engine/tensormap.py), the encoder's use of the driver (intercepted), the dense launch plan passing
the maps by value (packed.Blob) or falling back to the cp.async rows kernel, and the shared-memory
descriptors of the TMA's 128-byte swizzled tiles (wgmma.cuh.j2, transcribed) against wgmma's
canonical layouts, the same model checked first on the no-swizzle row layout of the cp.async producer."""
from __future__ import annotations

import ctypes
from collections import OrderedDict
from types import SimpleNamespace

import numpy as np
import pytest

from qattn.engine import tensormap
from qattn.engine.packed import Blob
from qattn.engine.spec import KernelSpec
from qattn.engine.tensormap import MAP_BYTES, MapEncoder, TiledMap, swizzled_rows


def _contiguous(shape, itemsize=2):
    return tuple(int(np.prod(shape[i + 1:])) * itemsize for i in range(len(shape)))


# ---- encode arguments -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,code", [("float16", 6), ("bfloat16", 9)])
@pytest.mark.parametrize("d,rows", [(64, 128), (128, 128), (128, 64)])
def test_contiguous_kv_map(dtype, code, d, rows):
    b, h, length = 2, 8, 1029
    m = swizzled_rows("k", (b, h, length, d), _contiguous((b, h, length, d)), dtype, rows)
    assert m.data_type == code and m.rank == 5
    # innermost first: 64 elements of a 128-byte line, the rows, the lines, the heads, the batches
    assert m.dims == (64, length, d // 64, h, b)
    assert m.strides == (2 * d, 128, 2 * d * length, 2 * d * length * h)  # bytes, dimensions 1..4
    assert m.box == (64, rows, d // 64, 1, 1) and m.element_strides == (1,) * 5
    assert (m.interleave, m.swizzle, m.oob_fill) == (0, 3, 0)  # none, 128B, zeros past the bounds
    assert m.l2_promotion == tensormap.L2_PROMOTION["128B"]
    assert m.box_bytes == rows * 2 * d  # the tile, K_TILE / V_TILE of the template


def test_strided_bshd_view_and_axes_of_one():
    b, l, h, d = 2, 777, 4, 128
    # [B, L, 3, H, D] storage seen as [B, H, L, D] (test_gpu_prefill's packed QKV)
    strides = (l * 3 * h * d * 2, d * 2, 3 * h * d * 2, 2)
    m = swizzled_rows("v", (b, h, l, d), strides, "float16", 128)
    assert m.dims == (64, l, 2, h, b) and m.strides == (3 * h * d * 2, 128, d * 2, l * 3 * h * d * 2)
    # an axis of one element takes any stride (never multiplied by a coordinate but 0): the packed one
    odd = (12345, 7, 3, 2)  # strides of axes of one element are whatever the view had
    m = swizzled_rows("k", (1, 1, 1, 64), odd, "bfloat16", 64)
    assert m.strides == (128, 128, 128, 128) and m.dims == (64, 1, 1, 1, 1)
    m = swizzled_rows("k", (1, 1, 300, 64), (5, 3, 256, 2), "float16", 64)  # rows 256 B apart
    assert m.strides == (256, 128, 256 * 300, 256 * 300)


@pytest.mark.parametrize("strides,axis", [((0, 64 * 2 * 100, 128, 2), 0),  # a batch broadcast
                                          ((100 * 128, 0, 128, 2), 1),  # a head broadcast
                                          ((2 * 100 * 128, 100 * 128, -128, 2), 2),  # keys reversed
                                          ((2 * 100 * 128, 100 * 128, 136, 2), 2),  # not a multiple of 16
                                          ((1 << 41, 100 * 128, 128, 2), 0)])  # past 2^40
def test_strides_the_tma_cannot_read_are_named(strides, axis):
    with pytest.raises(ValueError, match=rf"k: .*axis {axis} has"):
        swizzled_rows("k", (2, 2, 100, 64), strides, "float16", 128)


def test_other_refusals():
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        swizzled_rows("k", (1, 1, 8, 64), _contiguous((1, 1, 8, 64), 4), "float32", 64)
    with pytest.raises(ValueError, match="contiguous"):
        swizzled_rows("v", (1, 1, 8, 64), (2048, 2048, 256, 4), "float16", 64)
    with pytest.raises(ValueError, match="multiple of 64"):
        swizzled_rows("k", (1, 1, 8, 96), _contiguous((1, 1, 8, 96)), "float16", 64)
    with pytest.raises(ValueError, match="rows"):
        swizzled_rows("k", (1, 1, 8, 64), _contiguous((1, 1, 8, 64)), "float16", 512)
    with pytest.raises(ValueError, match="non-empty"):
        swizzled_rows("k", (1, 1, 0, 64), _contiguous((1, 1, 0, 64)), "float16", 64)


# ---- the encoder (the driver call intercepted) ------------------------------------------------------

def _fake_driver(monkeypatch, status=0):
    calls = []

    def encode(map_ptr, data_type, rank, address, dims, strides, box, element_strides, interleave, swizzle, l2, oob):
        calls.append(dict(aligned=map_ptr % 64 == 0, data_type=data_type, rank=rank, address=address,
                          dims=tuple(dims[i] for i in range(rank)), strides=tuple(strides[i] for i in range(rank - 1)),
                          box=tuple(box[i] for i in range(rank)),
                          element_strides=tuple(element_strides[i] for i in range(rank)),
                          modes=(interleave, swizzle, l2, oob)))
        ctypes.memmove(map_ptr, (address & 0xFF).to_bytes(1, "little") * MAP_BYTES, MAP_BYTES)
        return status

    monkeypatch.setattr(tensormap, "_encode_tiled", lambda: encode)
    return calls


def test_encoder_passes_the_arguments_and_keeps_maps_by_address(monkeypatch):
    calls = _fake_driver(monkeypatch)
    spec = swizzled_rows("k", (2, 4, 333, 128), _contiguous((2, 4, 333, 128)), "bfloat16", 128)
    encode = MapEncoder(spec)
    blob = encode(0x7000_0100)
    assert blob == b"\x00" * MAP_BYTES and len(calls) == 1
    call = calls[0]
    assert call["aligned"] and call["address"] == 0x7000_0100 and call["rank"] == 5 and call["data_type"] == 9
    assert call["dims"] == spec.dims and call["strides"] == spec.strides and call["box"] == spec.box
    assert call["element_strides"] == spec.element_strides and call["modes"] == (0, 3, 2, 0)
    assert encode(0x7000_0100) is blob and len(calls) == 1  # a repeated pointer encodes nothing
    assert encode(0x7000_0210) == b"\x10" * MAP_BYTES and len(calls) == 2
    for i in range(2 * MapEncoder.KEEP):  # bounded
        encode(0x8000_0000 + 256 * i)
    assert len(encode._maps) <= MapEncoder.KEEP


def test_a_refused_encode_raises(monkeypatch):
    _fake_driver(monkeypatch, status=1)
    encode = MapEncoder(swizzled_rows("v", (1, 1, 64, 64), _contiguous((1, 1, 64, 64)), "float16", 64))
    with pytest.raises(tensormap.TensorMapError, match="CUresult 1"):
        encode(0x1000)


def test_no_driver_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(tensormap, "_encode_tiled", lambda: None)
    encode = MapEncoder(swizzled_rows("v", (1, 1, 64, 64), _contiguous((1, 1, 64, 64)), "float16", 64))
    with pytest.raises(tensormap.TensorMapError, match="cuTensorMapEncodeTiled"):
        encode(0x1000)


# ---- the dense launch plan ----------------------------------------------------------------------

def _array(shape, strides=None, dtype="float16"):
    return SimpleNamespace(shape=shape, strides=strides or _contiguous(shape), dtype=np.dtype(dtype), itemsize=2,
                           ndim=len(shape), device=SimpleNamespace(id=0), data=SimpleNamespace(ptr=1 << 20))


def _stand_in(spec):
    return SimpleNamespace(spec=spec, function=lambda suffix="": SimpleNamespace(ptr=1),
                           threads=spec.family.threads(spec.tile),
                           shared_bytes=spec.family.smem_bytes(spec.tile, spec.head_dim), plans=OrderedDict())


def test_wgmma_plan_passes_two_maps_by_value():
    from qattn.formats.dense import launch

    spec = KernelSpec(recipe="f16", head_dim=128, causal=True, arch="sm_90a", mma="wgmma")
    assert dict(spec.options)["kv_rows"] == "off" and spec.name == "prefill_f16_d128_m128n128w8s2_causal_wgmma_pingpong_sm90a"
    b, hq, hkv, lq, lk, d = 2, 8, 2, 300, 1029, 128
    q, k = _array((b, hq, lq, d)), _array((b, hkv, lk, d))
    v = _array((b, hkv, lk, d), (lk * 3 * hkv * d * 2, d * 2, 3 * hkv * d * 2, 2))  # a BSHD view
    plan = launch._plan(_stand_in(spec), q, k, v, None, None, False)
    assert plan.maps is not None
    k_map, v_map = (m.spec for m in plan.maps)
    assert k_map == swizzled_rows("k", k.shape, k.strides, "float16", 128)
    assert v_map.strides == (3 * hkv * d * 2, 128, d * 2, lk * 3 * hkv * d * 2)
    blobs = plan.launch._blobs
    assert [(name, size) for _, name, size in blobs] == [("k_map", 128), ("v_map", 128)]
    assert all(address % 64 == 0 for address, _, _ in blobs)


def test_mma_sync_plan_has_no_maps():
    from qattn.formats.dense import launch

    spec = KernelSpec(recipe="f16", head_dim=128, arch="sm_90a")
    assert spec.family.values["mma_unit"] == "mma.sync" and not spec.options
    q = _array((1, 4, 100, 128))
    plan = launch._plan(_stand_in(spec), q, q, q, None, None, False)
    assert plan.maps is None and plan.launch._blobs == []


@pytest.fixture
def built(monkeypatch):
    """The specs the launcher builds instead of the kernel it was given (stand-ins, nothing compiled)."""
    from qattn.engine import kernel as engine_kernel

    specs = []

    def build(spec):
        specs.append(spec)
        return _stand_in(spec)

    monkeypatch.setattr(engine_kernel, "build_kernel", build)
    return specs


def test_strides_the_tma_cannot_read_run_the_rows_kernel(built):
    """A K broadcast over the batch (stride 0) runs the same spec with kv_rows "on" (cp.async rows)."""
    from qattn.formats.dense import launch

    spec = KernelSpec(recipe="f16", head_dim=64, arch="sm_90a", mma="wgmma")
    q, v = _array((2, 4, 100, 64)), _array((2, 4, 100, 64))
    k = _array((2, 4, 100, 64), (0, 100 * 64 * 2, 64 * 2, 2))
    plan = launch._plan(_stand_in(spec), q, k, v, None, None, False)
    assert plan.maps is None and plan.launch._blobs == []
    assert built == [spec.with_(options={**dict(spec.options), "kv_rows": "on"})]
    assert built[0].name == "prefill_f16_d64_m128n128w8s2_wgmma_kvrows_sm90a"


def test_chained_plan_with_tma_stores_passes_the_output_map(monkeypatch):
    """out_tma "on" on chained items: a third map, of the output's 16-row boxes (a fresh output's strides, or the
    given out's); without the option, or where items do not chain, two."""
    from qattn.formats.dense import launch

    monkeypatch.setattr(launch, "work_grid", lambda spec, items, device, per_sm: (132, 1, 1))
    chained = {"persistent": "on", "chain": "on"}
    spec = KernelSpec(recipe="bf16", head_dim=128, arch="sm_90a", mma="wgmma", options={**chained, "out_tma": "on"})
    b, hq, hkv, lq, lk, d = 2, 8, 2, 1029, 1029, 128
    q, k = _array((b, hq, lq, d), dtype="bfloat16"), _array((b, hkv, lk, d), dtype="bfloat16")
    plan = launch._plan(_stand_in(spec), q, k, k, None, None, False)
    assert plan.out_map.spec == swizzled_rows("out", q.shape, q.strides, "bfloat16", 16)
    assert [name for _, name, _ in plan.launch._blobs] == ["k_map", "v_map", "o_map"]
    out = _array((b, hq, lq, d), (lq * hq * d * 2, d * 2, hq * d * 2, 2), dtype="bfloat16")  # a BSHD view
    plan = launch._plan(_stand_in(spec), q, k, k, out, None, False)
    assert plan.out_map.spec.strides == (hq * d * 2, 128, d * 2, lq * hq * d * 2)
    plan = launch._plan(_stand_in(spec.with_(options=chained)), q, k, k, None, None, False)  # d128: Q by TMA
    assert plan.out_map is None and [name for _, name, _ in plan.launch._blobs] == ["k_map", "v_map", "q_map"]
    plan = launch._plan(_stand_in(spec.with_(options={**chained, "out_tma": "on", "persistent": "off"})),
                        q, k, k, None, None, False)
    assert plan.out_map is None and [name for _, name, _ in plan.launch._blobs] == ["k_map", "v_map"]


def test_chained_q_rows_by_tma_pass_a_map_of_q(monkeypatch):
    """q_tma "on" (d128's default) on chained items: a map of Q's boxes of BM rows, from Q's own strides (a BSHD
    view as well); the spec settles it "off" where items do not chain and beside out_tma, and without a map."""
    from qattn.formats.dense import launch

    monkeypatch.setattr(launch, "work_grid", lambda spec, items, device, per_sm: (132, 1, 1))
    spec = KernelSpec(recipe="f16", head_dim=128, causal=True, arch="sm_90a", mma="wgmma",
                      options={"persistent": "on", "chain": "on"})
    assert dict(spec.options)["q_tma"] == "on" and spec.name.endswith("_chain_qtma_sm90a")
    b, hq, lq, d = 2, 8, 333, 128
    q = _array((b, hq, lq, d), (lq * hq * d * 2, d * 2, hq * d * 2, 2))  # a BSHD view
    k = _array((b, 2, lq, d))
    plan = launch._plan(_stand_in(spec), q, k, k, None, None, False)
    assert plan.q_map.spec == swizzled_rows("q", q.shape, q.strides, "float16", spec.tile.block_m)
    assert [name for _, name, _ in plan.launch._blobs] == ["k_map", "v_map", "q_map"]
    for options in ({"persistent": "on"}, {"persistent": "on", "chain": "on", "out_tma": "on"}):
        other = spec.with_(options={**options, "q_tma": "on"})
        assert dict(other.options)["q_tma"] == "off" and "qtma" not in other.name
        assert launch._plan(_stand_in(other), q, k, k, None, None, False).q_map is None
    d64 = KernelSpec(recipe="f16", head_dim=64, arch="sm_90a", mma="wgmma", options={"persistent": "on", "chain": "on"})
    assert dict(d64.options)["q_tma"] == "off"  # d64 keeps the consumers' cp.async rows by default
    d256 = KernelSpec(recipe="f16", head_dim=256, arch="sm_90a", mma="wgmma", options={"persistent": "on", "chain": "on"})
    assert dict(d256.options)["q_tma"] == "off"  # its output rows are staged over Q's: nothing chains


def test_a_q_the_tma_cannot_read_runs_with_the_consumers_q_loads(built, monkeypatch):
    """A Q whose strides the TMA cannot take runs the same spec with q_tma "off"."""
    from qattn.formats.dense import launch

    monkeypatch.setattr(launch, "work_grid", lambda spec, items, device, per_sm: (132, 1, 1))
    spec = KernelSpec(recipe="bf16", head_dim=128, arch="sm_90a", mma="wgmma", options={"persistent": "on", "chain": "on"})
    q = _array((2, 4, 100, 128), (-100 * 128 * 2 * 4, 100 * 128 * 2, 128 * 2, 2), dtype="bfloat16")  # batches backwards
    k = _array((2, 4, 100, 128), dtype="bfloat16")
    plan = launch._plan(_stand_in(spec), q, k, k, None, None, False)
    assert plan.q_map is None and [name for _, name, _ in plan.launch._blobs] == ["k_map", "v_map"]
    assert built == [spec.with_(options={**dict(spec.options), "q_tma": "off"})]


def test_an_output_the_tma_cannot_write_runs_without_tma_stores(built, monkeypatch):
    """An out whose strides the TMA cannot take runs the same spec with out_tma "off"."""
    from qattn.formats.dense import launch

    monkeypatch.setattr(launch, "work_grid", lambda spec, items, device, per_sm: (132, 1, 1))
    spec = KernelSpec(recipe="f16", head_dim=64, causal=True, arch="sm_90a", mma="wgmma",
                      options={"persistent": "on", "chain": "on", "out_tma": "on"})
    q = _array((2, 4, 100, 64))
    out = _array((2, 4, 100, 64), (-100 * 64 * 2 * 4, 100 * 64 * 2, 64 * 2, 2))  # batches backwards
    plan = launch._plan(_stand_in(spec), q, q, q, out, None, False)
    assert plan.out_map is None and [name for _, name, _ in plan.launch._blobs] == ["k_map", "v_map"]
    assert built == [spec.with_(options={**dict(spec.options), "out_tma": "off"})]


# ---- descriptors over the TMA tile (wgmma.cuh.j2 transcribed) ------------------------------------
# wgmma's canonical layouts of 16-bit operands (PTX ISA, "shared memory matrix layout"), the byte
# address of an element from the descriptor's start; LBO and SBO are its leading and stride offsets.
# No swizzle, core matrices of 8 rows x 16 bytes (LBO between them along K, SBO along M/N):
#   K-major, element (mn, k):  (mn % 8) * 16 + (mn // 8) * SBO + (k % 8) * 2 + (k // 8) * LBO
#   MN-major, element (k, mn): (mn % 8) * 2 + (mn // 8) * SBO + (k % 8) * 16 + (k // 8) * LBO
# 128-byte swizzle, atoms of 8 rows x 128 bytes, the address then swizzled (bits [4, 7) ^= [7, 10)):
#   K-major, element (mn, k) of one k16 step:  (mn % 8) * 128 + (mn // 8) * SBO + k * 2
#   MN-major, element (k, mn): (mn % 64) * 2 + (mn // 64) * LBO + (k % 8) * 128 + (k // 8) * SBO

def _swz(address):
    return address ^ (((address >> 7) & 7) << 4)


def _k_major(start, lbo, sbo, n, k, swizzled):
    if swizzled:
        return _swz(start + (n % 8) * 128 + (n // 8) * sbo + k * 2)
    return start + (n % 8) * 16 + (n // 8) * sbo + (k % 8) * 2 + (k // 8) * lbo


def _mn_major(start, lbo, sbo, k, n, swizzled):
    if swizzled:
        return _swz(start + (n % 64) * 2 + (n // 64) * lbo + (k % 8) * 128 + (k // 8) * sbo)
    return start + (n % 8) * 2 + (n // 8) * sbo + (k % 8) * 16 + (k // 8) * lbo


def _desc(lo: int, hi: int, offset: int):
    """sw128_desc_at / core_desc_at / mn_desc_at: the low word plus offset >> 4, the high word; decoded
    to (start, LBO, SBO) in bytes and the swizzle mode (bits 62-63: 1 is 128B)."""
    lo += offset >> 4
    return (lo & 0x3FFF) << 4, ((lo >> 16) & 0x3FFF) << 4, (hi & 0x3FFF) << 4, hi >> 30


def _row_major(chunks, row, chunk):  # core_offset<CHUNKS>: the cp.async producer's layout
    return (((row >> 3) * chunks + chunk) << 7) + ((row & 7) << 4)


def _swizzled(base, rows, row, channel):  # the TMA box (swizzled_rows), at a tile address `base`
    return _swz(base + (channel // 64) * rows * 128 + row * 128 + (channel % 64) * 2)


def _sw128_k_step(rows, kd):  # sw128_k_step<ROWS>
    return (kd % 4) * 32 + (kd // 4) * rows * 128


@pytest.mark.parametrize("d,bn", [(64, 64), (64, 128), (128, 64), (128, 128), (128, 160)])
@pytest.mark.parametrize("layout", ["rows", "tma"])
def test_descriptors_read_the_tile_they_describe(d, bn, layout):
    """For each k16 step of S = Q Kᵀ (K K-major, n = BN keys) and of O += P V (V N-major, n = D
    channels), every element the descriptor addresses is the key and channel that step multiplies:
    "rows" is the cp.async layout with core_desc / mn_desc (no swizzle), "tma" the swizzled box with
    sw128_k_desc / sw128_mn_desc."""
    chunks, base = d // 8, 0x8400 if layout == "rows" else 0x8000  # a slot's address (swizzled: 1024-aligned)
    swizzled = layout == "tma"
    if layout == "rows":
        at = lambda key, ch: base + _row_major(chunks, key, ch // 8) + (ch % 8) * 2  # noqa: E731
        k_lo, k_hi = (base >> 4) | ((128 >> 4) << 16), (chunks * 128) >> 4  # core_desc_lo, core_desc_at<CHUNKS>
        v_lo, v_hi = (base >> 4) | (((chunks * 128) >> 4) << 16), 128 >> 4  # mn_desc_lo<CHUNKS>, mn_desc_at
        k_step, v_step = (lambda kd: kd * 256), 2 * chunks * 128  # issue_qk's kd * 256, issue_pv16's step
    else:
        at = lambda key, ch: _swizzled(base, bn, key, ch)  # noqa: E731
        sw_hi = (1024 >> 4) | (1 << 30)  # sw128_desc_at
        k_lo, k_hi = (base >> 4) | ((16 >> 4) << 16), sw_hi  # sw128_k_desc_lo
        v_lo, v_hi = (base >> 4) | (((bn * 128) >> 4) << 16), sw_hi  # sw128_mn_desc_lo<BN>
        k_step, v_step = (lambda kd: _sw128_k_step(bn, kd)), 2048  # sw128_k_step<BN>(kd), kp * 2048
    for kd in range(d // 16):  # S: B is BN keys x 16 channels, K-major
        start, lbo, sbo, mode = _desc(k_lo, k_hi, k_step(kd))
        assert mode == (1 if swizzled else 0)
        for n in range(bn):
            for k in range(16):
                assert _k_major(start, lbo, sbo, n, k, swizzled) == at(n, 16 * kd + k), (kd, n, k)
    for kp in range(bn // 16):  # PV: B is 16 keys x D channels, N-major (imm-trans-b)
        start, lbo, sbo, mode = _desc(v_lo, v_hi, kp * v_step)
        for k in range(16):
            for n in range(d):
                assert _mn_major(start, lbo, sbo, k, n, swizzled) == at(16 * kp + k, n), (kp, k, n)


@pytest.mark.parametrize("d,bn", [(64, 128), (128, 128), (128, 64)])
def test_the_box_lands_in_swizzled_lines(d, bn):
    """The TMA writes a box densely, dimension 0 fastest, each 16-byte chunk at its swizzled place:
    element (e0, row, line) of the box at swz(((line * BN + row) * 64 + e0) * 2), which is channel
    64 * line + e0 of key row0 + row at the tile's (row, channel) byte; every byte of the tile written
    once; K_TILE bytes."""
    m = swizzled_rows("k", (1, 1, 4096, d), _contiguous((1, 1, 4096, d)), "float16", bn)
    e0, rows, lines = m.box[:3]
    seen = set()
    for line in range(lines):
        for r in range(rows):
            for e in range(e0):
                off = _swz(((line * rows + r) * e0 + e) * 2)
                assert off == _swizzled(0, bn, r, 64 * line + e)
                seen.add(off)
    assert len(seen) * 2 == m.box_bytes == bn * 2 * d and max(seen) + 2 == m.box_bytes


def test_descriptor_fields_fit():
    """Leading and stride offsets are 14-bit fields of 16-byte units (sw128_mn_desc_lo's BN * 128)."""
    for bn in (64, 128):
        assert (bn * 128) >> 4 < 1 << 14 and (bn * 128) % 16 == 0


def test_blob_dataclass():
    assert Blob("k_map") == Blob("k_map", 128, 64)
    with pytest.raises(ValueError, match="power of two"):
        Blob("x", 128, 48)


def test_tiled_map_is_plain_data():
    m = TiledMap(6, (8, 10, 8, 1, 1), (128, 16, 1280, 1280), (8, 64, 8, 1, 1), (1,) * 5)
    assert m.rank == 5 and m.box_bytes == 8 * 64 * 8 * 2


def test_work_grid_is_a_block_per_item_or_the_resident_blocks(monkeypatch):
    """The wgmma kernels' flat grid over their work items (query blocks x heads x batch): one block each,
    or with persistent "on" as many as the SMs hold (the blocks an SM holds given by the family), never
    more than the items (causal: than their pairs); a count past 2^31 - 1 is refused naming q."""
    from qattn.engine import grid
    from qattn.engine.tile import Tile

    monkeypatch.setattr(grid, "sm_count", lambda device_id: 132)
    spec = KernelSpec(recipe="f16", head_dim=128, arch="sm_90a", mma="wgmma")
    assert grid.work_grid(spec, 4096, 0, 1) == (4096, 1, 1)
    persistent = spec.with_(options={"persistent": "on"})
    assert persistent.name == "prefill_f16_d128_m128n128w8s2_wgmma_pingpong_persistent_sm90a"
    assert grid.work_grid(persistent, 4096, 0, 1) == (132, 1, 1)
    assert grid.work_grid(persistent, 100, 0, 1) == (100, 1, 1)
    single = persistent.with_(tile=Tile(64, 128, 4, 2))
    assert grid.work_grid(single, 4096, 0, 2) == (264, 1, 1)
    paired = persistent.with_(causal=True)  # causal items go in pairs: at most one block a pair
    assert grid.work_grid(paired, 4096, 0, 1) == (132, 1, 1)
    assert grid.work_grid(paired, 101, 0, 1) == (51, 1, 1)
    i8 = KernelSpec(recipe="i8-f8", head_dim=64, arch="sm_90a", tile=Tile(64, 64, 4, 2), options={"persistent": "on"})
    assert i8.name == "prefill_i8-f8_d64_m64n64w4s2_persistent_sm90a"
    assert grid.work_grid(i8, 4096, 0, 3) == (396, 1, 1)
    with pytest.raises(ValueError, match="^q: .* split the call"):
        grid.work_grid(spec, 2**31, 0, 1)


def test_wgmma_plan_passes_the_batch_and_a_flat_grid():
    from qattn.formats.dense import launch

    spec = KernelSpec(recipe="f16", head_dim=64, arch="sm_90a", mma="wgmma", causal=True)
    q, k = _array((3, 8, 300, 64)), _array((3, 2, 1029, 64))
    plan = launch._plan(_stand_in(spec), q, k, k, None, None, False)
    assert plan.launch._dims[:3] == (3 * 8 * 3, 1, 1)  # ceil(300 / 128) query blocks x 8 heads x 3 sequences
    sync = KernelSpec(recipe="f16", head_dim=64, arch="sm_90a")
    assert launch._plan(_stand_in(sync), q, k, k, None, None, False).launch._dims[:3] == (3, 8, 3)
