"""Q/K channel balancing of an 8-bit K decode cache (k_balance) on the GPU: the writer's bytes and α
against the host model, every balanced QK path against its emulator (rel_l2 1e-3) with and without a
K bias and page means, a given (not power-of-two) α, and a balanced decode step in a CUDA graph."""
from __future__ import annotations

import numpy as np
import pytest

import qattn
from decode_steps import assert_stored_alike, decode_over_splits, replay_decode_steps, write_in_parts
from qattn.check import metrics
from qattn.formats.decode import emulate as emu
from qattn.formats.decode.quant import HostPagedCache
from qattn.formats.decode.recipes import emulator_rel_l2, tolerance

pytestmark = pytest.mark.gpu
EMU_REL_L2 = 1e-3


def _emu_rel_l2(path: str) -> float:
    from qattn.engine.spec import device_arch

    return emulator_rel_l2(path, device_arch())  # the sm_90a fp8 path: 4e-3 on these outlier channels


OUTLIERS = (3, 17, 40)  # scale-type outlier channels of the test K (50-200x an ordinary channel)


def _dtype(fmt: str):
    import ml_dtypes

    return ml_dtypes.bfloat16 if "bf16" in fmt else np.float16


def _balanced(fmt, *, lens, kv_heads=2, head_dim=128, page_size=16, scale="token", k_bias=None, k_mean="off",
              k_balance="calibrate", seed=0):
    """A balanced GPU cache and its host model written alike with K holding scale-type outlier channels (and
    the bias, if any, added): every sequence's prompt (its first quarter) in one write, then 64 tokens of each
    sequence a write (pages shuffled); plus the table and the original K/V per sequence."""
    rng = np.random.default_rng(seed)
    k_side, v_side = fmt.split("-")
    max_pages = max(-(-int(n) // page_size) for n in lens) + 1
    num_pages = len(lens) * max_pages + 3
    options = dict(k_bias=k_bias, k_mean=k_mean, k_balance=k_balance)
    cache = qattn.PagedKVCache(num_pages, page_size, kv_heads, head_dim, k=k_side, v=v_side, scale=scale, **options)
    host = HostPagedCache.empty(fmt, num_pages, page_size, kv_heads, head_dim, scale, **options)
    table = rng.permutation(num_pages)[:len(lens) * max_pages].reshape(len(lens), max_pages).astype(np.int32)
    gain = np.ones(head_dim)
    gain[list(OUTLIERS)] = np.array([50.0, 120.0, 200.0]) / 3
    dtype = _dtype(fmt)
    ks, vs, slots = [], [], []
    for b, n in enumerate(lens):
        bias = 0 if k_bias is None else np.asarray(k_bias)[None]
        ks.append((rng.standard_normal((n, kv_heads, head_dim)) * gain + bias).astype(dtype))
        vs.append(rng.standard_normal((n, kv_heads, head_dim)).astype(dtype))
        slots.append((table[b, np.arange(n) // page_size] * page_size + np.arange(n) % page_size).astype(np.int32))
    write_in_parts(cache, host, ks, vs, slots, scale=scale)
    return (cache, host, table, np.asarray(lens, np.int32), [k.astype(np.float64).transpose(1, 0, 2) for k in ks],
            [v.astype(np.float64).transpose(1, 0, 2) for v in vs])


@pytest.mark.parametrize("fmt, scale, k_mean, biased", [("i8-i8", "token", "off", False), ("e4m3-e4m3", "token", "off", True),
                                                        ("i8-f16", "head", "off", False), ("i8-i8", "token", "page", True),
                                                        ("e4m3-bf16", "head", "page", False)])
def test_balanced_writer_stores_what_the_host_model_stores(fmt, scale, k_mean, biased):
    """The calibrated α (powers of two, > 1 on the outlier channels), the codes and the scales are the host
    model's bit for bit."""
    import cupy

    bias = (np.random.default_rng(5).standard_normal((2, 64)) * 20).astype(np.float32) if biased else None
    cache, host, *_ = _balanced(fmt, lens=[45, 300, 130], head_dim=64, scale=scale, k_bias=bias, k_mean=k_mean)
    got = cache.host()
    np.testing.assert_array_equal(cupy.asnumpy(cache.k_balance), host.alpha)
    assert (host.alpha[:, list(OUTLIERS)] >= 4).all()
    np.testing.assert_array_equal(got.alpha, host.alpha)
    assert_stored_alike(got, host)


@pytest.mark.parametrize("fmt, path", [("i8-i8", "transform"), ("i8-i8", "int8"), ("e4m3-e4m3", "transform"),
                                       ("e4m3-e4m3", "fp8"), ("i8-f16", "int8"), ("e4m3-bf16", "transform"),
                                       ("i8-bf16", "transform")])
@pytest.mark.parametrize("head_dim, group, lq, page_size", [(128, 4, 1, 16), (64, 8, 2, 32), (128, 1, 5, 64),
                                                            (256, 4, 3, 128)])
@pytest.mark.parametrize("terms", ["alone", "bias+mean"])
def test_balanced_decode_matches_emulator(fmt, path, head_dim, group, lq, page_size, terms):
    """Balanced decode over tails (a sequence of 1 + lq keys, lengths off the page and step grid), one, three
    and automatic splits, into NaN-poisoned outputs, alone or with a K bias and page means: within rel_l2 1e-3
    of the emulator, its LSE too, and within the format's rel_l2 of FP64 on the cache."""
    bias = (np.random.default_rng(6).standard_normal((2, head_dim)) * 20).astype(np.float32) if terms != "alone" else None
    cache, host, table, lens, *_ = _balanced(fmt, lens=[1 + lq, 777, 2100], head_dim=head_dim, page_size=page_size,
                                             k_bias=bias, k_mean="page" if terms != "alone" else "off")
    rng = np.random.default_rng(1)
    q = rng.standard_normal((3, 2 * group, lq, head_dim)).astype(_dtype(fmt))
    ref = emu.reference(q, host, table, lens)
    lse_tol = 2e-3 * _emu_rel_l2(path) / EMU_REL_L2  # the LSE takes the scores' error too
    for splits, got in decode_over_splits(q, cache, host, table, lens, qk=path, emu_rel_l2=_emu_rel_l2(path),
                                          lse_tol=lse_tol):
        if path == "transform":  # the 8-bit paths' Q rounding grows with q·α's outlier channels
            assert metrics.compare(got, ref).rel_l2 <= tolerance(fmt, path).rel_l2, (splits, metrics.compare(got, ref))


@pytest.mark.parametrize("fmt, path", [("i8-i8", "transform"), ("i8-i8", "int8"), ("e4m3-f16", "fp8")])
def test_a_given_alpha_need_not_be_a_power_of_two(fmt, path):
    """α given (3 on the outlier channels, 1.5 elsewhere on one head): the writer stores K x fl(1/α), the kernel
    rounds q·α as the emulator does."""
    import cupy

    alpha = np.ones((2, 128), np.float32)
    alpha[:, list(OUTLIERS)] = 3.0
    alpha[1, ::7] = 1.5
    cache, host, table, lens, *_ = _balanced(fmt, lens=[300, 901], k_balance=alpha)
    np.testing.assert_array_equal(cache.host().k, host.k)
    q = np.random.default_rng(2).standard_normal((2, 8, 2, 128)).astype(np.float16)
    got = cupy.asnumpy(qattn.decode(cupy.asarray(q), cache, cupy.asarray(table), cupy.asarray(lens), splits=2, qk=path))
    want = emu.emulate(q, host, table, lens, splits=2, qk=path)
    assert metrics.compare(got.astype(np.float32), want).rel_l2 <= _emu_rel_l2(path)


def test_balancing_cuts_the_int8_error_on_the_gpu():
    """The kernel on the balanced i8-i8 cache is several times closer to the original K/V than the unbalanced
    cache's emulator (measured 4-6x by the emulators on the outlier presets)."""
    import cupy

    cache, host, table, lens, ks, vs = _balanced("i8-i8", lens=[700, 1500])
    q = np.random.default_rng(3).standard_normal((2, 8, 1, 128)).astype(np.float16)
    got = cupy.asnumpy(qattn.decode(cupy.asarray(q), cache, cupy.asarray(table), cupy.asarray(lens), qk="transform"))
    _, plain, table_p, lens_p, *_ = _balanced("i8-i8", lens=[700, 1500], k_balance=None)
    dense = emu.reference_dense(q, ks, vs)
    plain_err = metrics.compare(emu.emulate(q, plain, table_p, lens_p), dense).rel_l2
    assert metrics.compare(got.astype(np.float32), dense).rel_l2 < plain_err / 2


def test_cuda_graph_capture_of_a_balanced_decode_step():
    """The calibrating first write is refused under capture; after it, write + decode on a balanced cache
    (with page means) captured once and replayed as tokens arrive: every replay equals a fresh call and the
    emulator."""
    import cupy

    fmt, b, hkv, d = "i8-i8", 2, 2, 128
    fresh_cache = qattn.PagedKVCache(4, 16, hkv, d, k="i8", v="i8", k_balance="calibrate")
    stream = cupy.cuda.Stream(non_blocking=True)
    k_new, v_new = cupy.zeros((b, hkv, d), cupy.float16), cupy.zeros((b, hkv, d), cupy.float16)
    slots = cupy.zeros(b, cupy.int32)
    with stream:
        stream.begin_capture()
        try:
            with pytest.raises(ValueError, match="k_balance='calibrate' computes α"):
                fresh_cache.write(k_new, v_new, slots, stream=stream)
        finally:
            stream.end_capture()
    cache, host, table, lens, *_ = _balanced(fmt, lens=[60, 95], kv_heads=hkv, head_dim=d, k_mean="page")
    outliers = np.where(np.isin(np.arange(d), OUTLIERS), 60, 1)  # lengths 61..63 and 96..98: a page starts at 96
    replay_decode_steps(cache, host, table, lens, kv_heads=hkv, head_dim=d, qk="int8", page_size=16,
                        new_k=lambda rng, shape: rng.standard_normal(shape) * outliers)
