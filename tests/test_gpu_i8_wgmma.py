"""i8-f8 on Hopper warpgroup MMAs (mma="wgmma", sm_90a): against its CPU emulator (rel_l2 <= 1e-3)
and FP64 on the shapes of the mma.sync kernels' tests (tails, GQA, causal Lq != Lk), with bf16
inputs, LSE, strided output, and other tiles (64 to 224 keys; one, two or three warpgroups, whose
output bits must not depend on the rows per block). Skipped off sm_90a."""
from __future__ import annotations

import numpy as np
import pytest

import qattn
from qattn.check import emulate
from test_gpu_i8 import F32, SHAPES, _check, _f32, _inputs, _poisoned

pytestmark = pytest.mark.gpu


def _kernel(head_dim, causal, tile=None):
    from qattn.engine.spec import device_arch

    if device_arch() != "sm_90a":
        pytest.skip("wgmma needs sm_90a")
    spec = dict(format="i8-f8", head_dim=head_dim, causal=causal, mma="wgmma")
    return qattn.build("prefill", **spec, **({"tile": tile} if tile else {}))


def _options(kernel):
    """The emulator's options for the kernel: one Q scale per row, the tile's keys per K scale block
    and softmax step, four K scale groups per block."""
    from qattn.formats.int8qk import host as int8

    options = int8.emulator_options(kernel.spec)
    assert options == {"block_m": 1, "block_n": kernel.spec.tile.block_n, "k_granularity": "thread"}
    return options


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq,lk", SHAPES)
def test_against_emulator_and_fp64(head_dim, causal, lq, lk):
    kernel = _kernel(head_dim, causal)
    assert kernel.spec.family.values["mma_unit"] == "wgmma"
    seed = hash(("wgmma", head_dim, causal, lq, lk)) % 2**32  # fresh per process; printed so a failure can be replayed
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    group = 4 if (lq + lk) % 2 else 1
    host, (q, k, v) = _inputs(rng, "float16", 1, 4, 4 // group, lq, lk, head_dim)
    out = _poisoned(q)
    assert kernel(q, k, v, out=out) is out
    _check("i8-f8", out, host, causal=causal, options=_options(kernel))


@pytest.mark.parametrize("causal", [False, True])
def test_bf16_lse_and_strided_output(causal):
    import cupy

    kernel = _kernel(128, causal)
    rng = np.random.default_rng(17)
    host, (q, k, v) = _inputs(rng, "bfloat16", 2, 8, 2, 1000, 1300, 128)
    store = cupy.full((2, 1000, 8, 128), np.nan, dtype=q.dtype)
    out = store.transpose(0, 2, 1, 3)  # BSHD storage seen as BHSD
    res, lse = kernel(q, k, v, out=out, return_lse=True)
    assert res is out
    _check("i8-f8", out, host, causal=causal, lse=lse, options=_options(kernel))


@pytest.mark.parametrize("head_dim,tile,causal", [(64, (128, 128, 8, 2), False), (64, (64, 64, 4, 3), True),
                                                   (64, (64, 128, 4, 2), True), (128, (64, 128, 4, 2), False),
                                                   (128, (128, 64, 8, 2), True), (128, (64, 64, 4, 3), False),
                                                   (128, (128, 64, 8, 4), False), (128, (128, 224, 8, 2), False),
                                                   (128, (128, 224, 8, 2), True), (64, (128, 160, 8, 2), False)])
def test_other_tiles(head_dim, tile, causal):
    """Two warpgroups of 64 rows, 64- to 224-key blocks, deeper rings: 128 query rows per Q scale
    whatever the tile, the tile's keys per K scale and softmax step (1100 keys: a tail on every tile)."""
    from qattn.engine.tile import Tile

    kernel = _kernel(head_dim, causal, Tile(*tile))
    rng = np.random.default_rng(23)
    host, (q, k, v) = _inputs(rng, "float16", 1, 4, 4, 700, 1100, head_dim)
    out = _poisoned(q)
    kernel(q, k, v, out=out)
    _check("i8-f8", out, host, causal=causal, options=_options(kernel))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq,lk", [(1, 300), (65, 65), (700, 1100), (1000, 1000), (1100, 700), (4096, 4096)])
def test_block_rows_do_not_change_the_output_bits(head_dim, causal, lq, lk):
    """One 192-row block of three warpgroups on two or three K/V slots (the defaults: three at d64, two
    at d128; at these lengths the last block holds rows past Lq, whole warpgroups of them at all but
    1100) gives the bits of 64-row blocks: each warpgroup takes the Q scale of its own rows and every
    row visits the same key tiles in the same order, the masked ones adding nothing."""
    from qattn.engine.tile import Tile

    rng = np.random.default_rng(hash(("rows", head_dim, causal, lq, lk)) % 2**32)
    host, (q, k, v) = _inputs(rng, "float16", 1, 8, 2, lq, lk, head_dim)
    outs = []
    for tile in (Tile(64, 128, 4, 2), Tile(192, 128, 12, 2), Tile(192, 128, 12, 3)):
        out = _poisoned(q)
        _kernel(head_dim, causal, tile)(q, k, v, out=out)
        outs.append(out.get())
    for other in outs[1:]:
        assert not np.isnan(other).any(), "out has NaNs: not every row was written"
        assert np.array_equal(outs[0].view(np.uint16), other.view(np.uint16))
    if lq <= 1100:
        _check("i8-f8", outs[1], host, causal=causal, options=_options(_kernel(head_dim, causal)))


@pytest.mark.parametrize("fmt,tile", [("i8-f8", None), ("i8-f8", (64, 128, 4, 2)), ("i8-f16", None)])
@pytest.mark.parametrize("causal", [False, True])
def test_persistent_blocks_give_the_same_bits(fmt, tile, causal):
    """persistent "on" (as many blocks as the SMs hold, each taking work items in turn, causal ones in pairs of
    a heavy and a light query block; the ring's slots and phases and the warpgroups' turns running on across
    items) against a block per item: the same output and LSE bits, with more items than blocks (of different
    key counts when causal), tails and GQA."""
    import cupy

    from qattn.engine.spec import device_arch
    from qattn.engine.tile import Tile

    if device_arch() != "sm_90a":
        pytest.skip("wgmma needs sm_90a")
    spec = dict(format=fmt, head_dim=128, causal=causal, mma="wgmma", **({"tile": Tile(*tile)} if tile else {}))
    one = qattn.build("prefill", **spec)
    many = qattn.build("prefill", **spec, options={"persistent": "on"})
    assert dict(many.spec.options)["persistent"] == "on" and many.spec.tile == one.spec.tile
    rng = np.random.default_rng()
    for b, hq, hkv, lq, lk in ((2, 16, 4, 2100, 2100), (3, 8, 8, 300, 1029), (1, 2, 1, 77, 1)):
        host, (q, k, v) = _inputs(rng, "float16", b, hq, hkv, lq, lk, 128)
        a, la = many(q, k, v, out=_poisoned(q), return_lse=True)
        ref, lref = one(q, k, v, out=_poisoned(q), return_lse=True)
        assert cupy.array_equal(a.view(cupy.uint16), ref.view(cupy.uint16)), (b, hq, lq, lk)
        assert cupy.array_equal(la, lref), (b, hq, lq, lk)
    from qattn.formats.int8qk import host as int8

    _check(fmt, a, host, causal=causal, lse=la, options=int8.emulator_options(many.spec))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_rising_row_max_rebases_the_accumulator(head_dim, causal):
    """Scores that climb along the keys (the row max rises by over 2^96 along the context): the kernel's
    accumulator reference must move several times (it moves once the max has risen 2^32 above it),
    and output and LSE must still match the emulator and FP64."""
    import cupy

    kernel = _kernel(head_dim, causal)
    rng = np.random.default_rng(31)
    lq, lk = 300, 1500
    ramp = np.linspace(0.0, 1.0, lk, dtype=F32)[None, None, :, None] * (8.0 if head_dim == 128 else 11.0)
    q = (1.0 + 0.2 * rng.standard_normal((1, 2, lq, head_dim))).astype(np.float16)
    k = (ramp * (1.0 + 0.2 * rng.standard_normal((1, 2, lk, head_dim)))).astype(np.float16)
    v = rng.standard_normal((1, 2, lk, head_dim)).astype(np.float16)
    logits = q[0, 0, -1].astype(np.float64) @ k[0, 0].astype(np.float64).T / np.sqrt(head_dim) / np.log(2)
    assert logits.max() - logits[:64].max() > 96, "the row max must rise well past the rebase threshold"
    host = [q, k, v]
    out = _poisoned(cupy.asarray(q))
    _, lse = kernel(*(cupy.asarray(x) for x in host), out=out, return_lse=True)
    _check("i8-f8", out, host, causal=causal, options=_options(kernel))
    # LSE against the emulator only: scores this large carry the int8 QK error into it (~0.09 from
    # FP64 here, the format's, not the kernel's)
    emu_lse = emulate.emulate("i8-f8", *host, causal=causal, return_lse=True, **_options(kernel))[1]
    np.testing.assert_allclose(_f32(lse), emu_lse, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype,layout", [("float16", "bhsd"), ("float16", "bshd"), ("float16", "broadcast"),
                                          ("bfloat16", "bhsd")])
@pytest.mark.parametrize("causal", [False, True])
def test_v_by_tma_matches_the_quantizers_tiles(dtype, layout, causal):
    """i8-f16's V read by the TMA (v_tiles "off", the default): from the caller's fp16 rows (contiguous, or a BSHD
    view), or from fp16 rows the quantizer writes (bf16 V, V broadcast over the batch with stride 0), against the
    quantizer's swizzled tiles (v_tiles "on"): the same output and LSE bits, with tails and GQA, in whole calls and
    through quantize() and attention_quantized(); and within the emulator's and FP64's tolerance."""
    import cupy

    from qattn.engine.spec import device_arch
    from qattn.formats.int8qk import host as int8

    if device_arch() != "sm_90a":
        pytest.skip("wgmma needs sm_90a")
    spec = dict(format="i8-f16", head_dim=128, causal=causal, mma="wgmma", options={"persistent": "on"})
    tma = qattn.build("prefill", **spec)
    tiles = qattn.build("prefill", **{**spec, "options": {"persistent": "on", "v_tiles": "on"}})
    assert dict(tma.spec.options)["v_tiles"] == "off" and "vtiles" in tiles.spec.name
    rng = np.random.default_rng()
    b, hq, hkv, lq, lk = 2, 8, 2, 700, 1029
    host, (q, k, v) = _inputs(rng, dtype, b, hq, hkv, lq, lk, 128)
    if layout == "bshd":
        v = cupy.ascontiguousarray(v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    elif layout == "broadcast":
        v = cupy.broadcast_to(v[:1], v.shape)
        host[2] = np.broadcast_to(host[2][:1], host[2].shape)
    a, la = tma(q, k, v, out=_poisoned(q), return_lse=True)
    ref, lref = tiles(q, k, v, out=_poisoned(q), return_lse=True)
    assert cupy.array_equal(a.view(cupy.uint16), ref.view(cupy.uint16))
    assert cupy.array_equal(la, lref)
    qkv = int8.quantize(q, k, v, kernel=tma, with_shift=True)
    assert not qkv.v_tiles and (qkv.v.data.ptr == v.data.ptr) == (dtype == "float16" and layout != "broadcast")
    split, lsplit = int8.attention_quantized(tma, qkv, return_lse=True, out=_poisoned(q))
    assert cupy.array_equal(split.view(cupy.uint16), a.view(cupy.uint16)) and cupy.array_equal(lsplit, la)
    with pytest.raises(ValueError, match="another layout"):
        int8.attention_quantized(tiles, qkv)
    _check("i8-f16", a, host, causal=causal, lse=la, options=int8.emulator_options(tma.spec))
