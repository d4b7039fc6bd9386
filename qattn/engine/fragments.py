"""Fragment layouts of mma.sync m16n8 operands that the kernels store data in (the 8-bit PV's key order),
written once for the code that stores them and the tests that model them.

In an ``mma.sync m16n8k32`` with 8-bit operands, the A register a0 of lane (g, t) holds k slots
4t..4t+3 of row g, but the S accumulator it is packed from gives that lane keys 2t, 2t+1 of each
8-key n-tile. Packing two n-tiles' pairs into one register makes slot s of every 16-key group
stand for key ``pv_slot_key(s)``; V must be presented (transposed, k contiguous) in that order.
Both functions take ints or NumPy integer arrays.
"""
from __future__ import annotations


def pv_slot_key(slot):
    """The key (within its 16-key group) that slot s holds: slots 4t..4t+3 are keys 2t, 2t+1,
    8+2t, 9+2t."""
    s = slot % 16
    return 2 * (s // 4) + (s % 4) % 2 + 8 * ((s % 4) // 2)


def pv_key_slot(key):
    """The slot (within its 16-key group) that holds key k: the inverse of pv_slot_key."""
    k = key % 16
    return 4 * ((k % 8) // 2) + k % 2 + 2 * (k // 8)
