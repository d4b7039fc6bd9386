"""The HIP f16/bf16 prefill kernel (dense's hip/prefill_matrix.hip.j2) run on the CPU, matrix ops included, under the
host stand-ins for its headers (hip_offline.host_hip_environment), on MFMA's wave64 layout (gfx942), RDNA3's
replicated one (gfx1100) and RDNA4's (gfx1201): its output and LSE must be the emulator's (same key tiles, P rounded
to the operand type) to the rounding of the last fp32 sums, with GQA, tails on both axes, causal rows with
Lq < Lk, Lq > Lk (rows that see no key: zeros, LSE -inf) and head dims 32 to 256."""
import ctypes

import ml_dtypes
import numpy as np
import pytest

from qattn.check.emulate import emulate
from qattn.check.metrics import compare
from qattn.engine.render import context
from qattn.engine.spec import KernelSpec

from hip_offline import HOST_FLAGS, host_hip_environment, host_library, needs_clang

pytestmark = needs_clang

DRIVER = r"""
alignas(16) elem smem[65536 / sizeof(elem)];  // the block's LDS (the kernel declares it extern)
extern "C" void run(const void* q, const void* k, const void* v, void* o, float* lse, const i64* st, i64 lse_bh,
                    int B, int Hq, int group, int Lq, int Lk, float scale_log2) {
    launch((Lq + BM - 1) / BM, Hq, B, THREADS, [=] {
        {{ name }}((const elem*)q, (const elem*)k, (const elem*)v, (elem*)o, lse, st[0], st[1], st[2], st[3], st[4],
                   st[5], st[6], st[7], st[8], st[9], st[10], st[11], lse_bh, Hq, group, Lq, Lk, scale_log2);
    });
}
"""

CASES = [  # (target, format, head dim, causal, Lq, Lk)
    ("gfx942", "f16", 64, False, 70, 90),
    ("gfx942", "bf16", 96, True, 50, 83),
    ("gfx1100", "f16", 64, True, 83, 83),
    ("gfx1100", "bf16", 64, False, 33, 47),
    ("gfx1201", "f16", 96, True, 90, 40),
    ("gfx1201", "bf16", 64, True, 61, 77),
    ("gfx942", "f16", 32, True, 40, 100),
    ("gfx1100", "bf16", 128, True, 70, 70),
    ("gfx1201", "f16", 256, False, 37, 45),  # d256's own tile, m32n16w2s1
]


@pytest.mark.parametrize("target, fmt, d, causal, lq, lk", CASES,
                         ids=[f"{c[0]}-{c[1]}-d{c[2]}-{'causal' if c[3] else 'full'}-{c[4]}x{c[5]}" for c in CASES])
def test_hip_prefill_runs_as_its_emulator(tmp_path, target, fmt, d, causal, lq, lk):
    spec = KernelSpec(kind="prefill", recipe=fmt, head_dim=d, causal=causal, backend="hip", arch=target)
    values = context(spec)
    env = host_hip_environment(target, eight=False)
    # the block's LDS: an extern array, defined by the driver (HOST_BLOCKS makes __shared__ arrays static)
    source = env.get_template(spec.family.template).render(**values).replace("extern __shared__", "extern")
    lib = host_library(tmp_path, source + env.from_string(DRIVER).render(**values), HOST_FLAGS)

    rng = np.random.default_rng(d + lq)
    dtype = np.float16 if fmt == "f16" else ml_dtypes.bfloat16
    b, hq, hkv = 2, 4, 2
    q = (rng.standard_normal((b, hq, lq, d)) * 1.3).astype(dtype)
    k = rng.standard_normal((b, hkv, lk, d)).astype(dtype)
    v = rng.standard_normal((b, hkv, lk, d)).astype(dtype)
    o = np.full((b, hq, lq, d), np.nan, dtype)
    lse = np.full((b, hq, lq), np.nan, np.float32)
    strides = np.array([s // 2 for x in (q, k, v, o) for s in x.strides[:3]], np.int64)
    scale_log2 = np.float32(d ** -0.5 * np.log2(np.e))
    lib.run(*(x.ctypes.data_as(ctypes.c_void_p) for x in (q, k, v, o, lse, strides)), ctypes.c_longlong(lq),
            *map(ctypes.c_int, (b, hq, hq // hkv, lq, lk)), ctypes.c_float(scale_log2))
    want, want_lse = emulate(fmt, q, k, v, causal=causal, return_lse=True, block_n=spec.tile.block_n)
    got = o.astype(np.float32)
    errors = compare(got, want.astype(np.float32))
    assert errors.nonfinite == 0 and errors.rel_l2 <= 1e-4, errors
    np.testing.assert_allclose(lse, want_lse, rtol=0, atol=1e-5)
    if causal and lq > lk:  # the first Lq - Lk rows see no key
        assert (got[:, :, :lq - lk] == 0).all() and np.isneginf(lse[:, :, :lq - lk]).all()
