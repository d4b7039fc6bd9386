"""int8-QK kernels (i8-f16, i8-i8, i8-f8) on the GPU: each against its CPU emulator (what the
kernel must compute, rel_l2 <= 1e-3) and against FP64 (the recipe's tolerance); tails, GQA,
causal Lq != Lk, fp16 and bf16, strided BSHD views, LSE with q·K̄ restored, NaN-poisoned outputs,
64-bit offsets, the separate quantization steps (codes checked exactly against qattn.check.quant)
and argument errors.

Run the first GPU check in this order (each isolates one layer): test_quantization_steps_match_quant
(the quantization kernels alone), then test_against_emulator_and_fp64 for one small shape, then the
rest."""
import numpy as np
import pytest

import qattn
from qattn.engine.fragments import pv_key_slot
from qattn.engine.registry import recipe
from qattn.check import emulate
from qattn.check import metrics
from qattn.check import quant
from qattn.formats.int8qk import quant as i8quant
from qattn.formats.int8qk.host import untile_v16
from qattn.check import reference
from qattn.engine.arrays import numpy_dtype

pytestmark = pytest.mark.gpu

FORMATS = ["i8-f16", "i8-i8", "i8-f8"]
EMU_REL_L2 = 1e-3  # kernel vs its emulator


def emu_rel_l2(fmt: str) -> float:
    """The kernel-vs-emulator bound. What limits it: rounding P turns the kernel's one-ulp exp2
    differences (ex2.approx) into whole grid steps of P for the keys near a rounding tie. On four
    query rows over 2100 keys (the smallest case below), the emulator with exp2 perturbed by
    ±2^-22 differs from itself by up to 8.6e-4 rel_l2 for i8-i8 (steps of 1/127; 150 seeds),
    4.9e-4 for i8-f8 and 1.1e-4 for i8-f16 (60 seeds): i8-i8 gets 3e-3, the others 1e-3. A rarer
    seed puts one heavy key at a tie (i8-f8, d64, one row: 2.7e-3 in one head), so a case over the
    bound passes only if the emulator with its exponents moved a step or two (_check) comes within it."""
    return 3e-3 if fmt == "i8-i8" else EMU_REL_L2
F32 = np.float32


def _skip_unsupported(fmt):
    from qattn.engine.spec import device_arch

    if device_arch() not in recipe(fmt).family("cuda").archs:
        pytest.skip(f"{fmt} needs one of {recipe(fmt).family('cuda').archs}")


def _host(rng, shape, dtype, offset=None):
    x = rng.standard_normal(shape).astype(F32)
    if offset is not None:
        x = x + offset
    return x.astype(numpy_dtype(dtype))


def _inputs(rng, dtype, b, hq, hkv, lq, lk, d, k_bias=True):
    """N(0,1) q, k, v; k gets a per-channel offset (what K smoothing removes) unless k_bias is False."""
    import cupy

    bias = (2.0 * rng.standard_normal((1, 1, 1, d))).astype(F32) if k_bias else None
    host = [_host(rng, (b, hq, lq, d), dtype), _host(rng, (b, hkv, lk, d), dtype, bias),
            _host(rng, (b, hkv, lk, d), dtype)]
    return host, [cupy.asarray(x) for x in host]


def _f32(x):
    from qattn.check.reference import to_numpy

    return np.asarray(to_numpy(x)).astype(F32)


def _check(fmt, out, host, *, causal, scale=None, lse=None, options=None):
    """out against the emulator under the kernel's scale options (int8.emulator_options; default: the
    default kernel's; rounded to out's dtype, as the kernel rounds its fp32 result) and FP64."""
    if options is None:
        from qattn.formats.int8qk import host as int8
        from qattn.api import default_spec

        options = int8.emulator_options(default_spec(fmt, host[0].shape[-1], causal=causal))
    out32 = _f32(out)
    assert not np.isnan(out32).any(), "out has NaNs: not every element was written"
    emu = emulate.emulate(fmt, *host, causal=causal, scale=scale, return_lse=lse is not None, **options)
    emu_out = emu[0] if lse is not None else emu
    emu_out = emu_out.astype(host[0].dtype).astype(F32)
    err = metrics.compare(out32, emu_out)
    assert err.nonfinite == 0, err
    if err.rel_l2 > emu_rel_l2(fmt):
        # a key near a rounding tie of P: the emulator with its exponents a score step or two apart
        # (emulate.exp2_moved) brackets the kernel's rounding of them
        moved = {n: metrics.compare(out32, emulate.emulate(fmt, *host, causal=causal, scale=scale, exp2_ulps=n,
                                                            **options).astype(host[0].dtype).astype(F32)).rel_l2
                 for n in (-2, -1, 1, 2)}
        assert min(moved.values()) <= emu_rel_l2(fmt), ("vs emulator", err, "exponents moved", moved)
    tol = recipe(fmt).tolerance
    ref = reference.attention(*host, causal=causal, scale=scale, return_lse=lse is not None)
    ref_err = metrics.compare(out32, ref[0] if lse is not None else ref)
    assert ref_err.rel_l2 <= tol.rel_l2 and ref_err.max_rel <= tol.max_rel, ("vs FP64", ref_err, tol)
    if lse is not None:
        got = _f32(lse)
        np.testing.assert_allclose(got, emu[1], rtol=1e-4, atol=1e-4)  # natural log, q·K̄ restored
        np.testing.assert_allclose(got, ref[1], rtol=0, atol=5e-2)
    return err


def _poisoned(q):
    import cupy

    return cupy.full(q.shape, np.nan, dtype=q.dtype)


SHAPES = [(1, 1), (7, 7), (129, 129), (1, 2100), (129, 1500), (1500, 2100), (2100, 1500), (7, 129)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq,lk", SHAPES)
def test_against_emulator_and_fp64(fmt, head_dim, causal, lq, lk):
    _skip_unsupported(fmt)
    seed = hash((fmt, head_dim, causal, lq, lk)) % 2**32  # fresh per process; printed so a failure can be replayed
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    group = 4 if (lq + lk) % 2 else 1
    host, (q, k, v) = _inputs(rng, "float16", 1, 4, 4 // group, lq, lk, head_dim)
    out = _poisoned(q)
    res = qattn.attention(q, k, v, format=fmt, causal=causal, out=out)
    assert res is out
    _check(fmt, out, host, causal=causal)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq,lk", [(129, 1500), (2100, 1500)])
def test_bf16_inputs(fmt, head_dim, causal, lq, lk):
    _skip_unsupported(fmt)
    seed = hash(("bf16", fmt, head_dim, causal, lq, lk)) % 2**32  # fresh per process; printed so a failure can be replayed
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    host, (q, k, v) = _inputs(rng, "bfloat16", 2, 4, 1, lq, lk, head_dim)
    out = qattn.attention(q, k, v, format=fmt, causal=causal)
    assert out.dtype == q.dtype and out.shape == q.shape
    _check(fmt, out, host, causal=causal)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gqa_and_lse(fmt, group, dtype):
    _skip_unsupported(fmt)
    rng = np.random.default_rng(group)
    host, (q, k, v) = _inputs(rng, dtype, 2, 8, 8 // group, 300, 1029, 128)
    out = _poisoned(q)
    res, lse = qattn.attention(q, k, v, format=fmt, causal=True, return_lse=True, scale=0.05, out=out)
    assert res is out and lse.shape == (2, 8, 300) and lse.dtype == np.float32
    _check(fmt, out, host, causal=True, scale=0.05, lse=lse)


@pytest.mark.parametrize("fmt", FORMATS)
def test_causal_rows_without_keys(fmt):
    _skip_unsupported(fmt)
    rng = np.random.default_rng(7)
    host, (q, k, v) = _inputs(rng, "float16", 1, 2, 2, 300, 100, 64)  # first 200 rows see no key
    out, lse = qattn.attention(q, k, v, format=fmt, causal=True, return_lse=True)
    assert np.all(_f32(out)[:, :, :200] == 0)
    assert np.all(np.isneginf(_f32(lse)[:, :, :200]))
    _check(fmt, out, host, causal=True, lse=lse)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_strided_bshd_views(fmt, dtype):
    import cupy

    _skip_unsupported(fmt)
    rng = np.random.default_rng(3)
    b, length, h, d = 2, 777, 4, 128
    packed = cupy.asarray(_host(rng, (b, length, 3, h, d), dtype))
    q, k, v = (packed[:, :, i].transpose(0, 2, 1, 3) for i in range(3))  # BSHD views, no copy
    assert not q.flags.c_contiguous
    out_store = cupy.full((b, length, h, d), np.nan, dtype=q.dtype)
    out = out_store.transpose(0, 2, 1, 3)
    qattn.attention(q, k, v, format=fmt, out=out, causal=True)
    _check(fmt, out, [q.get(), k.get(), v.get()], causal=True)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim,causal", [(64, True), (128, False), (128, True)])
def test_output_independent_of_lse_and_steps(fmt, dtype, head_dim, causal):
    """The whole call, the whole call with LSE (which also has the quantization compute q·K̄) and
    quantize + attention_quantized give the same output bits: strided Q, GQA, a query tail whose
    128-row Q scale block ends past Lq."""
    import cupy
    from qattn.formats.int8qk import host as int8

    _skip_unsupported(fmt)
    rng = np.random.default_rng(21)
    b, hq, hkv, lq, lk = 2, 4, 2, 300, 1029
    host, (_, k, v) = _inputs(rng, dtype, b, hq, hkv, lq, lk, head_dim)
    q = cupy.asarray(host[0]).transpose(0, 2, 1, 3).copy().transpose(0, 2, 1, 3)  # BSHD storage
    assert not q.flags.c_contiguous
    kernel = qattn.build("prefill", format=fmt, head_dim=head_dim, causal=causal)
    whole = qattn.attention(q, k, v, format=fmt, causal=causal, out=_poisoned(q))
    steps = int8.attention_quantized(kernel, int8.quantize(q, k, v, kernel=kernel))
    with_lse, _ = qattn.attention(q, k, v, format=fmt, causal=causal, return_lse=True)
    bits = [x.get().view(np.uint16) for x in (whole, steps, with_lse)]
    assert np.array_equal(bits[0], bits[1]) and np.array_equal(bits[0], bits[2])
    _check(fmt, whole, host, causal=causal)


def _stored_column(keys):
    """Column of V^T (the kernel's key order inside each 16-key group) that holds each key."""
    return keys - keys % 16 + pv_key_slot(keys)


def _unpermute_vt(vt, lk):
    """[B, H, D, Lpad] V^T codes in the kernel's key order -> [B, H, Lk, D]."""
    return np.swapaxes(vt[..., _stored_column(np.arange(lk))], -1, -2)


def _quant_k(k_smooth, spec):
    """quant's K codes for the kernel of spec, and its K scales as the kernel stores them:
    [B, H, blocks·groups], each block's groups in order (a group absent from a short last block: 0)."""
    from qattn.formats.int8qk import host as int8

    opts = int8.emulator_options(spec)
    bn, groups = opts["block_n"], int8.k_scale_groups(spec)
    k8 = i8quant.quantize_int8(k_smooth, bn, granularity=opts["k_granularity"], operand="k")
    lk = k_smooth.shape[-2]
    pad = -(-lk // bn) * bn - lk  # zero keys leave every group's absmax alone
    padded = i8quant.quantize_int8(np.pad(k_smooth, [(0, 0)] * (k_smooth.ndim - 2) + [(0, pad), (0, 0)]), bn,
                                 granularity=opts["k_granularity"], operand="k")
    first = np.arange(0, lk + pad, bn)[:, None] + 2 * np.arange(groups)[None, :]  # a key of each group
    return k8, padded.scale[..., first.ravel(), 0]


def _quant_q(q2, spec):
    """quant's Q codes for the kernel of spec and its Q scales as stored [B, H, ceil(Lq / rows)]."""
    from qattn.formats.int8qk import host as int8

    rows = int8.scale_blocks(spec)[0]
    q8 = i8quant.quantize_int8(q2, rows, operand="q")
    return q8, q8.scale[..., ::rows, 0]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_quantization_steps_match_quant(fmt, dtype):
    """The quantization kernels alone, against qattn.check.quant (what the emulator uses)."""
    from qattn.formats.int8qk import host as int8

    _skip_unsupported(fmt)
    rng = np.random.default_rng(11)
    b, hq, hkv, lq, lk, d = 2, 4, 2, 300, 1029, 128
    host, (q, k, v) = _inputs(rng, dtype, b, hq, hkv, lq, lk, d)
    qkv = int8.quantize(q, k, v, format=fmt, with_shift=True)
    q32, k32, v32 = (np.asarray(x, F32) for x in host)
    scale = 1 / np.sqrt(d)
    spec = _default_spec(fmt)
    keys = int8.scale_blocks(spec)[1]  # 64, or 128 on the sm_90a wgmma kernel
    assert qkv.dims == (b, hq, hkv, lq, lk, d)
    assert qkv.emulator_options() == {**int8.emulator_options(spec), "smoothing": "mean"}
    # K mean and K codes (scales per block of keys, or per group of a block's keys)
    k_smooth, k_mean = i8quant.smooth_k(k32)
    np.testing.assert_allclose(qkv.k_mean.get(), k_mean[..., 0, :], rtol=1e-6, atol=1e-7)
    k8, k_scales = _quant_k(k_smooth, spec)
    got_k8 = qkv.k8_rows().get()
    mismatch = np.abs(got_k8.astype(int) - k8.codes.astype(int))
    assert mismatch.max() <= 1 and (mismatch > 0).mean() < 1e-4, "K codes"
    np.testing.assert_allclose(qkv.k_scale.get(), k_scales, rtol=1e-6)
    # Q codes: exact (they depend on q and the scale only)
    q2 = quant.fold_softmax_scale(q32, scale)
    q8, q_scales = _quant_q(q2, spec)
    np.testing.assert_array_equal(qkv.q8.get(), q8.codes)
    np.testing.assert_array_equal(qkv.q_scale.get(), q_scales)
    shift = np.einsum("bgqd,bgd->bgq", q2.reshape(b, hkv, hq // hkv * lq, d), k_mean[..., 0, :])
    np.testing.assert_allclose(qkv.shift.get(), shift.reshape(b, hq, lq), rtol=1e-4, atol=1e-5)
    # V operand
    pv = recipe(fmt).ctype["pv"]
    if pv == "f16":
        assert qkv.v.dtype == np.float16 and qkv.v_scale is None
        np.testing.assert_array_equal(qkv.v_rows().get(), v32.astype(np.float16))
        if qkv.v_tiles:  # the wgmma kernel's tiles (v_tiles "on"): the keys past Lk are zeros
            assert not untile_v16(qkv.v, qkv.v.shape[2], qkv.tile_keys)[:, :, lk:].any()
    else:
        vq = i8quant.quantize_v_int8(v32) if pv == "i8" else i8quant.quantize_v_e4m3(v32)
        if _default_spec(fmt).family.values["pv_operand"] == "f16":
            # e4m3 carried in fp16 (Hopper): rows of the codes' values, not transposed
            assert qkv.v.shape == (b, hkv, lk, d) and qkv.v.dtype == np.float16
            np.testing.assert_array_equal(qkv.v.get(), vq.codes.astype(F32).astype(np.float16))
        else:
            lk_pad = -(-lk // keys) * keys
            vt = qkv.vt_rows().get()
            assert vt.shape == (b, hkv, d, lk_pad) and vt.dtype == np.uint8
            # Padding keys (lk and beyond) sit at permuted columns, some of them below lk.
            pad_columns = _stored_column(np.arange(lk, lk_pad))
            assert not vt[..., pad_columns].any(), "V^T padding must be zero codes"
            np.testing.assert_array_equal(_unpermute_vt(vt, lk), vq.codes.view(np.uint8))
        np.testing.assert_array_equal(qkv.v_scale.get(), vq.scale[..., 0, :])
        p_scale = F32(quant.INT8_MAX if pv == "i8" else quant.E4M3_MAX)
        np.testing.assert_array_equal(qkv.v_out_scale.get(), (vq.scale[..., 0, :] / p_scale).astype(F32))


def _default_spec(fmt):
    from qattn.api import default_spec

    return default_spec(fmt, 128)


@pytest.mark.parametrize("fmt", FORMATS)
def test_separate_steps(fmt):
    """quantize once, attend many times; new queries against the same quantized K/V."""
    from qattn.formats.int8qk import host as int8

    _skip_unsupported(fmt)
    rng = np.random.default_rng(12)
    host, (q, k, v) = _inputs(rng, "float16", 1, 4, 2, 200, 700, 64)
    kernel = qattn.build("prefill", format=fmt, head_dim=64, causal=True)
    qkv = int8.quantize(q, k, v, kernel=kernel, with_shift=True)
    out, lse = int8.attention_quantized(kernel, qkv, return_lse=True)
    whole, whole_lse = qattn.attention(q, k, v, format=fmt, causal=True, return_lse=True)
    assert bytes(out.get().data) == bytes(whole.get().data)
    np.testing.assert_array_equal(lse.get(), whole_lse.get())
    _check(fmt, out, host, causal=True, lse=lse)
    # the LSE needs the shift
    bare = int8.quantize(q, k, v, kernel=kernel)
    assert bare.shift is None
    with pytest.raises(ValueError, match="with_shift"):
        int8.attention_quantized(kernel, bare, return_lse=True)
    assert bytes(int8.attention_quantized(kernel, bare).get().data) == bytes(out.get().data)
    # new queries (another length), same K/V codes
    q_new_host = _host(rng, (1, 4, 33, 64), "float16")
    import cupy

    qkv2 = qkv.with_query(cupy.asarray(q_new_host), kernel=kernel)
    assert qkv2.k8 is qkv.k8 and qkv2.dims[3] == 33
    out2 = int8.attention_quantized(kernel, qkv2)
    _check(fmt, out2, [q_new_host, host[1], host[2]], causal=True)
    # a kernel of another format or causality does not take these operands
    with pytest.raises(ValueError, match="causal"):
        int8.attention_quantized(kernel, qkv, causal=False)
    other = "i8-i8" if fmt != "i8-i8" else "i8-f16"
    with pytest.raises(ValueError, match="format"):
        int8.attention_quantized(qattn.build("prefill", format=other, head_dim=64, causal=True), qkv)


@pytest.mark.parametrize("fmt", FORMATS)
def test_output_deterministic(fmt):
    _skip_unsupported(fmt)
    rng = np.random.default_rng(9)
    host, (q, k, v) = _inputs(rng, "float16", 2, 4, 4, 1029, 2100, 128)
    a, b = _poisoned(q), _poisoned(q)
    qattn.attention(q, k, v, format=fmt, out=a, causal=True)
    qattn.attention(q, k, v, format=fmt, out=b, causal=True)
    assert not np.isnan(_f32(a)).any()
    assert bytes(a.get().data) == bytes(b.get().data)


@pytest.mark.parametrize("fmt", FORMATS)
def test_repeated_calls_follow_their_inputs(fmt):
    """A call's launches are planned once per signature: a repeated call computes its own new
    inputs, other strides and another scale get plans of their own, and a misaligned view with a
    planned shape and strides is still refused by name."""
    import cupy

    _skip_unsupported(fmt)
    rng = np.random.default_rng(21)
    kernel = qattn.build("prefill", format=fmt, head_dim=64, causal=True)
    host_a, (qa, ka, va) = _inputs(rng, "float16", 1, 4, 2, 130, 300, 64)
    host_b, (qb, kb, vb) = _inputs(rng, "float16", 1, 4, 2, 130, 300, 64)
    out_a = kernel(qa, ka, va)
    plans = len(kernel.plans)
    out_b = kernel(qb, kb, vb)
    assert len(kernel.plans) == plans
    _check(fmt, out_a, host_a, causal=True)
    _check(fmt, out_b, host_b, causal=True)
    q_bshd = cupy.ascontiguousarray(qb.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)  # same values, BSHD storage
    assert q_bshd.strides != qb.strides
    assert bytes(kernel(q_bshd, kb, vb).get().data) == bytes(out_b.get().data)
    assert len(kernel.plans) > plans
    _check(fmt, kernel(qb, kb, vb, scale=0.1), host_b, causal=True, scale=0.1)
    buffer = cupy.empty(qb.size + 8, dtype=cupy.float16)
    shifted = buffer[1:1 + qb.size].reshape(qb.shape)  # 2 bytes off, the planned strides
    shifted[...] = qb
    with pytest.raises(ValueError, match="q: data pointer must be 16-byte aligned"):
        kernel(shifted, kb, vb)


@pytest.mark.parametrize("fmt", ["i8-i8", "i8-f8"])
def test_offsets_past_2_to_31(fmt):
    """B·H·L·D past 2^31 elements: the kernels' int64 offsets (checked on the last heads); i8-f8
    covers the wgmma kernel and its tiled K8 / V^T where that is the default."""
    import cupy

    b, h, length, d = 1, 16400, 1024, 128  # 2.15e9 elements per tensor
    assert b * h * length * d > 2**31
    cupy.random.seed(5)
    q, k, v = (cupy.random.standard_normal((b, h, length, d), dtype=cupy.float32).astype(cupy.float16)
               for _ in range(3))
    out = qattn.attention(q, k, v, format=fmt)
    tail = slice(h - 2, h)
    host = [x[:, tail].get() for x in (q, k, v)]
    got = out[:, tail].get()
    del q, k, v, out
    cupy.get_default_memory_pool().free_all_blocks()
    _check(fmt, got, host, causal=False)


def test_bad_inputs_raise_clear_errors():
    import cupy

    from qattn.formats.int8qk import host as int8

    q = cupy.ones((1, 2, 16, 64), dtype=cupy.float16) * 0.5
    with pytest.raises(TypeError, match="q: format 'i8-i8' takes float16 or bfloat16"):
        qattn.attention(q.astype(cupy.float32), q, q, format="i8-i8")
    with pytest.raises(TypeError, match="one dtype"):
        q_bf16 = cupy.asarray(np.full((1, 2, 16, 64), 0.5, dtype=numpy_dtype("bfloat16")))
        qattn.attention(q, q_bf16, q_bf16, format="i8-i8")
    with pytest.raises(ValueError, match="head_dim"):
        qattn.attention(*(cupy.ones((1, 2, 16, 96), dtype=cupy.float16),) * 3, format="i8-i8")
    with pytest.raises(ValueError, match="k: head_dim"):
        bad = cupy.ones((1, 2, 16, 128), dtype=cupy.float16)
        qattn.attention(q, bad, bad, format="i8-i8")
    with pytest.raises(ValueError, match="multiple"):
        qattn.attention(cupy.ones((1, 3, 16, 64), dtype=cupy.float16), q, q, format="i8-i8")
    with pytest.raises(ValueError, match="out: expected shape"):
        qattn.attention(q, q, q, format="i8-i8", out=cupy.empty((1, 2, 15, 64), dtype=cupy.float16))
    with pytest.raises(ValueError, match="out: expected shape"):
        qattn.attention(q, q, q, format="i8-i8", out=cupy.empty((1, 2, 16, 64), dtype=cupy.float32))
    with pytest.raises(ValueError, match="contiguous"):
        wide = cupy.ones((1, 2, 16, 128), dtype=cupy.float16)
        qattn.attention(wide[..., ::2], wide[..., ::2], wide[..., ::2], format="i8-i8")
    with pytest.raises(TypeError, match="q: expected a CUDA array"):
        qattn.attention(np.ones((1, 2, 16, 64), np.float16), q, q, format="i8-i8")
    with pytest.raises(ValueError, match="scale"):
        qattn.attention(q, q, q, format="i8-i8", scale=-1.0)
    with pytest.raises(ValueError, match="format"):
        int8.quantize(q, q, q)


def test_constant_inputs_give_finite_output():
    """All-equal keys (K − K̄ = 0: s_K = 0) and all-zero queries (s_Q = 0): zero scores, uniform p."""
    import cupy

    from qattn.engine.spec import device_arch

    for fmt in FORMATS:
        if device_arch() not in recipe(fmt).family("cuda").archs:
            continue
        q = cupy.zeros((1, 2, 130, 64), dtype=cupy.float16)
        k = cupy.ones((1, 2, 200, 64), dtype=cupy.float16)
        rng = np.random.default_rng(4)
        v_host = rng.standard_normal((1, 2, 200, 64)).astype(np.float16)
        out, lse = qattn.attention(q, k, cupy.asarray(v_host), format=fmt, causal=True, return_lse=True)
        host = [q.get(), k.get(), v_host]
        _check(fmt, out, host, causal=True, lse=lse)


# ---- K smoothing on and off (smoothing), on model-like K (issue 4) -----------------------------
# Presets of qattn.data in fp16; one FP64 reference per case; every int8-QK format with smoothing
# on and off, each against its emulator (same scale blocks as the kernel's tile) and FP64. What the
# emulators measured on these inputs (2 heads x 256 rows, seeds below; tests/test_smoothing.py has
# the survey over seeds): i8-f8 rel_l2 ~0.041-0.043 with smoothing; without it 8-10x that on
# outliers and 4.5-5.5x on bias; at 32K i8-f8 cos ~0.99906-0.99913 on outliers (e4m3 PV's own
# level: 0.9992 on N(0,1)) and i8-i8 1.3-1.5x i8-f8's rel_l2 (about level at 4K).

SMOOTH_PRESETS = ("outliers", "bias")
SMOOTH_CTX = (1024, 4096, 32768)
SMOOTH_ROWS, SMOOTH_HEADS, SMOOTH_DIM = 256, 2, 128
SMOOTH_OFF_FACTOR = 3.0  # rel_l2 without smoothing >= this x with it (measured >= 4.5x)
I8_PV_BEHIND_AT_32K = 1.15  # i8-i8 rel_l2 >= this x i8-f8's at 32K (measured 1.25-1.68x)


def _smoothing_host(preset, ctx):
    from qattn import data

    seed = {"outliers": 40, "bias": 41}[preset] + ctx
    d = data.preset(preset, ctx=ctx, queries=SMOOTH_ROWS, heads=SMOOTH_HEADS, head_dim=SMOOTH_DIM, seed=seed)
    return [d[name].astype(np.float16) for name in "qkv"]


def _smoothing_case(preset, ctx, causal, attend):
    """attend(fmt, host, causal, smoothing) -> (out, lse, emulator options) as float32 NumPy.
    Checks each run against its emulator and the formats' claims against FP64; returns the errors."""
    host = _smoothing_host(preset, ctx)
    ref = reference.attention(*host, causal=causal)
    errs = {}
    for fmt in FORMATS:
        for smooth in ("mean", None):
            out, lse, options = attend(fmt, host, causal, smooth)
            assert not np.isnan(out).any(), "out has NaNs: not every element was written"
            emu, emu_lse = emulate.emulate(fmt, *host, causal=causal, return_lse=True, smoothing=smooth, **options)
            vs_emu = metrics.compare(out, emu.astype(np.float16).astype(F32))
            assert vs_emu.nonfinite == 0 and vs_emu.rel_l2 <= emu_rel_l2(fmt), ("vs emulator", fmt, smooth, vs_emu)
            np.testing.assert_allclose(lse, emu_lse, rtol=1e-4, atol=1e-4)  # smoothing None: no q·K̄ added
            errs[fmt, smooth] = metrics.compare(out, ref)
    for fmt in FORMATS:
        on, off, tol = errs[fmt, "mean"], errs[fmt, None], recipe(fmt).tolerance
        assert on.rel_l2 <= tol.rel_l2 and on.max_rel <= tol.max_rel, ("vs FP64", fmt, on, tol)
        assert off.rel_l2 >= SMOOTH_OFF_FACTOR * on.rel_l2, ("smoothing off not markedly worse", fmt, on, off)
    if ctx >= 32768:
        f8, i8 = errs["i8-f8", "mean"], errs["i8-i8", "mean"]
        assert i8.rel_l2 >= I8_PV_BEHIND_AT_32K * f8.rel_l2, ("i8-i8 vs i8-f8 at 32K", i8, f8)
        if preset == "outliers":
            assert f8.cos >= 0.999, ("i8-f8 cos at 32K on outliers", f8)
    return errs


def _gpu_attend(fmt, host, causal, smoothing):
    import cupy

    q, k, v = (cupy.asarray(x) for x in host)
    from qattn.formats.int8qk import host as int8

    spec = qattn.build("prefill", format=fmt, head_dim=q.shape[-1], causal=causal).spec  # what attention runs
    out = _poisoned(q)
    res, lse = qattn.attention(q, k, v, format=fmt, causal=causal, return_lse=True, out=out, smoothing=smoothing)
    assert res is out
    return _f32(out), _f32(lse), int8.emulator_options(spec)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("ctx", SMOOTH_CTX)
@pytest.mark.parametrize("preset", SMOOTH_PRESETS)
def test_smoothing_on_model_like_k(preset, ctx, causal):
    """outliers / bias K at 1K, 4K, 32K: every format with smoothing "mean" and None matches its emulator
    (rel_l2 <= 1e-3, LSE to 1e-4); smoothing off is >= 3x worse vs FP64; at 32K i8-i8 trails i8-f8
    and, on outliers, i8-f8 keeps cos >= 0.999."""
    for fmt in FORMATS:
        _skip_unsupported(fmt)
    errs = _smoothing_case(preset, ctx, causal, _gpu_attend)
    print(preset, ctx, causal, {f"{f}{'' if s else ' off'}": (round(e.rel_l2, 5), round(e.cos, 6))
                                for (f, s), e in errs.items()})


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_without_smoothing(fmt):
    """smoothing=None: K̄ is zeros, K codes and scales are quant's of K as given (exactly), the shift
    is 0, Q and V are as with smoothing; attention(smoothing=...) runs the same operands, and so does
    the deprecated smooth_k (with a DeprecationWarning)."""
    import cupy

    from qattn.formats.int8qk import host as int8

    _skip_unsupported(fmt)
    rng = np.random.default_rng(13)
    b, hq, hkv, lq, lk, d = 2, 4, 2, 300, 1029, 128
    host, (q, k, v) = _inputs(rng, "float16", b, hq, hkv, lq, lk, d)
    kernel = qattn.build("prefill", format=fmt, head_dim=d, causal=True)
    off = int8.quantize(q, k, v, kernel=kernel, with_shift=True, smoothing=None)
    on = int8.quantize(q, k, v, kernel=kernel, with_shift=True)
    assert off.smoothing is None and on.smoothing == "mean" and off.alpha is None and on.alpha is None
    assert off.k_mean.shape == (b, hkv, d) and not off.k_mean.any() and not off.shift.any()
    k8, k_scales = _quant_k(np.asarray(host[1], F32), kernel.spec)
    np.testing.assert_array_equal(off.k8_rows().get(), k8.codes)
    np.testing.assert_array_equal(off.k_scale.get(), k_scales)
    np.testing.assert_array_equal(off.q8.get(), on.q8.get())
    np.testing.assert_array_equal(off.q_scale.get(), on.q_scale.get())
    assert bytes(off.v.get().data) == bytes(on.v.get().data)
    # the launcher path: "mean" is the default (smooth_k=True its alias), None runs the operands above
    default = qattn.attention(q, k, v, format=fmt, causal=True)
    with pytest.warns(DeprecationWarning, match="smooth_k is deprecated"):
        alias = qattn.attention(q, k, v, format=fmt, causal=True, smooth_k=True)
    assert bytes(alias.get().data) == bytes(default.get().data)
    out, lse = qattn.attention(q, k, v, format=fmt, causal=True, smoothing=None, return_lse=True)
    with pytest.warns(DeprecationWarning, match="smooth_k is deprecated"):
        alias = qattn.attention(q, k, v, format=fmt, causal=True, smooth_k=False)
    assert bytes(alias.get().data) == bytes(out.get().data)
    direct, direct_lse = int8.attention_quantized(kernel, off, return_lse=True)
    assert bytes(out.get().data) == bytes(direct.get().data)
    np.testing.assert_array_equal(lse.get(), direct_lse.get())
    emu, emu_lse = emulate.emulate(fmt, *host, causal=True, return_lse=True, smoothing=None,
                                   **int8.emulator_options(kernel.spec))
    assert metrics.compare(_f32(out), emu.astype(np.float16).astype(F32)).rel_l2 <= emu_rel_l2(fmt)
    np.testing.assert_allclose(_f32(lse), emu_lse, rtol=1e-4, atol=1e-4)
    # new queries keep K̄ = 0
    qkv2 = off.with_query(cupy.ascontiguousarray(q[:, :, :33]), kernel=kernel)
    assert qkv2.smoothing is None and qkv2.k8 is off.k8 and not qkv2.shift.any()
    with pytest.raises(ValueError, match="smoothing: format 'f16'"):
        qattn.attention(q, k, v, format="f16", smoothing=None)


# ---- the fused quantization launches (CUDA): exact codes, fixed-order statistics -----------------

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d,lk", [(128, 9001), (64, 1029), (128, 37)])
def test_fused_quantization_is_exact(fmt, dtype, d, lk):
    """K̄ equals the fp64 mean rounded to fp32 (exact sums of these inputs), so K codes and every scale
    match quant bit for bit; V^T / V rows and Q too; two calls give identical bytes (no atomics)."""
    from qattn.formats.int8qk import host as int8

    _skip_unsupported(fmt)
    rng = np.random.default_rng(lk + d)
    b, hq, hkv, lq = 2, 4, 2, 300
    host, (q, k, v) = _inputs(rng, dtype, b, hq, hkv, lq, lk, d)
    kernel = qattn.build("prefill", format=fmt, head_dim=d)
    qkv = int8.quantize(q, k, v, kernel=kernel, with_shift=True)
    again = int8.quantize(q, k, v, kernel=kernel, with_shift=True)
    for name in ("q8", "q_scale", "k8", "k_scale", "k_mean", "shift", "v", "v_scale", "v_out_scale"):
        a, b2 = getattr(qkv, name), getattr(again, name)
        assert (a is None) == (b2 is None) and (a is None or bytes(a.get().data) == bytes(b2.get().data)), name
    q32, k32, v32 = (np.asarray(x, F32) for x in host)
    k_smooth, k_mean = i8quant.smooth_k(k32)
    np.testing.assert_array_equal(qkv.k_mean.get(), k_mean[..., 0, :])
    k8, k_scales = _quant_k(k_smooth, kernel.spec)
    np.testing.assert_array_equal(qkv.k8_rows().get(), k8.codes)
    np.testing.assert_array_equal(qkv.k_scale.get(), k_scales)
    q8, q_scales = _quant_q(quant.fold_softmax_scale(q32, 1 / np.sqrt(d)), kernel.spec)
    np.testing.assert_array_equal(qkv.q8.get(), q8.codes)
    np.testing.assert_array_equal(qkv.q_scale.get(), q_scales)
    pv = recipe(fmt).ctype["pv"]
    if pv == "f16":
        np.testing.assert_array_equal(qkv.v_rows().get(), v32.astype(np.float16))
        return
    vq = i8quant.quantize_v_int8(v32) if pv == "i8" else i8quant.quantize_v_e4m3(v32)
    if kernel.spec.family.values["pv_operand"] == "f16":
        np.testing.assert_array_equal(qkv.v.get(), vq.codes.astype(F32).astype(np.float16))
    else:
        vt = qkv.vt_rows().get()
        lk_pad = -(-lk // kernel.spec.tile.block_n) * kernel.spec.tile.block_n
        assert vt.shape == (b, hkv, d, lk_pad)
        assert not vt[..., _stored_column(np.arange(lk, lk_pad))].any()
        np.testing.assert_array_equal(_unpermute_vt(vt, lk), vq.codes.view(np.uint8))
    np.testing.assert_array_equal(qkv.v_scale.get(), vq.scale[..., 0, :])


def test_accuracy_records_match_a_direct_fp64_check():
    """bench.prefill.accuracy_against_fp64 (tools/bench_accuracy.py): one record per preset, context,
    causal and implementation; qattn's rel_l2 equals a direct FP64 comparison of the same call; a
    context longer than max_queries has no causal row (the peers' masks align top-left)."""
    import cupy

    from qattn import data
    from qattn.bench.prefill import accuracy_against_fp64

    _skip_unsupported("i8-f8")
    records = accuracy_against_fp64(("outliers",), (700, 1500), ("i8-f8",), peers=(), max_queries=1000)
    assert [(r["ctx"], r["queries"], r["causal"]) for r in records] == [(700, 700, False), (700, 700, True),
                                                                         (1500, 1000, False)]
    x = data.preset("outliers", ctx=1500, queries=1000, heads=2, seed=1)
    q, k, v = (cupy.asarray(x[n]).astype(cupy.float16) for n in ("q", "k", "v"))
    out = _f32(qattn.attention(q, k, v, format="i8-f8"))
    ref = reference.attention(*(np.asarray(x[n], np.float16).astype(np.float64) for n in ("q", "k", "v")))
    direct = metrics.compare(out, ref).rel_l2
    assert abs(records[2]["rel_l2"] - direct) <= 1e-3 * direct
    assert 0.01 < direct < recipe("i8-f8").tolerance.rel_l2
