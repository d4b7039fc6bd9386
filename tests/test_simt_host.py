"""The fp32 SIMT kernel body that CUDA and HIP share (templates/common/prefill_simt.j2), run on the CPU: the
body of the f32 and kv8-f32 specs, rendered under a host header instead of a GPU one (hip_offline.HOST_BLOCKS:
each thread of a block a std::thread, barriers and the lane exchange in their place), built by clang for the host without FMA contraction, and launched block by block over the
spec's grid. Its outputs and LSE are checked against the FP64 reference within the format's tolerance, on
shapes with tails, GQA, causal rows and queries past the keys, so the kernels' arithmetic is checked here
with no GPU at all (the GPU tests run the CUDA build; the HIP build is compiled offline only)."""
import ctypes

import numpy as np
import pytest

from qattn.check import reference
from qattn.engine.render import context, environment
from qattn.engine.spec import KernelSpec
from qattn.engine.tile import Tile
from qattn.formats.kv8.quant import quantize_kv_cache

from hip_offline import HOST_BLOCKS, HOST_FLAGS, HOST_SCALARS, HOST_SOFTMAX, host_library, needs_clang

pytestmark = needs_clang

LOG2E = np.float32(np.log2(np.e))

# What the shared body needs of a backend header beyond the host's block machinery and scalars (hip_offline's
# HOST_BLOCKS, HOST_SCALARS): the block's shared memory (one array the body declares extern), and the softmax step
# and LSE (HOST_SOFTMAX).
HOST_HEADER = HOST_BLOCKS + HOST_SCALARS + r"""
#undef __shared__
#define __shared__
#define QATTN_NEG_INF (-INFINITY)
{% include "common/rows.h.j2" %}
extern "C" { alignas(16) float fsmem[65536 / 4]; }  // the block's shared memory (the kernel names it extern "C")
QATTN_DEVICE void warp_sync() { block_sync(); }  // every thread of the body reaches it
QATTN_DEVICE void grid_dependency_wait() {}
""" + HOST_SOFTMAX

F32_ENTRY = r"""
extern "C" void run_f32(const float* q, const float* k, const float* v, float* o, float* lse, const i64* st,
                        int B, int Hq, int group, int Lq, int Lk, float scale_log2) {
    launch((Lq + BM - 1) / BM, Hq, B, THREADS, [=] {
        {{ name }}(q, k, v, o, lse, st[0], st[1], st[2], st[3], st[4], st[5], st[6], st[7], st[8], st[9], st[10], st[11],
                   st[12], Hq, group, Lq, Lk, scale_log2);
    });
}
"""

KV8_ENTRY = r"""
extern "C" void run_kv8(const float* q, const signed char* kc, const float* ksc, const signed char* vc,
                        const float* vsc, float* o, float* lse, const i64* st, int B, int Hq, int group, int Lq,
                        int Lk, float scale_log2) {
    launch((Lq + BM - 1) / BM, Hq, B, THREADS, [=] {
        {{ name }}(q, st[0], st[1], st[2], kc, st[3], st[4], st[5], ksc, st[6], st[7], vc, st[8], st[9], st[10], vsc,
                   st[11], st[12], o, st[13], st[14], st[15], lse, st[16], nullptr, Hq, group, Lq, Lk, scale_log2);
    });
}
"""


def _library(folder, spec: KernelSpec):
    """The spec's kernel body under the host header, with its driver, built for the host."""
    entry = F32_ENTRY if spec.recipe == "f32" else KV8_ENTRY
    text = ("{% extends template %}{% block prelude %}" + HOST_HEADER + "{% endblock %}")
    source = environment().from_string(text).render(template=spec.family.template, **context(spec))
    source += environment().from_string(entry).render(**context(spec))
    return host_library(folder, source, HOST_FLAGS)


def _ptr(x, ctype=ctypes.c_void_p):
    return x.ctypes.data_as(ctype)


def _inputs(rng, b, hq, hkv, lq, lk, d):
    q = rng.standard_normal((b, hq, lq, d)).astype(np.float32)
    k = rng.standard_normal((b, hkv, lk, d)).astype(np.float32)
    v = rng.standard_normal((b, hkv, lk, d)).astype(np.float32)
    return q, k, v


SHAPES = [  # (B, Hq, Hkv, Lq, Lk): tails past every block, GQA, fewer and more queries than keys
    (1, 2, 2, 45, 70),
    (2, 4, 2, 33, 33),
    (1, 2, 1, 70, 40),
]
CASES = [(fmt, d, causal, tile) for fmt, d, tile in (("f32", 32, None), ("f32", 64, Tile(16, 16, 4, 1)),
                                                     ("kv8-f32", 64, None))
         for causal in (False, True)]


@pytest.mark.parametrize("fmt, d, causal, tile", CASES, ids=[f"{c[0]}-d{c[1]}-{'causal' if c[2] else 'full'}"
                                                               f"{'-' + c[3].name if c[3] else ''}" for c in CASES])
def test_shared_simt_body_matches_fp64(tmp_path, fmt, d, causal, tile):
    spec = KernelSpec("prefill", fmt, d, tile, causal, "cuda", "sm_80")
    lib = _library(tmp_path, spec)
    rng = np.random.default_rng(d + causal)
    scale = 1 / np.sqrt(d)
    for b, hq, hkv, lq, lk in SHAPES:
        q, k, v = _inputs(rng, b, hq, hkv, lq, lk, d)
        o = np.full((b, hq, lq, d), np.nan, np.float32)  # poisoned: every row must be written
        lse = np.full((b, hq, lq), np.nan, np.float32)
        args = (ctypes.c_int(b), ctypes.c_int(hq), ctypes.c_int(hq // hkv), ctypes.c_int(lq), ctypes.c_int(lk),
                ctypes.c_float(np.float32(scale) * LOG2E))
        views = lambda *xs: [s // x.itemsize for x in xs for s in x.strides[:3]]  # noqa: E731
        if fmt == "f32":
            strides = np.array(views(q, k, v, o) + [lq], np.int64)
            lib.run_f32(_ptr(q), _ptr(k), _ptr(v), _ptr(o), _ptr(lse), _ptr(strides), *args)
            k_ref, v_ref = k.astype(np.float64), v.astype(np.float64)
        else:
            kq, vq = (quantize_kv_cache(x) for x in (k, v))
            kc, vc = (np.ascontiguousarray(c.codes) for c in (kq, vq))
            ks, vs = (np.ascontiguousarray(c.scales, np.float32) for c in (kq, vq))  # [B, Hkv, Lk]
            strides = np.array(views(q, kc) + [hkv * lk, lk] + views(vc) + [hkv * lk, lk] + views(o) + [lq], np.int64)
            lib.run_kv8(_ptr(q), _ptr(kc), _ptr(ks), _ptr(vc), _ptr(vs), _ptr(o), _ptr(lse), _ptr(strides), *args)
            k_ref = kc.astype(np.float64) * ks.astype(np.float64)[..., None]  # the cache's exact values
            v_ref = vc.astype(np.float64) * vs.astype(np.float64)[..., None]
        want, want_lse = reference.attention(q.astype(np.float64), k_ref, v_ref, causal=causal, scale=scale,
                                             return_lse=True)
        seen = np.isfinite(want_lse)  # causal rows before the first key see none: output 0, LSE -inf
        assert np.all(np.isfinite(o)), (b, hq, lq, lk)
        np.testing.assert_allclose(o[seen], want[seen], rtol=0, atol=2e-5 * np.abs(want).max())
        np.testing.assert_array_equal(o[~seen], 0)
        np.testing.assert_allclose(lse[seen], want_lse[seen], rtol=1e-5, atol=1e-5)
        assert np.all(lse[~seen] == -np.inf)
