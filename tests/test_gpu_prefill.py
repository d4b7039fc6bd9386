"""Prefill kernels on the GPU against FP64: every CUDA format, tails, GQA, causal Lq != Lk,
strided input, LSE, poisoned outputs, 64-bit offsets, and argument errors."""
import math

import numpy as np
import pytest

import qattn
from qattn.check import metrics
from qattn.check import reference
from qattn.engine.arrays import numpy_dtype

pytestmark = pytest.mark.gpu

TOL_REL_L2 = {"f16": 2e-3, "bf16": 1e-2, "f32": 1e-5}


def _inputs(rng, fmt, b, hq, hkv, lq, lk, d):
    import cupy

    dt = numpy_dtype(qattn.recipe(fmt).input_dtypes[0])
    host = [rng.standard_normal(s).astype(np.float32).astype(dt)
            for s in ((b, hq, lq, d), (b, hkv, lk, d), (b, hkv, lk, d))]
    return host, [cupy.asarray(x) for x in host]


def _check(fmt, out, ref):
    err = metrics.compare(out, ref)
    assert err.nonfinite == 0, err
    if fmt == "f32":
        assert err.max_rel <= 1e-5, err
    assert err.rel_l2 <= TOL_REL_L2[fmt], err
    return err


SHAPES = [(1, 1), (7, 7), (64, 129), (129, 64), (1500, 1500), (2100, 1500), (1, 2100), (7, 1500)]


@pytest.mark.parametrize("fmt", ["f16", "bf16", "f32"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq,lk", SHAPES)
def test_against_fp64(fmt, head_dim, causal, lq, lk):
    import cupy

    seed = hash((fmt, head_dim, causal, lq, lk)) % 2**32  # fresh per process; printed so a failure can be replayed
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    host, (q, k, v) = _inputs(rng, fmt, 2, 4, 4, lq, lk, head_dim)
    out = cupy.full(q.shape, np.nan, dtype=q.dtype)
    qattn.attention(q, k, v, format=fmt, causal=causal, out=out)
    _check(fmt, out, reference.attention(*host, causal=causal))


@pytest.mark.parametrize("fmt", ["f16", "bf16", "f32"])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_gqa_and_lse(fmt, group):
    rng = np.random.default_rng(group)
    host, (q, k, v) = _inputs(rng, fmt, 2, 8, 8 // group, 300, 1029, 128)
    out, lse = qattn.attention(q, k, v, format=fmt, causal=True, return_lse=True, scale=0.05)
    ref, ref_lse = reference.attention(*host, causal=True, scale=0.05, return_lse=True)
    _check(fmt, out, ref)
    np.testing.assert_allclose(lse.get(), ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["f16", "f32"])
def test_causal_rows_without_keys_are_zero(fmt):
    rng = np.random.default_rng(7)
    host, (q, k, v) = _inputs(rng, fmt, 1, 2, 2, 300, 100, 64)  # first 200 rows see no key
    out, lse = qattn.attention(q, k, v, format=fmt, causal=True, return_lse=True)
    assert np.all(out.get()[:, :, :200] == 0)
    assert np.all(np.isneginf(lse.get()[:, :, :200]))
    _check(fmt, out, reference.attention(*host, causal=True))


@pytest.mark.parametrize("fmt", ["f16", "bf16", "f32"])
def test_strided_bshd_views(fmt):
    import cupy

    rng = np.random.default_rng(3)
    dt = numpy_dtype(qattn.recipe(fmt).input_dtypes[0])
    b, l, h, d = 2, 777, 4, 128
    packed = cupy.asarray(rng.standard_normal((b, l, 3, h, d)).astype(np.float32).astype(dt))
    q, k, v = (packed[:, :, i].transpose(0, 2, 1, 3) for i in range(3))  # BSHD views, no copy
    assert not q.flags.c_contiguous
    out_store = cupy.full((b, l, h, d), np.nan, dtype=dt)
    out = out_store.transpose(0, 2, 1, 3)
    qattn.attention(q, k, v, format=fmt, out=out)
    _check(fmt, out, reference.attention(q.get(), k.get(), v.get()))


@pytest.mark.parametrize("head_dim", [32, 96, 256])
def test_other_head_dims(head_dim):
    rng = np.random.default_rng(head_dim)
    host, (q, k, v) = _inputs(rng, "f16", 1, 4, 2, 257, 1100, head_dim)
    out = qattn.attention(q, k, v, format="f16", causal=True)
    _check("f16", out, reference.attention(*host, causal=True))


def test_offsets_past_2_to_31():
    import cupy

    d, l = 128, 64
    big = cupy.empty((2**31 // (l * d) + 2) * l * d, dtype=cupy.float16)
    batch_stride = big.size - l * d  # batch 1 starts past element 2^31
    rng = np.random.default_rng(11)
    vals = rng.standard_normal((2, 1, l, d)).astype(np.float16)
    big[:l * d] = cupy.asarray(vals[0, 0].ravel())
    big[batch_stride:] = cupy.asarray(vals[1, 0].ravel())
    view = cupy.lib.stride_tricks.as_strided(big, shape=(2, 1, l, d),
                                             strides=(batch_stride * 2, l * d * 2, d * 2, 2))
    out = qattn.attention(view, view, view, format="f16")
    _check("f16", out, reference.attention(vals, vals, vals))


def test_build_and_call_kernel_object():
    rng = np.random.default_rng(5)
    host, (q, k, v) = _inputs(rng, "f16", 1, 2, 2, 200, 333, 64)
    kernel = qattn.build("prefill", format="f16", head_dim=64, causal=True, tile=(64, 64, 4, 2))
    assert kernel.resources["registers"] > 0 and "mma.sync" in kernel.source
    _check("f16", kernel(q, k, v), reference.attention(*host, causal=True))


def test_torch_tensors_roundtrip():
    torch = pytest.importorskip("torch")
    q, k, v = (torch.randn(1, 4, 129, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    out = qattn.attention(q, k, v, format="f16")
    assert isinstance(out, torch.Tensor)
    ref = reference.attention(*(x.float().cpu().numpy() for x in (q, k, v)))
    _check("f16", out.float().cpu().numpy(), ref)


def test_bad_inputs_raise_clear_errors(monkeypatch):
    import dataclasses

    import cupy

    from qattn.engine.registry import RECIPES

    q = cupy.ones((1, 2, 16, 64), dtype=cupy.float16) * 0.5
    with pytest.raises(TypeError, match="q: format 'f16' takes float16"):
        qattn.attention(q.astype(cupy.float32), q, q, format="f16")
    with pytest.raises(ValueError, match="k: head_dim"):
        qattn.attention(q, cupy.ones((1, 2, 16, 32), dtype=cupy.float16), cupy.ones((1, 2, 16, 32), dtype=cupy.float16))
    with pytest.raises(ValueError, match="head_dim"):
        qattn.attention(*(cupy.ones((1, 2, 16, 80), dtype=cupy.float16),) * 3)
    with pytest.raises(TypeError, match="q: expected a CUDA array"):
        qattn.attention(np.ones((1, 2, 16, 64), np.float16), q, q)
    with pytest.raises(ValueError, match="multiple"):
        qattn.attention(cupy.ones((1, 3, 16, 64), dtype=cupy.float16), q, q)
    with pytest.raises(ValueError, match="out: expected shape"):
        qattn.attention(q, q, q, out=cupy.empty((1, 2, 15, 64), dtype=cupy.float16))
    # a format without a CUDA kernel names itself (every registered format may have one by now)
    monkeypatch.setitem(RECIPES, "i8-f8", dataclasses.replace(RECIPES["i8-f8"], families={}))
    with pytest.raises(ValueError, match="i8-f8"):
        qattn.attention(q, q, q, format="i8-f8")
    with pytest.raises(ValueError, match="format: unknown"):
        qattn.attention(q, q, q, format="f12")


def test_output_written_everywhere_and_deterministic():
    import cupy

    rng = np.random.default_rng(9)
    host, (q, k, v) = _inputs(rng, "f16", 2, 4, 4, 1029, 2100, 128)
    a = cupy.full(q.shape, np.nan, dtype=q.dtype)
    b = cupy.full(q.shape, np.nan, dtype=q.dtype)
    qattn.attention(q, k, v, out=a, causal=True)
    qattn.attention(q, k, v, out=b, causal=True)
    assert not bool(cupy.isnan(a).any())
    assert bytes(a.get().data) == bytes(b.get().data)
    assert math.isfinite(float(a.astype(cupy.float32).sum()))


def test_attention_looks_its_kernel_up_and_still_checks_its_arguments():
    import cupy

    from qattn import api

    rng = np.random.default_rng()
    q = cupy.asarray(rng.standard_normal((1, 2, 77, 64)).astype(np.float16))
    first = qattn.attention(q, q, q, format="f16", causal=True)
    known = dict(api._CALL_KERNELS)
    again = qattn.attention(q, q, q, format="f16", causal=True)
    assert api._CALL_KERNELS == known  # the second call built nothing
    assert cupy.array_equal(first.view(cupy.uint16), again.view(cupy.uint16))
    with pytest.raises(ValueError, match="causal"):
        qattn.attention(q, q, q, format="f16", causal=1)
    with pytest.raises(ValueError, match="tile"):
        qattn.attention(q, q, q, format="f16", tile=(64, 64, 4, 2))
    with pytest.raises(ValueError, match="head_dim"):
        qattn.attention(q[..., :48], q[..., :48], q[..., :48], format="f16")


@pytest.mark.parametrize("fmt", ["f16", "bf16", "f32"])
def test_the_default_format_follows_the_dtype(fmt):
    """attention() without format= runs f16, bf16 or f32 by q's dtype, bit for bit the explicit call."""
    rng = np.random.default_rng(11)
    host, (q, k, v) = _inputs(rng, fmt, 1, 4, 2, 70, 300, 64)
    implicit = qattn.attention(q, k, v, causal=True)
    explicit = qattn.attention(q, k, v, format=fmt, causal=True)
    import cupy

    assert implicit.dtype == q.dtype
    assert np.array_equal(cupy.asnumpy(implicit).view(np.uint8), cupy.asnumpy(explicit).view(np.uint8))
    _check(fmt, implicit, reference.attention(*host, causal=True))
