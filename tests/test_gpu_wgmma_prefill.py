"""f16, bf16 and i8-f16 on the warp-specialized wgmma pipeline (sm_90a; mma="wgmma", the default
there) on the GPU: against FP64 at the mma.sync kernels' tolerances (and i8-f16 within rel_l2 1e-3 of
its emulator under the kernel's scale layout), causal and not, GQA 1/4/8, D64/D128, lengths that are
no multiple of any tile, LSE, causal rows with no key, strided inputs and output, NaN-poisoned
outputs fully written, other valid tiles, and agreement with the mma.sync kernel on the same inputs.
D256 by name. Skipped off sm_90a (CPU half: tests/test_wgmma_prefill.py)."""
from __future__ import annotations

import numpy as np
import pytest

import qattn
from qattn.check import metrics, reference
from qattn.engine.tile import Tile
from test_gpu_i8 import _check as _check_i8
from test_gpu_i8 import _f32
from test_gpu_i8 import _inputs as _i8_inputs
from test_gpu_prefill import TOL_REL_L2, _inputs

pytestmark = pytest.mark.gpu

FORMATS = ["f16", "bf16", "i8-f16"]
LQ = [1, 77, 1500]
LK = [1, 129, 2100]


def _kernel(fmt, head_dim, causal, tile=None, mma="wgmma", options=None):
    from qattn.engine.spec import device_arch

    if device_arch() != "sm_90a":
        pytest.skip("wgmma needs sm_90a")
    kernel = qattn.build("prefill", format=fmt, head_dim=head_dim, causal=causal, mma=mma,
                         **({"tile": tile} if tile else {}), **({"options": options} if options else {}))
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
    ("i8-f16", 64, (64, 128, 4, 2), False), ("bf16", 64, (192, 128, 12, 2), True),
    ("f16", 128, (192, 80, 12, 2), False), ("i8-f16", 64, (192, 128, 12, 2), False),
    ("i8-f16", 64, (192, 128, 12, 2), True), ("i8-f16", 64, (192, 128, 12, 3), True),
    ("f16", 128, (128, 176, 8, 2), False), ("bf16", 128, (128, 176, 8, 2), True),
    ("i8-f16", 128, (128, 160, 8, 2), True), ("i8-f16", 128, (128, 192, 8, 2), False)])
def test_other_tiles(fmt, head_dim, tile, causal):
    """One and three consumer warpgroups, 64- to 192-key tiles (f16's 176: the output staged over Q's rows),
    a deeper ring."""
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
def test_agrees_with_mma_sync(fmt, head_dim, causal, monkeypatch):
    """The wgmma and mma.sync kernels compute the same format on the same inputs: within the format's
    tolerance of each other (i8-f16's scale blocks differ between them: per row on wgmma, per 128 rows
    on mma.sync), and the default call (qattn.attention) of 1111 query rows runs the measured faster
    one: wgmma (i8-f16's default unit; f16's and bf16's from 1024 rows, recipes.LAUNCH_TILES)."""
    from qattn.api import default_spec

    monkeypatch.setenv("QATTN_TUNED", "0")
    wgmma, sync = _kernel(fmt, head_dim, causal), _kernel(fmt, head_dim, causal, mma="mma.sync")
    faster = "wgmma"
    assert default_spec(fmt, head_dim, causal=causal).family.values["mma_unit"] == (
        "wgmma" if fmt == "i8-f16" else "mma.sync")  # f16 / bf16: wgmma is the listed kernel, by rows
    rng = np.random.default_rng(head_dim + causal)
    host, (q, k, v) = _host_inputs(rng, fmt, 2, 8, 2, 1111, 1500, head_dim)
    a, b = wgmma(q, k, v), sync(q, k, v)
    tol = TOL_REL_L2[fmt] if fmt in TOL_REL_L2 else qattn.recipe(fmt).tolerance.rel_l2
    err = metrics.compare(_f32(a), _f32(b))
    assert err.nonfinite == 0 and err.rel_l2 <= tol, err
    default = qattn.attention(q, k, v, format=fmt, causal=causal)
    assert metrics.compare(_f32(default), _f32(a if faster == "wgmma" else b)).rel_l2 == 0


@pytest.mark.parametrize("fmt", ["f16", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_runs_wgmma_from_1024_query_rows(fmt, causal, monkeypatch):
    """qattn.attention on sm_90a: f16 / bf16 calls of 1024 query rows and more run the wgmma kernel
    (recipes.LAUNCH_TILES), shorter ones the mma.sync default, but for non-causal d128 calls from 512 rows and, over
    enough sequence-heads, causal d128 ones from 768 rows (persistent blocks without chaining below 1024) and causal
    d64 ones from 768; persistent blocks for causal calls (at d64 below 4096 rows) and non-causal d64 ones, and
    non-causal d128 ones below 4096 rows; d64 on three consumer warpgroups but for causal calls below 4096
    rows; d256 on wgmma from 256 rows (causal persistent); the persistent blocks of two warpgroups chain their
    items; each within its format's tolerance of FP64, with a tail past the last block."""
    from qattn import api

    _kernel(fmt, 64, causal)  # skips off sm_90a
    monkeypatch.setenv("QATTN_TUNED", "0")
    monkeypatch.setattr(api, "_CALL_KERNELS", {})
    rng = np.random.default_rng()
    m128, m192 = Tile(128, 128, 8, 2), Tile(192, 128, 12, 2)
    # (query rows, head dim, batch of 4 heads each, unit, persistent, tile)
    for lq, d, b, unit, blocks, tile in ((1024 + 77, 64, 1, "wgmma", "on", m128 if causal else m192),
                                         (4096 + 77, 64, 1, "wgmma", "off" if causal else "on", m192),
                                         (1000, 64, 1, "mma.sync", None, None),
                                         (800, 64, 32, "wgmma" if causal else "mma.sync", "on" if causal else None,
                                          m128 if causal else None),
                                         (600, 128, 1, "mma.sync" if causal else "wgmma", None if causal else "on", None),
                                         (800, 128, 1, "mma.sync" if causal else "wgmma", None if causal else "on", None),
                                         (800, 128, 16, "wgmma", "on", m128),
                                         (1024 + 77, 128, 1, "wgmma", "on", m128),
                                         (4096 + 77, 128, 1, "wgmma", "on" if causal else "off", m128),
                                         (200, 256, 1, "mma.sync", None, None),
                                         (256 + 77, 256, 1, "wgmma", "on" if causal else "off", Tile(128, 64, 8, 2))):
        host, (q, k, v) = _host_inputs(rng, fmt, b, 4, 2, lq, lq + 33, d)
        api._CALL_KERNELS.clear()  # two cases may run one kernel
        out = qattn.attention(q, k, v, format=fmt, causal=causal)
        (kernel,) = api._CALL_KERNELS.values()
        assert kernel.spec.family.values["mma_unit"] == unit, kernel.spec.name
        assert dict(kernel.spec.options).get("persistent") == blocks, kernel.spec.name
        assert tile is None or kernel.spec.tile == tile, kernel.spec.name
        chained = blocks == "on" and kernel.spec.tile == m128 and not (causal and d == 128 and lq < 1024)
        assert dict(kernel.spec.options).get("chain", "off") == ("on" if chained else "off"), kernel.spec.name
        _check(fmt, kernel, out, host, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_i8_f16_runs_192_key_tiles_from_8192_query_rows(causal, monkeypatch):
    """qattn.attention with i8-f16 at d128 on sm_90a: calls of 8192 query rows and more run the 192-key tile
    (recipes.I8_F16_WIDE; its K scale blocks follow), within rel_l2 1e-3 of the emulator at that key block and
    the format's tolerance of FP64, with a tail past the last tile."""
    from qattn import api

    _kernel("i8-f16", 128, causal)  # skips off sm_90a
    monkeypatch.setenv("QATTN_TUNED", "0")
    monkeypatch.setattr(api, "_CALL_KERNELS", {})
    rng = np.random.default_rng()
    host, (q, k, v) = _host_inputs(rng, "i8-f16", 1, 2, 1, 8192 + 77, 8192 + 77, 128)
    out = qattn.attention(q, k, v, format="i8-f16", causal=causal)
    (kernel,) = api._CALL_KERNELS.values()
    assert kernel.spec.tile == Tile(128, 192, 8, 2) and dict(kernel.spec.options)["persistent"] == "off"
    _check("i8-f16", kernel, out, host, causal=causal)


# ---- the TMA producer of the f16 / bf16 kernel (engine/tensormap.py) ------------------------------

@pytest.mark.parametrize("fmt", ["f16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_tma_and_row_producers_give_the_same_bits(fmt, head_dim, causal):
    """K and V by TMA boxes (128-byte swizzled tiles, their own descriptors) and by cp.async rows (kv_rows
    "on", the kernel before TMA): the same products in the same order, so the same bits; tails of
    one key and of 129 past a tile, GQA, a BSHD view of V."""
    import cupy

    tma = _kernel(fmt, head_dim, causal)
    assert dict(tma.spec.options)["kv_rows"] == "off"
    rows = qattn.build("prefill", format=fmt, head_dim=head_dim, causal=causal, mma="wgmma",
                       options={"kv_rows": "on"})
    rng = np.random.default_rng(head_dim + 2 * causal)
    for lq, lk in ((77, 1), (300, 129), (1029, 2100)):
        host, (q, k, v) = _host_inputs(rng, fmt, 2, 8, 2, lq, lk, head_dim)
        v = cupy.ascontiguousarray(v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
        a, la = tma(q, k, v, return_lse=True)
        b, lb = rows(q, k, v, return_lse=True)
        assert cupy.array_equal(a.view(cupy.uint16), b.view(cupy.uint16)), (lq, lk)
        assert cupy.array_equal(la, lb), (lq, lk)
        _check(fmt, tma, a, host, causal=causal, lse=la)


TURN_CASES = [(fmt, d, t) for fmt in ("f16", "bf16") for d, t in ((128, (128, 128, 8, 2)), (64, (192, 64, 12, 2)),
                                                                   (128, (128, 64, 8, 3)), (128, (128, 160, 8, 2)))]
TURN_CASES += [("i8-f16", 128, (128, 64, 8, 3)), ("i8-f16", 64, (128, 128, 8, 2)), ("i8-f16", 64, (192, 64, 12, 2))]


@pytest.mark.parametrize("fmt,head_dim,tile", TURN_CASES)
@pytest.mark.parametrize("causal", [False, True])
def test_warpgroups_in_turns_give_the_same_bits(fmt, head_dim, tile, causal):
    """pingpong "on" (the consumer warpgroups issue their MMAs in turns, two or three of them) changes
    the order of issue between warpgroups, never a warpgroup's own products: the same bits as the
    kernel without turns, with LSE, tails, GQA, and a block count that differs per launch block
    (causal)."""
    import cupy

    free = _kernel(fmt, head_dim, causal, tile=Tile(*tile), options={"pingpong": "off"})
    turns = qattn.build("prefill", format=fmt, head_dim=head_dim, causal=causal, mma="wgmma", tile=Tile(*tile),
                        options={"pingpong": "on"})
    assert "pingpong" in turns.spec.name and "pingpong" not in free.spec.name
    rng = np.random.default_rng(head_dim + 3 * causal + tile[0])
    for lq, lk in ((77, 1), (300, 129), (1029, 2100)):
        host, (q, k, v) = _host_inputs(rng, fmt, 2, 8, 2, lq, lk, head_dim)
        a, la = turns(q, k, v, return_lse=True)
        b, lb = free(q, k, v, return_lse=True)
        assert cupy.array_equal(a.view(cupy.uint16), b.view(cupy.uint16)), (lq, lk)
        assert cupy.array_equal(la, lb), (lq, lk)
        _check(fmt, turns, a, host, causal=causal, lse=la)


@pytest.mark.parametrize("fmt", ["f16", "bf16"])
@pytest.mark.parametrize("options", [{}, {"pingpong": "on"}, {"kv_rows": "on"}, {"chain": "on"},
                                     {"chain": "on", "pingpong": "off"}, {"chain": "on", "out_tma": "on"},
                                     {"chain": "on", "q_tma": "on"}, {"chain": "on", "q_tma": "off"}])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim,tile", [(128, None), (64, None), (64, Tile(192, 128, 12, 2)),
                                           (128, Tile(128, 176, 8, 2))])
def test_persistent_blocks_give_the_same_bits(fmt, options, causal, head_dim, tile):
    """persistent "on" (as many blocks as the SMs hold, each taking work items in turn; the ring's slots
    and phases, and the warpgroups' turns, running on across items) against a block per item: the same
    bits, with more items than blocks (several per block, of different key counts when causal), tails
    and GQA; two and three consumer warpgroups; the output staged over Q's rows (176-key tiles), which the
    next item's Q rows then overwrite; chained items (an item's last P V beside the next one's first Q Kᵀ, Q
    rows in two regions), with causal items that see no key (more queries than keys) between them."""
    import cupy

    one = _kernel(fmt, head_dim, causal, tile, options=options)
    many = _kernel(fmt, head_dim, causal, tile, options={**options, "persistent": "on"})
    rng = np.random.default_rng()
    for b, hq, hkv, lq, lk in ((2, 16, 4, 2100, 2100), (3, 8, 8, 300, 1029), (1, 2, 1, 77, 1), (2, 8, 2, 1029, 300)):
        host, (q, k, v) = _host_inputs(rng, fmt, b, hq, hkv, lq, lk, head_dim)
        a, la = many(q, k, v, return_lse=True)
        ref, lref = one(q, k, v, return_lse=True)
        assert cupy.array_equal(a.view(cupy.uint16), ref.view(cupy.uint16)), (b, hq, lq, lk)
        assert cupy.array_equal(la, lref), (b, hq, lq, lk)
    _check(fmt, many, a, host, causal=causal, lse=la)


def _split_rows(plan, qblocks, hq, bm):
    """(batch, head, first row) of each item the plan split over blocks (work_item's order, causal pairs)."""
    rows = []
    for item in plan.merges[:, 0].tolist():
        qi, bh = item % qblocks, item // qblocks
        qblock = (qi // 2 if qi % 2 else qblocks - 1 - qi // 2) if plan.paired else qi
        rows.append((bh // hq, bh % hq, qblock * bm))
    return rows


@pytest.mark.parametrize("fmt,head_dim,causal,shape", [
    ("f16", 128, False, (1, 17, 17, 1000, 1000)),  # 136 items on 132 SMs: the last 4 items' tiles one to a block
    ("bf16", 128, True, (2, 17, 1, 1024, 1100)),  # 136 pairs: the last 4 pairs' tiles shared
    ("f16", 64, True, (2, 8, 2, 2100, 1900)),  # more queries than keys: the top query blocks see none
])
def test_split_last_round(fmt, head_dim, causal, shape):
    """The routed chained kernel with its last round split (tail "split": each block's pieces after its items, and
    the merge) against the same launch whole (tail "off", the routed default): an item no piece split has the same bits; a split item's
    rows (normalized per piece and merged) within a rounding of them; every row written into a NaN-poisoned out;
    within the format's tolerance of FP64, with the LSE."""
    import cupy

    from qattn.engine.grid import sm_count
    from qattn.formats.dense.tail import plan_tail

    b, hq, hkv, lq, lk = shape
    whole = qattn.build("prefill", format=fmt, head_dim=head_dim, causal=causal, queries=lq)
    if whole.spec.arch != "sm_90a":
        pytest.skip("wgmma needs sm_90a")
    split = qattn.build("prefill", format=fmt, head_dim=head_dim, causal=causal, mma="wgmma", tile=whole.spec.tile,
                        options={**dict(whole.spec.options), "tail": "split"})
    spec = split.spec
    assert dict(spec.options)["tail"] == "split" and dict(whole.spec.options)["tail"] == "off"
    bm = spec.tile.block_m
    qblocks = -(-lq // bm)
    plan = plan_tail(items=qblocks * hq * b, qblocks=qblocks, lq=lq, lk=lk, block_m=bm, block_n=spec.tile.block_n,
                     causal=causal, grid=sm_count(0))
    assert plan is not None and len(plan.merges) > 0
    rng = np.random.default_rng()
    host, (q, k, v) = _host_inputs(rng, fmt, b, hq, hkv, lq, lk, head_dim)
    out, lse = _poisoned(q.shape, q.dtype), cupy.full((b, hq, lq), cupy.nan, cupy.float32)
    split(q, k, v, out=out, lse=lse)
    ref, lref = whole(q, k, v, return_lse=True)
    mask = np.zeros((b, hq, lq), bool)
    for batch, head, row in _split_rows(plan, qblocks, hq, bm):
        mask[batch, head, row:row + bm] = True
    got, want = _f32(out), _f32(ref)
    assert mask.any() and not mask.all()
    assert np.array_equal(got[~mask], want[~mask]) and np.array_equal(_f32(lse)[~mask], _f32(lref)[~mask])
    ulp = 2.0 ** (-8 if fmt == "bf16" else -11)
    np.testing.assert_allclose(got[mask], want[mask], rtol=4 * ulp, atol=4 * ulp)
    np.testing.assert_allclose(_f32(lse)[mask], _f32(lref)[mask], rtol=1e-6, atol=1e-6)
    _check(fmt, split, out, host, causal=causal, lse=lse)


@pytest.mark.parametrize("fmt,head_dim,causal", [("f16", 128, True), ("bf16", 128, False), ("f16", 64, False)])
def test_q_rows_by_tma_read_a_strided_q_view(fmt, head_dim, causal):
    """Chained items with their Q rows by the producer's TMA (q_tma "on") from a Q seen through a wider
    [B, L, H, D + 64] store whose other channels are NaN: the same bits as the consumers' own Q loads, with a tail of
    rows past the last full block."""
    import cupy

    options = {"persistent": "on", "chain": "on"}
    tma = _kernel(fmt, head_dim, causal, options={**options, "q_tma": "on"})
    own = _kernel(fmt, head_dim, causal, options={**options, "q_tma": "off"})
    assert dict(tma.spec.options)["q_tma"] == "on"
    rng = np.random.default_rng()
    b, hq, hkv, lq, lk = 3, 8, 2, 1093, 1100
    host, (q, k, v) = _host_inputs(rng, fmt, b, hq, hkv, lq, lk, head_dim)
    store = _poisoned((b, lq, hq, head_dim + 64), q.dtype)
    store[..., :head_dim] = q.transpose(0, 2, 1, 3)
    view = store[..., :head_dim].transpose(0, 2, 1, 3)
    a, la = tma(view, k, v, return_lse=True)
    ref, lref = own(view, k, v, return_lse=True)
    assert cupy.array_equal(a.view(cupy.uint16), ref.view(cupy.uint16))
    assert cupy.array_equal(la, lref)
    _check(fmt, tma, a, host, causal=causal, lse=la)


@pytest.mark.parametrize("fmt,head_dim,causal", [("f16", 128, False), ("bf16", 128, True), ("f16", 64, True)])
def test_tma_stores_write_the_output_rows_and_nothing_else(fmt, head_dim, causal):
    """Chained items with their rows by TMA stores (out_tma "on") into an out seen through a wider [B, L, H, D + 64]
    store: every row below Lq written, as the warps' own stores write it (the same bits), and none of the channels
    beside the view touched."""
    import cupy

    options = {"persistent": "on", "chain": "on"}
    tma = _kernel(fmt, head_dim, causal, options={**options, "out_tma": "on"})
    own = _kernel(fmt, head_dim, causal, options=options)
    rng = np.random.default_rng()
    b, hq, hkv, lq, lk = 3, 8, 2, 1029, 1100
    host, (q, k, v) = _host_inputs(rng, fmt, b, hq, hkv, lq, lk, head_dim)
    store = _poisoned((b, lq, hq, head_dim + 64), q.dtype)
    before = store.copy()
    out = store[..., :head_dim].transpose(0, 2, 1, 3)
    assert tma(q, k, v, out=out) is out
    beside = (x[..., head_dim:].view(cupy.uint16) for x in (store, before))
    assert cupy.array_equal(*beside), "a TMA store wrote past the view"
    assert cupy.array_equal(out.view(cupy.uint16), own(q, k, v).view(cupy.uint16))
    _check(fmt, tma, out, host, causal=causal)


@pytest.mark.parametrize("fmt", ["f16", "bf16"])
def test_strides_the_tma_cannot_read_fall_back_to_rows(fmt):
    """K broadcast over the batch (stride 0) and V read backwards along the keys: the launch runs the
    kv_rows kernel (its producer gathers rows with cp.async), with the right result."""
    import cupy

    kernel = _kernel(fmt, 128, True)
    rng = np.random.default_rng(5)
    host, (q, k, v) = _host_inputs(rng, fmt, 2, 8, 2, 300, 1029, 128)
    k1 = k[:1]
    k_b = cupy.lib.stride_tricks.as_strided(k1, shape=k.shape, strides=(0, *k1.strides[1:]))
    v_rev = cupy.ascontiguousarray(v[:, :, ::-1])[:, :, ::-1]  # the same values, keys stride negative
    assert k_b.strides[0] == 0 and v_rev.strides[2] < 0
    out = kernel(q, k_b, v_rev)
    host_k = np.broadcast_to(host[1][:1], host[1].shape)
    _check(fmt, kernel, out, (host[0], host_k, host[2]), causal=True)


def test_tma_maps_follow_the_pointers():
    """Calls of one signature with other K and V arrays (a map per pointer, encoded on a miss and
    kept): each result is its own inputs' result, and a repeated pointer reuses its map."""
    kernel = _kernel("f16", 128, False)
    rng = np.random.default_rng(17)
    cases = [_host_inputs(rng, "f16", 1, 4, 4, 200, 700, 128) for _ in range(3)]
    for host, (q, k, v) in cases + cases[:1]:
        out = kernel(q, k, v)
        _check("f16", kernel, out, host, causal=False)


def test_tma_batch_offsets_past_2_to_32_bytes():
    """A batch stride of more than 2^32 bytes: the map's strides are 64-bit."""
    import cupy

    d, l = 128, 192
    big = cupy.empty((2**31 // (l * d) + 2) * l * d, dtype=cupy.float16)
    batch_stride = big.size - l * d  # batch 1 starts past byte 2^32
    rng = np.random.default_rng(11)
    vals = rng.standard_normal((2, 1, l, d)).astype(np.float16)
    big[:l * d] = cupy.asarray(vals[0, 0].ravel())
    big[batch_stride:] = cupy.asarray(vals[1, 0].ravel())
    view = cupy.lib.stride_tricks.as_strided(big, shape=(2, 1, l, d), strides=(batch_stride * 2, l * d * 2, d * 2, 2))
    kernel = _kernel("f16", 128, False)
    out = kernel(view, view, view)
    _check("f16", kernel, out, (vals, vals, vals), causal=False)


def test_tma_kernel_in_a_cuda_graph():
    """The maps are parameters passed by value: a captured launch replays with them."""
    import cupy

    kernel = _kernel("bf16", 64, True)
    rng = np.random.default_rng(29)
    host, (q, k, v) = _host_inputs(rng, "bf16", 1, 4, 1, 129, 333, 64)
    out = _poisoned(q.shape, q.dtype)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        kernel(q, k, v, out=out)
        stream.synchronize()
        want = out.copy()
        out.fill(np.nan)
        stream.begin_capture()
        kernel(q, k, v, out=out)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
    assert cupy.array_equal(out.view(cupy.uint16), want.view(cupy.uint16))
    _check("bf16", kernel, out, host, causal=True)


@pytest.mark.parametrize("fmt", ["f16", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("options", [{}, {"kv_rows": "on"}, {"persistent": "on"}])
def test_head_dim_256(fmt, causal, options):
    """D = 256 on wgmma (named; calls from 1024 rows run it): against FP64 with tails, GQA, LSE and one query row
    over 65 keys; with the K/V rows producer (a row's 32 chunks wider than a pass of its 128 threads) and
    with persistent blocks (the output staged over Q's rows, which the block's next item then overwrites)."""
    kernel = _kernel(fmt, 256, causal, options=options or None)
    rng = np.random.default_rng()
    for b, hq, hkv, lq, lk in ((2, 8, 2, 700, 1100), (1, 4, 4, 1, 65), (3, 4, 1, 333, 333)):
        host, (q, k, v) = _host_inputs(rng, fmt, b, hq, hkv, lq, lk, 256)
        out = _poisoned(q.shape, q.dtype)
        res, lse = kernel(q, k, v, out=out, return_lse=True)
        assert res is out
        _check(fmt, kernel, out, host, causal=causal, lse=lse)
