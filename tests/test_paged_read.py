"""The plain paged reader (`qattn bench paged-read`): piece sizes, the page assignment, the reader's
source compiled for sm_80 and sm_90a, the command's options; on a GPU, the reader reads exactly the
pieces of its pages (the xor of what it read against the same xor taken by CuPy)."""
from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from qattn.bench import paged_read
from qattn.cli import main
from qattn.engine.compile import compile_cuda


@pytest.mark.parametrize("fmt, page, d, expected", [
    ("e4m3-e4m3", 16, 128, (2048, 2048)),
    ("f16-f16", 32, 128, (8192, 8192)),
    ("f16-e4m3", 64, 64, (8192, 4096)),
    ("i8-bf16", 128, 128, (16384, 32768)),
])
def test_piece_bytes_follow_the_cache_sides(fmt, page, d, expected):
    assert paged_read.piece_bytes(fmt, page, d) == expected


def test_block_pages_give_each_group_its_own_shuffled_pages():
    ids, per_group = paged_read.block_pages(1000, 48, 8, np.random.default_rng(3))
    assert per_group == 1000 // 6 and ids.shape == (6 * per_group,) and ids.dtype == np.int32
    assert len(set(ids.tolist())) == ids.size and ids.min() >= 0 and ids.max() < 1000
    assert not np.array_equal(ids, np.sort(ids))


def test_block_pages_refuse_partial_groups_and_too_few_pages():
    with pytest.raises(ValueError, match="blocks: 50 is not a multiple of kv_heads 8"):
        paged_read.block_pages(1000, 50, 8, np.random.default_rng(0))
    with pytest.raises(ValueError, match="pages: 3 pages cannot give each of 6 block groups one"):
        paged_read.block_pages(3, 48, 8, np.random.default_rng(0))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("k_bytes, v_bytes, stages", [(2048, 2048, 2), (8192, 4096, 3), (65536, 65536, 2)])
def test_reader_compiles_with_whole_line_copies(arch, k_bytes, v_bytes, stages):
    binary = compile_cuda(paged_read.source(k_bytes, v_bytes, stages), arch, "paged_read", entry="paged_read")
    assert "cp.async.cg.shared.global.L2::128B" in binary.ptx
    assert f"cp.async.wait_group {stages - 2}" in binary.ptx
    assert binary.resources["spill_stores"] == 0


@pytest.mark.parametrize("k_bytes, v_bytes, stages, message", [
    (2048, 2048, 1, "stages: expected at least 2"),
    (2040, 2048, 2, "k_bytes: expected a positive multiple of 16"),
    (2048, 0, 2, "v_bytes: expected a positive multiple of 16"),
])
def test_source_refuses_bad_pieces(k_bytes, v_bytes, stages, message):
    with pytest.raises(ValueError, match=message):
        paged_read.source(k_bytes, v_bytes, stages)


def test_fastest_depth_is_reported():
    records = [{"gbs": 3000.0, "stages": 2}, {"gbs": 4100.0, "stages": 3}, {"gbs": float("nan"), "stages": 4}]
    assert paged_read.fastest(records)["stages"] == 3


def test_command_refuses_bad_options_without_a_gpu():
    runner = CliRunner()
    result = runner.invoke(main, ["bench", "paged-read", "--page-size", "24"])
    assert result.exit_code == 2 and "'24' is not one of" in result.output
    result = runner.invoke(main, ["bench", "paged-read", "-f", "e4m3"])
    assert result.exit_code == 2 and "--format" in result.output


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, page", [("e4m3-e4m3", 16), ("f16-e4m3", 32), ("f16-f16", 128)])
@pytest.mark.parametrize("stages", [2, 3])
def test_reader_reads_exactly_its_pages(fmt, page, stages):
    import cupy

    kv_heads, d = 4, 128
    k_bytes, v_bytes = paged_read.piece_bytes(fmt, page, d)
    reader = paged_read.Reader(k_bytes, v_bytes, paged_read.Depth(stages, 2))
    blocks = 2 * kv_heads  # two groups
    pages = 6 * paged_read.STAGE_BYTES // min(k_bytes + v_bytes, paged_read.STAGE_BYTES) + 5
    ids, per_group = paged_read.block_pages(pages, blocks, kv_heads, np.random.default_rng(1))
    rng = cupy.random.default_rng(2)
    k_pool = rng.integers(0, 2**32, pages * kv_heads * k_bytes // 4, dtype=cupy.uint64).astype(cupy.uint32)
    v_pool = rng.integers(0, 2**32, pages * kv_heads * v_bytes // 4, dtype=cupy.uint64).astype(cupy.uint32)
    out = cupy.full(blocks * paged_read.THREADS, 0xDEADBEEF, dtype=cupy.uint32)
    reader(k_pool, v_pool, cupy.asarray(ids), per_group, kv_heads, out)
    # the chunks of whole steps, as the reader streams them: each block's pages, K piece then V piece
    k_pieces = k_pool.reshape(pages, kv_heads, -1)
    v_pieces = v_pool.reshape(pages, kv_heads, -1)
    chunks_read = reader.bytes_read(blocks, per_group) // blocks // 4
    expected = np.uint32(0)
    for block in range(blocks):
        group, head = divmod(block, kv_heads)
        mine = cupy.asarray(ids[group * per_group:(group + 1) * per_group])
        stream = cupy.concatenate([k_pieces[mine, head], v_pieces[mine, head]], axis=1).reshape(-1)[:chunks_read]
        expected ^= np.bitwise_xor.reduce(stream.get())
    got = np.bitwise_xor.reduce(out.get())
    assert chunks_read > 0 and got == expected
