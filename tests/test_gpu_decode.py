"""Decode over paged K-V caches on the GPU: the writer's bytes against the host model, every format
against its emulator (rel_l2 1e-3) and FP64, splits, GQA, speculative rows, page sizes, NaN-poisoned
outputs, and a decode step (write + decode) captured in a CUDA graph."""
from __future__ import annotations

import numpy as np
import pytest

import qattn
from decode_steps import assert_stored_alike, decode_over_splits, replay_decode_steps, write_in_parts
from qattn.check import metrics
from qattn.formats.decode import emulate as emu
from qattn.formats.decode.quant import HostPagedCache
from qattn.formats.decode.recipes import FORMATS, qk_paths, tolerance

pytestmark = pytest.mark.gpu
EMU_REL_L2 = 1e-3


def _dtype(fmt: str):
    import ml_dtypes

    return ml_dtypes.bfloat16 if "bf16" in fmt else np.float16


def _filled(fmt, *, batch, kv_heads, head_dim, lens, page_size=32, scale="token", seed=0, spare_pages=7):
    """A GPU cache and its host model, written with the same tokens (pages shuffled), plus the table
    and the original K/V per sequence."""
    import cupy

    rng = np.random.default_rng(seed)
    k_side, v_side = fmt.split("-")
    max_pages = max(-(-int(n) // page_size) for n in lens) + 1
    num_pages = batch * max_pages + spare_pages
    cache = qattn.PagedKVCache(num_pages, page_size, kv_heads, head_dim, k=k_side, v=v_side, scale=scale)
    host = HostPagedCache.empty(fmt, num_pages, page_size, kv_heads, head_dim, scale)
    table = rng.permutation(num_pages)[:batch * max_pages].reshape(batch, max_pages).astype(np.int32)
    dtype = _dtype(fmt)
    ks, vs = [], []
    for b, n in enumerate(lens):
        k = (rng.standard_normal((n, kv_heads, head_dim)) * 1.5).astype(dtype)
        v = rng.standard_normal((n, kv_heads, head_dim)).astype(dtype)
        slots = (table[b, np.arange(n) // page_size] * page_size + np.arange(n) % page_size).astype(np.int64)
        for lo in range(0, n, 700):  # a prompt, then pieces, as an engine fills it
            part = slice(lo, min(n, lo + 700))
            cache.write(cupy.asarray(k[part]), cupy.asarray(v[part]), cupy.asarray(slots[part]))
            host.write(k[part], v[part], slots[part], scale=scale)
        ks.append(k.astype(np.float64).transpose(1, 0, 2))
        vs.append(v.astype(np.float64).transpose(1, 0, 2))
    return cache, host, table, np.asarray(lens, np.int32), ks, vs


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scale", ["token", "head"])
def test_writer_stores_what_the_host_model_stores(fmt, scale):
    if fmt.count("16") == 2 and scale == "head":
        pytest.skip("no 8-bit side: no scales")
    cache, host, *_ = _filled(fmt, batch=2, kv_heads=2, head_dim=64, lens=[45, 130], page_size=16, scale=scale)
    got = cache.host()
    for side in ("k", "v"):
        np.testing.assert_array_equal(getattr(got, side), getattr(host, side))
        want = getattr(host, f"{side}_scale")
        if want is not None:
            np.testing.assert_array_equal(getattr(got, f"{side}_scale"), want)


@pytest.mark.parametrize("fmt", ["e4m3-e4m3", "i8-i8", "bf16-e4m3", "e4m3-bf16", "i8-bf16", "f16-f16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("scale", ["token", "head"])
def test_writer_codes_every_magnitude_as_the_host_model(fmt, head_dim, scale):
    """Rows of every magnitude (bf16 from 2^-110 to 2^60, whose tiniest scales take the exact division's
    slow path; fp16 from 2^-22 to 2^10, with subnormals), zeros of both signs, a prompt's aligned groups and
    scattered single tokens, contiguous inputs and inputs whose head stride is odd (one load per channel):
    the writer's bytes are the host model's."""
    import cupy

    if fmt.count("16") == 2 and scale == "head":
        pytest.skip("no 8-bit side: no scales")
    rng = np.random.default_rng(head_dim)
    dtype, kv_heads, page_size, tokens = _dtype(fmt), 2, 32, 75
    lo, hi = (-110, 60) if dtype != np.float16 else (-22, 10)
    num_pages = 8
    cache = qattn.PagedKVCache(num_pages, page_size, kv_heads, head_dim, k=fmt.split("-")[0], v=fmt.split("-")[1],
                               scale=scale)
    host = HostPagedCache.empty(fmt, num_pages, page_size, kv_heads, head_dim, scale)

    def rows(n):  # [n, kv_heads, head_dim + 1]: the last channel pads the head stride to an odd count
        x = rng.standard_normal((n, kv_heads, head_dim + 1)) * 2.0 ** rng.integers(lo, hi, (n, kv_heads, 1))
        x[rng.random(x.shape) < 0.05] = 0.0
        x[rng.random(x.shape) < 0.05] = -0.0
        return x.astype(dtype)

    prompt = np.arange(64, 64 + tokens, dtype=np.int64)  # pages 2 and 3, then a tail of 11 tokens on page 4
    second = np.arange(5 * page_size, 6 * page_size, dtype=np.int64)
    singles = rng.choice(np.arange(6 * page_size, num_pages * page_size), 6, replace=False).astype(np.int64)
    for slots, odd_stride in ((prompt, False), (second, True), (singles, True)):
        k, v = rows(len(slots)), rows(len(slots))
        if odd_stride:
            k_in, v_in = (cupy.asarray(x)[:, :, :head_dim] for x in (k, v))
        else:
            k_in, v_in = (cupy.asarray(np.ascontiguousarray(x[:, :, :head_dim])) for x in (k, v))
        cache.write(k_in, v_in, cupy.asarray(slots))
        host.write(k[:, :, :head_dim], v[:, :, :head_dim], slots, scale=scale)
    got = cache.host()
    for side in ("k", "v"):
        np.testing.assert_array_equal(getattr(got, side), getattr(host, side), err_msg=side)
        want = getattr(host, f"{side}_scale")
        if want is not None:
            np.testing.assert_array_equal(getattr(got, f"{side}_scale"), want, err_msg=f"{side}_scale")


@pytest.mark.parametrize("fmt, k_mean, odd_stride", [("e4m3-e4m3", "off", False), ("i8-i8", "page", False),
                                                     ("bf16-e4m3", "off", True), ("f16-f16", "off", False),
                                                     ("i8-f16", "off", True)])
def test_writer_codes_a_long_prompt_with_broken_groups(fmt, k_mean, odd_stride):
    """A write of 30005 tokens (far more blocks than the SMs hold at once): whole 16-token groups (a prompt,
    pages shuffled) between broken ones (slots swapped or padded) and a tail, from contiguous inputs or inputs
    whose head stride is odd (one load per channel); the bytes (and with page means the sums and records) are
    the host model's."""
    import cupy

    rng = np.random.default_rng(11)
    dtype, kv_heads, head_dim, page_size, tokens = _dtype(fmt), 8, 64, 32, 30005
    num_pages = -(-tokens // page_size) + 1
    k_side, v_side = fmt.split("-")
    cache = qattn.PagedKVCache(num_pages, page_size, kv_heads, head_dim, k=k_side, v=v_side, k_mean=k_mean)
    host = HostPagedCache.empty(fmt, num_pages, page_size, kv_heads, head_dim, "token", k_mean=k_mean)
    order = rng.permutation(num_pages)[np.arange(tokens) // page_size]
    slots = (order * page_size + np.arange(tokens) % page_size).astype(np.int64)
    broken = 16 * rng.choice(tokens // 16, 40, replace=False)[:, None] + rng.choice(np.arange(1, 16), (40, 2))
    if k_mean == "page":  # padding (never a page's first token: a write that starts a page holds it in order)
        slots[broken.ravel()] = -1
    else:  # two slots swapped, and padding anywhere
        slots[broken] = slots[broken[:, ::-1]]
        slots[rng.choice(tokens, 25, replace=False)] = -1
    width = head_dim + 1 if odd_stride else head_dim
    k = (rng.standard_normal((tokens, kv_heads, width)) * 2.0 + 3.0).astype(dtype)
    v = rng.standard_normal((tokens, kv_heads, width)).astype(dtype)
    cache.write(cupy.asarray(k)[:, :, :head_dim], cupy.asarray(v)[:, :, :head_dim], cupy.asarray(slots))
    k, v = k[:, :, :head_dim], v[:, :, :head_dim]
    host.write(k, v, slots)
    got = cache.host()
    for side in ("k", "v", "k_scale", "v_scale"):
        want = getattr(host, side)
        if want is not None:
            np.testing.assert_array_equal(getattr(got, side), want, err_msg=side)
    if k_mean == "page":
        for field in ("codes", "scale", "sums", "counts"):
            np.testing.assert_array_equal(getattr(got.k_mean, field), getattr(host.k_mean, field), err_msg=field)


@pytest.mark.parametrize("fmt", ["bf16-e4m3", "e4m3-bf16", "i8-bf16", "bf16-i8"])
@pytest.mark.parametrize("given", [2.0 ** -64, float.fromhex("0x1.fffffep-64"), 1.1875 * 2.0 ** -40])
def test_writer_codes_overflowing_quotients_under_a_given_head_scale(fmt, given):
    """bf16 rows up to 2^127 over a tiny given head scale: quotients past the float range and just below it
    (saturated: 448, 127) and ordinary ones in the same rows, a bf16 Inf among them (e4m3's NaN code)."""
    import cupy

    rng = np.random.default_rng(7)
    dtype, kv_heads, head_dim, page_size, tokens = _dtype(fmt), 2, 128, 16, 40
    side = "v" if fmt.startswith("bf16") else "k"  # the 8-bit side
    cache = qattn.PagedKVCache(4, page_size, kv_heads, head_dim, k=fmt.split("-")[0], v=fmt.split("-")[1],
                               scale="head", **{f"{side}_scale": given})
    host = HostPagedCache.empty(fmt, 4, page_size, kv_heads, head_dim, "head",
                                **{f"{side}_scale": [given] * kv_heads})
    x = rng.standard_normal((2, tokens, kv_heads, head_dim)) * 2.0 ** rng.integers(-20, 124, (2, tokens, kv_heads, 1))
    # next to the overflow threshold, and far past it
    x[:, :, :, :4] = [1.9921875 * 2.0 ** 63, -1.9921875 * 2.0 ** 64, 1.9921875 * 2.0 ** 62, 2.0 ** 127]
    x[:, 3, 1, 7] = -np.inf
    k, v = x.astype(dtype)
    others = np.setdiff1d(np.arange(4 * page_size), np.arange(page_size, 2 * page_size))
    scattered = rng.choice(others, tokens - page_size, replace=False)
    slots = np.concatenate([np.arange(page_size, 2 * page_size), scattered]).astype(np.int64)  # one aligned group
    cache.write(cupy.asarray(k), cupy.asarray(v), cupy.asarray(slots))
    host.write(k, v, slots, scale="head")
    got = cache.host()
    assert np.isinf(x.astype(dtype).astype(np.float32) / np.float32(given)).any()  # the case is exercised
    np.testing.assert_array_equal(getattr(got, side), getattr(host, side))


@pytest.mark.parametrize("fmt", ["f16-f16", "bf16-bf16", "e4m3-e4m3", "i8-i8", "e4m3-f16", "f16-e4m3", "i8-bf16",
                                 "bf16-i8"])
@pytest.mark.parametrize("head_dim, group, lq, page_size", [(128, 4, 1, 32), (64, 8, 2, 16), (128, 1, 5, 64),
                                                            (256, 4, 1, 128), (128, 8, 4, 32)])
@pytest.mark.parametrize("path", ["transform", "8-bit"])
def test_decode_matches_emulator_and_fp64(fmt, head_dim, group, lq, page_size, path):
    if path == "8-bit":
        if len(qk_paths(fmt)) == 1:
            pytest.skip("a 16-bit K has no 8-bit QK path")
        path = qk_paths(fmt)[1]

    lens = [1 + lq, 777, 2100]
    cache, host, table, lens, ks, vs = _filled(fmt, batch=3, kv_heads=2, head_dim=head_dim, lens=lens,
                                               page_size=page_size)
    rng = np.random.default_rng(1)
    q = rng.standard_normal((3, 2 * group, lq, head_dim)).astype(_dtype(fmt))
    tol = tolerance(fmt, path)
    ref = emu.reference(q, host, table, lens)
    for splits, got in decode_over_splits(q, cache, host, table, lens, qk=path):
        err = metrics.compare(got, ref)
        assert err.rel_l2 <= tol.rel_l2 and err.max_rel <= tol.max_rel, (splits, err)


@pytest.mark.parametrize("fmt, qk", [("f16-f16", "transform"), ("e4m3-e4m3", "transform"), ("i8-i8", "int8"),
                                     ("bf16-e4m3", "transform")])
def test_splits_merged_in_a_cluster_match_the_merge_kernel(monkeypatch, fmt, qk):
    """From sm_90 the splits of a (kv head, row chunk, sequence) of at most CLUSTER_SPLITS run as one
    cluster and merge in it, no merge launch: the output (into a view only 2-byte aligned) and the LSE
    agree with the merge kernel's within rounding and with the emulator; every element is written."""
    import cupy

    from qattn.engine.packed import programmatic
    from qattn.formats.decode import schedule

    lq, group = 2, 4
    cache, host, table, lens, *_ = _filled(fmt, batch=3, kv_heads=2, head_dim=128, lens=[1 + lq, 1900, 3001])
    rng = np.random.default_rng(5)
    q = rng.standard_normal((3, 2 * group, lq, 128)).astype(_dtype(fmt))
    qd, td, ld = cupy.asarray(q), cupy.asarray(table), cupy.asarray(lens)
    kernel = cache.kernel(None, qk, group * lq)
    if not programmatic(kernel.spec):
        pytest.skip("thread-block clusters are sm_90 and newer")

    def run(splits):
        kernel.plans.clear()
        buffer = cupy.full(q.shape[:3] + (129,), np.nan, dtype=qd.dtype)
        out = buffer[..., 1:]  # 2 bytes past an 8-byte boundary
        got, lse = qattn.decode(qd, cache, td, ld, splits=splits, out=out, return_lse=True, qk=qk)
        plan = next(reversed(kernel.plans.values()))
        got = cupy.asnumpy(got).astype(np.float32)
        assert not np.isnan(got).any(), "an output element was left unwritten"
        return got, cupy.asnumpy(lse), plan

    for splits in (2, 5, schedule.CLUSTER_SPLITS):
        clustered, clustered_lse, plan = run(splits)
        assert plan.merge is None and plan.decode.cluster == splits and plan.ws_bytes == 0
        with monkeypatch.context() as m:
            m.setattr(schedule, "CLUSTER_SPLITS", 1)
            merged, merged_lse, plan = run(splits)
        assert plan.merge is not None and plan.decode.cluster == 1
        np.testing.assert_allclose(clustered, merged, rtol=2e-3, atol=2e-3)
        np.testing.assert_allclose(clustered_lse, merged_lse, rtol=1e-5, atol=1e-5)
        want = emu.emulate(q, host, table, lens, splits=splits, qk=qk)
        assert metrics.compare(clustered, want).rel_l2 <= 1e-3, (splits, metrics.compare(clustered, want))


def test_decode_format_cost_is_measured_against_the_original_kv():
    """The K8/V8 format's own error (the cache's rounding) against FP64 on the original fp16 K/V:
    e4m3 costs a few percent, int8 with token scales about 1%."""
    import cupy

    errors = {}
    for fmt in ("f16-f16", "i8-i8", "e4m3-e4m3"):
        cache, host, table, lens, ks, vs = _filled(fmt, batch=2, kv_heads=2, head_dim=128, lens=[900, 3000])
        q = np.random.default_rng(2).standard_normal((2, 8, 1, 128)).astype(np.float16)
        got = cupy.asnumpy(qattn.decode(cupy.asarray(q), cache, cupy.asarray(table), cupy.asarray(lens),
                                        qk="transform"))
        errors[fmt] = metrics.compare(got.astype(np.float32), emu.reference_dense(q, ks, vs)).rel_l2
    assert errors["f16-f16"] < 1e-3 < errors["i8-i8"] < 2e-2 < errors["e4m3-e4m3"] < 6e-2, errors


@pytest.mark.parametrize("fmt, qk", [("e4m3-e4m3", "fp8"), ("i8-i8", "int8"), ("f16-e4m3", "transform")])
def test_parity_on_captured_tensors_runs_the_kernel(tmp_path, fmt, qk):
    """parity's decode check on a captured file (a K bias 8x the tokens' spread): the kernel within the format's
    tolerance of FP64 on the cache, and its cost against the original K/V that of the emulator's run on the same
    window."""
    from qattn.check.captured import Captured
    from qattn.formats.decode.parity import check

    rng = np.random.default_rng(4)
    q = rng.standard_normal((2, 8, 700, 128)).astype(np.float32)
    k = rng.standard_normal((2, 2, 700, 128)).astype(np.float32) + 8.0 * rng.standard_normal(128).astype(np.float32)
    v = rng.standard_normal((2, 2, 700, 128)).astype(np.float32)
    np.savez(tmp_path / "qkv.npz", q=q, k=k, v=v)
    source = Captured.load(tmp_path / "qkv.npz")
    runs = {backend: check(fmt, 650, 3, backend=backend, batch=2, heads=8, kv_heads=2, head_dim=128, source=source,
                           qk=qk, time_it=False) for backend in ("cuda", "numpy")}
    assert runs["cuda"]["passed"] and runs["cuda"]["data"] == "npz:qkv.npz", runs["cuda"]
    cost = {backend: r["format_rel_l2"] for backend, r in runs.items()}
    assert abs(cost["cuda"] - cost["numpy"]) < 2e-3, cost  # the kernel is within 1e-3 of the emulator


def test_empty_and_short_sequences_and_padding_slots():
    import cupy

    cache, host, table, lens, *_ = _filled("e4m3-e4m3", batch=3, kv_heads=2, head_dim=128, lens=[0, 1, 40])
    q = np.random.default_rng(3).standard_normal((3, 8, 1, 128)).astype(np.float16)
    got, lse = qattn.decode(cupy.asarray(q), cache, cupy.asarray(table), cupy.asarray(lens), return_lse=True)
    got, lse = cupy.asnumpy(got), cupy.asnumpy(lse)
    assert (got[0] == 0).all() and np.isneginf(lse[0]).all()  # nothing cached: zeros, LSE -inf
    assert np.isfinite(got[1:]).all()
    before = cupy.asnumpy(cache.k_pool).copy()
    pad = cupy.asarray(np.full(4, -1, np.int32))
    cache.write(cupy.ones((4, 2, 128), cupy.float16), cupy.ones((4, 2, 128), cupy.float16), pad)
    assert (cupy.asnumpy(cache.k_pool) == before).all()  # negative slots write nothing


def test_non_finite_tokens_stay_non_finite():
    import cupy

    cache, host, table, lens, *_ = _filled("i8-i8", batch=1, kv_heads=1, head_dim=64, lens=[50])
    slot = int(table[0, 0]) * 32 + 3
    bad = cupy.ones((1, 1, 64), cupy.float16)
    bad[0, 0, 5] = np.nan
    cache.write(bad, cupy.ones((1, 1, 64), cupy.float16), cupy.asarray([slot], cupy.int32))
    q = cupy.ones((1, 1, 1, 64), cupy.float16)
    out = cupy.asnumpy(qattn.decode(q, cache, cupy.asarray(table), cupy.asarray(lens)))
    assert np.isnan(out).all()  # a NaN key reaches every score of the row


@pytest.mark.parametrize("fmt", ["e4m3-e4m3", "i8-i8"])
def test_a_nan_query_row_stays_nan_on_the_8bit_qk_path(fmt):
    """Q quantized per row: a NaN in one row makes that row's scale, and so its output, NaN; the
    other rows of the block (the same kv head's other query heads) are untouched."""
    import cupy

    cache, host, table, lens, *_ = _filled(fmt, batch=1, kv_heads=1, head_dim=128, lens=[300])
    q = np.random.default_rng(5).standard_normal((1, 4, 1, 128)).astype(np.float16)
    q[0, 2, 0, 17] = np.nan
    out = cupy.asnumpy(qattn.decode(cupy.asarray(q), cache, cupy.asarray(table), cupy.asarray(lens),
                                    qk=qk_paths(fmt)[1]))
    assert np.isnan(out[0, 2]).all() and np.isfinite(out[0, [0, 1, 3]]).all()


@pytest.mark.parametrize("fmt, path", [("e4m3-e4m3", "transform"), ("e4m3-e4m3", "fp8"), ("i8-i8", "int8"),
                                       ("f16-f16", "transform")])
def test_pre_bias_residual_k_on_the_bias_preset(fmt, path):
    """A K bias 30x the token-varying part: the writer stores K - b, the kernel adds q·b back; the
    cache's bytes are the host model's, the output is the emulator's, and the format's cost on the
    original K/V is that of N(0,1) data rather than the biased cache's."""
    import cupy

    from qattn import data

    x = data.preset("bias", ctx=900, queries=1, heads=8, kv_heads=2, head_dim=128, batch=2, seed=3)
    q = x["q"].astype(np.float16)
    k, v = x["k"].transpose(0, 2, 1, 3).astype(np.float16), x["v"].transpose(0, 2, 1, 3).astype(np.float16)
    k_side, v_side = fmt.split("-")
    table = np.arange(2 * 29, dtype=np.int32).reshape(2, 29)[:, ::-1].copy()
    slots = (table[:, np.arange(900) // 32] * 32 + np.arange(900) % 32).reshape(-1)
    lens = np.full(2, 900, np.int32)
    errors = {}
    for bias in (None, x["k_bias"]):
        cache = qattn.PagedKVCache(58, 32, 2, 128, k=k_side, v=v_side, k_bias=bias)
        host = HostPagedCache.empty(fmt, 58, 32, 2, 128, k_bias=bias)
        cache.write(cupy.asarray(k.reshape(-1, 2, 128)), cupy.asarray(v.reshape(-1, 2, 128)), cupy.asarray(slots))
        host.write(k.reshape(-1, 2, 128), v.reshape(-1, 2, 128), slots)
        np.testing.assert_array_equal(cache.host().k, host.k)
        got = cupy.asnumpy(qattn.decode(cupy.asarray(q), cache, cupy.asarray(table), cupy.asarray(lens), qk=path,
                                        splits=2)).astype(np.float32)
        want = emu.emulate(q, host, table, lens, splits=2, qk=path)
        if bias is not None or path != "fp8":  # (the fp8 wgmma's accumulator is narrower than fp32: on
            # the biased cache the scores' large common part leaves less than the emulator's precision)
            assert metrics.compare(got, want).rel_l2 <= EMU_REL_L2, (bias is not None, metrics.compare(got, want))
        dense = emu.reference_dense(q, [kk.astype(np.float64).transpose(1, 0, 2) for kk in k],
                                    [vv.astype(np.float64).transpose(1, 0, 2) for vv in v])
        errors[bias is not None] = metrics.compare(got, dense).rel_l2
    if fmt != "f16-f16":
        assert errors[True] < errors[False] / 5 and errors[True] < 0.08, errors
    else:
        assert errors[True] < 2 * errors[False] < 1e-3, errors  # fp16 K was not hurt by the bias


def test_cuda_graph_capture_of_a_decode_step():
    """write + decode captured on a CuPy stream with out= and workspace= given: a replay after the
    inputs change in place equals a fresh call."""
    import cupy

    from qattn.formats.decode import workspace_bytes
    from qattn.formats.decode.host import splits_for

    fmt, b, hkv, d = "e4m3-e4m3", 2, 2, 128
    cache, host, table, lens, *_ = _filled(fmt, batch=b, kv_heads=hkv, head_dim=d, lens=[300, 1000])
    table_d = cupy.asarray(table)
    lens_d = cupy.asarray(lens + 1)  # the new token included
    slots = cupy.asarray((table[np.arange(b), lens // 32] * 32 + lens % 32).astype(np.int32))
    k_new, v_new = cupy.zeros((b, hkv, d), cupy.float16), cupy.zeros((b, hkv, d), cupy.float16)
    q = cupy.zeros((b, 8, 1, d), cupy.float16)
    out = cupy.zeros_like(q)
    splits = splits_for(cache, b, 8, 1, table.shape[1])
    ws = cupy.zeros(max(1, workspace_bytes(b, 8, 1, d, splits)), cupy.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)
    qattn.decode(q, cache, table_d, lens_d, out=out, workspace=ws, stream=stream, splits=splits)  # builds, plans
    stream.synchronize()
    with stream:
        stream.begin_capture()
        cache.write(k_new, v_new, slots, stream=stream)
        qattn.decode(q, cache, table_d, lens_d, out=out, workspace=ws, stream=stream, splits=splits)
        graph = stream.end_capture()
    rng = np.random.default_rng(4)
    for _ in range(2):
        with stream:  # the inputs change on the graph's stream (a non-blocking stream does not wait for others)
            q[...] = cupy.asarray(rng.standard_normal(q.shape).astype(np.float16))
            k_new[...] = cupy.asarray(rng.standard_normal(k_new.shape).astype(np.float16))
            v_new[...] = cupy.asarray(rng.standard_normal(v_new.shape).astype(np.float16))
            graph.launch(stream)
        stream.synchronize()
        replayed = cupy.asnumpy(out)
        fresh = cupy.asnumpy(qattn.decode(q, cache, table_d, lens_d, splits=splits))
        np.testing.assert_array_equal(replayed, fresh)


def test_torch_graph_capture_and_tensors():
    torch = pytest.importorskip("torch")
    cache = qattn.PagedKVCache(8, 32, 2, 128, k="e4m3", v="e4m3")
    table = torch.arange(8, dtype=torch.int32, device="cuda").reshape(2, 4)
    lens = torch.tensor([40, 100], dtype=torch.int32, device="cuda")
    k = torch.randn(256, 2, 128, device="cuda", dtype=torch.float16)
    cache.write(k, torch.randn_like(k), torch.arange(256, device="cuda"))
    q = torch.randn(2, 8, 1, 128, device="cuda", dtype=torch.float16)
    out = torch.empty_like(q)
    qattn.decode(q, cache, table, lens, out=out, splits=1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qattn.decode(q, cache, table, lens, out=out, splits=1)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    fresh = qattn.decode(q, cache, table, lens, splits=1)
    assert isinstance(fresh, torch.Tensor) and torch.equal(out, fresh)


@pytest.mark.parametrize("call, words", [
    (lambda c, q, t, n: qattn.decode(q[..., :64], c, t, n), "head_dim"),
    (lambda c, q, t, n: qattn.decode(q[:, :3], c, t, n), "multiple"),
    (lambda c, q, t, n: qattn.decode(q, c, t.astype("int64"), n), "block_table"),
    (lambda c, q, t, n: qattn.decode(q, c, t, n[:1]), "seq_lens"),
    (lambda c, q, t, n: qattn.decode(q.astype("float32"), c, t, n), "q:"),
    (lambda c, q, t, n: qattn.decode(q, c, t, n, splits=0), "splits"),
    (lambda c, q, t, n: qattn.decode(q, c, t, n, qk="int8"), "qk: e4m3-e4m3 takes 'auto' or one of transform, fp8"),
    (lambda c, q, t, n: qattn.decode(q, "cache", t, n), "cache"),
    (lambda c, q, t, n: qattn.decode(q, c, t, n, out=q[:1]), "out"),
    (lambda c, q, t, n: c.write(q[0, :, 0], q[0, :, 0], t[0]), "k:"),
])
def test_bad_calls_name_the_argument(call, words):
    import cupy

    cache = qattn.PagedKVCache(8, 32, 2, 128, k="e4m3", v="e4m3")
    q = cupy.ones((2, 8, 1, 128), cupy.float16)
    table = cupy.arange(8, dtype=cupy.int32).reshape(2, 4)
    lens = cupy.asarray([3, 9], cupy.int32)
    with pytest.raises((ValueError, TypeError), match=words):
        call(cache, q, table, lens)


# ---- page means of an 8-bit K (k_mean "page") ------------------------------------------------------

def _mean_filled(fmt, *, lens, kv_heads=2, head_dim=128, page_size=16, scale="token", k_bias=None, seed=0):
    """A page-mean GPU cache and its host model written alike with K whose large channel mean drifts
    over the positions: every sequence's prompt (its first quarter) in one write, then 64 tokens of
    each sequence a write (pages shuffled); plus the table and the original K/V per sequence."""
    rng = np.random.default_rng(seed)
    k_side, v_side = fmt.split("-")
    max_pages = max(-(-int(n) // page_size) for n in lens) + 1
    num_pages = len(lens) * max_pages + 3
    cache = qattn.PagedKVCache(num_pages, page_size, kv_heads, head_dim, k=k_side, v=v_side, scale=scale,
                               k_bias=k_bias, k_mean="page")
    host = HostPagedCache.empty(fmt, num_pages, page_size, kv_heads, head_dim, scale, k_bias=k_bias, k_mean="page")
    table = rng.permutation(num_pages)[:len(lens) * max_pages].reshape(len(lens), max_pages).astype(np.int32)
    mean = np.zeros((kv_heads, head_dim))
    mean[:, ::16] = 30 * rng.choice([-1, 1], size=(kv_heads, head_dim // 16))
    dtype = _dtype(fmt)
    ks, vs, slots = [], [], []
    for b, n in enumerate(lens):
        growth = 1 + np.arange(n)[:, None, None] / max(n, 1)
        bias = 0 if k_bias is None else np.asarray(k_bias)[None]
        ks.append((rng.standard_normal((n, kv_heads, head_dim)) + mean[None] * growth + bias).astype(dtype))
        vs.append(rng.standard_normal((n, kv_heads, head_dim)).astype(dtype))
        slots.append((table[b, np.arange(n) // page_size] * page_size + np.arange(n) % page_size).astype(np.int32))
    write_in_parts(cache, host, ks, vs, slots, scale=scale)
    return (cache, host, table, np.asarray(lens, np.int32), [k.astype(np.float64).transpose(1, 0, 2) for k in ks],
            [v.astype(np.float64).transpose(1, 0, 2) for v in vs])


@pytest.mark.parametrize("fmt, scale", [("i8-i8", "token"), ("e4m3-e4m3", "token"), ("i8-f16", "head"),
                                        ("e4m3-bf16", "token")])
def test_page_mean_writer_stores_what_the_host_model_stores(fmt, scale):
    """Several writes with a drifting mean: the codes, token scales, page records, running sums and
    snapshot are the host model's bit for bit (integer sums: no order dependence)."""
    cache, host, *_ = _mean_filled(fmt, lens=[45, 300, 130], head_dim=64, scale=scale)
    got = cache.host()
    assert_stored_alike(got, host)
    for field in ("codes", "scale", "sums", "counts"):
        np.testing.assert_array_equal(getattr(got.k_mean, field), getattr(host.k_mean, field), err_msg=field)


@pytest.mark.parametrize("fmt, path", [("i8-i8", "transform"), ("i8-i8", "int8"), ("e4m3-e4m3", "transform"),
                                       ("e4m3-e4m3", "fp8"), ("i8-f16", "int8"), ("e4m3-bf16", "transform")])
@pytest.mark.parametrize("head_dim, group, lq, page_size", [(128, 4, 1, 16), (64, 8, 2, 32), (128, 1, 5, 64),
                                                            (256, 4, 1, 128)])
def test_page_mean_decode_matches_emulator(fmt, path, head_dim, group, lq, page_size):
    """Page-mean decode over tails (a sequence of 1 + lq keys, lengths off the page and step grid), one,
    three and automatic splits, into NaN-poisoned outputs: within rel_l2 1e-3 of the emulator, its LSE
    too, within the format's rel_l2 of FP64 on the cache, and closer to the original K/V than the same
    cache without page means (its emulator: 1.4x to 5.5x here, the lag of the running mean on a mean
    that doubles over the sequence)."""
    lens = [1 + lq, 777, 2100]
    cache, host, table, lens, ks, vs = _mean_filled(fmt, lens=lens, head_dim=head_dim, page_size=page_size)
    rng = np.random.default_rng(1)
    q = rng.standard_normal((3, 2 * group, lq, head_dim)).astype(_dtype(fmt))
    tol = tolerance(fmt, path)
    ref = emu.reference(q, host, table, lens)
    for splits, got in decode_over_splits(q, cache, host, table, lens, qk=path):
        assert metrics.compare(got, ref).rel_l2 <= tol.rel_l2, (splits, metrics.compare(got, ref))
    plain = HostPagedCache.empty(fmt, host.k.shape[0], page_size, 2, head_dim)
    for b, n in enumerate(lens):
        slots = table[b, np.arange(n) // page_size] * page_size + np.arange(n) % page_size
        plain.write(ks[b].transpose(1, 0, 2), vs[b].transpose(1, 0, 2), slots)
    dense = emu.reference_dense(q, ks, vs)
    plain_err = metrics.compare(emu.emulate(q, plain, table, lens, qk=path), dense).rel_l2
    assert metrics.compare(got, dense).rel_l2 < plain_err, (metrics.compare(got, dense).rel_l2, plain_err)


def test_page_means_with_a_k_bias_and_non_finite_tokens():
    """k_bias and page means together (the transform path, the emulator's default): the kernel adds q·b
    and q·μ_page back (the emulator's output);
    a NaN token stays out of the running mean (the pages after it keep finite records) while its own
    row's output turns NaN."""
    import cupy

    bias = (np.random.default_rng(7).standard_normal((2, 128)) * 40).astype(np.float32)
    cache, host, table, lens, *_ = _mean_filled("i8-i8", lens=[300, 900], k_bias=bias, page_size=32)
    q = np.random.default_rng(8).standard_normal((2, 8, 1, 128)).astype(np.float16)
    got = cupy.asnumpy(qattn.decode(cupy.asarray(q), cache, cupy.asarray(table), cupy.asarray(lens), splits=2, qk="transform"))
    want = emu.emulate(q, host, table, lens, splits=2)
    assert metrics.compare(got.astype(np.float32), want).rel_l2 <= EMU_REL_L2
    bad = cupy.ones((1, 2, 128), cupy.float16)
    bad[0, 0, 5] = np.nan
    slot = int(table[0, 300 // 32]) * 32 + 300 % 32
    cache.write(bad, cupy.ones((1, 2, 128), cupy.float16), cupy.asarray([slot], cupy.int32))
    after = cache.host().k_mean
    assert np.isfinite(after.scale).all() and list(after.counts) == [1200, 1201]  # head 0's row is left out
    grown = cupy.asarray(lens + np.array([1, 0], np.int32))
    out = cupy.asnumpy(qattn.decode(cupy.asarray(q), cache, cupy.asarray(table), grown))
    assert np.isnan(out[0, :4]).all() and np.isfinite(out[0, 4:]).all() and np.isfinite(out[1]).all()


def test_cuda_graph_capture_of_a_page_mean_decode_step():
    """write + decode on a page-mean cache captured once and replayed as tokens arrive (a new page
    started on the way): every replay equals a fresh call, and the records are the host model's."""
    cache, host, table, lens, *_ = _mean_filled("i8-i8", lens=[60, 95], kv_heads=2, head_dim=128, page_size=16)
    # lengths 61..63 and 96..98: the second sequence starts a page at 96; K far from zero-mean
    replay_decode_steps(cache, host, table, lens, kv_heads=2, head_dim=128, qk="transform", page_size=16,
                        new_k=lambda rng, shape: rng.standard_normal(shape) + 30)
    np.testing.assert_array_equal(cache.host().k_mean.codes, host.k_mean.codes)


@pytest.mark.parametrize("name,tol", [("flashinfer", 2e-3), ("flashinfer_e4m3", 6e-2)])
def test_flashinfer_peers_agree_with_fp64(name, tol):
    """The benchmark's FlashInfer peers (bench/paged_peers.py), where FlashInfer is installed: pages of
    the same tokens in shuffled pages, a last page part full, GQA; the fp16 cache within fp16's error of FP64, the e4m3
    one (one scale per tensor) within e4m3's."""
    import cupy

    from qattn.bench import decode as bench_decode
    from qattn.bench import paged_peers
    from qattn.check import reference

    pytest.importorskip("torch")
    pytest.importorskip("flashinfer")
    rng = np.random.default_rng()
    batch, ctx, heads, kv_heads, d = 3, 1000, 16, 4, 128
    k, v = (rng.standard_normal((batch * ctx, kv_heads, d)).astype(np.float16) for _ in range(2))
    q = rng.standard_normal((batch, heads, 1, d)).astype(np.float16)
    table = bench_decode.page_ids(batch, ctx, 32, "shuffled", rng)  # the pages qattn reads in the benchmark
    call, nbytes = paged_peers.paged_peer(name, cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), batch=batch,
                                          ctx=ctx, page_size=32, table=table)
    assert nbytes == batch * 32 * 32 * kv_heads * d * 2 * (1 if name.endswith("e4m3") else 2)  # 32 pages a sequence
    out = cupy.asnumpy(cupy.from_dlpack(call().contiguous())).reshape(batch, heads, 1, d)
    per_seq = [x.reshape(batch, ctx, kv_heads, d).transpose(0, 2, 1, 3) for x in (k, v)]
    ref = reference.attention(q, *per_seq)
    err = metrics.compare(out, ref)
    assert err.nonfinite == 0 and err.rel_l2 <= tol, err


@pytest.mark.parametrize("page_order", ["shuffled", "in-order"])
def test_bench_sweep_times_every_format_on_one_block_table(page_order):
    """`qattn bench decode`'s sweep: every format of a point is filled into the same pages and timed,
    none recorded as an error (bf16 caches written and read in bf16), and (where torch's SDPA runs) each agrees
    with the fp16 answer within its format's error."""
    from qattn.bench import decode as bench

    formats = ("f16-f16", "e4m3-e4m3", "i8-i8", "f16-e4m3", "bf16-bf16", "e4m3-bf16")
    run = bench.Run(bench.Point(2, 200, heads=8, kv_heads=2, head_dim=64, page_size=16), ("warm",))
    records = bench.bench_sweep([run], [(f, "auto") for f in formats], rounds=1, page_order=page_order)
    ours = {r["format"]: r for r in records if r["impl"].startswith("qattn:")}
    assert set(ours) == set(formats), records
    for fmt, rec in ours.items():
        assert "error" not in rec and rec["ms"] > 0 and rec["page_order"] == page_order, rec
        assert rec["splits"] >= 1 and (rec["splits"] == 1) == (rec["merge"] == "none"), rec
        assert rec["merge"] in ("none", "kernel", "cluster") and rec["kernel"].startswith(f"decode_{fmt}_"), rec
        if "rel_l2_vs_fp16" in rec:
            assert rec["rel_l2_vs_fp16"] < {"f16-f16": 1e-3, "bf16-bf16": 8e-3}.get(fmt, 6e-2), rec
