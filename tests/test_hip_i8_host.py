"""The HIP int8-QK prefill (int8qk's hip/prefill_i8.hip.j2) run on the CPU end to end, matrix ops included: the
module's own steps in the order the HIP host runs them (qattn.formats.int8qk.host: K's column sums, K̄ finished in
fp64, K's and Q's codes with the shift q̃·K̄, V's codes after its column maxima where PV is 8-bit), then the attention
kernel, under the host stand-ins for its headers (hip_offline.host_hip_environment) on CDNA's wave64 layouts (gfx942,
gfx90a), RDNA3's (gfx1100) and RDNA4's (gfx1201). Output and LSE must be the emulator's (the same scale blocks, K
smoothing, and Q/K balancing with α from the column ranges as the HIP host computes it) to the rounding of the
last fp32 sums, with GQA, tails and causal rows."""
import ctypes

import ml_dtypes
import numpy as np
import pytest

from qattn.check.emulate import emulate
from qattn.check.metrics import compare
from qattn.check.quant import LOG2E
from qattn.engine.render import context
from qattn.engine.spec import KernelSpec
from qattn.formats.int8qk.host import smoothing_options
from qattn.formats.int8qk.launch import COLSTATS_CHUNK, q_quant_rows, scale_blocks
from qattn.formats.int8qk.quant import balance_from_ranges

from hip_offline import HOST_FLAGS, host_hip_environment, host_library, needs_clang

pytestmark = needs_clang

DRIVER = r"""
alignas(16) unsigned char smem[65536];  // the attention block's LDS (the kernel declares it extern)
#define PICK(stem) (bf ? {{ name }}_##stem##_bf16 : {{ name }}_##stem##_f16)
extern "C" void colstats(int bf, const u16* x, const i64* st, int L, double* part_sum, float* part_max, int B, int H) {
    launch((L + {{ chunk }} - 1) / {{ chunk }}, H, B, D, [=] {
        PICK(colstats)(x, st[0], st[1], st[2], L, {{ chunk }}, part_sum, part_max);
    });
}
extern "C" void quant_k(int bf, const u16* x, const i64* st, int L, const float* k_mean, signed char* codes,
                        float* scales, int B, int H) {
    launch((L + BN - 1) / BN, H, B, QT, [=] { PICK(quant_k)(x, st[0], st[1], st[2], L, k_mean, codes, scales); });
}
extern "C" void quant_q(int bf, const u16* x, const i64* st, int L, int group, float mul, const float* k_mean,
                        signed char* codes, float* scales, float* shift, int B, int H, int rows) {
    launch((L + rows - 1) / rows, H, B, QT, [=] {
        PICK(quant_q)(x, st[0], st[1], st[2], L, group, mul, k_mean, codes, scales, shift);
    });
}
extern "C" void quant_k_balance(int bf, const u16* x, const i64* st, int L, const float* k_mean, signed char* codes,
                                float* scales, const float* alpha, int B, int H) {
    launch((L + BN - 1) / BN, H, B, QT, [=] {
        PICK(quant_k_balance)(x, st[0], st[1], st[2], L, k_mean, codes, scales, alpha);
    });
}
extern "C" void quant_q_balance(int bf, const u16* x, const i64* st, int L, int group, float mul, const float* k_mean,
                                signed char* codes, float* scales, float* shift, const float* alpha, int B, int H,
                                int rows) {
    launch((L + rows - 1) / rows, H, B, QT, [=] {
        PICK(quant_q_balance)(x, st[0], st[1], st[2], L, group, mul, k_mean, codes, scales, shift, alpha);
    });
}
{% if pv != "f16" %}
extern "C" void quant_v(int bf, const u16* x, const i64* st, int L, int L_pad, const float* amax, float* v_scale,
                        float* v_out_scale, unsigned char* vt, int B, int H) {
    launch(L_pad / BN, H, B, QT, [=] { PICK(quant_v)(x, st[0], st[1], st[2], L, L_pad, amax, v_scale, v_out_scale, vt); });
}
{% endif %}
extern "C" void attention(int bf, const signed char* q8, const signed char* k8, const char* v, const float* sq,
                          const float* sk, const float* sv, u16* o, float* lse, const float* shift, const i64* st,
                          int B, int Hq, int group, int Lq, int Lk) {
    launch((Lq + BM - 1) / BM, Hq, B, THREADS, [=] {
        (bf ? {{ name }}_bf16 : {{ name }}_f16)(q8, k8, v, sq, sk, sv, o, lse, shift, st[0], st[1], st[2], st[3], st[4],
                                               st[5], B, Hq, group, Lq, Lk);
    });
}
"""

CASES = [  # (target, format, input type, head dim, causal, Lq, Lk, smoothing)
    ("gfx942", "i8-f16", "f16", 64, True, 70, 90, "mean"),
    ("gfx1100", "i8-i8", "bf16", 64, False, 45, 77, "mean"),
    ("gfx1201", "i8-f8", "f16", 128, True, 66, 66, "mean"),
    ("gfx942", "i8-f8", "bf16", 64, False, 40, 100, "mean+balance"),
    ("gfx90a", "i8-i8", "f16", 64, True, 50, 70, "mean"),
    ("gfx1100", "i8-f16", "f16", 64, True, 60, 75, "mean+balance"),
]


def _ptr(x):
    return None if x is None else x.ctypes.data_as(ctypes.c_void_p)


def _st(x, unit=None):
    return np.array([s // (unit or x.itemsize) for s in x.strides[:3]], np.int64)


@pytest.mark.parametrize("target, fmt, dtype, d, causal, lq, lk, smoothing", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}-d{c[3]}-{'causal' if c[4] else 'full'}-{c[5]}x{c[6]}-{c[7]}"
                              for c in CASES])
def test_hip_int8_qk_runs_as_its_emulator(tmp_path, target, fmt, dtype, d, causal, lq, lk, smoothing):
    spec = KernelSpec(kind="prefill", recipe=fmt, head_dim=d, causal=causal, backend="hip", arch=target)
    values = {**context(spec), "chunk": COLSTATS_CHUNK, "pv": spec.recipe.split("-")[1]}
    env = host_hip_environment(target, eight=True)
    source = env.get_template(spec.family.template).render(**values).replace("extern __shared__", "extern")
    lib = host_library(tmp_path, source + env.from_string(DRIVER).render(**values), HOST_FLAGS)

    rng = np.random.default_rng(d + lq + lk)
    half = np.float16 if dtype == "f16" else ml_dtypes.bfloat16
    bf = ctypes.c_int(dtype == "bf16")
    b, hq, hkv = 2, 4, 2
    q = (rng.standard_normal((b, hq, lq, d)) * 1.5).astype(half)
    k = rng.standard_normal((b, hkv, lk, d)) + rng.standard_normal(d) * 3  # a channel bias to smooth
    if smoothing == "mean+balance":
        k[..., 5] *= 40  # an outlier channel for α to balance
    k = k.astype(half)
    v = rng.standard_normal((b, hkv, lk, d)).astype(half)
    ints = ctypes.c_int
    bm, bn = scale_blocks(spec)

    def colstats(x, want_sum):
        chunks = -(-x.shape[2] // COLSTATS_CHUNK)
        part_sum = np.zeros(x.shape[:2] + (chunks, d), np.float64) if want_sum else None
        part_max = None if want_sum else np.zeros(x.shape[:2] + (chunks, d), np.float32)
        lib.colstats(bf, _ptr(x), _ptr(_st(x)), ints(x.shape[2]), _ptr(part_sum), _ptr(part_max), ints(b),
                     ints(x.shape[1]))
        return part_sum.sum(axis=2) if want_sum else part_max.max(axis=2)

    k_mean = np.ascontiguousarray((colstats(k, True) / lk).astype(np.float32))
    mul = np.float32(d ** -0.5 * LOG2E)
    # α as the HIP host takes it (from Q's and K's column ranges), and the balancing entries' extra argument
    alpha = np.ascontiguousarray(balance_from_ranges(q, k, k_mean, mul, smoothing_options(smoothing)["alpha_rule"])) \
        if smoothing == "mean+balance" else None
    balanced, extra = ("_balance", (_ptr(alpha),)) if alpha is not None else ("", ())
    k8 = np.zeros((b, hkv, lk, d), np.int8)
    k_scale = np.zeros((b, hkv, -(-lk // bn)), np.float32)
    getattr(lib, "quant_k" + balanced)(bf, _ptr(k), _ptr(_st(k)), ints(lk), _ptr(k_mean), _ptr(k8), _ptr(k_scale),
                                       *extra, ints(b), ints(hkv))
    q8 = np.zeros((b, hq, lq, d), np.int8)
    q_scale = np.zeros((b, hq, -(-lq // bm)), np.float32)
    shift = np.zeros((b, hq, lq), np.float32)
    getattr(lib, "quant_q" + balanced)(bf, _ptr(q), _ptr(_st(q)), ints(lq), ints(hq // hkv), ctypes.c_float(mul),
                                       _ptr(k_mean), _ptr(q8), _ptr(q_scale), _ptr(shift), *extra, ints(b), ints(hq),
                                       ints(q_quant_rows(spec)))
    if values["pv"] == "f16":
        assert dtype == "f16"  # (bf16 V would first be rounded to fp16 rows, v_to_half)
        v_op, v_out_scale = v, None
    else:
        amax = np.ascontiguousarray(colstats(v, False))
        lk_pad = -(-lk // bn) * bn
        v_op = np.zeros((b, hkv, d, lk_pad), np.uint8)
        v_scale, v_out_scale = np.zeros((b, hkv, d), np.float32), np.zeros((b, hkv, d), np.float32)
        lib.quant_v(bf, _ptr(v), _ptr(_st(v)), ints(lk), ints(lk_pad), _ptr(amax), _ptr(v_scale), _ptr(v_out_scale),
                    _ptr(v_op), ints(b), ints(hkv))
    out = np.full((b, hq, lq, d), np.nan, half)
    lse = np.full((b, hq, lq), np.nan, np.float32)
    strides = np.concatenate([_st(v_op, 1), _st(out)])
    lib.attention(bf, _ptr(q8), _ptr(k8), _ptr(v_op), _ptr(q_scale), _ptr(k_scale), _ptr(v_out_scale), _ptr(out),
                  _ptr(lse), _ptr(shift), _ptr(strides), *map(ints, (b, hq, hq // hkv, lq, lk)))

    want, want_lse = emulate(fmt, q, k, v, causal=causal, return_lse=True, block_n=bn, block_m=bm,
                             k_granularity="block", **smoothing_options(smoothing))
    if alpha is not None:
        assert (alpha != 1).any()  # the outlier channel is balanced
    got = out.astype(np.float32)
    errors = compare(got, np.asarray(want).astype(half).astype(np.float32))  # (the emulator's O is fp32)
    assert errors.nonfinite == 0 and errors.rel_l2 <= 1e-4, errors
    np.testing.assert_allclose(lse, want_lse, rtol=2e-6, atol=1e-5)  # (LSE includes the shift: |LSE| up to ~30)
