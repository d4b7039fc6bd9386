"""The pre-bias residual K under RoPE of an 8-bit decode cache (rope=qattn.RoPE(...), post- and pre-RoPE keys)
on the CPU: the RoPE map and its table, the host model's stored values, the emulator against FP64 on the
cache, the accuracy gate on the bias_rope preset, bad arguments refused by name, the specs and their kernels
compiling, and the command line."""
from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

import qattn
import qattn.data
from qattn.check import metrics
from qattn.engine.compile import compile_cuda
from qattn.engine.render import render
from qattn.engine.spec import KernelSpec
from qattn.formats.decode import emulate as emu
from qattn.formats.decode.quant import HostPagedCache
from qattn.formats.decode.rope import RoPE, constant_bias, rotate_exact, rotated_bias, rotated_bias_exact

KV_HEADS, HEAD_DIM, PAGE = 2, 64, 16


def test_rope_table_holds_the_fp32_angles_cos_and_sin():
    """θ_i = fl32(theta^(-2i/R)); row p holds fp16 cos, sin of fl32(p θ_i) at 2i, 2i + 1; the pairs of each
    style; the writer's fp32 R_p b is the exact map's to fp32 rounding."""
    rope = RoPE(theta=500000.0, rotary_dim=32, style="neox").resolved(64, 4096)
    assert rope.max_positions == 4096 and rope.rotary_dim == 32
    theta = rope.frequencies()
    np.testing.assert_array_equal(theta, np.float32(500000.0 ** (-np.arange(16) / 16)))
    table = rope.table()
    angle = np.float32(3001) * theta[5]
    assert table[3001, 10] == np.float16(np.cos(np.float64(angle))) and table[3001, 11] == np.float16(np.sin(np.float64(angle)))
    assert [list(p[:3]) for p in rope.pairs()] == [[0, 1, 2], [16, 17, 18]]
    assert [list(p[:3]) for p in RoPE(rotary_dim=32, style="gptj").resolved(64, 8).pairs()] == [[0, 2, 4], [1, 3, 5]]
    bias = np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32) * 30
    fast = rotated_bias(bias, rope, table, np.arange(100))
    exact = rotated_bias_exact(bias, rope, table, 100).transpose(1, 0, 2)
    np.testing.assert_allclose(fast, exact, rtol=0, atol=1e-4)
    np.testing.assert_array_equal(fast[..., 32:], np.broadcast_to(bias[:, 32:], (100, 2, 32)))  # not rotated
    np.testing.assert_array_equal(constant_bias(bias, rope)[:, :32], 0)
    # a rotation up to the table's fp16 rounding: the norm of each pair is kept to ~2^-11
    pair = np.hypot(exact[..., :16], exact[..., 16:32])
    np.testing.assert_allclose(pair, np.broadcast_to(np.hypot(bias[:, :16], bias[:, 16:32]), pair.shape), rtol=2e-3)


@pytest.mark.parametrize("rope, words", [
    (RoPE(rotary_dim=24), "rotary_dim must be a multiple of 16 from 16 to head_dim 64, got 24"),
    (RoPE(rotary_dim=128), "rotary_dim must be a multiple of 16"),
    (RoPE(style="glm"), "style must be one of neox, gptj"),
    (RoPE(theta=float("inf")), "theta must be a finite number above 1"),
    (RoPE(max_positions=0), "max_positions must be an integer from 1"),
])
def test_rope_fields_are_checked(rope, words):
    with pytest.raises(ValueError, match=f"^rope: {words}"):
        rope.resolved(64, 1024)


def _rotated_keys(rng, rope, table, tokens, bias, spread=1.0):
    """Post-RoPE keys k = M_p (b + z) (M_p the cache's own map, z N(0, spread²)) and N(0,1) V, fp16 [T, H, D]."""
    pre = (rng.standard_normal((tokens, KV_HEADS, HEAD_DIM)) * spread + bias).astype(np.float64)
    first, second = rope.pairs()
    rows = table[np.arange(tokens)].astype(np.float64)[:, None]
    cos, sin = rows[..., 0::2], rows[..., 1::2]
    k = pre.copy()
    k[..., first] = pre[..., first] * cos - pre[..., second] * sin
    k[..., second] = pre[..., first] * sin + pre[..., second] * cos
    return k.astype(np.float16), rng.standard_normal((tokens, KV_HEADS, HEAD_DIM)).astype(np.float16)


def _write(fmt, k, v, *, rope=None, bias=None, k_mean="off", k_balance=None, scale="token", layout="post-rope"):
    """A host cache of one sequence (pages shuffled) written as a prompt and then 64-token pieces, at the
    tokens' positions (their indices) for post-RoPE keys."""
    tokens = k.shape[0]
    pages = -(-tokens // PAGE)
    table = np.random.default_rng(tokens).permutation(pages + 1)[:pages][None].astype(np.int32)
    slots = table[0, np.arange(tokens) // PAGE] * PAGE + np.arange(tokens) % PAGE
    cache = HostPagedCache.empty(fmt, pages + 1, PAGE, KV_HEADS, HEAD_DIM, scale, k_bias=bias, k_mean=k_mean,
                                 k_balance=k_balance, rope=rope, k_bias_layout=layout)
    bounds = [0, tokens // 4] + list(range(tokens // 4 + 64, tokens, 64)) + [tokens]
    for lo, hi in zip(bounds, bounds[1:]):
        positions = np.arange(lo, hi) if rope is not None and layout == "post-rope" else None
        cache.write(k[lo:hi], v[lo:hi], slots[lo:hi], scale=scale, positions=positions)
    return cache, table, np.array([tokens], np.int32)


@pytest.mark.parametrize("style, rotary_dim", [("neox", 64), ("gptj", 32), ("neox", 48)])
@pytest.mark.parametrize("k_mean, k_balance", [("off", None), ("page", "calibrate")])
def test_post_rope_residual_is_stored_and_added_back(style, rotary_dim, k_mean, k_balance):
    """Keys rotated by the cache's own map: the stored residual is the token-varying part (its 8-bit scale
    ~30x below the biased key's), dequantized it is the key to the residual's rounding, and the emulator on
    every QK path is within its arithmetic of FP64 on the cache, over splits, GQA and Lq 3."""
    rng = np.random.default_rng(21)
    rope = RoPE(rotary_dim=rotary_dim, style=style).resolved(HEAD_DIM, 4096)
    bias = (rng.standard_normal((KV_HEADS, HEAD_DIM)) * 30).astype(np.float32)
    k, v = _rotated_keys(rng, rope, rope.table(), 600, bias)
    cache, table, lens = _write("i8-i8", k, v, rope=RoPE(rotary_dim=rotary_dim, style=style, max_positions=4096),
                                bias=bias, k_mean=k_mean, k_balance=k_balance)
    plain, *_ = _write("i8-i8", k, v)
    assert cache.k_scale[table[0]].max() < plain.k_scale[table[0]].max() / 10
    exact = k.astype(np.float64).transpose(1, 0, 2)
    err = np.abs(cache.dequantize("k", table[0], 600) - exact).max()
    assert err < 0.05, err  # half an int8 step of a ~5-wide residual, and fp16 K's own rounding
    q = rng.standard_normal((1, 8, 3, HEAD_DIM)).astype(np.float16)
    ref = emu.reference(q, cache, table, lens)
    for qk, bound in (("transform", 1e-3), ("int8", 1e-2)):
        assert metrics.compare(emu.emulate(q, cache, table, lens, qk=qk, splits=3), ref).rel_l2 < bound


def _bias_rope_errors(fmt, qk, seed, layouts=("normal", "plain", "post-rope", "pre-rope")):
    """rel_l2 against FP64 on the original K/V of the emulator: N(0,1) data, and the bias_rope preset stored
    plainly and as the residual of post-RoPE keys and of pre-RoPE keys (8-bit K only; pre-RoPE on the transform
    path)."""
    errors = {}
    for layout in layouts:
        if layout == "pre-rope" and qk != "transform":
            continue
        x = qattn.data.preset("normal" if layout == "normal" else "bias_rope", ctx=640, queries=2, heads=8,
                              kv_heads=KV_HEADS, head_dim=HEAD_DIM, seed=seed)
        q = x["q"].astype(np.float16)
        k, v, k_pre = (x[name][0].transpose(1, 0, 2).astype(np.float16) if name in x else None
                       for name in ("k", "v", "k_pre"))
        rope = RoPE(theta=float(x["rope_theta"])) if layout.endswith("-rope") else None
        cache, table, lens = _write(fmt, k_pre if layout == "pre-rope" else k, v, rope=rope,
                                    bias=x["k_bias"] if rope else None, layout=layout if rope else "post-rope")
        dense = emu.reference_dense(q, [k.astype(np.float64).transpose(1, 0, 2)], [v.astype(np.float64).transpose(1, 0, 2)])
        errors[layout] = metrics.compare(emu.emulate(q, cache, table, lens, qk=qk), dense).rel_l2
    return errors


# Measured (D64, 8/2 heads, 1024 keys, Lq 2): N(0,1) / bias_rope plain / post-RoPE residual / pre-RoPE residual
#   e4m3-e4m3 3.8e-2 / 3.5e-1 / 2.7e-2 / 2.6e-2, i8-i8 8.4e-3 / 6.4e-2 / 6.6e-3 / 8.0e-3 (transform; fp8 and
#   int8 QK alike, post-RoPE), e4m3-f16 2.8e-2 / 3.5e-1 / 9.1e-3, i8-f16 6.0e-3 / 6.4e-2 / 2.8e-3; K16/V8 on
#   bias_rope: f16-e4m3 2.5e-2, f16-i8 6.0e-3 (as on N(0,1)).
@pytest.mark.parametrize("fmt, qk, control", [("e4m3-e4m3", "transform", "f16-e4m3"), ("e4m3-e4m3", "fp8", "f16-e4m3"),
                                              ("i8-i8", "transform", "f16-i8"), ("i8-i8", "int8", "f16-i8"),
                                              ("e4m3-f16", "transform", "f16-e4m3"), ("i8-f16", "transform", "f16-i8")])
def test_bias_rope_gate(fmt, qk, control):
    """On the bias_rope preset plain K8 is several times worse than K16/V8, and both residual layouts are within
    2x of the format's own N(0,1) error."""
    errors = _bias_rope_errors(fmt, qk, 31)
    k16 = _bias_rope_errors(control, "transform", 31, layouts=("plain",))["plain"]
    assert errors["plain"] > 4 * k16, (errors, k16)
    assert errors["post-rope"] < 2 * errors["normal"], errors
    assert errors.get("pre-rope", 0) < 2 * errors["normal"], errors


@pytest.mark.parametrize("style, rotary_dim", [("neox", 64), ("gptj", 32), ("neox", 32)])
def test_pre_rope_keys_are_stored_unrotated_and_turned_on_chip(style, rotary_dim):
    """Pre-RoPE keys: the cache stores k_pre - b (no positions), dequantizes to R_p (stored + b) = the rotated key
    to the residual's rounding; the emulator turns the codes per key (rounded to fp16) within its arithmetic of
    FP64 on the cache; the 8-bit QK paths are refused."""
    rng = np.random.default_rng(22)
    rope = RoPE(rotary_dim=rotary_dim, style=style, max_positions=1024)
    table = rope.resolved(HEAD_DIM, 1024).table()
    bias = (rng.standard_normal((KV_HEADS, HEAD_DIM)) * 30).astype(np.float32)
    k_pre = (rng.standard_normal((500, KV_HEADS, HEAD_DIM)) + bias).astype(np.float16)
    v = rng.standard_normal((500, KV_HEADS, HEAD_DIM)).astype(np.float16)
    cache, table_ids, lens = _write("i8-f16", k_pre, v, rope=rope, bias=bias, layout="pre-rope")
    plain, *_ = _write("i8-f16", k_pre, v, bias=bias)
    np.testing.assert_array_equal(cache.k, plain.k)  # k_pre - b coded as the pre-bias residual without RoPE
    rotated = rotate_exact(k_pre.astype(np.float64).transpose(1, 0, 2), rope.resolved(HEAD_DIM, 1024), table)
    assert np.abs(cache.dequantize("k", table_ids[0], 500) - rotated).max() < 0.05
    q = rng.standard_normal((1, 4, 2, HEAD_DIM)).astype(np.float16)
    out = emu.emulate(q, cache, table_ids, lens, splits=2)
    assert metrics.compare(out, emu.reference(q, cache, table_ids, lens)).rel_l2 < 1e-3
    with pytest.raises(ValueError, match="^qk: a pre-RoPE cache turns its codes on chip"):
        emu.emulate(q, cache, table_ids, lens, qk="int8")


@pytest.mark.parametrize("kwargs, words", [
    ({"k": "i8", "rope": RoPE()}, "^rope: the residual K under RoPE is for an 8-bit K .* with a k_bias"),
    ({"k": "f16", "rope": RoPE(), "k_bias": np.ones((2, 64))}, "^rope: the residual K under RoPE is for an 8-bit K"),
    ({"k": "i8", "rope": "neox", "k_bias": np.ones((2, 64))}, "^rope: expected None or a qattn.RoPE"),
    ({"k": "i8", "rope": RoPE(rotary_dim=8), "k_bias": np.ones((2, 64))}, "^rope: rotary_dim must be"),
])
def test_cache_rope_arguments_are_checked(kwargs, words):
    with pytest.raises(ValueError, match=words):
        qattn.PagedKVCache(4, PAGE, KV_HEADS, HEAD_DIM, v="i8", **kwargs)


@pytest.mark.parametrize("kwargs, words", [
    ({"k_bias_layout": "pre"}, "^k_bias_layout: expected one of 'post-rope', 'pre-rope', got 'pre'"),
    ({"k_bias_layout": "pre-rope", "rope": None}, "^k_bias_layout: 'pre-rope' keys are turned by the cache's RoPE"),
    ({"k_bias_layout": "pre-rope", "k_mean": "page"}, "^k_bias_layout: 'pre-rope' keys take neither k_mean nor"),
    ({"k_bias_layout": "pre-rope", "k_balance": "calibrate"}, "^k_bias_layout: 'pre-rope' keys take neither"),
])
def test_bias_layouts_are_checked(kwargs, words):
    options = {"k": "i8", "v": "i8", "k_bias": np.ones((2, 64)), "rope": RoPE(), **kwargs}
    with pytest.raises(ValueError, match=words):
        qattn.PagedKVCache(4, PAGE, KV_HEADS, HEAD_DIM, **options)
    host = {name: options[name] for name in ("k_bias", "rope", "k_bias_layout")}
    with pytest.raises(ValueError, match=words):
        HostPagedCache.empty("i8-i8", 4, PAGE, KV_HEADS, HEAD_DIM, k_mean=options.get("k_mean", "off"),
                             k_balance=options.get("k_balance"), **host)


def test_host_writes_need_positions_with_rope_only():
    bias = np.ones((KV_HEADS, HEAD_DIM), np.float32)
    k = np.zeros((3, KV_HEADS, HEAD_DIM), np.float16)
    with pytest.raises(ValueError, match="^positions: expected the tokens' positions"):
        HostPagedCache.empty("i8-i8", 2, PAGE, KV_HEADS, HEAD_DIM, k_bias=bias, rope=RoPE()).write(k, k, np.arange(3))
    with pytest.raises(ValueError, match="^positions: expected the tokens' positions"):
        HostPagedCache.empty("i8-i8", 2, PAGE, KV_HEADS, HEAD_DIM).write(k, k, np.arange(3), positions=np.arange(3))
    pre = HostPagedCache.empty("i8-i8", 2, PAGE, KV_HEADS, HEAD_DIM, k_bias=bias, rope=RoPE(), k_bias_layout="pre-rope")
    with pytest.raises(ValueError, match="^positions: expected the tokens' positions"):
        pre.write(k, k, np.arange(3), positions=np.arange(3))
    with pytest.raises(ValueError, match="^rope: the residual K under RoPE is for an 8-bit K"):
        HostPagedCache.empty("f16-i8", 2, PAGE, KV_HEADS, HEAD_DIM, k_bias=bias, rope=RoPE())


def test_rope_specs_name_and_refuse():
    spec = KernelSpec(kind="decode", recipe="e4m3-e4m3", arch="sm_90a", options={"k_rope": "post"})
    assert "_krope-post_" in spec.name
    off = KernelSpec(kind="decode", recipe="e4m3-e4m3", arch="sm_90a")
    assert "krope" not in off.name and "rope" not in render(off)
    hip = KernelSpec(kind="decode", recipe="i8-i8", backend="hip", arch="gfx942", options={"k_rope": "post"})
    assert "_krope-post_" in hip.name  # RoPE keys build on HIP (tests/test_hip_decode_options.py)
    assert "_krope-pre_transform_" in KernelSpec(kind="decode", recipe="i8-i8", backend="hip", arch="gfx942",
                                                 options={"k_rope": "pre"}).name
    assert "_krope-pre_transform_" in KernelSpec(kind="decode", recipe="i8-i8", arch="sm_90a",
                                                 options={"k_rope": "pre", "qk": "transform"}).name
    for options, words in (({"qk": "int8"}, "^qk: the pre-RoPE residual K turns each key's codes on chip"),
                           ({"k_mean": "page"}, "^k_mean: the pre-RoPE residual K takes k_mean 'off'"),
                           ({"k_balance": "on"}, "^k_balance: the pre-RoPE residual K takes k_balance 'off'")):
        with pytest.raises(ValueError, match=words):
            KernelSpec(kind="decode", recipe="i8-i8", arch="sm_90a", options={"k_rope": "pre", **options})
        with pytest.raises(ValueError, match=words):
            KernelSpec(kind="decode", recipe="i8-i8", backend="hip", arch="gfx1201", options={"k_rope": "pre", **options})


@pytest.mark.parametrize("fmt, arch, paths, spills", [("i8-i8", "sm_90a", ("transform", "int8"), 0),
                                                      ("e4m3-e4m3", "sm_90a", ("transform", "fp8"), 0),
                                                      ("e4m3-bf16", "sm_89", ("transform", "fp8"), 0),
                                                      ("i8-i8", "sm_80", ("transform",), 24)])
def test_rope_kernels_compile(fmt, arch, paths, spills):
    """Every QK path with the post-RoPE term (with page means and balancing on the first), and its writer, at
    d128: no local memory on sm_89/sm_90a (sm_80's i8 transform kernel, at the 128-register cap, spills 16
    bytes, 20 with page means and balancing); the per-key term is on the fp16 MMA."""
    for i, path in enumerate(paths):
        options = {"qk": path, "k_rope": "post", **({"k_mean": "page", "k_balance": "on"} if i == 0 else {})}
        spec = KernelSpec(kind="decode", recipe=fmt, head_dim=128, arch=arch, options=options)
        source = render(spec)
        for entry in ("_f16", "_write_bf16_i64") if i == 0 else ("_bf16",):
            binary = compile_cuda(source, arch, spec.name, entry=f"qattn_{spec.name.replace('-', '_')}{entry}")
            allowed = spills if entry != "_write_bf16_i64" else 0
            assert binary.resources["spill_stores"] <= allowed and binary.resources["spill_loads"] <= allowed, (
                spec.name, entry, binary.resources)
        assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in binary.ptx


@pytest.mark.parametrize("fmt, arch", [("i8-i8", "sm_90a"), ("e4m3-bf16", "sm_89"), ("i8-f16", "sm_80")])
def test_pre_rope_kernels_compile_without_spills(fmt, arch):
    """The pre-RoPE kernel (codes turned on chip on the transform path; three blocks per SM at d128, so up to
    168 registers) and its writer (the plain pre-bias residual writer) stay out of local memory."""
    spec = KernelSpec(kind="decode", recipe=fmt, head_dim=128, arch=arch, options={"k_rope": "pre"})
    source = render(spec)
    assert "rotated_run" in source and "const int* __restrict__ positions" not in source
    for entry in ("_f16", "_bf16", "_write_f16_i32"):
        binary = compile_cuda(source, arch, spec.name, entry=f"qattn_{spec.name.replace('-', '_')}{entry}")
        assert binary.resources["spill_stores"] == 0 and binary.resources["spill_loads"] == 0, (entry, binary.resources)


def test_cli_rope(tmp_path):
    import json

    from qattn.cli import main

    runner = CliRunner()
    gen = runner.invoke(main, ["gen", "decode", "-f", "i8-i8", "--k-rope", "post", "--qk", "transform", "--arch", "sm_90a"])
    assert gen.exit_code == 0 and "decode_i8-i8_d128_m8n64w4s2_p32_token_krope-post_transform_sm90a" in gen.output
    refused = runner.invoke(main, ["gen", "decode", "-f", "f16-f16", "--k-rope", "post", "--arch", "sm_90a"])
    assert refused.exit_code != 0 and "k_rope" in refused.output
    out = tmp_path / "r.json"
    result = runner.invoke(main, ["parity", "--kind", "decode", "-f", "i8-i8", "--shape", "300/2", "--heads", "4",
                                  "--kv-heads", "2", "-d", "64", "--backend", "numpy", "--preset", "bias_rope",
                                  "--k-rope", "post", "--qk", "transform", "--json", str(out)])
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())[0]
    assert record["k_rope"] == "post" and record["passed"] and "post-RoPE residual K" in result.output
    assert record["format_rel_l2"] < 0.02
    result = runner.invoke(main, ["parity", "--kind", "decode", "-f", "i8-i8", "--shape", "300/2", "--heads", "4",
                                  "--kv-heads", "2", "-d", "64", "--backend", "numpy", "--preset", "bias_rope",
                                  "--k-rope", "pre", "--qk", "transform", "--json", str(out)])
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())[0]
    assert record["k_rope"] == "pre" and record["passed"] and record["format_rel_l2"] < 0.02
    refused = runner.invoke(main, ["parity", "--kind", "decode", "-f", "i8-i8", "--shape", "300/2", "--backend", "numpy",
                                   "--k-rope", "post"])
    assert refused.exit_code != 0 and "k_rope: the data (N(0,1)) has no RoPE" in refused.output
