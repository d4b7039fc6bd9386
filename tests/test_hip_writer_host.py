"""The HIP decode module's cache writer (templates/hip/decode_write.hip.j2), run on the CPU: the writer rendered for
a HIP decode spec under a host stand-in for hip/common.h.j2 (hip_offline.HOST_BLOCKS) and the constants
decode_paged.hip.j2 gives it (waves of 64 or 32 lanes), built by clang for the host and launched over the writer's
grid. The pools and scales it leaves must be what decode.quant.HostPagedCache stores for the same tokens, bit for
bit: every K-V pairing of 16-bit, e4m3 and int8 sides, token and head scales, padding slots, fp16 and bf16 inputs
with strides, a pre-bias residual K (post-RoPE too) and an int8 K's channel balancing; and with page means
(k_mean "page"), over two writes, the page records, the running sums and the snapshot too."""
import ctypes

import numpy as np
import pytest

from qattn.check.quant import E4M3
from qattn.engine.arrays import numpy_dtype
from qattn.engine.render import context, environment
from qattn.engine.spec import KernelSpec
from qattn.formats.decode.quant import HostPagedCache, balance_factors, balance_inverse, head_scales

from hip_offline import HOST_BLOCKS, HOST_FLAGS, HOST_SCALARS, host_library, needs_clang

pytestmark = needs_clang

HOST_HEADER = HOST_BLOCKS + HOST_SCALARS + r"""
namespace {
constexpr int D = {{ head_dim }};
constexpr int PAGE = {{ page_size }};
constexpr int WAVE = {{ wave }};
constexpr int K_CODE = {{ {"16": 0, "e4m3": 1, "i8": 2}[k_code] }};
constexpr int V_CODE = {{ {"16": 0, "e4m3": 1, "i8": 2}[v_code] }};
constexpr int K_BYTES = K_CODE == 0 ? 2 : 1, V_BYTES = V_CODE == 0 ? 2 : 1;
constexpr bool TOKEN_SCALES = {{ "true" if scale_mode == "token" else "false" }};
}  // namespace
"""

DRIVER = r"""
// The writer's grid: blocks of WRITE_TOKENS tokens of one kv head, 32 * WRITE_GROUPS threads each.
extern "C" void write_tokens(int bf16, const u16* k, const u16* v, const i64* slots, unsigned char* k_pool,
                             unsigned char* v_pool, float* k_scale, float* v_scale, const float* k_head,
                             const float* v_head, const float* k_bias, const float* k_unbalance, u64* mean_sums,
                             unsigned char* k_mean, float* k_mean_scale, const u16* rope_table, const i64* positions,
                             int rotary_dim, int gptj, int max_positions, i64 k_t, i64 k_h, i64 v_t, i64 v_h, int T,
                             int Hkv, int pages) {
    unsigned char* mean_now = k_mean != nullptr ? k_mean + (i64)pages * Hkv * D : nullptr;  // the snapshot: last
    float* mean_now_scale = k_mean_scale != nullptr ? k_mean_scale + (i64)pages * Hkv : nullptr;
    launch((T + WRITE_TOKENS - 1) / WRITE_TOKENS, Hkv, 1, 32 * WRITE_GROUPS, [=] {
        auto entry = bf16 ? {{ name }}_write_bf16_i64 : {{ name }}_write_f16_i64;
        entry(k, v, slots, k_pool, v_pool, k_scale, v_scale, k_head, v_head, k_bias, mean_sums, k_mean, k_mean_scale,
              mean_now, mean_now_scale,{% if k_balance == "on" %} k_unbalance,{% endif %}
              {% if k_rope == "post" %} rope_table, positions, rotary_dim, gptj, max_positions,{% endif %}
              k_t, k_h, v_t, v_h, T, Hkv);
    });
}
"""

PAGES, PAGE_SIZE, KV_HEADS, T = 12, 16, 2, 40


def _library(folder, spec: KernelSpec, wave: int):
    text = HOST_HEADER + '{% include "hip/decode_write.hip.j2" %}' + DRIVER
    source = environment().from_string(text).render(wave=wave, **context(spec))
    return host_library(folder, source, HOST_FLAGS)


def _values(raw: np.ndarray, side: str) -> np.ndarray:
    """A pool's stored values as the host model holds them (as PagedKVCache.host reads them)."""
    if side in ("f16", "bf16"):
        data = raw.view(np.uint16)
        return (data.astype(np.uint32) << 16).view(np.float32) if side == "bf16" else \
            data.view(np.float16).astype(np.float32)
    return raw.view(E4M3 if side == "e4m3" else np.int8).astype(np.float32)


def _ptr(x):
    return None if x is None else x.ctypes.data_as(ctypes.c_void_p)


NO_ROPE = (None, None, ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0))  # the RoPE table, positions and ints


def _ints(k, v, tokens):
    """The writer's trailing integers: K's and V's token and head strides (elements), tokens, kv heads, pages."""
    return (*(ctypes.c_longlong(x.strides[i] // 2) for x in (k, v) for i in (0, 1)), ctypes.c_int(tokens),
            ctypes.c_int(KV_HEADS), ctypes.c_int(PAGES))


CASES = [  # (format, scale mode, K term)
    ("e4m3-e4m3", "token", None), ("i8-i8", "head", None), ("f16-i8", "token", None), ("e4m3-f16", "head", None),
    ("bf16-e4m3", "token", None), ("i8-bf16", "token", "bias"), ("i8-i8", "token", "balance"),
    ("e4m3-e4m3", "head", "bias"),
]


@pytest.mark.parametrize("wave", [64, 32])
@pytest.mark.parametrize("fmt, scale, term", CASES, ids=[f"{c[0]}-{c[1]}-{c[2] or 'plain'}" for c in CASES])
def test_hip_writer_stores_what_the_host_model_stores(tmp_path, wave, fmt, scale, term):
    k_side, v_side = fmt.split("-")
    options = {"page_size": PAGE_SIZE, "scale_mode": scale, **({"k_balance": "on"} if term == "balance" else {})}
    spec = KernelSpec(kind="decode", recipe=fmt, head_dim=64, backend="hip", arch="gfx942", options=options)
    lib = _library(tmp_path, spec, wave)
    d = spec.head_dim
    rng = np.random.default_rng(len(fmt) + wave)
    dtype = numpy_dtype("bfloat16" if "bf16" in fmt else "float16")
    # strided inputs: [T, Hkv, D] views of wider rows; a scale-type outlier channel and a large bias in K
    wide_k = (rng.standard_normal((T, KV_HEADS + 1, d)) * 1.5).astype(np.float32)
    wide_k[..., 5] *= 40
    k = wide_k.astype(dtype)[:, :KV_HEADS]
    v = rng.standard_normal((T, KV_HEADS, d)).astype(dtype)
    slots = rng.permutation(PAGES * PAGE_SIZE)[:T].astype(np.int64)
    slots[[3, 17]] = -1  # padding: written nowhere
    bias = (rng.standard_normal((KV_HEADS, d)) * 8).astype(np.float32) if term == "bias" else None
    alpha = balance_factors(np.asarray(k, np.float32)) if term == "balance" else None
    given = {}
    if scale == "head":  # the heads' scales, as a cache calibrates them from its first write
        x = np.asarray(k, np.float32) - (0 if bias is None else bias[None])
        for name, side, y in (("k_scale", k_side, x), ("v_scale", v_side, np.asarray(v, np.float32))):
            if side in ("e4m3", "i8"):
                given[name] = head_scales(y, side).astype(np.float32)
    host = HostPagedCache.empty(fmt, PAGES, PAGE_SIZE, KV_HEADS, d, scale, k_bias=bias, k_balance=alpha, **given)
    host.write(k, v, slots, scale=scale)

    pools = {side_name: np.full((PAGES, KV_HEADS, PAGE_SIZE, d * (2 if side in ("f16", "bf16") else 1)), 0xA5,
                                np.uint8) for side_name, side in (("k", k_side), ("v", v_side))}
    token_scales = {name: np.full((PAGES, KV_HEADS, PAGE_SIZE), np.nan, np.float32) for name in ("k", "v")}
    keep = slots >= 0
    before = {name: pools[name].copy() for name in pools}
    lib.write_tokens(ctypes.c_int(int(dtype.name == "bfloat16")), _ptr(k), _ptr(v), _ptr(slots), _ptr(pools["k"]),
                     _ptr(pools["v"]), _ptr(token_scales["k"]), _ptr(token_scales["v"]), _ptr(given.get("k_scale")),
                     _ptr(given.get("v_scale")), _ptr(bias),
                     _ptr(None if alpha is None else np.ascontiguousarray(balance_inverse(alpha), np.float32)),
                     None, None, None, *NO_ROPE, *_ints(k, v, T))
    pages, offsets = slots[keep] // PAGE_SIZE, slots[keep] % PAGE_SIZE
    for name, side in (("k", k_side), ("v", v_side)):
        got = _values(pools[name], side)
        np.testing.assert_array_equal(got[pages, :, offsets], getattr(host, name)[pages, :, offsets], err_msg=name)
        untouched = np.ones(PAGES * PAGE_SIZE, bool)
        untouched[slots[keep]] = False
        pu, ou = np.nonzero(untouched.reshape(PAGES, PAGE_SIZE))
        assert np.array_equal(pools[name][pu, :, ou], before[name][pu, :, ou]), name  # padding and other slots
        if scale == "token" and side in ("e4m3", "i8"):
            np.testing.assert_array_equal(token_scales[name][pages, :, offsets],
                                          getattr(host, f"{name}_scale")[pages, :, offsets], err_msg=name)


@pytest.mark.parametrize("wave", [64, 32])
@pytest.mark.parametrize("fmt, scale, term", [("i8-i8", "token", None), ("e4m3-e4m3", "token", "bias"),
                                              ("i8-f16", "token", "balance")], ids=lambda x: str(x))
def test_hip_page_mean_writer_stores_what_the_host_model_stores(tmp_path, wave, fmt, scale, term):
    """Two writes of two sequences in order (a prompt over several pages, then a step that ends one page and
    starts the next) under a K mean that drifts: codes, scales, the pages' records, the running sums and the
    snapshot bit for bit (integer sums: no order dependence, the last block re-encodes the snapshot)."""
    options = {"page_size": PAGE_SIZE, "scale_mode": scale, "k_mean": "page",
               **({"k_balance": "on"} if term == "balance" else {})}
    spec = KernelSpec(kind="decode", recipe=fmt, head_dim=64, backend="hip", arch="gfx942", options=options)
    lib = _library(tmp_path, spec, wave)
    d = spec.head_dim
    rng = np.random.default_rng(wave + len(fmt))
    dtype = numpy_dtype("bfloat16" if "bf16" in fmt else "float16")
    table = rng.permutation(PAGES)[:2 * (PAGES // 2)].reshape(2, -1)
    bias = (rng.standard_normal((KV_HEADS, d)) * 8).astype(np.float32) if term == "bias" else None
    host = None
    v_bytes = 1 if fmt.split("-")[1] in ("e4m3", "i8") else 2  # an 8-bit K: one byte
    pool = (PAGES, KV_HEADS, PAGE_SIZE)
    buffers = {"sums": np.zeros(KV_HEADS * (d + 1) + 1, np.int64), "codes": np.zeros((PAGES + 1, KV_HEADS, d), np.int8),
               "scale": np.zeros((PAGES + 1, KV_HEADS), np.float32), "k": np.zeros(pool + (d,), np.uint8),
               "v": np.zeros(pool + (d * v_bytes,), np.uint8), "ks": np.zeros(pool, np.float32),
               "vs": np.zeros(pool, np.float32)}
    for step, (lo, hi) in enumerate(((0, 37), (37, 49))):  # positions [lo, hi) of both sequences
        n = hi - lo
        pos = np.arange(lo, hi)
        slots = np.concatenate([table[b, pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE for b in range(2)])
        drift = (1 + step + pos / 10).astype(np.float32)[:, None, None]  # the channel mean moves over the sequence
        k = np.concatenate([(rng.standard_normal((n, KV_HEADS, d)) + 3 * drift) for _ in range(2)]).astype(dtype)
        v = rng.standard_normal((2 * n, KV_HEADS, d)).astype(dtype)
        if host is None:  # the first write seeds the snapshot (on the GPU a few CuPy launches, PagedKVCache)
            alpha = balance_factors(np.asarray(k, np.float32)) if term == "balance" else None
            host = HostPagedCache.empty(fmt, PAGES, PAGE_SIZE, KV_HEADS, d, scale, k_bias=bias, k_mean="page",
                                        k_balance=alpha)
            host.k_mean.seed(np.asarray(k, np.float32) - (0 if bias is None else bias[None]), slots)
            buffers["codes"][-1], buffers["scale"][-1] = host.k_mean.codes[-1], host.k_mean.scale[-1]
        host.write(k, v, slots, scale=scale)
        unbalance = None if alpha is None else np.ascontiguousarray(balance_inverse(alpha), np.float32)
        lib.write_tokens(ctypes.c_int(int(dtype.name == "bfloat16")), _ptr(k), _ptr(v), _ptr(slots.astype(np.int64)),
                         _ptr(buffers["k"]), _ptr(buffers["v"]), _ptr(buffers["ks"]), _ptr(buffers["vs"]), None, None,
                         _ptr(bias), _ptr(unbalance), _ptr(buffers["sums"]), _ptr(buffers["codes"]),
                         _ptr(buffers["scale"]), *NO_ROPE, *_ints(k, v, 2 * n))
        means = host.k_mean
        sums = buffers["sums"][:-1].reshape(KV_HEADS, d + 1)
        np.testing.assert_array_equal(sums[:, :-1], means.sums, err_msg=f"sums, write {step}")
        np.testing.assert_array_equal(sums[:, -1], means.counts, err_msg=f"counts, write {step}")
        assert buffers["sums"][-1] == 0  # the ticket, reset by the last block
        np.testing.assert_array_equal(buffers["codes"], means.codes, err_msg=f"records, write {step}")
        np.testing.assert_array_equal(buffers["scale"], means.scale, err_msg=f"record scales, write {step}")
        assert np.count_nonzero(means.scale[:-1]) >= 4  # pages started by the writes took records
        for name, side, scales in (("k", fmt.split("-")[0], "ks"), ("v", fmt.split("-")[1], "vs")):
            stored = slots // PAGE_SIZE, slots % PAGE_SIZE
            got = _values(buffers[name], side)
            np.testing.assert_array_equal(got[stored[0], :, stored[1]], getattr(host, name)[stored[0], :, stored[1]],
                                          err_msg=f"{name}, write {step}")
            if side in ("e4m3", "i8"):
                np.testing.assert_array_equal(buffers[scales][stored[0], :, stored[1]],
                                              getattr(host, f"{name}_scale")[stored[0], :, stored[1]])


@pytest.mark.parametrize("style, rotary_dim", [("neox", None), ("gptj", 32)])
@pytest.mark.parametrize("fmt", ["i8-i8", "e4m3-f16"])
def test_hip_rope_writer_stores_what_the_host_model_stores(tmp_path, fmt, style, rotary_dim):
    """Post-RoPE keys (k_rope "post"): K - R_p b with R_p b from the fp16 table at each token's position (positions
    past the table clamped to its last row), bit for bit the host model's, both pair layouts, a partial rotary."""
    from qattn.formats.decode.rope import RoPE

    spec = KernelSpec(kind="decode", recipe=fmt, head_dim=64, backend="hip", arch="gfx942",
                      options={"page_size": PAGE_SIZE, "scale_mode": "token", "k_rope": "post"})
    lib = _library(tmp_path, spec, 64)
    d = spec.head_dim
    rng = np.random.default_rng(len(style))
    bias = (rng.standard_normal((KV_HEADS, d)) * 20).astype(np.float32)
    rope = RoPE(theta=1e6, rotary_dim=rotary_dim, style=style, max_positions=300)
    host = HostPagedCache.empty(fmt, PAGES, PAGE_SIZE, KV_HEADS, d, k_bias=bias, rope=rope)
    k = (rng.standard_normal((T, KV_HEADS, d)) + bias[None]).astype(np.float16)
    v = rng.standard_normal((T, KV_HEADS, d)).astype(np.float16)
    slots = rng.permutation(PAGES * PAGE_SIZE)[:T].astype(np.int64)
    positions = rng.integers(0, 400, T).astype(np.int64)  # some past the table's 300 rows
    host.write(k, v, slots, positions=positions)
    resolved = host.rope
    table = np.ascontiguousarray(host.rope_table)
    pool = (PAGES, KV_HEADS, PAGE_SIZE)
    v_side = fmt.split("-")[1]
    pools = {"k": np.zeros(pool + (d,), np.uint8), "v": np.zeros(pool + (d * (2 if v_side == "f16" else 1),), np.uint8)}
    scales = {name: np.zeros(pool, np.float32) for name in ("k", "v")}
    lib.write_tokens(ctypes.c_int(0), _ptr(k), _ptr(v), _ptr(slots), _ptr(pools["k"]), _ptr(pools["v"]),
                     _ptr(scales["k"]), _ptr(scales["v"]), None, None, _ptr(bias), None, None, None, None,
                     _ptr(table), _ptr(positions), ctypes.c_int(resolved.rotary_dim), ctypes.c_int(int(resolved.gptj)),
                     ctypes.c_int(resolved.max_positions), *_ints(k, v, T))
    pages, offsets = slots // PAGE_SIZE, slots % PAGE_SIZE
    for name, side in (("k", fmt.split("-")[0]), ("v", v_side)):
        np.testing.assert_array_equal(_values(pools[name], side)[pages, :, offsets], getattr(host, name)[pages, :, offsets],
                                      err_msg=name)
        if side in ("e4m3", "i8"):
            np.testing.assert_array_equal(scales[name][pages, :, offsets], getattr(host, f"{name}_scale")[pages, :, offsets])
