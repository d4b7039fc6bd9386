"""The split last round of chained wgmma prefill launches (formats/dense/tail.py, prefill_wgmma.cu.j2's pieces): which
items and pieces each block takes, that every (item, key tile) is taken exactly once, how evenly the last round is
shared, and the kernel with its pieces' loop and merge as NVRTC builds them."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from conftest import check_spills, entry_ptx
from qattn.engine.compile import compile_cuda, entry_resources
from qattn.engine.render import entry_name, render
from qattn.engine.spec import call_spec
from qattn.formats.dense.tail import item_tiles, plan_tail


def _main_items(block: int, grid: int, main_items: int, paired: bool) -> list[int]:
    """The items the chained kernel's block takes below main_items (first_item / next_item)."""
    taken, item = [], 2 * block if paired else block
    while item < main_items:
        taken.append(item)
        item = (item - 1 + 2 * grid if item % 2 else item + 1) if paired else item + grid
    return taken


def _keys_for_rows(q0, lq, lk, bm, causal):
    return min(q0 + bm + (lk - lq), lk) if causal else lk


SHAPES = [  # batch, heads, lq, lk, causal, grid: each splits its last round
    (16, 32, 1024, 1024, False, 132), (16, 32, 1024, 1024, True, 132), (8, 32, 2048, 2048, True, 132),
    (1, 17, 1000, 1000, False, 132), (3, 5, 700, 1900, True, 20), (1, 32, 32768, 32768, True, 132),
    (4, 9, 333, 333, True, 20),
    (2, 7, 1500, 600, True, 40),  # more queries than keys: the top query blocks see none
    (1, 5, 300, 300, True, 3), (1, 5, 300, 900, False, 7),  # odd items: the last pair has one
]


@pytest.mark.parametrize("batch, heads, lq, lk, causal, grid", SHAPES)
def test_every_key_tile_of_every_item_is_taken_once(batch, heads, lq, lk, causal, grid):
    bm = bn = 128
    qblocks = -(-lq // bm)
    items = qblocks * heads * batch
    tiles = item_tiles(items, qblocks, lq, lk, bm, bn, causal, causal)
    # the tiles per item are the kernel's (work_item's query block, bottom-right causal)
    qi = np.arange(items) % qblocks
    qblock = np.where(qi % 2, qi // 2, qblocks - 1 - qi // 2) if causal else qi
    assert tiles.tolist() == [-(-max(_keys_for_rows(int(b) * bm, lq, lk, bm, causal), 0) // bn) for b in qblock]
    # (free pieces and merge: the table of every shape, whether or not the split would pay there)
    plan = plan_tail(items=items, qblocks=qblocks, lq=lq, lk=lk, block_m=bm, block_n=bn, causal=causal, grid=grid,
                     piece_tiles=0, merge_tiles=0)
    assert plan is not None
    seen = {}
    for block in range(grid):
        for item in _main_items(block, grid, plan.main_items, causal):
            for tile in range(tiles[item]):
                seen[(item, tile)] = seen.get((item, tile), 0) + 1
        for item, start, end, slot in plan.entries[plan.first[block]:plan.first[block + 1]].tolist():
            assert item >= plan.main_items and 0 <= start <= end <= tiles[item]
            assert (slot == -1) == (start == 0 and end == tiles[item]), (item, start, end, slot)
            for tile in range(start, end):
                seen[(item, tile)] = seen.get((item, tile), 0) + 1
    expected = {(item, tile) for item in range(items) for tile in range(tiles[item])}
    assert set(seen) == expected and set(seen.values()) == {1}
    # the items without keys are still written (zeros, LSE -inf): each is a whole piece of the table
    empty = {int(i) for i in np.flatnonzero(tiles == 0) if i >= plan.main_items}
    assert empty <= {item for item, _, end, slot in plan.entries.tolist() if end == 0 and slot == -1}
    # the split items' slots: consecutive, one per piece, every slot once
    pieces = {}
    for item, _, _, slot in plan.entries.tolist():
        if slot >= 0:
            pieces.setdefault(item, []).append(slot)
    assert sorted(pieces) == sorted(plan.merges[:, 0].tolist())
    for item, first, count, _ in plan.merges.tolist():
        assert pieces[item] == list(range(first, first + count)) and count >= 2
    assert sorted(s for slots in pieces.values() for s in slots) == list(range(plan.slots))


def test_the_last_round_is_shared_evenly():
    """B16 H32 L1024 on 132 SMs: 4096 items, 31 full rounds kept, the last 4 items' 32 tiles one to a block; causal,
    2048 pairs, the last 68 pairs' 612 tiles in runs of 5 (three pieces a block at most), which the measured costs
    of pieces and merge leave whole."""
    plan = plan_tail(items=4096, qblocks=8, lq=1024, lk=1024, block_m=128, block_n=128, causal=False, grid=132)
    assert plan.main_items == 4092 and len(plan.entries) == 32 and plan.slots == 32 and len(plan.merges) == 4
    assert plan.first.tolist() == list(range(33)) + [32] * 100
    args = dict(items=4096, qblocks=8, lq=1024, lk=1024, block_m=128, block_n=128, causal=True, grid=132)
    assert plan_tail(**args) is None  # at the measured costs its pieces cost what the last pair does
    causal = plan_tail(**args, piece_tiles=0, merge_tiles=0)
    assert causal.main_items == 2 * 1980
    per_block = [causal.entries[a:b] for a, b in zip(causal.first[:-1], causal.first[1:])]
    spans = [int((e[:, 2] - e[:, 1]).sum()) for e in per_block]
    assert max(spans) == 5 and sum(spans) == 68 * 9 and max(len(e) for e in per_block) <= 3


@pytest.mark.parametrize("items, qblocks, causal, grid", [
    (4092, 8, False, 132),  # whole rounds: nothing to share
    (100, 1, False, 132),   # fewer units than blocks: one round
    (4000, 1, False, 132),  # items of one tile: a piece saves nothing
    (2 * 84, 12, True, 30),  # 24 of 30 blocks take a last pair: its pieces would cost as much
    (32 * 32 * 4, 4, False, 132),  # B32 L512: items of 4 tiles (measured 2-4% slower split)
])
def test_no_split_where_it_would_not_save_time(items, qblocks, causal, grid):
    lq = qblocks * 128
    assert plan_tail(items=items, qblocks=qblocks, lq=lq, lk=lq, block_m=128, block_n=128, causal=causal,
                     grid=grid) is None


ROUTED = [call_spec(f, d, c, 1024, "sm_90a") for f, d, c in (("f16", 128, False), ("bf16", 128, True),
                                                            ("f16", 64, True))]
SPLIT = [s.with_(options={**dict(s.options), "tail": "split"}) for s in ROUTED]


@pytest.mark.parametrize("spec", SPLIT, ids=lambda s: s.name)
def test_chained_kernels_take_their_pieces_after_their_items(spec):
    """The routed chained kernels with their last round split (tail "split"): an item
    bound, then a second loop over the block's pieces (one more first S, S-ahead step and last P V than the kernel
    with tail "off"), the launch of the merge allowed from the start, and the merge beside it, which waits for them.
    ptxas spills nothing in either entry and serializes no wgmma."""
    assert dict(spec.options)["tail"] == "split" and "tail-split" in spec.name
    off = spec.with_(options={**dict(spec.options), "tail": "off"})
    assert "tail" not in off.name
    binary = compile_cuda(render(spec), spec.arch, spec.name)
    assert "C7514" not in binary.log and "serialized" not in binary.log, binary.log
    for suffix in ("", "_merge"):
        check_spills(suffix, entry_resources(binary.log, entry_name(spec) + suffix), attention=not suffix)
    main = entry_ptx(binary.ptx, entry_name(spec))
    assert main.index("griddepcontrol.wait") < main.index("griddepcontrol.launch_dependents")
    merge = entry_ptx(binary.ptx, entry_name(spec) + "_merge")
    assert "griddepcontrol.wait" in merge and "ex2.approx" in merge and "lg2.approx" in merge
    whole = entry_ptx(compile_cuda(render(off), off.arch, off.name).ptx, entry_name(off))
    assert "griddepcontrol.launch_dependents" not in whole
    t, bn, d = spec.recipe, spec.tile.block_n, spec.head_dim
    more = Counter({bn: 2 * d // 16}) + Counter({d: 2 * bn // 16})  # S: n = BN, k = D; P V: n = D, k = BN
    for n, count in more.items():
        op = f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{t}.{t}"
        assert main.count(op) == whole.count(op) + count, (n, main.count(op), whole.count(op))


def test_the_split_takes_no_effect_where_its_loop_would_not_fit():
    """tail settles "off" where items do not chain (a block an item, the cp.async producer) and where the pieces'
    loop would spill (beside TMA stores; at d128 beside Q rows by the consumers)."""
    from qattn.engine.spec import KernelSpec

    chained = {"persistent": "on", "chain": "on"}
    for d, options in ((128, {}), (128, {**chained, "kv_rows": "on"}), (128, {**chained, "out_tma": "on"}),
                       (128, {**chained, "q_tma": "off"})):
        spec = KernelSpec(recipe="f16", head_dim=d, arch="sm_90a", mma="wgmma", options=options)
        assert dict(spec.options)["tail"] == "off" and "tail" not in spec.name, options
    for d in (64, 128):
        spec = KernelSpec(recipe="f16", head_dim=d, arch="sm_90a", mma="wgmma", options={**chained, "tail": "split"})
        assert dict(spec.options)["tail"] == "split" and "tail-split" in spec.name
        assert dict(spec.with_(options=chained).options)["tail"] == "off"  # the default
