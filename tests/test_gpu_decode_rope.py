"""The pre-bias residual K under RoPE (rope=qattn.RoPE(...)) on the GPU, post-RoPE keys and pre-RoPE keys: the
writer's bytes against the host model, every QK path against its emulator (rel_l2 1e-3) over formats, GQA, Lq,
tails, page sizes, styles and partial rotary, with and without page means and balancing (post-RoPE), the
bias_rope preset against FP64 on the original K/V, and a decode step in a CUDA graph."""
from __future__ import annotations

import numpy as np
import pytest

import qattn
from decode_steps import assert_stored_alike, decode_over_splits, replay_decode_steps, write_in_parts
import qattn.data
from qattn.check import metrics
from qattn.formats.decode import emulate as emu
from qattn.formats.decode.quant import HostPagedCache

pytestmark = pytest.mark.gpu
EMU_REL_L2 = 1e-3


def _dtype(fmt: str):
    import ml_dtypes

    return ml_dtypes.bfloat16 if "bf16" in fmt else np.float16


def _rope_filled(fmt, *, lens, rope, kv_heads=2, head_dim=128, page_size=16, scale="token", k_mean="off",
                 k_balance=None, seed=0, slot_dtype=np.int32, layout="post-rope"):
    """A GPU cache of the residual K under RoPE and its host model written alike: K = RoPE(N(0,1) + b) with a
    large b (its norm 30x the token-varying part's), rotated by data._rotate at the positions 0..L-1 (the
    post-RoPE keys written with their positions, or the keys before RoPE for layout "pre-rope"), every
    sequence's prompt (its first quarter) in one write and then 64 tokens of each sequence a write (pages
    shuffled); plus the table, the lengths and the original (rotated) K and V per sequence."""
    from qattn.data import _rotate

    rng = np.random.default_rng(seed)
    k_side, v_side = fmt.split("-")
    max_pages = max(-(-int(n) // page_size) for n in lens) + 1
    num_pages = len(lens) * max_pages + 3
    bias = rng.standard_normal((kv_heads, head_dim)).astype(np.float32)
    bias *= 30 * np.sqrt(head_dim) / np.linalg.norm(bias, axis=-1, keepdims=True)
    options = dict(k_bias=bias, k_mean=k_mean, k_balance=k_balance, rope=rope, k_bias_layout=layout)
    post = layout == "post-rope"
    cache = qattn.PagedKVCache(num_pages, page_size, kv_heads, head_dim, k=k_side, v=v_side, scale=scale, **options)
    host = HostPagedCache.empty(fmt, num_pages, page_size, kv_heads, head_dim, scale, **options)
    table = rng.permutation(num_pages)[:len(lens) * max_pages].reshape(len(lens), max_pages).astype(np.int32)
    dtype = _dtype(fmt)
    ks, stored, vs, slots = [], [], [], []
    for b, n in enumerate(lens):
        pre = rng.standard_normal((kv_heads, n, head_dim)).astype(np.float32) + bias[:, None]
        rotated = pre.copy()
        dim = rope.rotary_dim or head_dim  # the data's own RoPE (neox, fp32 cos/sin), on the rotary channels
        if rope.style == "neox":
            rotated[..., :dim] = _rotate(pre[..., :dim], np.arange(n), rope.theta)
        else:  # gptj pairs (2i, 2i + 1) as neox pairs of the de-interleaved channels
            order = np.concatenate([np.arange(0, dim, 2), np.arange(1, dim, 2)])
            rotated[..., order] = _rotate(pre[..., order], np.arange(n), rope.theta)
        ks.append(rotated.transpose(1, 0, 2).astype(dtype))
        stored.append((rotated if post else pre).transpose(1, 0, 2).astype(dtype))
        vs.append(rng.standard_normal((n, kv_heads, head_dim)).astype(dtype))
        slots.append((table[b, np.arange(n) // page_size] * page_size + np.arange(n) % page_size).astype(slot_dtype))
    write_in_parts(cache, host, stored, vs, slots, scale=scale, positions=post)
    return (cache, host, table, np.asarray(lens, np.int32), [k.astype(np.float64).transpose(1, 0, 2) for k in ks],
            [v.astype(np.float64).transpose(1, 0, 2) for v in vs])


@pytest.mark.parametrize("fmt, scale, rope, k_mean, balance, slot_dtype", [
    ("i8-i8", "token", qattn.RoPE(), "off", None, np.int32),
    ("e4m3-e4m3", "token", qattn.RoPE(rotary_dim=32, style="gptj"), "off", None, np.int64),
    ("i8-f16", "head", qattn.RoPE(theta=1e6), "page", None, np.int32),
    ("e4m3-bf16", "token", qattn.RoPE(rotary_dim=48), "page", "calibrate", np.int64)])
def test_rope_writer_stores_what_the_host_model_stores(fmt, scale, rope, k_mean, balance, slot_dtype):
    """K - R_p b (fp32 from the table's fp16 cos/sin), its codes and scales are the host model's bit for bit."""
    cache, host, *_ = _rope_filled(fmt, lens=[45, 300, 130], rope=rope, head_dim=64, scale=scale, k_mean=k_mean,
                                   k_balance=balance, slot_dtype=slot_dtype)
    got = cache.host()
    np.testing.assert_array_equal(got.rope_table, host.rope_table)
    assert_stored_alike(got, host)


@pytest.mark.parametrize("fmt, path", [("i8-i8", "transform"), ("i8-i8", "int8"), ("e4m3-e4m3", "transform"),
                                       ("e4m3-e4m3", "fp8"), ("i8-f16", "int8"), ("e4m3-bf16", "transform"),
                                       ("i8-bf16", "transform")])
@pytest.mark.parametrize("head_dim, group, lq, page_size, rope", [
    (128, 4, 1, 16, qattn.RoPE()), (64, 8, 2, 32, qattn.RoPE(rotary_dim=32, style="gptj")),
    (128, 1, 5, 64, qattn.RoPE(theta=1e6, rotary_dim=64)), (256, 4, 3, 128, qattn.RoPE(style="gptj"))])
@pytest.mark.parametrize("terms", ["alone", "mean+balance"])
def test_rope_decode_matches_emulator(fmt, path, head_dim, group, lq, page_size, rope, terms):
    """Post-RoPE decode over tails (a sequence of 1 + lq keys, lengths off the page and step grid), one, three
    and automatic splits, into NaN-poisoned outputs, alone or with page means and balancing: within rel_l2 1e-3
    of the emulator, its LSE too, and (int8 K, transform path) within rel_l2 2e-2 of FP64 on the original K/V
    (a plain int8 K: ~6e-2)."""
    extra = {} if terms == "alone" else {"k_mean": "page", "k_balance": "calibrate"}
    cache, host, table, lens, ks, vs = _rope_filled(fmt, lens=[1 + lq, 777, 2100], rope=rope, head_dim=head_dim,
                                                    page_size=page_size, **extra)
    rng = np.random.default_rng(1)
    q = rng.standard_normal((3, 2 * group, lq, head_dim)).astype(_dtype(fmt))
    dense = emu.reference_dense(q, ks, vs)
    for splits, got in decode_over_splits(q, cache, host, table, lens, qk=path):
        if path == "transform" and "i8" in fmt.split("-")[0]:
            assert metrics.compare(got, dense).rel_l2 < 2e-2, (splits, metrics.compare(got, dense))


@pytest.mark.parametrize("fmt, path", [("i8-i8", "transform"), ("e4m3-e4m3", "transform"), ("i8-f16", "transform"),
                                       ("e4m3-bf16", "transform")])
@pytest.mark.parametrize("head_dim, group, lq, page_size, rope", [
    (128, 4, 1, 16, qattn.RoPE()), (64, 8, 2, 32, qattn.RoPE(rotary_dim=32, style="gptj")),
    (128, 1, 5, 64, qattn.RoPE(theta=1e6, rotary_dim=64)), (256, 4, 3, 128, qattn.RoPE(style="gptj"))])
def test_pre_rope_decode_matches_emulator(fmt, path, head_dim, group, lq, page_size, rope):
    """Pre-RoPE keys (k_pre - b stored, codes turned on chip): the writer's bytes are the host model's, and decode
    over tails, one, three and automatic splits is within rel_l2 1e-3 of the emulator (its LSE too)."""
    import cupy

    cache, host, table, lens, ks, vs = _rope_filled(fmt, lens=[1 + lq, 777, 2100], rope=rope, head_dim=head_dim,
                                                    page_size=page_size, layout="pre-rope")
    np.testing.assert_array_equal(cache.host().k, host.k)
    rng = np.random.default_rng(2)
    q = rng.standard_normal((3, 2 * group, lq, head_dim)).astype(_dtype(fmt))
    decode_over_splits(q, cache, host, table, lens, emu_qk=path)  # the call's default path
    with pytest.raises(ValueError, match="^qk: the pre-RoPE residual K"):
        qattn.decode(cupy.asarray(q), cache, cupy.asarray(table), cupy.asarray(lens),
                     qk="int8" if fmt.startswith("i8") else "fp8")


@pytest.mark.parametrize("fmt, control", [("i8-i8", "f16-i8"), ("e4m3-e4m3", "f16-e4m3")])
def test_bias_rope_preset_on_the_gpu(fmt, control):
    """The bias_rope preset through tools/parity's check: plain K8 several times worse than K16/V8 against the
    original K/V, both residual layouts within 2x of the format's N(0,1) error, the kernel within the format's
    tolerance of FP64 on the cache."""
    from qattn.formats.decode.parity import check

    def run(f, **options):
        record = check(f, 2048, 1, backend="cuda", batch=2, heads=8, kv_heads=2, head_dim=128, time_it=False,
                       qk="transform", **options)
        assert record["passed"], record
        return record["format_rel_l2"]

    plain, k16 = run(fmt, source="bias_rope"), run(control, source="bias_rope")
    post, pre = (run(fmt, source="bias_rope", k_rope=layout) for layout in ("post", "pre"))
    normal = run(fmt)
    assert plain > 4 * k16 and post < 2 * normal and pre < 2 * normal, (plain, k16, post, pre, normal)


def test_cuda_graph_capture_of_a_rope_decode_step():
    """write (with positions) + decode on a post-RoPE cache captured once and replayed as tokens arrive: every
    replay equals a fresh call and the emulator; the stored codes are the host model's."""
    cache, host, table, lens, *_ = _rope_filled("i8-i8", lens=[60, 95], rope=qattn.RoPE(theta=1e6), kv_heads=2,
                                                head_dim=128)
    replay_decode_steps(cache, host, table, lens, kv_heads=2, head_dim=128, qk="transform", page_size=16,
                        positions=True, new_k=lambda rng, shape: rng.standard_normal(shape) + 20)


@pytest.mark.parametrize("call, words", [
    (lambda c, k, s: c.write(k, k, s), "positions: a cache of post-RoPE keys needs each token's position"),
    (lambda c, k, s: c.write(k, k, s, positions=s.astype("int64")), "positions: expected int32"),
])
def test_rope_writes_check_positions(call, words):
    import cupy

    cache = qattn.PagedKVCache(4, 16, 2, 64, k="i8", v="i8", k_bias=np.ones((2, 64)), rope=qattn.RoPE())
    k = cupy.zeros((3, 2, 64), cupy.float16)
    with pytest.raises(ValueError, match=f"^{words}"):
        call(cache, k, cupy.arange(3, dtype=cupy.int32))
