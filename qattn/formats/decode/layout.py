"""Where a paged cache keeps V (the layout the decode kernels read and the cache writers store).

V is kept transposed per (page, kv head) so that the key-major PV product reads keys contiguously: the
page's tokens are slots, every 16-token group in ``fragments.pv_key_slot`` order (a lane's four keys of a
PV operand, slots 4t .. 4t + 3, one run), and the slots come in blocks of 4, ``[page_size / 4][D][4]``:
element ``(slot // 4 * D + channel) * 4 + slot % 4``. A block holds exactly the runs one lane reads, so
a kernel's copy of any whole groups is contiguous; a token's V lies in 4 D elements (one in four), the
fewest memory sectors a single token's write can touch while the runs stay whole.
"""
from __future__ import annotations

import numpy as np

from ...engine.fragments import pv_key_slot

BLOCK = 4  # slots per block: one lane's PV run


def slot(offset):
    """The V^T slot of the token at page offset ``offset`` (ints or NumPy integer arrays)."""
    return offset - offset % 16 + pv_key_slot(offset)


def element(slot_, channel, head_dim: int):
    """The element of (slot, channel) in one (page, kv head) piece of V^T."""
    return (slot_ // BLOCK * head_dim + channel) * BLOCK + slot_ % BLOCK


def pool_shape(num_pages: int, kv_heads: int, page_size: int, head_dim: int, itemsize: int) -> tuple:
    """The V pool's shape in bytes: [page][kv head][block][channel][4 slots x itemsize]."""
    return (num_pages, kv_heads, page_size // BLOCK, head_dim, BLOCK * itemsize)


def tokens(values: np.ndarray) -> np.ndarray:
    """[..., page_size / 4, D, 4] values of V^T pieces -> [..., page_size, D] in token order."""
    *lead, blocks, head_dim, _ = values.shape
    by_slot = np.swapaxes(values, -1, -2).reshape(*lead, blocks * BLOCK, head_dim)
    return by_slot[..., slot(np.arange(blocks * BLOCK)), :]
