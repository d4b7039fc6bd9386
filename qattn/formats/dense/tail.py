"""The last round of a persistent chained wgmma prefill grid, shared by key tiles (stream-K over the grid's tail).

A persistent grid of G blocks takes its work units (query blocks, or causal pairs of a heavy and a light one) in
turn: unit u goes to block u % G. When the units are not a multiple of G, the last round leaves most blocks idle
while the few that took one unit more finish it: at B16 H32 L1024 (4096 units on 132 SMs) four blocks run a 32nd
unit that the other 128 do not have, 3% of the call. plan_tail keeps the full rounds (the items below main_items)
and cuts the rest into runs of key tiles, about as many tiles for each block: block b takes tiles [b·T, (b + 1)·T)
of the last round's tiles laid end to end, as pieces of consecutive items, after its own items (prefill_wgmma.cu.j2,
PIECES). A piece that is a whole item writes its rows; the pieces of an item that several blocks share write their
rows (normalized, with their LSE) to a workspace slot each, and the module's merge kernel combines them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# The fixed costs of a piece (its Q rows, a first S with no P V beside it, its rows out) and of the merge (its launch
# and its wait for every block), in key tiles, as the H100 runs of docs/notes/dense.md put them: where the split
# saves less than they cost, plan_tail keeps the last round whole (split, B32 L512 ran 2-4% slower, B16 L1024 1-3%
# faster).
PIECE_TILES = 3.0
MERGE_TILES = 3.0


@dataclass(frozen=True)
class TailPlan:
    """main_items: the main kernel's item bound (items below it, in work_item order; paired: 2 x its pairs);
    entries [n, 4] int32: (item, first key tile, end key tile, slot or -1), block b's in entries[first[b]:first[b+1]];
    merges [m, 4] int32: (item, its first slot, its slots, 0) for each item split over blocks; slots: partials."""

    main_items: int
    paired: bool  # the launch's items go in causal pairs
    entries: np.ndarray
    first: np.ndarray
    merges: np.ndarray
    slots: int


def item_tiles(items: int, qblocks: int, lq: int, lk: int, block_m: int, block_n: int, causal: bool,
               paired: bool) -> np.ndarray:
    """Key tiles of each work item, in the kernel's order (wgmma_attention.cuh.j2's work_item)."""
    qi = np.arange(items) % qblocks
    if paired:
        qblock = np.where(qi % 2 == 1, qi // 2, qblocks - 1 - qi // 2)
    elif causal:
        qblock = qblocks - 1 - qi
    else:
        qblock = qi
    keys = np.minimum(qblock * block_m + block_m + (lk - lq), lk) if causal else np.full(items, lk)
    return -(-np.maximum(keys, 0) // block_n)


def plan_tail(*, items: int, qblocks: int, lq: int, lk: int, block_m: int, block_n: int, causal: bool, grid: int,
              piece_tiles: float = PIECE_TILES, merge_tiles: float = MERGE_TILES) -> TailPlan | None:
    """The split of the launch's last round, or None where it would not save time (at the given fixed costs)."""
    paired = causal  # persistent causal launches pair their items
    per_unit = 2 if paired else 1
    units = -(-items // per_unit)
    rest = units % grid
    if rest == 0 or units < grid:
        return None
    main_items = (units - rest) * per_unit
    tiles = item_tiles(items, qblocks, lq, lk, block_m, block_n, causal, paired)
    tail = np.arange(main_items, items)
    # the last round as it is: a unit's tiles and pieces on one block
    last = [tiles[u * per_unit:(u + 1) * per_unit] for u in range(units - rest, units)]
    whole = max(int(unit.sum()) + piece_tiles * len(unit) for unit in last)
    total = int(tiles[tail].sum())
    if total == 0:
        return None
    share = math.ceil(total / grid)
    pieces = _pieces(tail, tiles[tail], share)
    split = max(sum(end - start for _, start, end, _ in block) + piece_tiles * len(block) for block in pieces)
    if split + merge_tiles >= whole:
        return None
    return _table(main_items, paired, pieces, grid)


def _pieces(tail, tiles, share: int) -> list[list[tuple]]:
    """Block by block, the pieces (item, start tile, end tile, whole) of the tail items' tiles laid end to end, share
    tiles a block; an item without tiles (causal rows above every key) is a piece of its own, on the block where it
    falls."""
    blocks, current, filled = [], [], 0
    for item, count in zip(tail.tolist(), tiles.tolist()):
        if count == 0:
            current.append((item, 0, 0, True))
            continue
        start = 0
        while start < count:
            take = min(count - start, share - filled)
            current.append((item, start, start + take, take == count))
            start, filled = start + take, filled + take
            if filled == share:
                blocks.append(current)
                current, filled = [], 0
    if current:
        blocks.append(current)
    return blocks


def _table(main_items: int, paired: bool, pieces, grid: int) -> TailPlan:
    entries, first, merges, slots = [], [0], [], 0
    opened = {}  # item -> index in merges
    for b in range(grid):
        for item, start, end, whole in (pieces[b] if b < len(pieces) else []):
            slot = -1
            if not whole:
                if item not in opened:
                    opened[item] = len(merges)
                    merges.append([item, slots, 0, 0])
                merges[opened[item]][2] += 1
                slot = slots
                slots += 1
            entries.append((item, start, end, slot))
        first.append(len(entries))
    return TailPlan(main_items, paired, np.asarray(entries, np.int32).reshape(-1, 4), np.asarray(first, np.int32),
                    np.asarray(merges, np.int32).reshape(-1, 4), slots)
