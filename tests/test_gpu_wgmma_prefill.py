"""f16, bf16 and i8-f16 on the warp-specialized wgmma pipeline (sm_90a; mma="wgmma", the default
there) on the GPU: against FP64 at the mma.sync kernels' tolerances (and i8-f16 within rel_l2 1e-3 of
its emulator under the kernel's scale layout), causal and not, GQA 1/4/8, D64/D128, lengths that are
no multiple of any tile, LSE, causal rows with no key, strided inputs and output, NaN-poisoned
outputs fully written, other valid tiles, and agreement with the mma.sync kernel on the same inputs.
Skipped off sm_90a (CPU half: tests/test_wgmma_prefill.py)."""
from __future__ import annotations

import numpy as np
import pytest

import qattn
from qattn.check import metrics, reference
from test_gpu_i8 import _check as _check_i8
from test_gpu_i8 import _f32
from test_gpu_i8 import _inputs as _i8_inputs
from test_gpu_prefill import TOL_REL_L2, _inputs

pytestmark = pytest.mark.gpu

FORMATS = ["f16", "bf16", "i8-f16"]
LQ = [1, 77, 1500]
LK = [1, 129, 2100]


def _kernel(fmt, head_dim, causal, tile=None, mma="wgmma"):
    from qattn.engine.spec import device_arch

    if device_arch() != "sm_90a":
        pytest.skip("wgmma needs sm_90a")
    kernel = qattn.build("prefill", format=fmt, head_dim=head_dim, causal=causal, mma=mma,
                         **({"tile": tile} if tile else {}))
    assert kernel.spec.family.values["mma_unit"] == mma
    return kernel


def _host_inputs(rng, fmt, b, hq, hkv, lq, lk, d):
    """N(0,1) inputs (K with a per-channel offset for i8-f16, what smoothing removes)."""
    if fmt == "i8-f16":
        return _i8_inputs(rng, "float16", b, hq, hkv, lq, lk, d)
    return _inputs(rng, fmt, b, hq, hkv, lq, lk, d)


def _poisoned(shape, dtype):
    import cupy

    return cupy.full(shape, np.nan, dtype=dtype)


def _check(fmt, kernel, out, host, *, causal, lse=None, scale=None):
    """out (and lse) against FP64 (i8-f16: and its emulator); every element written."""
    assert not np.isnan(_f32(out)).any(), "out has NaNs: not every element was written"
    if fmt == "i8-f16":
        from qattn.formats.int8qk import host as int8

        return _check_i8(fmt, out, host, causal=causal, scale=scale, lse=lse, options=int8.emulator_options(kernel.spec))
    ref = reference.attention(*host, causal=causal, scale=scale, return_lse=lse is not None)
    err = metrics.compare(out, ref[0] if lse is not None else ref)
    assert err.nonfinite == 0, err
    assert err.rel_l2 <= TOL_REL_L2[fmt], err
    if lse is not None:
        np.testing.assert_allclose(_f32(lse), ref[1], rtol=1e-5, atol=1e-5)
    return err


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq", LQ)
@pytest.mark.parametrize("lk", LK)
def test_against_fp64(fmt, head_dim, causal, lq, lk):
    kernel = _kernel(fmt, head_dim, causal)
    seed = hash(("wgmma-prefill", fmt, head_dim, causal, lq, lk)) % 2**32  # printed so a failure can be replayed
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    group = (1, 4, 8)[(lq + lk) % 3]
    host, (q, k, v) = _host_inputs(rng, fmt, 1, 8, 8 // group, lq, lk, head_dim)
    out = _poisoned(q.shape, q.dtype)
    assert kernel(q, k, v, out=out) is out
    _check(fmt, kernel, out, host, causal=causal)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gqa_and_lse(fmt, group, head_dim):
    import cupy

    kernel = _kernel(fmt, head_dim, True)
    rng = np.random.default_rng(group + head_dim)
    host, (q, k, v) = _host_inputs(rng, fmt, 2, 8, 8 // group, 300, 1029, head_dim)
    out = _poisoned(q.shape, q.dtype)
    lse = cupy.full(q.shape[:3], np.nan, dtype=cupy.float32)
    res, res_lse = kernel(q, k, v, out=out, lse=lse, scale=0.05)
    assert res is out and res_lse is lse
    _check(fmt, kernel, out, host, causal=True, lse=lse, scale=0.05)


@pytest.mark.parametrize("fmt", FORMATS)
def test_causal_rows_without_keys_are_zero(fmt):
    kernel = _kernel(fmt, 64, True)
    rng = np.random.default_rng(7)
    host, (q, k, v) = _host_inputs(rng, fmt, 1, 4, 2, 1500, 129, 64)  # the first 1371 rows see no key
    out, lse = kernel(q, k, v, return_lse=True)
    assert np.all(_f32(out)[:, :, :1371] == 0)
    assert np.all(np.isneginf(_f32(lse)[:, :, :1371]))
    _check(fmt, kernel, out, host, causal=True, lse=lse)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("causal", [False, True])
def test_strided_bshd_views(fmt, causal):
    """q, k, v and out stored [B, L, H, D] and seen as [B, H, L, D]: the producer's row gathers and
    the consumers' Q rows follow the strides."""
    import cupy

    kernel = _kernel(fmt, 128, causal)
    rng = np.random.default_rng(3)
    host, _ = _host_inputs(rng, fmt, 2, 8, 2, 333, 777, 128)
    q, k, v = (cupy.ascontiguousarray(cupy.asarray(x).transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3) for x in host)
    assert not q.flags.c_contiguous
    store = _poisoned((2, 333, 8, 128), q.dtype)
    out = store.transpose(0, 2, 1, 3)
    assert kernel(q, k, v, out=out) is out
    _check(fmt, kernel, out, host, causal=causal)


@pytest.mark.parametrize("fmt,head_dim,tile,causal", [
    ("f16", 64, (192, 64, 12, 2), False), ("f16", 64, (192, 64, 12, 2), True),
    ("bf16", 64, (64, 128, 4, 2), True), ("f16", 128, (128, 64, 8, 3), True),
    ("bf16", 128, (128, 64, 8, 2), False), ("i8-f16", 64, (128, 64, 8, 2), True),
    ("i8-f16", 64, (64, 128, 4, 2), False)])
def test_other_tiles(fmt, head_dim, tile, causal):
    """One and three consumer warpgroups, 64-key tiles, a deeper ring."""
    from qattn.engine.tile import Tile

    kernel = _kernel(fmt, head_dim, causal, Tile(*tile))
    rng = np.random.default_rng(23)
    host, (q, k, v) = _host_inputs(rng, fmt, 1, 4, 4, 700, 1100, head_dim)
    out = _poisoned(q.shape, q.dtype)
    kernel(q, k, v, out=out)
    _check(fmt, kernel, out, host, causal=causal)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_agrees_with_mma_sync(fmt, head_dim, causal):
    """The wgmma and mma.sync kernels compute the same format on the same inputs: within the format's
    tolerance of each other (i8-f16's scale blocks differ between them: per row on wgmma, per 128 rows
    on mma.sync), and the default call (qattn.attention) runs the measured faster one: wgmma for
    i8-f16, mma.sync for f16 and bf16."""
    from qattn.api import default_spec

    wgmma, sync = _kernel(fmt, head_dim, causal), _kernel(fmt, head_dim, causal, mma="mma.sync")
    faster = "wgmma" if fmt == "i8-f16" else "mma.sync"
    assert default_spec(fmt, head_dim, causal=causal).family.values["mma_unit"] == faster
    rng = np.random.default_rng(head_dim + causal)
    host, (q, k, v) = _host_inputs(rng, fmt, 2, 8, 2, 1111, 1500, head_dim)
    a, b = wgmma(q, k, v), sync(q, k, v)
    tol = TOL_REL_L2[fmt] if fmt in TOL_REL_L2 else qattn.recipe(fmt).tolerance.rel_l2
    err = metrics.compare(_f32(a), _f32(b))
    assert err.nonfinite == 0 and err.rel_l2 <= tol, err
    default = qattn.attention(q, k, v, format=fmt, causal=causal)
    assert metrics.compare(_f32(default), _f32(a if faster == "wgmma" else b)).rel_l2 == 0
