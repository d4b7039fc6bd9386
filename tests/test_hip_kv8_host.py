"""The HIP tensor-core kv8 kernels (kv8's hip/prefill_kv8_mma.hip.j2: kv8-imma, kv8-split) run on the CPU, matrix ops
included: a module's three entries in the order qattn.formats.kv8.launch plans them (the Q / V statistics, attention with the key range
split or not, the merge), under the host stand-ins for its headers (hip_offline.host_hip_environment) on CDNA's
wave64 layouts (gfx942, gfx90a), RDNA3's (gfx1100) and RDNA4's (gfx1201). The output must be the emulator's under
the kernel's options (its key tile; for kv8-imma the split's low byte signed, the digits AMD's signed-only int8 ops
take) to the rounding of the last fp32 sums, and within the format's 1e-5 of FP64 on the dequantized cache, with GQA, tails and causal rows (rows that see no key
come out 0 with LSE -inf)."""
import ctypes
import math

import numpy as np
import pytest

from qattn.check.emulate import emulate
from qattn.check.metrics import compare
from qattn.check.reference import attention as reference
from qattn.engine.render import context
from qattn.engine.spec import KernelSpec
from qattn.formats.kv8.launch import emulator_options
from qattn.formats.kv8.quant import quantize_kv_cache

from hip_offline import HOST_FLAGS, host_hip_environment, host_library, needs_clang

pytestmark = needs_clang

DRIVER = r"""
alignas(16) unsigned char smem[65536];  // the attention block's LDS (the kernel declares it extern)
extern "C" void stat(const float* q, const i64* qs, const float* vs, const i64* vss, float* st, int B, int Hq,
                     int group, int Lq, int Lk, float scale_log2) {
    launch(Hq, B, 1, 256, [=] { {{ name }}_stat(q, qs[0], qs[1], qs[2], vs, vss[0], vss[1], st, Hq, group, Lq, Lk, scale_log2); });
}
extern "C" void attention(const float* q, const i64* qs, const signed char* kc, const i64* kcs, const float* ks,
                          const i64* kss, const signed char* vc, const i64* vcs, const float* vs, const i64* vss,
                          float* o, const i64* os, float* lse, const float* st, int B, int Hq, int group, int Lq,
                          int Lk, float scale_log2, int splits, float* part_o, float2* part_ml) {
    launch((Lq + BM - 1) / BM * splits, Hq, B, THREADS, [=] {
        {{ name }}(q, qs[0], qs[1], qs[2], kc, kcs[0], kcs[1], kcs[2], ks, kss[0], kss[1], vc, vcs[0], vcs[1], vcs[2],
                   vs, vss[0], vss[1], o, os[0], os[1], os[2], lse, Lq, st, Hq, group, Lq, Lk, scale_log2, splits,
                   part_o, part_ml);
    });
}
extern "C" void merge(const float* part_o, const float2* part_ml, int splits, i64 bh_rows, int Hq, int Lq, float* o,
                      const i64* os, float* lse) {
    launch((bh_rows * (D / 4) + MERGE_THREADS - 1) / MERGE_THREADS, 1, 1, MERGE_THREADS, [=] {
        {{ name }}_merge(part_o, part_ml, splits, bh_rows, Hq, Lq, o, os[0], os[1], os[2], lse, Lq);
    });
}
"""

CASES = [  # (format, target, head dim, causal, Lq, Lk, splits)
    ("kv8-imma", "gfx942", 64, True, 70, 150, 1),
    ("kv8-imma", "gfx942", 128, False, 33, 100, 3),
    ("kv8-imma", "gfx90a", 64, False, 50, 90, 2),
    ("kv8-imma", "gfx1100", 128, True, 66, 66, 1),
    ("kv8-imma", "gfx1100", 64, True, 90, 40, 2),  # more queries than keys: the first 50 rows see none
    ("kv8-imma", "gfx1201", 128, True, 40, 130, 3),
    ("kv8-imma", "gfx1201", 64, False, 20, 70, 1),
    ("kv8-split", "gfx942", 128, True, 70, 100, 1),  # its d128 tile: 32 keys a block
    ("kv8-split", "gfx90a", 64, False, 40, 90, 3),
    ("kv8-split", "gfx1100", 128, False, 33, 70, 2),
    ("kv8-split", "gfx1201", 64, True, 80, 50, 1),
]


def _ptr(x):
    return None if x is None else x.ctypes.data_as(ctypes.c_void_p)


def _st(x):
    return np.array([s // x.itemsize for s in x.strides[:3]], np.int64)


def _run(lib, values, q, k, v, splits, scale_log2):
    """The three launches of a kv8 call (formats/kv8/launch.py), on the host."""
    b, hq, lq, d = q.shape
    hkv, lk = k.codes.shape[1], k.codes.shape[2]
    ints = ctypes.c_int
    sizes = (ints(b), ints(hq), ints(hq // hkv), ints(lq), ints(lk), ctypes.c_float(scale_log2))
    stat = np.full((b, hq, d // 64 + 1), np.nan, np.float32)
    lib.stat(_ptr(q), _ptr(_st(q)), _ptr(v.scales), _ptr(_st(v.scales)), _ptr(stat), *sizes)
    out = np.full(q.shape, np.nan, np.float32)
    lse = np.full((b, hq, lq), np.nan, np.float32)
    part_o = np.full((splits, b, hq, lq, d), np.nan, np.float32) if splits > 1 else None
    part_ml = np.full((splits, b, hq, lq, 2), np.nan, np.float32) if splits > 1 else None
    lib.attention(_ptr(q), _ptr(_st(q)), _ptr(k.codes), _ptr(_st(k.codes)), _ptr(k.scales), _ptr(_st(k.scales)),
                  _ptr(v.codes), _ptr(_st(v.codes)), _ptr(v.scales), _ptr(_st(v.scales)), _ptr(out), _ptr(_st(out)),
                  _ptr(lse), _ptr(stat), *sizes, ints(splits), _ptr(part_o), _ptr(part_ml))
    if splits > 1:
        lib.merge(_ptr(part_o), _ptr(part_ml), ints(splits), ctypes.c_longlong(b * hq * lq), ints(hq), ints(lq),
                  _ptr(out), _ptr(_st(out)), _ptr(lse))
    return out, lse


@pytest.mark.parametrize("fmt, target, d, causal, lq, lk, splits", CASES,
                         ids=[f"{c[0]}-{c[1]}-d{c[2]}-{'causal' if c[3] else 'full'}-{c[4]}x{c[5]}-splits{c[6]}"
                              for c in CASES])
def test_hip_kv8_runs_as_its_emulator(tmp_path, fmt, target, d, causal, lq, lk, splits):
    spec = KernelSpec(kind="prefill", recipe=fmt, head_dim=d, causal=causal, backend="hip", arch=target)
    values = context(spec)
    env = host_hip_environment(target, eight=fmt == "kv8-imma")
    source = env.get_template(spec.family.template).render(**values).replace("extern __shared__", "extern")
    lib = host_library(tmp_path, source + env.from_string(DRIVER).render(**values), HOST_FLAGS)

    rng = np.random.default_rng(d + lq + lk + splits)
    b, hq, hkv = 2, 4, 2
    q = (rng.standard_normal((b, hq, lq, d)) * 1.5).astype(np.float32)
    q[0, 1, :, 70 % d] *= 8  # one channel far above the others: its group's Q scale is its own
    k = quantize_kv_cache(rng.standard_normal((b, hkv, lk, d)) + rng.standard_normal(d) * 2)
    v = quantize_kv_cache(rng.standard_normal((b, hkv, lk, d)) * np.exp(rng.standard_normal((b, hkv, lk, 1))))
    scale = d ** -0.5
    out, lse = _run(lib, values, q, k, v, splits, np.float32(scale * math.log2(math.e)))

    assert emulator_options(spec) == {"block_n": spec.tile.block_n, **({"signed_low": True} if fmt == "kv8-imma" else {})}
    want, want_lse = emulate(fmt, q, k, v, causal=causal, return_lse=True, **emulator_options(spec))
    errors = compare(out, want)
    # splits == 1: the emulator's loop, but for the exp2 and the row sums' order (and kv8-split's fp16 products,
    # which the matrix ops sum in their own order); the merge adds a few roundings
    bound = (2e-7 if splits == 1 else 1e-6) * (1 if fmt == "kv8-imma" else 5)
    assert errors.nonfinite == 0 and errors.rel_l2 <= bound, errors
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6, atol=1e-6)
    exact, exact_lse = reference(q.astype(np.float64), k.dequantize(), v.dequantize(), causal=causal, return_lse=True)
    errors = compare(out, exact)
    assert errors.max_rel <= 1e-5 and errors.rel_l2 <= 1e-5, errors  # the format's tolerance
    blind = (np.arange(lq) + (lk - lq) < 0) if causal else np.zeros(lq, bool)  # rows that see no key
    assert (out[:, :, blind] == 0).all() and np.isneginf(lse[:, :, blind]).all()
    assert np.isfinite(lse[:, :, ~blind]).all()
