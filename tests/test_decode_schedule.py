"""The decode call's launch shape: blocks per SM for the K/V bytes in flight, the shared-memory cap
that enforces it, and the split count that fills one wave."""
import pytest

from qattn.engine.tile import Tile
from qattn.formats.decode.schedule import (CLUSTER_SPLITS, IN_FLIGHT_BYTES, SHARED_GRANULE, auto_splits,
                                           capped_shared_bytes, cluster_merge, key_bytes, most_blocks_per_sm,
                                           target_blocks_per_sm)

H200_SM_BYTES, RESERVED, BLOCK_LIMIT = 233472, 1024, 232448


@pytest.mark.parametrize("fmt, want", [("f16-f16", 2), ("bf16-bf16", 2), ("e4m3-f16", 3), ("f16-i8", 3), ("f16-e4m3", 3),
                                       ("e4m3-e4m3", 4), ("i8-i8", 4)])
def test_the_target_holds_about_the_measured_bytes_in_flight(fmt, want):
    tile = Tile(16, 64, 4, 2)  # the default decode tile: 64 keys a step, two slots
    per_block = tile.stages * tile.block_n * key_bytes(fmt, 128)
    assert target_blocks_per_sm(per_block, resident=6) == want
    assert target_blocks_per_sm(per_block, resident=1) == 1  # never above what fits
    assert abs(want * per_block - IN_FLIGHT_BYTES) < per_block


@pytest.mark.parametrize("fmt, block_n, stages, want", [("e4m3-e4m3", 32, 3, 4), ("i8-i8", 32, 3, 4),
                                                        ("e4m3-e4m3", 64, 2, 4), ("f16-e4m3", 32, 2, 5),
                                                        ("e4m3-f16", 32, 2, 5), ("f16-f16", 32, 2, 4)])
def test_k8v8_takes_at_most_its_measured_blocks_per_sm(fmt, block_n, stages, want):
    """The two-warp tiles of pages of 32: 25 KB in flight a block makes five by the bytes; K8/V8 keeps four."""
    per_block = stages * block_n * key_bytes(fmt, 128)
    assert target_blocks_per_sm(per_block, resident=7, most=most_blocks_per_sm(fmt, 128)) == want
    assert target_blocks_per_sm(per_block, resident=3, most=most_blocks_per_sm(fmt, 128)) == min(want, 3)
    # D64 follows the bytes: half of them a block, twice the blocks
    per_block = stages * block_n * key_bytes(fmt, 64)
    assert target_blocks_per_sm(per_block, resident=16, most=most_blocks_per_sm(fmt, 64)) == round(
        IN_FLIGHT_BYTES / per_block)


def test_the_shared_memory_cap_admits_exactly_the_target():
    for need in (20_000, 36_000, 71_000):
        for static in (0, 128, 4096, 4100):
            for target in (1, 2, 3, 4, 5, 6, 7):
                ask = capped_shared_bytes(need, target, H200_SM_BYTES, RESERVED, BLOCK_LIMIT, static)
                assert need <= ask <= BLOCK_LIMIT - static
                allocated = -(-(ask + static) // SHARED_GRANULE) * SHARED_GRANULE  # as the driver counts a block
                fits = H200_SM_BYTES // (allocated + RESERVED)
                assert fits == target or (ask == need and fits < target), (need, static, target, ask, fits)


def test_splits_fill_one_wave_when_the_grid_fits_in_one():
    assert auto_splits(8, 2048, 132, 2) == 33  # 264 blocks: two on every SM, not 30 (240, 91%)
    assert auto_splits(64, 512, 132, 4) == 8  # 512 of 528 slots
    assert auto_splits(64, 512, 132, 2) == 4
    assert auto_splits(512, 64, 132, 4) == 1  # 512 blocks already fill the wave
    assert auto_splits(512, 64, 132, 2) == 1  # two waves of 264, the last 94% full
    assert auto_splits(3, 2048, 132, 4, least=5) == 128  # as many as allowed: 384 of 528 slots
    assert auto_splits(4, 7, 132, 4) == 1  # too few steps to split


def test_splits_merge_in_a_cluster_only_where_it_costs_no_wave():
    def held(count):
        asked = []

        def ask(size):
            asked.append(size)
            return count
        return ask, asked

    ask, asked = held(64)
    assert cluster_merge(8, 64, 528, ask) and asked == [8]  # 8x32768 K8/V8: 64 clusters of 8 in one wave
    assert not cluster_merge(8, 64, 528, held(63)[0])  # one cluster short: a second wave the plain grid does not take
    assert cluster_merge(4, 64, 264, held(64)[0])
    assert cluster_merge(8, 200, 528, held(60)[0])  # four waves either way (1600 blocks over 528 slots)
    assert not cluster_merge(8, 200, 528, held(40)[0])  # five against four
    assert not cluster_merge(2, 8, 528, held(0)[0])  # the driver cannot launch the cluster
    for splits in (1, CLUSTER_SPLITS + 1, 66):  # nothing to merge, or more than a portable cluster: never asked
        ask, asked = held(528)
        assert not cluster_merge(splits, 8, 528, ask) and asked == []
