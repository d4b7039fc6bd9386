"""The int8 KV-cache writer (kv8's common/kv8_write.j2) on HIP: compiled offline with clang-19 for the four targets,
and run on the CPU under the host stand-in for the HIP header (hip_offline.HOST_BLOCKS: a thread per GPU thread,
the lane exchange through an array), where its codes and scales must be quant.quantize_kv_cache's bit for bit:
fp32, fp16 and bf16 rows with strides, a token offset into a wider cache, rows of zeros, a non-finite V row that
marks its token's K scale NaN."""
import ctypes
import re

import ml_dtypes
import numpy as np
import pytest

from qattn.engine.compile import compile_hip_offline, disassemble, resource_remarks
from qattn.engine.family import HIP_ARCHS
from qattn.engine.render import environment
from qattn.formats.kv8 import cache as kvcache
from qattn.formats.kv8.quant import quantize_kv_cache

from hip_offline import HOST_BLOCKS, HOST_FLAGS, HOST_SCALARS, host_library, needs_clang

pytestmark = needs_clang

KINDS = ("f32", "f16", "bf16")


def test_writer_source_names_its_backend():
    assert "__shfl_xor_sync" in kvcache.writer_source("cuda") and "__builtin_amdgcn" in kvcache.writer_source("hip")
    with pytest.raises(ValueError, match="^backend: expected one of cuda, hip, got 'metal'"):
        kvcache.writer_source("metal")


def test_the_writer_a_hip_call_builds_is_the_hip_one(tmp_path):
    """`qattn compile --backend hip` builds kv8's cache writer beside its kernels (the family's companions): for a HIP
    target the HIP source, compiled offline and cached under the target's name."""
    from qattn.engine.cache import KernelCache

    store = KernelCache(tmp_path)
    data, meta = kvcache.build_writer("gfx942", store)
    assert data[:4] == b"\x7fELF" and meta["name"] == "kv8_write_gfx942" and meta["compiler"] == "clang-offline"
    assert "--offload-arch=gfx942" in meta["options"] and meta["resources"]["registers"] > 0
    assert kvcache.build_writer("gfx942", store) == (data, meta)  # from the cache
    assert "__builtin_amdgcn" in next(tmp_path.rglob("source.*")).read_text()


@pytest.mark.parametrize("arch", HIP_ARCHS)
def test_hip_writer_compiles(arch):
    """Each input type's entry: a 32-lane max by lane exchanges, the IEEE division, rint; nothing in scratch."""
    binary = compile_hip_offline(kvcache.writer_source("hip"), arch, "kv8_write")
    remarks = resource_remarks(binary.log)
    funcs = disassemble(binary.data, "hip")
    for kind in KINDS:
        r = remarks[f"{kvcache.WRITER_NAME}_{kind}"]
        assert r["ScratchSize"] == 0 and r["VGPRs Spill"] == 0 and 0 < r["VGPRs"] <= 128, (kind, r)
    assert len(re.findall(r"\bds_bpermute_b32\b", funcs)) == 5 * len(KINDS)  # masks 16, 8, 4, 2, 1
    assert "v_div_fixup_f32" in funcs and "v_rndne_f32" in funcs
    assert not re.search(r"v_(mfma|wmma)", funcs)


# ---- run on the host ------------------------------------------------------------------------------------

HOST_HEADER = HOST_BLOCKS + HOST_SCALARS + r"""
{% include "common/rows.h.j2" %}
"""

DRIVER = r"""
extern "C" void quantize_rows(int kind, const void* x, const i64* x_st, signed char* codes, const i64* c_st, float* scales,
                              float* k_scales, i64 s_b, i64 s_h, int B, int H, int n, int D, int offset) {
    const int rows = B * H * n;
    launch((rows + WARPS - 1) / WARPS, 1, 1, 32 * WARPS, [=] {
        auto entry = kind == 0 ? {{ name }}_f32 : kind == 1 ? {{ name }}_f16 : {{ name }}_bf16;
        entry(x, x_st[0], x_st[1], x_st[2], codes, c_st[0], c_st[1], c_st[2], scales, k_scales, s_b, s_h, B, H, n, D,
              offset);
    });
}
"""


@pytest.fixture(scope="module")
def host_writer(tmp_path_factory):
    env = environment()
    values = dict(name=kvcache.WRITER_NAME, warps=kvcache.WRITER_WARPS, ln2="0.6931471805599453",
                  log2e="1.4426950408889634")
    source = env.get_template(kvcache.WRITER_TEMPLATE).render(header=env.from_string(HOST_HEADER), **values)
    source += env.from_string(DRIVER).render(**values)
    return host_library(tmp_path_factory.mktemp("kv8_write"), source, HOST_FLAGS)


def _ptr(a):
    return None if a is None else a.ctypes.data_as(ctypes.c_void_p)


def _el(a: np.ndarray, dims: int = 3) -> np.ndarray:
    return np.array([s // a.itemsize for s in a.strides[:dims]], np.int64)


@pytest.mark.parametrize("kind", KINDS)
def test_host_run_codes_what_quantize_kv_cache_codes(host_writer, kind):
    rng = np.random.default_rng(KINDS.index(kind))
    b, h, n, d, capacity, offset = 2, 3, 13, 64, 24, 5
    dtype = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}[kind]
    wide = (rng.standard_normal((b, h + 1, n, d + 8)) * rng.uniform(0.01, 30, (b, h + 1, n, 1))).astype(dtype)
    k = wide[:, :h, :, :d]  # strided rows: a wider head axis and padded channels
    k[0, 1, 4] = 0  # a row of zeros: scale 0, codes 0
    v = rng.standard_normal((b, h, n, d)).astype(dtype)
    v[1, 2, 7, 3] = np.inf  # a non-finite V row: its scale and its token's K scale NaN
    codes = {name: np.full((b, h, capacity, d), 99, np.int8) for name in ("k", "v")}
    scales = {name: np.full((b, h, capacity), -1.0, np.float32) for name in ("k", "v")}
    for name, x, mark in (("k", k, None), ("v", v, scales["k"])):
        host_writer.quantize_rows(KINDS.index(kind), _ptr(x), _ptr(_el(x)), _ptr(codes[name]), _ptr(_el(codes[name])),
                          _ptr(scales[name]), _ptr(mark), *map(ctypes.c_longlong, _el(scales[name], 2)),
                          *map(ctypes.c_int, (b, h, n, d, offset)))
    for name, x in (("k", k), ("v", v)):
        with np.errstate(invalid="ignore"):
            want = quantize_kv_cache(np.asarray(x, np.float32))
        rows = slice(offset, offset + n)
        finite = np.isfinite(want.scales)
        np.testing.assert_array_equal(codes[name][:, :, rows][finite], want.codes[finite])
        expected = np.where(finite, want.scales, np.float32(np.nan))  # a non-finite row: NaN, never an Inf scale
        if name == "k":
            expected[1, 2, 7] = np.nan  # marked by the V pass
        np.testing.assert_array_equal(scales[name][:, :, rows], expected)
        untouched = np.ones(capacity, bool)
        untouched[rows] = False
        assert (codes[name][:, :, untouched] == 99).all() and (scales[name][:, :, untouched] == -1).all()
    assert np.isnan(scales["v"][1, 2, offset + 7]) and np.isnan(scales["k"][1, 2, offset + 7])
    assert scales["k"][0, 1, offset + 4] == 0 and (codes["k"][0, 1, offset + 4] == 0).all()
