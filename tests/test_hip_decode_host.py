"""The HIP decode kernel run on the CPU, matrix ops included: the module rendered for a HIP target under the host
stand-ins for its headers (hip_offline.host_hip_environment: a thread per GPU thread, each matrix op summed from the
wave's fragments as the target's layout places them, the target's own branches taken), built by clang for the host
and launched over the kernel's grid, then the merge's where the keys are split. Its output and LSE must be the
emulator's (decode.emulate) to the rounding of the last fp32 sums, on CDNA's wave64 layouts (gfx942; gfx90a's 8-bit
op), RDNA3's replicated one (gfx1100) and RDNA4's (gfx1201): the transform path and the 8-bit QK paths, GQA with
several new tokens, tails, splits, token and head scales, a pre-bias residual K, balancing, page means, post- and
pre-RoPE keys."""
import ctypes

import ml_dtypes
import numpy as np
import pytest

from qattn.check.metrics import compare
from qattn.engine.render import context
from qattn.engine.spec import KernelSpec
from qattn.formats.decode.emulate import emulate
from qattn.formats.decode.quant import HostPagedCache
from qattn.formats.decode.recipes import EMULATOR_REL_L2
from qattn.formats.decode.rope import RoPE

from hip_offline import HOST_FLAGS, host_hip_environment, host_library, needs_clang

pytestmark = needs_clang

DRIVER = r"""
{% for t in query_types %}
extern "C" void run_{{ t }}(const void* q, const unsigned char* k_pool, const unsigned char* v_pool, const float* k_scale,
                            const float* v_scale, const int* table, const float* k_bias, const unsigned char* k_mean,
                            const float* k_mean_scale, const int* lens, const float* k_balance, const u16* rope_table,
                            const float* rope_bias, int rotary_dim, int gptj, int max_positions, void* out, float* lse,
                            float* ws_o, float* ws_ml, const i64* st, int B, int Hq, int Hkv, int Lq, int table_stride,
                            int keys_per_split, float scale_log2, int splits, int row_blocks) {
    launch(splits, Hkv * row_blocks, B, THREADS, [=] {
        {{ name }}_{{ t }}((const {{ t }}*)q, k_pool, v_pool, k_scale, v_scale, table, k_bias, k_mean, k_mean_scale, lens,
            {% if k_balance == "on" %}k_balance, {% endif %}{% if k_rope != "off" %}rope_table, rope_bias, rotary_dim, gptj,
            max_positions, {% endif %}({{ t }}*)out, splits > 1 ? nullptr : lse, ws_o, ws_ml, st[0], st[1], st[2], st[3],
            st[4], st[5], B, Hq, Hkv, Lq, table_stride, keys_per_split, scale_log2);
    });
    if (splits > 1)
        launch(B * Hq * Lq, 1, 1, D, [=] {
            {{ name }}_merge_{{ t }}(ws_o, ws_ml, ({{ t }}*)out, lse, st[3], st[4], st[5], B, Hq, Lq, splits);
        });
}
{% endfor %}
"""

HKV, GROUP, LQ = 2, 4, 3
LENGTHS = (45, 70)  # tails on the 32-key tiles, and the lengths' own causal rows


def _library(folder, spec: KernelSpec):
    values = context(spec)
    eight = dict(spec.options).get("qk", "transform") != "transform"
    env = host_hip_environment(spec.arch, eight)
    source = env.get_template(spec.family.template).render(**values) + env.from_string(DRIVER).render(**values)
    return host_library(folder, source, HOST_FLAGS)


def _raw(values: np.ndarray, side: str) -> np.ndarray:
    """A pool's bytes from the host model's stored values."""
    dtype = {"f16": np.float16, "bf16": ml_dtypes.bfloat16, "e4m3": ml_dtypes.float8_e4m3fn, "i8": np.int8}[side]
    return np.ascontiguousarray(values.astype(dtype)).view(np.uint8)


def _ptr(x):
    return None if x is None else x.ctypes.data_as(ctypes.c_void_p)


def _cache(fmt, scale, options, rng, page, d):
    """A host cache of the two sequences (pages of `page` tokens, shuffled) and its block table."""
    k_side = fmt.split("-")[0]
    eight = k_side in ("e4m3", "i8")
    bias = (rng.standard_normal((HKV, d)) * 6).astype(np.float32) if options.get("bias") else None
    rope = RoPE(theta=1e4, rotary_dim=32 if options.get("rope") == "pre" else None, style="neox") \
        if options.get("rope") else None
    pages = sum(-(-n // page) for n in LENGTHS) + 1
    cache = HostPagedCache.empty(fmt, pages, page, HKV, d, scale=scale, k_bias=bias,
                                 k_mean="page" if options.get("mean") else "off",
                                 k_balance="calibrate" if options.get("balance") else None, rope=rope,
                                 k_bias_layout="pre-rope" if options.get("rope") == "pre" else "post-rope")
    order = rng.permutation(pages)
    table = np.full((len(LENGTHS), -(-max(LENGTHS) // page)), -1, np.int32)
    used = 0
    for b, n in enumerate(LENGTHS):
        count = -(-n // page)
        table[b, :count] = order[used:used + count]
        used += count
        k = rng.standard_normal((n, HKV, d)).astype(np.float32)
        if eight:
            k[..., 7] *= 20  # an outlier channel for balancing and the scales
        if bias is not None:
            k += bias[None]
        v = rng.standard_normal((n, HKV, d)).astype(np.float32)
        slots = table[b, np.arange(n) // page].astype(np.int64) * page + np.arange(n) % page
        cache.write(k, v, slots, scale=scale, positions=np.arange(n) if rope is not None and not cache.pre_rope else None)
    table[table < 0] = order[-1]  # (slots past a sequence: any page)
    return cache, table


CASES = [  # (target, format, qk, scale, options (page: page size, default 16; d: head dim, default 64), splits)
    ("gfx942", "f16-f16", "transform", "token", {}, 1),
    ("gfx1100", "e4m3-e4m3", "transform", "token", {}, 2),
    ("gfx1201", "i8-bf16", "transform", "head", {"bias": True}, 1),
    ("gfx942", "i8-i8", "int8", "token", {"mean": True, "balance": True}, 2),
    ("gfx1100", "i8-f16", "int8", "token", {"bias": True, "mean": True}, 1),
    ("gfx1201", "e4m3-e4m3", "fp8", "head", {"balance": True}, 2),
    ("gfx942", "e4m3-f16", "fp8", "token", {"bias": True, "rope": "post"}, 1),
    ("gfx1201", "i8-i8", "transform", "token", {"bias": True, "rope": "pre"}, 2),
    ("gfx1100", "e4m3-bf16", "transform", "token", {"bias": True, "rope": "post"}, 1),
    ("gfx90a", "i8-f16", "int8", "head", {"balance": True}, 2),
    ("gfx942", "i8-i8", "transform", "token", {"mean": True, "page": 64, "d": 128}, 2),  # a tile inside a page
    ("gfx1201", "e4m3-f16", "fp8", "token", {"mean": True, "page": 32, "d": 128}, 1),
]


@pytest.mark.parametrize("target, fmt, qk, scale, options, splits", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}-{'-'.join(c[4]) or 'plain'}-s{c[5]}" for c in CASES])
def test_hip_decode_runs_as_its_emulator(tmp_path, target, fmt, qk, scale, options, splits):
    rng = np.random.default_rng(len(fmt) + splits + len(options))
    page, d = options.get("page", 16), options.get("d", 64)
    cache, table = _cache(fmt, scale, options, rng, page, d)
    k_side, v_side = fmt.split("-")
    eight = k_side in ("e4m3", "i8")
    spec_options = {"page_size": page, "scale_mode": scale}
    if eight:
        spec_options |= {"qk": qk, "k_mean": "page" if options.get("mean") else "off",
                         "k_balance": "on" if options.get("balance") else "off",
                         "k_rope": options.get("rope", "off")}
    spec = KernelSpec(kind="decode", recipe=fmt, head_dim=d, backend="hip", arch=target, options=spec_options)
    lib = _library(tmp_path, spec)
    lens = np.array(LENGTHS, np.int32)
    b, hq = len(LENGTHS), HKV * GROUP
    half = ml_dtypes.bfloat16 if "bf16" in fmt else np.float16
    t = "bf16" if half is ml_dtypes.bfloat16 else "f16"
    q = (rng.standard_normal((b, hq, LQ, d)) * 1.5).astype(half)
    kps = -(-table.shape[1] * page // splits // 32) * 32  # whole 32-key tiles a split
    scale_log2 = np.float32(d ** -0.5 * np.log2(np.e))
    out = np.full((b, hq, LQ, d), np.nan, half)
    lse = np.full((b, hq, LQ), np.nan, np.float32)
    ws_o = np.zeros((splits, b, hq, LQ, d), np.float32)
    ws_ml = np.zeros((splits, b, hq, LQ, 2), np.float32)
    strides = np.array([x // 2 for x in q.strides[:3]] + [x // 2 for x in out.strides[:3]], np.int64)

    def scales(x):
        return np.zeros(1, np.float32) if x is None else np.ascontiguousarray(x, np.float32)

    rope = cache.rope
    row_bias = None if cache.k_bias is None else (cache.k_bias if rope is None else
                                                  np.where(np.arange(d) < rope.rotary_dim, 0, cache.k_bias))
    mean_codes = mean_scales = None
    if cache.k_mean is not None:
        mean_codes = np.ascontiguousarray(cache.k_mean.codes.astype(np.int8)).view(np.uint8)
        mean_scales = np.ascontiguousarray(cache.k_mean.scale, np.float32)
    args = [_ptr(q), _ptr(_raw(cache.k, k_side)), _ptr(_raw(cache.v, v_side)), _ptr(scales(cache.k_scale)),
            _ptr(scales(cache.v_scale)), _ptr(table), _ptr(None if row_bias is None else row_bias.astype(np.float32)),
            _ptr(mean_codes), _ptr(mean_scales), _ptr(lens), _ptr(cache.alpha),
            _ptr(None if rope is None else cache.rope_table.view(np.uint16)), _ptr(cache.k_bias),
            ctypes.c_int(0 if rope is None else rope.rotary_dim), ctypes.c_int(0 if rope is None else rope.gptj),
            ctypes.c_int(0 if rope is None else rope.max_positions), _ptr(out), _ptr(lse), _ptr(ws_o), _ptr(ws_ml),
            _ptr(strides), *map(ctypes.c_int, (b, hq, HKV, LQ, table.shape[1], kps)), ctypes.c_float(scale_log2),
            ctypes.c_int(splits), ctypes.c_int(-(-GROUP * LQ // spec.tile.block_m))]
    getattr(lib, f"run_{t}")(*args)
    want, want_lse = emulate(q, cache, table, lens, splits=splits, keys_per_split=kps, warps=1,
                             warp_keys=spec.tile.block_n, qk=qk, return_lse=True)
    got = out.astype(np.float32)
    assert not np.isnan(got).any() and not np.isnan(lse).any()
    errors = compare(got, want.astype(np.float32))
    # the emulator's partition and order: the outputs agree to the rounding of the last fp32 sums (an ulp of the
    # output type here and there), far inside the 1e-3 the GPU kernels must meet
    assert errors.rel_l2 <= EMULATOR_REL_L2 / 10, errors
    np.testing.assert_allclose(lse, want_lse, rtol=0, atol=1e-5)
