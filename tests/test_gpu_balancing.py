"""Q/K channel balancing (smoothing="mean+balance") in the int8-QK kernels (issue 31).

CPU: the option's plumbing (smoothing, the deprecated smooth_k, errors), a NumPy model of the CUDA
kernels' α arithmetic (balance_body: max|K̃| from K's column max and min, max|q̃| from Q's column
absmax, the median by rank) and the HIP host's (quant.balance_from_ranges) against
quant.balance_factors, bit for bit. GPU (marked gpu): every
int8-QK format with smoothing="mean+balance" against its emulator, α against balance_factors, and
balancing against mean-only vs FP64 on the outliers_scale preset.

    python3 -m pytest -q -m gpu tests/test_gpu_balancing.py
"""
import warnings

import numpy as np
import pytest

import qattn
from qattn.check import emulate, metrics, quant, reference
from qattn.engine.registry import recipe
from qattn.formats.int8qk import host as int8
from qattn.formats.int8qk import quant as i8quant

FORMATS = ["i8-f16", "i8-i8", "i8-f8"]
F32 = np.float32


# ---- CPU: the kernels' α arithmetic, modelled in NumPy --------------------------------------------

def _kernel_alpha(q2, k, chunk=256):
    """α [B, Hkv, D] as balance_body computes it from the statistics the kernels gather: K̄ (fp64
    mean -> fp32), K's column max and min per chunk of keys, Q's column absmax per chunk (raw, then
    ·mul: here q2 is already q̃, max|RN(q·mul)| = RN(max|q|·mul)), α in fp64 with the median found by
    rank (ties by channel), the "outliers" rule, fp32."""
    b, hkv, lk, d = k.shape
    k32 = np.asarray(k, F32)
    k_mean = i8quant.smooth_k(k32)[1][..., 0, :]
    kmax = np.max([k32[:, :, i:i + chunk].max(axis=2) for i in range(0, lk, chunk)], axis=0)
    kmin = np.min([k32[:, :, i:i + chunk].min(axis=2) for i in range(0, lk, chunk)], axis=0)
    k_absmax = np.maximum(kmax - k_mean, k_mean - kmin)
    q_absmax = np.abs(np.asarray(q2, F32)).reshape(b, hkv, -1, d).max(axis=2)
    alpha = np.ones((b, hkv, d), np.float64)
    for bi in range(b):
        for h in range(hkv):
            ka, qa = k_absmax[bi, h].astype(np.float64), q_absmax[bi, h].astype(np.float64)
            live = (qa > 0) & (ka > 0)
            with np.errstate(divide="ignore", invalid="ignore"):
                a = np.where(live, np.sqrt(ka / qa), np.nan)
            counted = ~np.isnan(a)
            n = int(counted.sum())
            middle = [None, None]
            for c in np.flatnonzero(counted):
                rank = int(np.sum((a < a[c]) | ((a == a[c]) & (np.arange(d) < c))))
                if rank == (n - 1) // 2:
                    middle[0] = a[c]
                if rank == n // 2:
                    middle[1] = a[c]
            median = (middle[0] + middle[1]) / 2 if n else np.nan
            with np.errstate(invalid="ignore"):
                r = np.where(live, a / median, 1.0)
            alpha[bi, h] = np.where((r > 0.5) & (r < 2.0), 1.0, r)
    return alpha.astype(F32)


def _balance_inputs(rng, preset, lq=96, lk=700, d=64, group=4):
    if preset == "normal":
        q = rng.standard_normal((2, 2 * group, lq, d)).astype(np.float16)
        k = rng.standard_normal((2, 2, lk, d)).astype(np.float16)
    else:
        from qattn import data

        x = data.preset(preset, ctx=lk, queries=lq, batch=2, heads=2 * group, kv_heads=2, head_dim=d,
                        seed=int(rng.integers(1 << 30)))
        q, k = (x[name].astype(np.float16) for name in "qk")
    return q, k


@pytest.mark.parametrize("preset", ["normal", "outliers_scale", "outliers_token", "rope_massive"])
@pytest.mark.parametrize("d", [64, 128])
def test_kernel_alpha_arithmetic_is_balance_factors(preset, d):
    """The arithmetic balance_body does gives quant.balance_factors' α bit for bit, on inputs with
    and without outliers, odd and even counts of live channels (dead ones: zero Q or K columns)."""
    rng = np.random.default_rng(d)
    q, k = _balance_inputs(rng, preset, d=d)
    q2 = quant.fold_softmax_scale(q, 1 / np.sqrt(d))
    for dead in (0, 3):  # 3 dead channels: an odd count of live ones
        q2 = q2.copy()
        q2[..., :dead] = 0
        want = i8quant.balance_factors(q2, i8quant.smooth_k(np.asarray(k, F32))[0])[..., 0, :]
        np.testing.assert_array_equal(_kernel_alpha(q2, k), want)


def test_kernel_alpha_keeps_nan_columns_at_one():
    """A NaN column (in Q or K) is not live: α 1 there, as balance_factors gives; the median of the rest."""
    rng = np.random.default_rng(5)
    q, k = _balance_inputs(rng, "outliers_scale")
    q2 = quant.fold_softmax_scale(q, 0.125)
    q2[0, 0, 3, 7] = np.nan
    k = k.copy()
    k[1, 0, 9, 2] = np.nan
    want = i8quant.balance_factors(q2, i8quant.smooth_k(np.asarray(k, F32))[0])[..., 0, :]
    got = _kernel_alpha(q2, k)
    np.testing.assert_array_equal(got, want)
    assert got[0, 0, 7] == 1 and got[1, 0, 2] == 1


@pytest.mark.parametrize("preset", ["normal", "outliers_scale", "rope_massive"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_hip_host_alpha_from_ranges_is_balance_factors(preset, dtype):
    """The HIP host's α (quant.balance_from_ranges, run there on CuPy arrays: Q's column absmax times mul, K's
    column max and min about K̄, never forming q̃ or K̃) is balance_factors' on q̃ and K − K̄, bit for bit,
    with dead channels, and a NaN column not live."""
    from qattn.engine.arrays import numpy_dtype

    rng = np.random.default_rng(11)
    q, k = (x.astype(numpy_dtype(dtype)) for x in _balance_inputs(rng, preset))
    mul = np.float32(0.125 * quant.LOG2E)
    balanced = []
    for dead, nan in ((0, False), (3, False), (0, True)):
        q_in, k_in = q.copy(), k.copy()
        q_in[..., :dead] = 0
        if nan:
            q_in[0, 0, 3, 7] = np.nan
            k_in[1, 0, 9, 2] = np.nan
        k32 = np.asarray(k_in, F32)
        k_smooth, k_mean = i8quant.smooth_k(k32)
        q2 = np.asarray(q_in, F32) * mul
        want = i8quant.balance_factors(q2, k_smooth)[..., 0, :]
        got = i8quant.balance_from_ranges(q_in, k_in, k_mean[..., 0, :], mul)
        assert got.dtype == F32
        np.testing.assert_array_equal(got, want)
        if nan:
            assert got[0, 0, 7] == 1 and got[1, 0, 2] == 1
        balanced.append(int((got != 1).sum()))
    assert preset != "outliers_scale" or min(balanced) > 0, balanced  # its outlier channels are balanced


# ---- CPU: the option ----------------------------------------------------------------------------

@pytest.fixture
def rng():
    return np.random.default_rng(0)


def _small(rng):
    return [rng.standard_normal((1, 2, 9, 64)).astype(np.float16) for _ in range(3)]


@pytest.mark.parametrize("fmt", ["f16", "bf16"])
def test_smoothing_only_on_int8_qk_formats(rng, fmt):
    q, k, v = _small(rng)
    with pytest.raises(ValueError, match=f"^smoothing: format '{fmt}' does not take it"):
        qattn.attention(q, k, v, format=fmt, smoothing="mean+balance")


def test_smoothing_errors_before_the_gpu(rng):
    q, k, v = _small(rng)
    with pytest.raises(ValueError, match="^smoothing: expected 'mean', 'mean\\+balance' or None"):
        int8.quantize(q, k, v, format="i8-f8", smoothing="balance")
    with pytest.raises(ValueError, match="^smooth_k: give smoothing or its deprecated alias"):
        int8.quantize(q, k, v, format="i8-f8", smoothing="mean", smooth_k=True)
    with pytest.raises(ValueError, match="^smooth_k: expected True or False"):
        int8.quantize(q, k, v, format="i8-f8", smooth_k=1)


def test_smooth_k_warns_before_the_gpu(rng):
    """smooth_k is resolved (with its DeprecationWarning) before anything reaches the GPU."""
    q, k, v = _small(rng)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            int8.quantize(q, k, v, format="i8-f8", smooth_k=False)
        except Exception:  # no GPU here: what follows the option fails
            pass
    assert any(issubclass(w.category, DeprecationWarning) and "smooth_k is deprecated" in str(w.message)
               for w in caught)




def test_emulator_options_carry_the_smoothing():
    assert int8.smoothing_options("mean") == {"smoothing": "mean"}
    assert int8.smoothing_options(None) == {"smoothing": None}
    assert int8.smoothing_options("mean+balance") == {"smoothing": "mean+balance", "alpha_rule": "outliers"}


# ---- GPU ------------------------------------------------------------------------------------------

def _skip_unsupported(fmt):
    from qattn.engine.spec import device_arch

    if device_arch() not in recipe(fmt).family("cuda").archs:
        pytest.skip(f"{fmt} needs one of {recipe(fmt).family('cuda').archs}")


def _emu_bound(fmt):
    return 3e-3 if fmt == "i8-i8" else 1e-3  # as tests/test_gpu_i8.py's emu_rel_l2 (P's rounding ties)


def _f32(x):
    return np.asarray(x.get(), F32)


def _host(kind, b, hq, hkv, lq, lk, d, seed, dtype=np.float16):
    """q, k, v as host arrays: N(0,1) ("normal") or a qattn.data preset."""
    rng = np.random.default_rng(seed)
    if kind == "normal":
        shapes = ((b, hq, lq, d), (b, hkv, lk, d), (b, hkv, lk, d))
        return [rng.standard_normal(s).astype(F32).astype(dtype) for s in shapes]
    from qattn import data

    x = data.preset(kind, ctx=lk, queries=lq, batch=b, heads=hq, kv_heads=hkv, head_dim=d, seed=seed)
    return [np.asarray(x[n]).astype(dtype) for n in "qkv"]


CASES = [  # (kind, B, Hq, Hkv, Lq, Lk, D, causal)
    ("outliers_scale", 1, 2, 1, 128, 4096, 128, False),
    ("outliers_scale", 1, 8, 2, 130, 4099, 128, True),  # GQA 4, tails on both axes
    ("normal", 2, 8, 2, 257, 2100, 64, True),
    ("normal", 1, 4, 4, 64, 37, 128, False),  # one partial key block
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[5]}-g{c[2] // c[3]}-d{c[6]}" for c in CASES])
@pytest.mark.parametrize("fmt", FORMATS)
def test_balanced_kernel_matches_its_emulator(fmt, case):
    """smoothing="mean+balance": out within rel_l2 1e-3 (i8-i8: 3e-3) of the emulator under the
    kernel's emulator options, the LSE within 1e-4 (the shift q̃·K̄ is unbalanced: exact), α equal to
    quant.balance_factors, q8/k8 the codes of q̃·α and K̃ / α exactly."""
    import cupy

    _skip_unsupported(fmt)
    kind, b, hq, hkv, lq, lk, d, causal = case
    host = _host(kind, b, hq, hkv, lq, lk, d, seed=lk + d)
    q, k, v = (cupy.asarray(x) for x in host)
    kernel = qattn.build("prefill", format=fmt, head_dim=d, causal=causal)
    out, lse = qattn.attention(q, k, v, format=fmt, causal=causal, return_lse=True, smoothing="mean+balance")
    qkv = int8.quantize(q, k, v, kernel=kernel, with_shift=True, smoothing="mean+balance")
    options = qkv.emulator_options()
    assert options["smoothing"] == "mean+balance" and options["alpha_rule"] == "outliers"
    emu, emu_lse = emulate.emulate(fmt, *host, causal=causal, return_lse=True, **options)
    vs_emu = metrics.compare(_f32(out), emu.astype(np.float16).astype(F32))
    assert vs_emu.nonfinite == 0 and vs_emu.rel_l2 <= _emu_bound(fmt), (fmt, case, vs_emu)
    np.testing.assert_allclose(_f32(lse), emu_lse, rtol=1e-4, atol=1e-4)
    # α and the operands, exactly
    q32, k32 = (np.asarray(x, F32) for x in host[:2])
    q2 = quant.fold_softmax_scale(q32, 1 / np.sqrt(d))
    q_in, k_in, k_mean = i8quant.smooth(q2, k32, "mean+balance")
    alpha = i8quant.balance_factors(q2, i8quant.smooth_k(k32)[0])[..., 0, :]
    np.testing.assert_array_equal(qkv.alpha.get(), alpha)
    np.testing.assert_array_equal(qkv.k_mean.get(), k_mean[..., 0, :])
    opts = int8.emulator_options(kernel.spec)
    q8 = i8quant.quantize_int8(q_in, opts["block_m"], operand="q")
    k8 = i8quant.quantize_int8(k_in, opts["block_n"], granularity=opts["k_granularity"], operand="k")
    np.testing.assert_array_equal(qkv.q8.get(), q8.codes)
    np.testing.assert_array_equal(qkv.k8_rows().get(), k8.codes)
    # the whole call runs the same operands
    direct, direct_lse = int8.attention_quantized(kernel, qkv, return_lse=True)
    assert bytes(out.get().data) == bytes(direct.get().data)
    np.testing.assert_array_equal(lse.get(), direct_lse.get())


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_balancing_beats_mean_only_on_scale_outliers(fmt):
    """On outliers_scale (five scale-type K channels at 50–200x) balancing takes the error vs FP64
    below mean-only's: the issue's targets, ≤ 0.4x for i8-f16 and ≤ 0.6x for i8-i8 / i8-f8 (the
    emulator measured 0.26–0.31x at 4K and 32K)."""
    import cupy

    _skip_unsupported(fmt)
    host = _host("outliers_scale", 1, 2, 1, 128, 4096, 128, seed=31)
    q, k, v = (cupy.asarray(x) for x in host)
    ref = reference.attention(*host)
    err = {s: metrics.compare(_f32(qattn.attention(q, k, v, format=fmt, smoothing=s)), ref).rel_l2
           for s in ("mean", "mean+balance")}
    target = 0.4 if fmt == "i8-f16" else 0.6
    assert err["mean+balance"] <= target * err["mean"], (fmt, err)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_balancing_is_deterministic_and_off_by_default(fmt):
    """Two balanced calls give identical bytes (no atomics in α); the default ("mean") gives no α and
    what smoothing="mean" gives; on N(0,1) no channel leaves (1/2, 2), so balancing changes nothing."""
    import cupy

    _skip_unsupported(fmt)
    host = _host("normal", 1, 4, 2, 200, 3000, 128, seed=7)
    q, k, v = (cupy.asarray(x) for x in host)
    kernel = qattn.build("prefill", format=fmt, head_dim=128)
    a = int8.quantize(q, k, v, kernel=kernel, with_shift=True, smoothing="mean+balance")
    b = int8.quantize(q, k, v, kernel=kernel, with_shift=True, smoothing="mean+balance")
    for name in ("alpha", "q8", "q_scale", "k8", "k_scale", "shift"):
        assert bytes(getattr(a, name).get().data) == bytes(getattr(b, name).get().data), name
    mean = int8.quantize(q, k, v, kernel=kernel, with_shift=True)
    assert mean.alpha is None and mean.smoothing == "mean"
    if not (a.alpha.get() != 1).any():
        for name in ("q8", "q_scale", "k8", "k_scale"):
            assert bytes(getattr(a, name).get().data) == bytes(getattr(mean, name).get().data), name
    with pytest.raises(ValueError, match="^q: operands quantized with smoothing='mean\\+balance'"):
        a.with_query(q, kernel=kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_balancing_keeps_nan_poisoning(fmt):
    """A NaN in K still reaches a NaN scale and NaN rows with balancing on (its column's α is 1)."""
    import cupy

    _skip_unsupported(fmt)
    host = _host("outliers_scale", 1, 2, 1, 64, 1024, 128, seed=3)
    host[1][0, 0, 100, 5] = np.nan
    q, k, v = (cupy.asarray(x) for x in host)
    out = _f32(qattn.attention(q, k, v, format=fmt, smoothing="mean+balance"))
    assert np.isnan(out).all()


@pytest.mark.gpu
def test_parity_checks_the_kernels_on_a_preset_with_their_smoothing():
    """`qattn parity --preset outliers_scale --smoothing mean+balance` on the GPU: each int8-QK kernel runs the
    call's smoothing on the preset's data, near the error of the emulator run with the same options (parity's
    emulator models the default tile's scale blocks, not every kernel's: a band, not the 1e-3 of the kernel tests),
    and balancing brings it several times closer to FP64 than the mean alone."""
    from qattn.check.parity import run_parity

    shapes = [(2048, 256)]
    options = dict(heads=4, kv_heads=2, causal=True, source="outliers_scale", time_it=False)
    for fmt in FORMATS:
        _skip_unsupported(fmt)
        gpu, emulated = (run_parity([fmt], shapes, backend=backend, smoothing="mean+balance", **options)[0]
                         for backend in ("cuda", "numpy"))
        mean = run_parity([fmt], shapes, backend="cuda", smoothing="mean", **options)[0]
        assert gpu["data"] == "outliers_scale" and gpu["smoothing"] == "mean+balance" and gpu["kernel"]
        assert gpu["nonfinite"] == 0
        assert emulated["rel_l2"] / 2 <= gpu["rel_l2"] <= 2 * emulated["rel_l2"], (gpu["rel_l2"], emulated["rel_l2"])
        assert gpu["rel_l2"] < mean["rel_l2"] / 2, (gpu["rel_l2"], mean["rel_l2"])
