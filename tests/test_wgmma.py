"""The Hopper warpgroup-MMA building blocks (templates/cuda/wgmma.cuh.j2) on their own: a 64x64
int8 product S = A Bᵀ from two shared-memory descriptors, and a 64x128 e4m3 product O = P V with
P in registers (mma.sync A layout) and V^T behind a descriptor. CPU: the module compiles for
sm_90a with the wgmma instructions. GPU (sm_90a only): both products equal NumPy's on random
codes, which pins the descriptor fields, the core-matrix layout and the fragment layouts."""
from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import check_spills

from qattn.engine.render import environment
from qattn.engine.compile import compile_cuda, disassemble
from qattn.engine.inspect import warpgroup_mmas

D_QK = 128  # reduction length of the int8 product (bytes per row)
KEYS = 64  # reduction length of the e4m3 product
CHANNELS = 128

KERNELS = r"""
// S [64][64] s32 = A [64][D_QK] s8 * B [64][D_QK]ᵀ s8 (rows contiguous).
extern "C" __global__ void __launch_bounds__(128) s8_product(const signed char* a, const signed char* b, int* s) {
    constexpr int CH = D_QK / 16;
    __shared__ __align__(128) unsigned char as[64 * D_QK], bs[64 * D_QK];
    for (int i = threadIdx.x; i < 64 * CH; i += 128) {
        const int r = i / CH, c = i % CH;
        *reinterpret_cast<uint4*>(as + core_offset<CH>(r, c)) = *reinterpret_cast<const uint4*>(a + r * D_QK + c * 16);
        *reinterpret_cast<uint4*>(bs + core_offset<CH>(r, c)) = *reinterpret_cast<const uint4*>(b + r * D_QK + c * 16);
    }
    fence_async_smem();
    __syncthreads();
    int d[8][4];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D_QK / 32; ++kk)
        wgmma_s8_n64(d, core_desc<CH>(smem_u32(as) + kk * 256), core_desc<CH>(smem_u32(bs) + kk * 256), kk > 0);
    wgmma_commit();
    wgmma_wait<0>();
    const int warp = threadIdx.x / 32, g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[(16 * warp + g + 8 * (e / 2)) * 64 + 8 * j + 2 * t + e % 2] = d[j][e];
}

// O [64][CHANNELS] f32 = P [64][KEYS] e4m3 * V, V given as V^T [CHANNELS][KEYS] e4m3 (rows contiguous).
extern "C" __global__ void __launch_bounds__(128) e4m3_product(const unsigned char* p, const unsigned char* vt, float* o) {
    constexpr int CH = KEYS / 16;
    __shared__ __align__(128) unsigned char vs[CHANNELS * KEYS];
    for (int i = threadIdx.x; i < CHANNELS * CH; i += 128) {
        const int r = i / CH, c = i % CH;
        *reinterpret_cast<uint4*>(vs + core_offset<CH>(r, c)) = *reinterpret_cast<const uint4*>(vt + r * KEYS + c * 16);
    }
    fence_async_smem();
    __syncthreads();
    const int warp = threadIdx.x / 32, g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
    const int row = 16 * warp + g;
    float d[CHANNELS / 8][4];
    wgmma_fence();
#pragma unroll
    for (int kq = 0; kq < KEYS / 32; ++kq) {
        const unsigned char* p0 = p + row * KEYS + 32 * kq + 4 * t;
        const u32 a[4] = {*reinterpret_cast<const u32*>(p0), *reinterpret_cast<const u32*>(p0 + 8 * KEYS),
                          *reinterpret_cast<const u32*>(p0 + 16), *reinterpret_cast<const u32*>(p0 + 8 * KEYS + 16)};
        wgmma_e4m3_n{{ channels }}(d, a, core_desc<CH>(smem_u32(vs) + kq * 256), kq > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int j = 0; j < CHANNELS / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[(row + 8 * (e / 2)) * CHANNELS + 8 * j + 2 * t + e % 2] = d[j][e];
}
"""


def _source() -> str:
    env = environment()
    values = {"ln2": repr(math.log(2.0)), "wgmma_shapes": [("s8", 64), ("e4m3", CHANNELS)], "channels": CHANNELS}
    head = env.get_template("cuda/common.cuh.j2").render(**values) + env.get_template("cuda/wgmma.cuh.j2").render(**values)
    consts = f"constexpr int D_QK = {D_QK}, KEYS = {KEYS}, CHANNELS = {CHANNELS};\n"
    return head + consts + env.from_string(KERNELS).render(**values)


def _compiled():
    return compile_cuda(_source(), "sm_90a", "wgmma_blocks")


def test_compiles_for_sm90a_with_wgmma():
    binary = _compiled()
    ptx = binary.ptx
    assert "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8" in ptx
    assert f"wgmma.mma_async.sync.aligned.m64n{CHANNELS}k32.f32.e4m3.e4m3" in ptx
    assert "wgmma.fence.sync.aligned" in ptx and "fence.proxy.async.shared::cta" in ptx
    assert binary.resources["spill_stores"] == 0


def test_core_offset_model():
    """core_offset (transcribed): every 16-byte chunk of a tile lands on its own 16-byte slot."""
    chunks, rows = 8, 64
    offsets = {(((r >> 3) * chunks + c) << 7) + ((r & 7) << 4) for r in range(rows) for c in range(chunks)}
    assert offsets == set(range(0, rows * chunks * 16, 16))


@pytest.mark.gpu
def test_products_match_numpy():
    import cupy
    import ml_dtypes

    from qattn.engine.spec import device_arch

    if device_arch() != "sm_90a":
        pytest.skip("wgmma needs sm_90a")
    rng = np.random.default_rng(5)
    module = cupy.cuda.Module()
    module.load(_compiled().data)
    a = rng.integers(-127, 128, (64, D_QK), dtype=np.int8)
    b = rng.integers(-127, 128, (64, D_QK), dtype=np.int8)
    s = cupy.full((64, 64), -7, dtype=cupy.int32)
    module.get_function("s8_product")((1,), (128,), (cupy.asarray(a), cupy.asarray(b), s))
    np.testing.assert_array_equal(s.get(), a.astype(np.int64) @ b.astype(np.int64).T)

    e4m3 = ml_dtypes.float8_e4m3fn
    p = rng.uniform(0, 448, (64, KEYS)).astype(e4m3)
    vt = rng.uniform(-448, 448, (CHANNELS, KEYS)).astype(e4m3)
    o = cupy.full((64, CHANNELS), np.nan, dtype=cupy.float32)
    module.get_function("e4m3_product")((1,), (128,), (cupy.asarray(p.view(np.uint8)), cupy.asarray(vt.view(np.uint8)), o))
    want = p.astype(np.float64) @ vt.astype(np.float64).T
    scale = np.abs(p.astype(np.float64)) @ np.abs(vt.astype(np.float64)).T
    # Each product of two e4m3 values is exact, but Hopper's fp8 wgmma sums them in a narrower
    # accumulator than fp32 (H200: up to ~3e-5 of the sum of |terms| over 64 keys); a layout error
    # would be of the order of the values themselves.
    assert np.all(np.abs(o.get() - want) <= 1e-4 * scale)


# ---- the i8-f8 attention kernel on wgmma ------------------------------------------------------

def _wgmma_specs():
    from qattn.engine.spec import KernelSpec
    from qattn.engine.tile import Tile

    specs = [KernelSpec(recipe="i8-f8", head_dim=d, causal=c, arch="sm_90a", mma="wgmma")
             for d in (64, 128) for c in (False, True)]
    return specs + [KernelSpec(recipe="i8-f8", head_dim=64, arch="sm_90a", mma="wgmma", tile=Tile(128, 128, 8, 2)),
                    KernelSpec(recipe="i8-f8", head_dim=64, arch="sm_90a", mma="wgmma", tile=Tile(64, 128, 4, 2)),
                    KernelSpec(recipe="i8-f8", head_dim=128, arch="sm_90a", mma="wgmma", tile=Tile(64, 128, 4, 2)),
                    KernelSpec(recipe="i8-f8", head_dim=64, arch="sm_90a", mma="wgmma", tile=Tile(192, 64, 12, 2)),
                    KernelSpec(recipe="i8-f8", head_dim=128, arch="sm_90a", mma="wgmma", tile=Tile(128, 64, 8, 4)),
                    KernelSpec(recipe="i8-f8", head_dim=128, arch="sm_90a", mma="wgmma", tile=Tile(64, 64, 4, 3)),
                    # FlashAttention-3's fp8 tile at d128 (128 x 224 on two consumer warpgroups' 240 registers), and
                    # a 160-key one at d64: wider key tiles, fewer instructions a key
                    KernelSpec(recipe="i8-f8", head_dim=128, arch="sm_90a", mma="wgmma", tile=Tile(128, 224, 8, 2)),
                    KernelSpec(recipe="i8-f8", head_dim=64, arch="sm_90a", mma="wgmma", tile=Tile(128, 160, 8, 2))]


def test_mma_unit_choice():
    from qattn.engine.spec import KernelSpec

    spec = KernelSpec(recipe="i8-f8", head_dim=128, arch="sm_90a", mma="wgmma")
    assert spec.family.values == {"pv_operand": "f8", "mma_unit": "wgmma", "q_scale_rows": 1, "k_scale_groups": 4,
                                  "persistent": "off"}
    assert spec.tile.block_m == 16 * spec.tile.warps
    assert spec.family.threads(spec.tile) == 32 * spec.tile.warps + 128  # and the producer warpgroup
    default = KernelSpec(recipe="i8-f8", head_dim=128, arch="sm_90a")
    spelled = KernelSpec(recipe="i8-f8", head_dim=128, arch="sm_90a", mma=default.family.values["mma_unit"])
    assert spelled == default and spelled.key == default.key  # the default unit, spelled out, is the same spec
    assert spec == default  # wgmma is sm_90a's default unit
    sync = KernelSpec(recipe="i8-f8", head_dim=128, arch="sm_90a", mma="mma.sync")
    assert sync.key != default.key and sync.name.endswith("_mmasync_sm90a")
    for bad in (dict(recipe="i8-i8", arch="sm_90a"), dict(recipe="i8-f8", arch="sm_90"),
                dict(recipe="i8-f8", arch="sm_89"), dict(recipe="f16", arch="sm_89")):
        with pytest.raises(ValueError, match="mma: "):
            KernelSpec(head_dim=128, mma="wgmma", **bad)
    from qattn.engine.tile import Tile

    for tile in (Tile(128, 64, 4, 2), Tile(256, 64, 16, 2)):
        with pytest.raises(ValueError, match="block_m must be 64, 128 or 192"):
            KernelSpec(recipe="i8-f8", head_dim=128, arch="sm_90a", mma="wgmma", tile=tile)
    for d, stages in ((64, 3), (128, 2)):
        assert KernelSpec(recipe="i8-f8", head_dim=d, arch="sm_90a", mma="wgmma").tile == Tile(192, 128, 12, stages)
    # key tiles: whole 32-key steps of the e4m3 PV, up to FlashAttention-3's 224; O and S in the registers
    for tile, why in ((Tile(128, 96 + 16, 8, 2), "multiple of 32 in \\[64, 224\\]"),
                      (Tile(128, 256, 8, 2), "multiple of 32 in \\[64, 224\\]"),
                      (Tile(192, 224, 12, 2), "registers a consumer thread")):
        with pytest.raises(ValueError, match=why):
            KernelSpec(recipe="i8-f8", head_dim=128, arch="sm_90a", mma="wgmma", tile=tile)


@pytest.mark.parametrize("spec", _wgmma_specs(), ids=lambda s: s.name)
def test_attention_kernel_compiles_on_wgmma(spec):
    from qattn.engine.render import entry_name, render
    from qattn.formats.int8qk import host as int8
    from qattn.engine.compile import entry_resources

    binary = compile_cuda(render(spec), spec.arch, spec.name)
    measured = ((spec.head_dim, spec.causal, spec.arch) in spec.family.measured_spills
                and spec.tile == spec.family.default_tile(spec.head_dim, spec.causal, spec.arch))
    for suffix in int8.module_entries(spec.recipe, spec.backend):
        check_spills(suffix, entry_resources(binary.log, entry_name(spec) + suffix),
                     attention=suffix in ("_f16", "_bf16"), allowed=96 if measured else 0)
    # ptxas serializes every wgmma of a kernel when it cannot prove their registers untouched while
    # in flight (advisory C7514): the kernel still runs, at a fraction of its speed
    serialized = [line for line in binary.log.splitlines() if "C7514" in line or "serialized" in line]
    assert not serialized, serialized
    ptx = binary.ptx
    attn = ptx[ptx.index(f".entry {entry_name(spec)}_f16("):]
    attn = attn[:attn.find(".entry ", 1) if attn.find(".entry ", 1) > 0 else len(attn)]
    assert f"wgmma.mma_async.sync.aligned.m64n{spec.tile.block_n}k32.s32.s8.s8" in attn
    assert f"wgmma.mma_async.sync.aligned.m64n{spec.head_dim}k32.f32.e4m3.e4m3" in attn
    assert "mma.sync" not in attn and "ldmatrix" not in attn
    assert "C7514" not in binary.log, "ptxas serialized the wgmmas"
    assert "fence.proxy.async.shared::cta" in attn and "cp.async" in attn  # Q, by the consumers
    # K and V^T: bulk copies by the producer, completing on mbarriers; registers handed over
    assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in attn
    assert "mbarrier.try_wait.parity" in attn and "mbarrier.arrive.expect_tx" in attn
    assert "setmaxnreg.dec.sync.aligned.u32 24" in attn and "setmaxnreg.inc.sync.aligned.u32" in attn
    # every warpgroup MMA of the PTX reaches the SASS as a product, none as a placeholder onto RZ
    wgmma = warpgroup_mmas(ptx, disassemble(binary.data, "cuda"))
    assert wgmma["sass"] == wgmma["ptx"] > 0 and wgmma["placeholders"] == 0, wgmma


def test_dropped_warpgroup_mmas_are_reported():
    """warpgroup_mmas (qattn inspect) tells a product from the placeholder ptxas leaves onto RZ where
    it dropped one whose accumulator it saw undefined."""
    ptx = "wgmma.mma_async.sync.aligned.m64n32k32.s32.s8.s8 {...}, %rd1, %rd2, p;\n" * 3
    sass = ("/*0100*/ IGMMA.64x32x32.S8.S8 R56, gdesc[UR12], RZ, !UPT ;\n"
            "/*0110*/ HGMMA.64x8x16.F16 RZ, gdesc[URZ], RZ, !UPT, gsb0 ;\n"
            "/*0120*/ QGMMA.64x128x32.F32.E4M3.E4M3 R24, R100, gdesc[UR16], R24 ;\n")
    assert warpgroup_mmas(ptx, sass) == {"ptx": 3, "sass": 2, "placeholders": 1}
    assert warpgroup_mmas("mma.sync.aligned.m16n8k16", "HMMA.16816.F32 R4, R8, R12, R4 ;") == {}


@pytest.mark.parametrize("causal", [False, True])
def test_d128_on_three_warpgroups_issues_s_after_the_pv_partial(causal):
    """At 160 registers a thread d128 cannot hold S in flight beside the PV partial: the tile
    compiles with S_{j+1} issued after PV_j is added (one wgmma group in flight, never two), spills
    at most a few dozen bytes and keeps its wgmmas unserialized."""
    from qattn.engine.render import entry_name, render
    from qattn.engine.spec import KernelSpec
    from qattn.engine.tile import Tile
    from qattn.engine.compile import entry_resources

    spec = KernelSpec(recipe="i8-f8", head_dim=128, causal=causal, arch="sm_90a", mma="wgmma",
                      tile=Tile(192, 128, 12, 2))
    binary = compile_cuda(render(spec), spec.arch, spec.name)
    check_spills("_f16", entry_resources(binary.log, entry_name(spec) + "_f16"), attention=True, allowed=96)
    assert "C7514" not in binary.log, "ptxas serialized the wgmmas"
    ptx = binary.ptx
    attn = ptx[ptx.index(f".entry {entry_name(spec)}_f16("):]
    attn = attn[:attn.find(".entry ", 1) if attn.find(".entry ", 1) > 0 else len(attn)]
    assert "wgmma.wait_group.sync.aligned 1;" not in attn and "wgmma.wait_group.sync.aligned 0;" in attn


def test_tile_layouts_round_trip():
    """untile_k8 / untile_vt invert the stores of the quantizer (transcribed: byte (row, col) of a
    tile at core_offset(row, col / 16) + col % 16), for both tile widths and a key tail."""
    from qattn.formats.int8qk.host import untile_k8, untile_vt

    rng = np.random.default_rng(3)
    for d, keys, lk in ((128, 64, 150), (64, 128, 300)):
        nbk = -(-lk // keys)
        rows = rng.integers(-127, 128, (2, 3, nbk * keys, d), dtype=np.int8)
        tiled = np.zeros_like(rows).reshape(2, 3, -1)
        for r in range(nbk * keys):
            for c in range(d):
                off = (r // keys) * keys * d + ((((r % keys) >> 3) * (d // 16) + c // 16) << 7) + ((r % keys & 7) << 4) + c % 16
                tiled[:, :, off] = rows[:, :, r, c]
        np.testing.assert_array_equal(untile_k8(tiled.reshape(rows.shape), lk, keys), rows[:, :, :lk])
        vt = rng.integers(0, 256, (2, 3, d, nbk * keys), dtype=np.uint8)
        vt_tiled = np.zeros_like(vt).reshape(2, 3, -1)
        for ch in range(d):
            for k in range(nbk * keys):
                off = (k // keys) * keys * d + (((ch >> 3) * (keys // 16) + (k % keys) // 16) << 7) + ((ch & 7) << 4) + k % 16
                vt_tiled[:, :, off] = vt[:, :, ch, k]
        np.testing.assert_array_equal(untile_vt(vt_tiled.reshape(vt.shape), keys), vt)


def test_v16_tiles_round_trip():
    """untile_v16 inverts the quantizer's fp16 V tile stores (transcribed from v_rows_body: element c
    of row r of a tile of `keys` rows at line c / 64, row r, chunk ((c % 64) / 8) ^ (r % 8), element
    c % 8), for both head dims and a key tail; the layout is the one wgmma's 128-byte swizzle reads
    (the chunk XOR the address bits 7-9 of a row 128 bytes apart)."""
    from qattn.formats.int8qk.host import untile_v16

    rng = np.random.default_rng(5)
    for d, keys, lk in ((128, 64, 150), (64, 128, 300), (128, 128, 128)):
        nbk = -(-lk // keys)
        rows = rng.standard_normal((2, 3, nbk * keys, d)).astype(np.float16)
        tiled = np.zeros_like(rows).reshape(2, 3, -1)
        for r in range(nbk * keys):
            rr = r % keys
            for c in range(d):
                off = (r // keys) * keys * d + (c // 64) * keys * 64 + rr * 64 + ((((c % 64) // 8) ^ (rr % 8)) * 8) + c % 8
                tiled[:, :, off] = rows[:, :, r, c]
        np.testing.assert_array_equal(untile_v16(tiled.reshape(rows.shape), lk, keys), rows[:, :, :lk])
        # byte address of (r, chunk): swizzle bits [4, 7) = logical chunk XOR bits [7, 10) of the row
        for r in range(8):
            for c in range(8):
                byte = r * 128 + ((c ^ (r % 8)) * 16)
                assert (byte >> 4) & 7 == c ^ ((byte >> 7) & 7)


def test_core_row_loader_model():
    """load_core_rows (transcribed): thread tid's k-th copy lands at byte 16 (tid + k threads), which is
    core_offset of its row and chunk, and the copies cover every (row, chunk) of the tile once."""
    for chunks, threads, rows in ((4, 128, 128), (8, 128, 64), (8, 256, 128), (4, 256, 64)):
        step = threads // chunks
        seen = []
        for tid in range(threads):
            r0, c = (tid // 8 // chunks) * 8 + tid % 8, (tid // 8) % chunks
            for k in range(rows // step):
                r = r0 + k * step
                assert (((r >> 3) * chunks + c) << 7) + ((r & 7) << 4) == 16 * (tid + k * threads)
                seen.append((r, c))
        assert sorted(seen) == [(r, c) for r in range(rows) for c in range(chunks)]


def test_operands_must_match_the_kernel_layout():
    """Operands quantized for the mma.sync kernel (plain K8 rows, fp16 V rows on Hopper) are refused
    by the wgmma kernel (K8 / V^T tiles), by name, and the other way round."""
    from types import SimpleNamespace

    from qattn.engine.spec import KernelSpec
    from qattn.formats.int8qk import host as int8

    wgmma = KernelSpec(recipe="i8-f8", head_dim=128, arch="sm_90a")
    sync = KernelSpec(recipe="i8-f8", head_dim=128, arch="sm_90a", mma="mma.sync")
    assert int8.scale_blocks(wgmma) == (1, 128) and int8.scale_blocks(sync) == (128, 64)
    assert int8.k_scale_groups(wgmma) == 4 and int8.k_scale_groups(sync) == 1

    def operands(layout, scales):  # laid out for kernel `layout`, with the scales of kernel `scales`
        v = np.zeros(1, np.uint8 if layout.family.values["pv_operand"] == "f8" else np.float16)
        (rows, keys), groups = int8.scale_blocks(scales), int8.k_scale_groups(scales)
        return int8.QuantizedQKV(format="i8-f8", dtype="float16", dims=(1, 1, 1, 1, 1, 128), block_m=rows,
                                 block_n=keys, scale=1.0, q8=None, q_scale=None, k8=None, k_scale=None, k_mean=None,
                                 shift=None, v=v, tile_keys=int8._tile_keys(layout), k_groups=groups)

    for spec, other in ((wgmma, sync), (sync, wgmma)):
        int8._check_kernel(SimpleNamespace(spec=spec), operands(spec, spec))  # its own: accepted
        with pytest.raises(ValueError, match="another layout"):  # its scale blocks, the other's layout
            int8._check_kernel(SimpleNamespace(spec=spec), operands(other, spec))
        with pytest.raises(ValueError, match="the operands were quantized with"):  # the other's scales
            int8._check_kernel(SimpleNamespace(spec=spec), operands(spec, other))


def test_key_block_is_the_tile_keys():
    """The wgmma kernel's format key block is its tile's block_n (128 keys by default); operands
    quantized with another key block are refused by name."""
    from types import SimpleNamespace

    from qattn.engine.spec import KernelSpec
    from qattn.engine.tile import Tile
    from qattn.formats.int8qk import host as int8

    assert int8.scale_blocks(KernelSpec(recipe="i8-f8", head_dim=128, arch="sm_90a")) == (1, 128)
    assert int8.scale_blocks(KernelSpec(recipe="i8-f8", head_dim=128, arch="sm_90a", tile=Tile(64, 64, 4, 2))) == (1, 64)
    d64 = KernelSpec(recipe="i8-f8", head_dim=64, arch="sm_90a")
    assert int8.scale_blocks(d64) == (1, 128)
    assert int8.scale_blocks(KernelSpec(recipe="i8-f8", head_dim=64, arch="sm_90a", tile=Tile(64, 64, 4, 2))) == (1, 64)
    assert int8.emulator_options(d64) == {"block_m": 1, "block_n": 128, "k_granularity": "thread"}
    qkv = int8.QuantizedQKV(format="i8-f8", dtype="float16", dims=(1, 1, 1, 1, 1, 64), block_m=1, block_n=64,
                            scale=1.0, q8=None, q_scale=None, k8=None, k_scale=None, k_mean=None, shift=None,
                            v=np.zeros(1, np.uint8), tile_keys=int8._tile_keys(d64), k_groups=4)
    with pytest.raises(ValueError, match="takes Q scales per row, 4 K scales per 128 keys; the operands were "
                                         "quantized with Q scales per row, 4 K scales per 64 keys"):
        int8._check_kernel(SimpleNamespace(spec=d64), qkv)
