"""The FP64 reference (qattn.reference.attention) against a direct NumPy softmax formula and against
known properties: causal alignment (bottom-right, Lq != Lk, rows that see no key), GQA, scale, LSE,
chunking over query rows. CPU only; fresh random inputs, never zeros."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import qattn
from qattn.check import reference
from qattn.check.reference import attention, check_shapes, softmax_rows, visible_keys


def qkv(rng, b, hq, hkv, lq, lk, d, scale_k=1.0):
    q = rng.standard_normal((b, hq, lq, d))
    k = rng.standard_normal((b, hkv, lk, d)) * scale_k
    v = rng.standard_normal((b, hkv, lk, d))
    return q, k, v


def formula(q, k, v, *, causal=False, scale=None):
    """Direct softmax(q k^T * scale) v per (batch, head), written independently of the module."""
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = np.zeros((b, hq, lq, d))
    lse = np.full((b, hq, lq), -np.inf)
    allowed = np.tril(np.ones((lq, lk), dtype=bool), k=lk - lq) if causal else np.ones((lq, lk), dtype=bool)
    for bi in range(b):
        for h in range(hq):
            kv = h // (hq // hkv)
            s = q[bi, h] @ k[bi, kv].T * scale
            for i in range(lq):
                idx = np.flatnonzero(allowed[i])
                if idx.size == 0:
                    continue
                row = s[i, idx]
                m = row.max()
                e = np.exp(row - m)
                out[bi, h, i] = e @ v[bi, kv, idx] / e.sum()
                lse[bi, h, i] = m + math.log(e.sum())
    return out, lse


SHAPES = [  # (b, hq, hkv, lq, lk, d): tails, GQA 1/4/8, Lq < Lk, Lq > Lk, single rows/keys
    (1, 1, 1, 1, 1, 8),
    (2, 2, 2, 7, 7, 16),
    (1, 4, 1, 7, 33, 32),
    (2, 8, 1, 29, 13, 16),
    (1, 8, 2, 1, 65, 64),
    (1, 2, 2, 65, 1, 8),
    (1, 4, 4, 100, 129, 24),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}h{}k{}q{}l{}d{}".format(*s))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_matches_direct_formula(rng, shape, causal):
    q, k, v = qkv(rng, *shape)
    out, lse = attention(q, k, v, causal=causal, return_lse=True)
    want, want_lse = formula(q, k, v, causal=causal)
    assert out.dtype == np.float64 and out.shape == q.shape and lse.shape == q.shape[:3]
    np.testing.assert_allclose(out, want, rtol=1e-11, atol=1e-13)
    assert np.array_equal(np.isinf(lse), np.isinf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[finite], want_lse[finite], rtol=1e-12, atol=1e-12)
    assert out is not None and not np.array_equal(out, np.zeros_like(out))


def test_return_value_without_lse(rng):
    q, k, v = qkv(rng, 1, 2, 2, 5, 9, 8)
    out = attention(q, k, v)
    assert isinstance(out, np.ndarray) and out.shape == q.shape


def test_causal_row0_is_v0_when_lengths_match(rng):
    q, k, v = qkv(rng, 2, 4, 2, 37, 37, 16)
    out, lse = attention(q, k, v, causal=True, return_lse=True)
    for bi in range(2):
        for h in range(4):
            np.testing.assert_allclose(out[bi, h, 0], v[bi, h // 2, 0], rtol=1e-14, atol=1e-14)
            assert lse[bi, h, 0] == pytest.approx(q[bi, h, 0] @ k[bi, h // 2, 0] / 4.0, rel=1e-12)
    # the last row sees every key: it equals the non-causal answer
    full = attention(q, k, v)
    np.testing.assert_allclose(out[:, :, -1], full[:, :, -1], rtol=1e-12, atol=1e-14)
    assert not np.allclose(out[:, :, 1:-1], full[:, :, 1:-1])


def test_causal_bottom_right_with_more_keys_than_queries(rng):
    lq, lk, d = 5, 12, 16
    q, k, v = qkv(rng, 1, 1, 1, lq, lk, d)
    out, lse = attention(q, k, v, causal=True, return_lse=True)
    assert list(visible_keys(lq, lk, True)) == [8, 9, 10, 11, 12]
    for i in range(lq):
        n = i + (lk - lq) + 1  # query i sees keys 0 .. i + Lk - Lq
        sub, sub_lse = attention(q[:, :, i:i + 1], k[:, :, :n], v[:, :, :n], return_lse=True)
        np.testing.assert_allclose(out[0, 0, i], sub[0, 0, 0], rtol=1e-12, atol=1e-14)
        assert lse[0, 0, i] == pytest.approx(sub_lse[0, 0, 0], rel=1e-12)
    # top-left alignment would have given row 0 only key 0: make sure that is not what we computed
    assert not np.allclose(out[0, 0, 0], v[0, 0, 0])


def test_causal_bottom_right_with_more_queries_than_keys(rng):
    lq, lk, d = 11, 4, 8
    q, k, v = qkv(rng, 2, 2, 1, lq, lk, d)
    out, lse = attention(q, k, v, causal=True, return_lse=True)
    blind = lq - lk  # rows 0 .. Lq-Lk-1 see no key
    assert list(visible_keys(lq, lk, True)) == [0] * blind + [1, 2, 3, 4]
    assert np.all(out[:, :, :blind] == 0.0) and np.all(np.isfinite(out))
    assert np.all(np.isneginf(lse[:, :, :blind]))
    assert np.all(np.isfinite(lse[:, :, blind:]))
    # the first row that sees anything sees only key 0
    for bi in range(2):
        for h in range(2):
            np.testing.assert_allclose(out[bi, h, blind], v[bi, 0, 0], rtol=1e-14, atol=1e-14)
            assert lse[bi, h, blind] == pytest.approx(q[bi, h, blind] @ k[bi, 0, 0] / math.sqrt(d), rel=1e-12, abs=1e-13)
    np.testing.assert_allclose(out[:, :, -1], attention(q, k, v)[:, :, -1], rtol=1e-12, atol=1e-13)


def test_gqa_equals_repeated_heads(rng):
    for g in (1, 4, 8):
        hkv = 2
        q, k, v = qkv(rng, 2, hkv * g, hkv, 9, 17, 16)
        for causal in (False, True):
            got, got_lse = attention(q, k, v, causal=causal, return_lse=True)
            rep, rep_lse = attention(q, np.repeat(k, g, axis=1), np.repeat(v, g, axis=1), causal=causal,
                                     return_lse=True)
            np.testing.assert_allclose(got, rep, rtol=1e-13, atol=1e-15)
            np.testing.assert_allclose(got_lse, rep_lse, rtol=1e-13, atol=1e-14)
            if g > 1:  # head h reads kv head h // g, not h % Hkv
                tiled = attention(q, np.tile(k, (1, g, 1, 1)), np.tile(v, (1, g, 1, 1)), causal=causal)
                assert not np.allclose(got, tiled)


def test_custom_scale(rng):
    q, k, v = qkv(rng, 1, 2, 1, 13, 21, 32)
    for scale in (0.05, 1.0, 0.7):
        out, lse = attention(q, k, v, scale=scale, return_lse=True)
        want, want_lse = formula(q, k, v, scale=scale)
        np.testing.assert_allclose(out, want, rtol=1e-11, atol=1e-13)
        np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-13)
        # folding the scale into q gives the same answer
        np.testing.assert_allclose(out, attention(q * scale * math.sqrt(32), k, v), rtol=1e-10, atol=1e-13)
    # default scale is 1/sqrt(D)
    np.testing.assert_allclose(attention(q, k, v), attention(q, k, v, scale=1 / math.sqrt(32)), rtol=1e-15)
    # scale 0: uniform weights over the visible keys
    zero = attention(q, k, v, scale=0.0, causal=True)
    seen = visible_keys(13, 21, True)
    for i in range(13):
        np.testing.assert_allclose(zero[0, 0, i], v[0, 0, :seen[i]].mean(axis=0), rtol=1e-12, atol=1e-14)


def test_lse_is_log_sum_exp(rng):
    q, k, v = qkv(rng, 1, 3, 3, 10, 40, 16)
    _, lse = attention(q, k, v, return_lse=True)
    s = np.einsum("bhqd,bhkd->bhqk", q, k) / 4.0
    np.testing.assert_allclose(lse, np.log(np.exp(s).sum(axis=-1)), rtol=1e-12, atol=1e-13)
    # large scores: still finite and equal to the shifted formula (no overflow)
    _, big = attention(q * 200, k, v, return_lse=True)
    s_big = np.einsum("bhqd,bhkd->bhqk", q * 200, k) / 4.0
    m = s_big.max(axis=-1)
    assert np.all(np.isfinite(big)) and np.all(m > 100)
    np.testing.assert_allclose(big, m + np.log(np.exp(s_big - m[..., None]).sum(axis=-1)), rtol=1e-12, atol=1e-13)


def test_large_scores_do_not_overflow(rng):
    q, k, v = qkv(rng, 1, 1, 1, 6, 30, 16, scale_k=300.0)
    out = attention(q, k, v, causal=True)
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, formula(q, k, v, causal=True)[0], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("rows_per_chunk", [1, 3, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_chunking_over_query_rows(rng, monkeypatch, rows_per_chunk, causal):
    q, k, v = qkv(rng, 2, 4, 2, 23, 17, 16)
    one, one_lse = attention(q, k, v, causal=causal, return_lse=True)
    assert reference._CHUNK_ELEMENTS // 17 >= 23  # the default is one chunk for this shape
    monkeypatch.setattr(reference, "_CHUNK_ELEMENTS", rows_per_chunk * 17 + (17 - 1 if rows_per_chunk > 1 else 0))
    many, many_lse = attention(q, k, v, causal=causal, return_lse=True)
    np.testing.assert_allclose(many, one, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(many_lse, one_lse, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(many, formula(q, k, v, causal=causal)[0], rtol=1e-11, atol=1e-13)


def test_chunk_smaller_than_one_row(rng, monkeypatch):
    q, k, v = qkv(rng, 1, 1, 1, 9, 50, 8)
    want = attention(q, k, v, causal=True)
    monkeypatch.setattr(reference, "_CHUNK_ELEMENTS", 7)  # < Lk: still one row per chunk
    # atol for outputs near 0, where the chunk's BLAS summation order shows
    np.testing.assert_allclose(attention(q, k, v, causal=True), want, rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
def test_low_precision_inputs_are_computed_in_fp64(rng, dtype):
    q, k, v = (x.astype(dtype) for x in qkv(rng, 1, 2, 1, 7, 9, 16))
    out = attention(q, k, v)
    assert out.dtype == np.float64
    up = [x.astype(np.float64) for x in (q, k, v)]
    np.testing.assert_allclose(out, formula(*up)[0], rtol=1e-11, atol=1e-13)


def test_torch_cpu_tensors_are_accepted(rng):
    torch = pytest.importorskip("torch")
    q, k, v = qkv(rng, 1, 2, 2, 5, 6, 8)
    out = attention(*(torch.from_numpy(x) for x in (q, k, v)), causal=True)
    np.testing.assert_allclose(out, attention(q, k, v, causal=True), rtol=1e-15)


def test_public_alias():
    assert qattn.reference.attention is attention


@pytest.mark.parametrize("shapes, arg", [
    (((1, 2, 3), (1, 2, 3, 4), (1, 2, 3, 4)), "q"),
    (((1, 2, 3, 4), (1, 2, 3, 4), (1, 2, 5, 4)), "v"),
    (((2, 2, 3, 4), (1, 2, 3, 4), (1, 2, 3, 4)), "k"),
    (((1, 2, 3, 4), (1, 2, 3, 8), (1, 2, 3, 8)), "k"),
    (((1, 3, 3, 4), (1, 2, 3, 4), (1, 2, 3, 4)), "q"),
])
def test_bad_shapes_name_the_argument(rng, shapes, arg):
    with pytest.raises(ValueError, match=rf"^{arg}:"):
        check_shapes(*shapes)
    arrays = [rng.standard_normal(s) for s in shapes]
    with pytest.raises(ValueError, match=rf"^{arg}:"):
        attention(*arrays)


def test_check_shapes_returns_dims():
    assert check_shapes((2, 8, 5, 64), (2, 2, 7, 64), (2, 2, 7, 64)) == (2, 8, 2, 5, 7, 64)


def test_visible_keys():
    assert list(visible_keys(3, 5, False)) == [5, 5, 5]
    assert list(visible_keys(3, 3, True)) == [1, 2, 3]
    assert list(visible_keys(3, 5, True)) == [3, 4, 5]
    assert list(visible_keys(5, 3, True)) == [0, 0, 1, 2, 3]


@pytest.mark.parametrize("causal", [False, True])
def test_softmax_rows(rng, causal):
    q, k, v = qkv(rng, 1, 4, 2, 9, 6, 8)
    p = softmax_rows(q, k, causal=causal)
    assert p.shape == (1, 4, 9, 6) and np.all(p >= 0)
    sums = p.sum(axis=-1)
    seen = visible_keys(9, 6, causal)
    np.testing.assert_allclose(sums, np.broadcast_to((seen > 0).astype(float), sums.shape), rtol=1e-14)
    if causal:
        mask = np.arange(6)[None, :] >= seen[:, None]
        assert np.all(p[..., mask] == 0)
    o = np.einsum("bhqk,bhkd->bhqd", p, np.repeat(v, 2, axis=1))
    np.testing.assert_allclose(o, attention(q, k, v, causal=causal), rtol=1e-12, atol=1e-14)
