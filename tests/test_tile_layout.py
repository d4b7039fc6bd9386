"""The smem tile layout of the cp.async-filled CUDA tiles (tile_offset in flash_mma.cuh.j2,
tile_pitch in recipes.py): ldmatrix reads conflict-free, and every global 32-byte sector a copy
brings lands in one aligned smem sector."""
import pytest

from qattn.engine.tiling import tile_pitch


def tile_offset(pitch: int, row: int, chunk: int) -> int:
    """The device rule: rows `pitch` bytes apart; with a 32-byte-aligned pitch, bit 0 of the
    16-byte chunk index flips in rows 4-7 of every 8."""
    return row * pitch + ((chunk ^ ((row >> 2) & 1)) if pitch % 32 == 0 else chunk) * 16


ROW_BYTES = [32, 64, 96, 128, 192, 256, 512]  # f16 rows of d16..d256, int8 rows of d32..d512


@pytest.mark.parametrize("row_bytes", ROW_BYTES)
def test_pitch_is_the_least_aligned_one(row_bytes):
    pitch = tile_pitch(row_bytes)
    assert pitch >= row_bytes and pitch % 64 == 32 and pitch - row_bytes < 64
    assert not any(p % 64 == 32 for p in range(row_bytes, pitch, 16))


@pytest.mark.parametrize("pitch", [tile_pitch(b) for b in ROW_BYTES] + [b + 16 for b in ROW_BYTES])
def test_ldmatrix_reads_eight_rows_in_eight_bank_quads(pitch):
    for row0 in range(0, 32, 8):
        for chunk in range(4):  # the bank pattern depends on the chunk's parity and the row only
            quads = {tile_offset(pitch, row0 + r, chunk) // 16 % 8 for r in range(8)}
            assert len(quads) == 8, (pitch, row0, chunk)


@pytest.mark.parametrize("row_bytes", ROW_BYTES)
def test_each_global_sector_fills_one_smem_sector(row_bytes):
    pitch = tile_pitch(row_bytes)
    for row in range(16):
        for sector in range(row_bytes // 32):
            ends = {tile_offset(pitch, row, 2 * sector + h) // 32 for h in (0, 1)}
            assert len(ends) == 1, (row, sector)
            assert tile_offset(pitch, row, 2 * sector) % 16 == 0


def test_column_and_row_steps_commute_with_the_flip():
    # The kernels add 32-byte column steps and 8-row steps to a lane's offset at compile time.
    pitch = tile_pitch(256)
    for row in range(8):
        for chunk in range(2):
            base = tile_offset(pitch, row, chunk)
            assert tile_offset(pitch, row + 8, chunk + 4) == base + 8 * pitch + 64


def test_a_16_byte_pad_leaves_odd_rows_off_a_sector():
    # Why the aligned layout exists: with the older pad, half the rows split every sector.
    pitch = 256 + 16
    split = [row for row in range(8) if tile_offset(pitch, row, 0) % 32]
    assert split == [1, 3, 5, 7]
