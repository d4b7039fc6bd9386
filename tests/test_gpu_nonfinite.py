"""Non-finite inputs on the GPU: a NaN or Inf in Q, K or V never comes out finite in the outputs it
reaches (README, "Non-finite inputs"). The 16- and 32-bit formats reach exactly what FP64 reaches;
the quantized formats may reach more (a scale block, a head), never less."""
from __future__ import annotations

import numpy as np
import pytest

import qattn
from qattn.engine.arrays import numpy_dtype

pytestmark = pytest.mark.gpu

B, HQ, HKV, LQ, LK, D = 1, 4, 2, 100, 300, 128
EXACT = ["f16", "bf16", "f32"]
QUANTIZED = ["i8-f16", "i8-i8", "i8-f8", "kv8-imma", "kv8-split", "kv8-f32"]
BAD = {"nan": np.nan, "inf": np.inf}


def _reach(q, k, v, where: str, causal: bool):
    """(must, may): the outputs the bad value must reach (non-finite in FP64 attention; for V, the
    rows that see its key, as 0·Inf in a masked key's P·V is the reference's own artefact) and those
    it may reach in a format that reproduces FP64's reach."""
    from qattn.check import reference

    with np.errstate(invalid="ignore", over="ignore"):
        may = ~np.isfinite(reference.attention(q, k, v, causal=causal))
    if where != "v":
        return may, may
    must = np.zeros(may.shape, bool)
    lq, lk = q.shape[2], k.shape[2]
    sees = np.arange(lq) + (lk - lq if causal else lk) >= 260
    must[0, 0:2][:, sees, 5] = True  # kv head 0 (query heads 0, 1), key 260, channel 5
    return must, may


def _inputs(fmt: str, where: str, bad: float):
    import cupy

    rng = np.random.default_rng(3)
    dtype = numpy_dtype("float32" if fmt.startswith("kv8") else qattn.recipe(fmt).input_dtypes[0])
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((B, HQ, LQ, D), (B, HKV, LK, D), (B, HKV, LK, D)))
    {"q": lambda: q.__setitem__((0, 1, 37, 11), bad), "k": lambda: k.__setitem__((0, 1, 250, 7), bad),
     "v": lambda: v.__setitem__((0, 0, 260, 5), bad)}[where]()
    host = [x.astype(dtype) for x in (q, k, v)]
    return host, [cupy.asarray(x) for x in host]


def _attend(fmt, q, k, v):
    import cupy

    if fmt.startswith("kv8"):
        return cupy.asnumpy(qattn.attention(q, qattn.KVCacheInt8.from_kv(k, v), format=fmt, causal=True))
    return cupy.asnumpy(qattn.attention(q, k, v, format=fmt, causal=True)).astype(np.float32)


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("fmt", EXACT + QUANTIZED)
def test_a_non_finite_input_never_comes_out_finite_where_it_reaches(fmt, where, bad):
    host, device = _inputs(fmt, where, BAD[bad])
    out = _attend(fmt, *device)
    must, may = _reach(*host, where, causal=True)
    assert must.any() and not np.isfinite(out[must]).any(), f"{fmt}: {np.isfinite(out[must]).sum()} finite outputs"
    if fmt in EXACT:  # the reach of FP64 attention: everything else finite
        assert np.isfinite(out[~may]).all()


def _decode_case(fmt: str, where: str, bad: float, page=32):
    """A cache of two sequences (300 and 170 tokens) with the bad value written into sequence 0."""
    import cupy

    rng = np.random.default_rng(5)
    lens = [300, 170]
    pages = [-(-n // page) for n in lens]
    cache = qattn.PagedKVCache(sum(pages), page, HKV, D, k=fmt.split("-")[0], v=fmt.split("-")[1])
    dtype = np.float16 if "bf16" not in fmt else numpy_dtype("bfloat16")
    table = np.zeros((2, max(pages)), np.int32)
    seq0 = None
    table[0, :pages[0]] = np.arange(pages[0])
    table[1, :pages[1]] = pages[0] + np.arange(pages[1])
    for s, n in enumerate(lens):
        k = rng.standard_normal((n, HKV, D)).astype(np.float32)
        v = rng.standard_normal((n, HKV, D)).astype(np.float32)
        if s == 0 and where == "k":
            k[250, 1, 7] = bad
        if s == 0 and where == "v":
            v[260, 0, 5] = bad
        if s == 0:
            seq0 = (k.astype(dtype).transpose(1, 0, 2)[None], v.astype(dtype).transpose(1, 0, 2)[None])
        slots = table[s, np.arange(n) // page] * page + np.arange(n) % page
        cache.write(cupy.asarray(k.astype(dtype)), cupy.asarray(v.astype(dtype)), cupy.asarray(slots.astype(np.int32)))
    q = rng.standard_normal((2, HQ, 1, D)).astype(np.float32)
    q[0, :, 0, 7] = np.abs(q[0, :, 0, 7]) + 0.5  # a bad K channel 7 scores +Inf or NaN, never -Inf (ignored)
    if where == "q":
        q[0, 1, 0, 11] = bad
    must = np.zeros((2, HQ, 1, D), bool)
    must[:1] = _reach(q[:1].astype(dtype), *seq0, where, causal=False)[0]
    return cache, cupy.asarray(q.astype(dtype)), cupy.asarray(table), cupy.asarray(np.asarray(lens, np.int32)), must


DECODE = [("f16-f16", "transform"), ("e4m3-e4m3", "transform"), ("e4m3-e4m3", "fp8"), ("i8-i8", "transform"),
          ("i8-i8", "int8"), ("f16-e4m3", "transform"), ("e4m3-f16", "fp8"), ("bf16-i8", "transform")]


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("fmt, qk", DECODE, ids=["/".join(p) for p in DECODE])
def test_decode_keeps_non_finite_inputs_non_finite(fmt, qk, where, bad):
    import cupy

    cache, q, table, lens, must = _decode_case(fmt, where, BAD[bad])
    out = cupy.asnumpy(qattn.decode(q, cache, table, lens, qk=qk)).astype(np.float32)
    assert must.any() and not np.isfinite(out[must]).any()
    assert np.isfinite(out[1]).all()  # the other sequence is untouched
