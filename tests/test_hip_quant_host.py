"""The HIP int8-QK quantization kernels (templates/hip/quantize_i8.h.j2), run on the CPU: the header rendered for
an i8-f16 spec under a host stand-in for hip/common.h.j2 (hip_offline.HOST_BLOCKS, a wave of 64 lanes as on CDNA
or of 32 as on RDNA), built by clang for the host and launched over the HIP host's grid. Q's and K's
codes and scales, with K smoothing alone and with Q/K channel balancing (α from quant.balance_from_ranges, as
the HIP host takes it), must equal the NumPy quantization of the emulator's q̃·α and (K − K̄) / α byte for
byte; the shift q̃·K̄ must agree to fp32 rounding. The column statistics (K's fp64 sums, V's absmax per chunk of
keys) and bf16 V's fp16 rows are NumPy's too."""
import ctypes

import numpy as np
import pytest

from qattn.check import quant
from qattn.engine.render import context, environment
from qattn.engine.spec import KernelSpec
from qattn.formats.int8qk import quant as i8quant

from hip_offline import HOST_BLOCKS, HOST_FLAGS, host_library, needs_clang

pytestmark = needs_clang

F32 = np.float32

HOST_HEADER = HOST_BLOCKS + r"""
namespace {
constexpr int D = {{ head_dim }};
constexpr int BM = {{ block_m }};
constexpr int BN = {{ block_n }};
constexpr int WAVE = {{ wave }};
}  // namespace
"""

DRIVER = r"""
template <bool BALANCE>
static void rows(bool is_k, const u16* x, const i64* st, int B, int H, int L, int group, float mul,
                 const float* k_mean, signed char* codes, float* scales, float* shift, const float* alpha) {
    if (is_k)
        launch((L + BN - 1) / BN, H, B, QT, [=] {
            quant_rows_body<false, BN, true, BALANCE>(x, st[0], st[1], st[2], L, 1, 1.f, k_mean, codes, scales,
                                                      nullptr, alpha);
        });
    else
        launch((L + BM - 1) / BM, H, B, QT, [=] {
            quant_rows_body<false, BM, false, BALANCE>(x, st[0], st[1], st[2], L, group, mul, k_mean, codes, scales,
                                                       shift, alpha);
        });
}

// The column statistics of fp16 x [B, H, L, D] per chunk of keys: one thread a channel (D threads).
extern "C" void colstats(const u16* x, const i64* st, int B, int H, int L, int chunk, double* part_sum, float* part_max) {
    launch((L + chunk - 1) / chunk, H, B, D, [=] {
        colstats_body<false>(x, st[0], st[1], st[2], L, chunk, part_sum, part_max);
    });
}

// bf16 V [B, H, L, D] to fp16 rows, nearest even (the i8-f16 PV operand of bf16 inputs).
extern "C" void v_to_half(const u16* x, const i64* st, int B, int H, int L, u16* y) {
    launch((L + 63) / 64, H, B, QT, [=] { v_to_half_body(x, st[0], st[1], st[2], L, y); });
}

// Q (is_k 0) or K (1) rows of fp16 x [B, H, L, D] into codes and block scales; alpha null: no balancing.
extern "C" void quant_rows(int is_k, const u16* x, const i64* st, int B, int H, int L, int group, float mul,
                           const float* k_mean, signed char* codes, float* scales, float* shift, const float* alpha) {
    if (alpha != nullptr) rows<true>(is_k, x, st, B, H, L, group, mul, k_mean, codes, scales, shift, alpha);
    else rows<false>(is_k, x, st, B, H, L, group, mul, k_mean, codes, scales, shift, alpha);
}
"""


@pytest.fixture(scope="module", params=[64, 32], ids=["wave64", "wave32"])
def host_quant(request, tmp_path_factory):
    """The quantization header of the HIP i8-f16 d64 spec, built for the host with a wave of 64 or 32 lanes."""
    spec = KernelSpec("prefill", "i8-f16", 64, None, False, "hip", "gfx942")
    text = HOST_HEADER + '{% include "hip/quantize_i8.h.j2" %}' + DRIVER
    source = environment().from_string(text).render(wave=request.param, **context(spec))
    return spec, host_library(tmp_path_factory.mktemp(f"quant{request.param}"), source, HOST_FLAGS)


def _ptr(x):
    return x.ctypes.data_as(ctypes.c_void_p) if x is not None else None


def _run(lib, is_k, x, group, mul, k_mean, alpha, rows):
    b, h, length, d = x.shape
    nblocks = -(-length // rows)
    codes = np.full(x.shape, 99, np.int8)  # poisoned
    scales = np.full((b, h, nblocks), np.nan, F32)
    shift = None if is_k else np.full((b, h, length), np.nan, F32)
    strides = np.array([s // 2 for s in x.strides[:3]], np.int64)
    lib.quant_rows(ctypes.c_int(is_k), _ptr(x), _ptr(strides), ctypes.c_int(b), ctypes.c_int(h), ctypes.c_int(length),
                   ctypes.c_int(group), ctypes.c_float(mul), _ptr(k_mean), _ptr(codes), _ptr(scales), _ptr(shift),
                   _ptr(alpha))
    return codes, scales, shift


@pytest.mark.parametrize("smoothing", ["mean", "mean+balance"])
@pytest.mark.parametrize("preset", ["normal", "outliers_scale"])
def test_hip_quantization_is_numpys(host_quant, smoothing, preset):
    spec, lib = host_quant
    from qattn import data

    b, hq, hkv, lq, lk, d = 1, 4, 2, 150, 200, 64  # tails: 150 rows in blocks of 128, 200 keys in blocks of 64
    x = data.preset(preset, ctx=lk, queries=lq, batch=b, heads=hq, kv_heads=hkv, head_dim=d, seed=7)
    q, k = (np.ascontiguousarray(np.asarray(x[n], F32).astype(np.float16)) for n in "qk")
    mul = F32(0.125 * quant.LOG2E)
    q2 = np.asarray(q, F32) * mul
    q_in, k_in, k_mean = i8quant.smooth(q2, np.asarray(k, F32), smoothing)
    k_mean = np.ascontiguousarray(k_mean[..., 0, :])
    alpha = None
    if smoothing == "mean+balance":
        alpha = np.ascontiguousarray(i8quant.balance_from_ranges(q, k, k_mean, mul))
        if preset == "outliers_scale":
            assert (alpha != 1).any()  # the balanced path is exercised
    bm, bn = spec.tile.block_m, spec.tile.block_n
    k8, k_scales, _ = _run(lib, 1, k, 1, F32(1), k_mean, alpha, bn)
    q8, q_scales, shift = _run(lib, 0, q, hq // hkv, mul, k_mean, alpha, bm)
    want_k = i8quant.quantize_int8(k_in, bn, operand="k")
    want_q = i8quant.quantize_int8(q_in, bm, operand="q")
    np.testing.assert_array_equal(k8, want_k.codes)
    np.testing.assert_array_equal(q8, want_q.codes)
    np.testing.assert_array_equal(k_scales, want_k.scale[:, :, ::bn, 0])
    np.testing.assert_array_equal(q_scales, want_q.scale[:, :, ::bm, 0])
    k_mean_q = np.repeat(k_mean, hq // hkv, axis=1)[:, :, None, :]
    np.testing.assert_allclose(shift, (q2.astype(np.float64) * k_mean_q).sum(-1), rtol=1e-5, atol=1e-5)


def test_hip_column_statistics_and_fp16_rows(host_quant):
    spec, lib = host_quant
    rng = np.random.default_rng(3)
    b, h, length, d, chunk = 2, 3, 300, spec.head_dim, 128  # a partial last chunk
    x = (rng.standard_normal((b, h, length, d)) * 3).astype(np.float16)
    strides = np.array([s // 2 for s in x.strides[:3]], np.int64)
    n = -(-length // chunk)
    part_sum = np.full((b, h, n, d), np.nan)
    part_max = np.full((b, h, n, d), np.nan, F32)
    lib.colstats(_ptr(x), _ptr(strides), ctypes.c_int(b), ctypes.c_int(h), ctypes.c_int(length), ctypes.c_int(chunk),
                 _ptr(part_sum), _ptr(part_max))
    for i in range(n):
        rows = np.asarray(x[:, :, i * chunk:(i + 1) * chunk], np.float64)
        np.testing.assert_array_equal(part_sum[:, :, i], np.cumsum(rows, axis=2)[:, :, -1])  # in key order
        np.testing.assert_array_equal(part_max[:, :, i], np.abs(rows).max(axis=2).astype(F32))
    from qattn.engine.arrays import numpy_dtype

    bf = (rng.standard_normal((b, h, length, d)) * 7).astype(numpy_dtype("bfloat16"))
    out = np.zeros((b, h, length, d), np.float16)
    lib.v_to_half(_ptr(bf), _ptr(np.array([s // 2 for s in bf.strides[:3]], np.int64)), ctypes.c_int(b), ctypes.c_int(h),
                  ctypes.c_int(length), _ptr(out))
    np.testing.assert_array_equal(out, bf.astype(F32).astype(np.float16))
