"""How a decode call fills the GPU: blocks resident per SM and the split of each sequence's keys.

Decode streams the K/V pages once, so its speed is the DRAM stream's. Measured on the H200 (GQA
32/8, D128, pages of 16 and 32 in shuffled order, docs/notes/decode.md): the formats stream fastest
with about 128 KiB of K/V in flight per SM (its blocks' pipeline slots): four blocks of the 16-bit
two-warp kernel, five of K8/V16 or K16/V8. More in flight than that slows the stream, fewer leaves
it short. K8/V8, which widens codes on both sides, is the exception the bytes do not explain: at
D128 on pages of 32 its two-warp blocks would make five (124 KiB), and five run 2-5% slower than
four (99 KiB), so there it takes at most EIGHT_BIT_MOST_BLOCKS (other head dims follow the bytes;
its default four-warp blocks at D128 make four by the bytes alone).

A call caps the blocks per SM at that target (by asking for more dynamic shared memory than the
kernel needs, which is what the occupancy calculator counts) and splits the keys so that its blocks
make one full wave of the capped slots. From sm_90 the splits of a group, at most CLUSTER_SPLITS of
them, run as one thread-block cluster and merge their partials through distributed shared memory
where the GPU holds as many such clusters at once as the grid needs waves (cluster_merge); the merge
kernel takes the rest.
"""
from __future__ import annotations

from .recipes import EIGHT_BIT, sides

CLUSTER_SPLITS = 8  # the most splits merged inside a thread-block cluster (the portable cluster size)
IN_FLIGHT_BYTES = 128 * 1024  # K/V bytes in flight per SM at which the measured stream is fastest
EIGHT_BIT_MOST_BLOCKS = 4  # blocks per SM of a format 8-bit on both sides (K8/V8) at D128, at most
MAX_SPLITS = 128
MIN_STEPS_PER_SPLIT = 4  # each split pays its Q load, pipeline fill and partial: keep it a few steps long
FULL_WAVE = 0.9  # a grid whose last wave is at least this full wastes little of it


def key_bytes(fmt: str, head_dim: int) -> int:
    """DRAM bytes of one key of one kv head: its K and V codes and an 8-bit side's token scale."""
    return sum(head_dim * (1 if side in EIGHT_BIT else 2) + (4 if side in EIGHT_BIT else 0) for side in sides(fmt))


def most_blocks_per_sm(fmt: str, head_dim: int) -> int | None:
    """The measured cap on a format's blocks per SM beside the bytes-in-flight rule, or None."""
    return EIGHT_BIT_MOST_BLOCKS if head_dim == 128 and all(side in EIGHT_BIT for side in sides(fmt)) else None


def target_blocks_per_sm(in_flight_per_block: int, resident: int, most: int | None = None) -> int:
    """Blocks per SM that hold about IN_FLIGHT_BYTES of pipeline slots, at least 1, at most resident
    (and most, where given)."""
    cap = resident if most is None else min(resident, most)
    return max(1, min(cap, round(IN_FLIGHT_BYTES / in_flight_per_block)))


SHARED_GRANULE = 128  # bytes: a block's shared memory (static + dynamic) is allocated in these units (sm_80+)


def capped_shared_bytes(needed: int, blocks_per_sm: int, sm_bytes: int, reserved: int, block_limit: int,
                        static: int = 0) -> int:
    """Dynamic shared memory a block asks for so that blocks_per_sm fit on an SM of sm_bytes and no more
    (each block also takes `reserved`, and its static and dynamic parts together are allocated in
    SHARED_GRANULE units), never less than it needs nor more than block_limit allows beside the static
    part."""
    share = (sm_bytes // blocks_per_sm - reserved) // SHARED_GRANULE * SHARED_GRANULE
    return min(block_limit - static, max(needed, share - static))


def auto_splits(blocks: int, key_steps: int, sms: int, blocks_per_sm: int, least: int = 1) -> int:
    """Splits of each block's key range for `blocks` blocks (kv heads x row chunks x batch) over at
    most `key_steps` steps, on `sms` SMs holding `blocks_per_sm` each, from `least`, at most one split
    per MIN_STEPS_PER_SPLIT steps. Where the grid fits one wave of resident blocks, the count that
    fills that wave best (the fewest on a tie): a second wave would pay every block's prologue again
    and run on a partly idle GPU. Otherwise the fewest whose last wave is FULL_WAVE full, else the
    best filled."""
    slots = sms * blocks_per_sm
    most = max(least, min(MAX_SPLITS, key_steps // MIN_STEPS_PER_SPLIT))

    def filled(splits: int) -> float:
        total = blocks * splits
        return total / (slots * -(-total // slots))

    candidates = range(least, most + 1)
    one_wave = [s for s in candidates if blocks * s <= slots]
    if one_wave:
        return max(one_wave, key=lambda s: (blocks * s, -s))
    good = [s for s in candidates if filled(s) >= FULL_WAVE]
    return good[0] if good else max(candidates, key=filled)


def cluster_merge(splits: int, blocks: int, slots: int, held) -> bool:
    """Whether the `splits` blocks of each of `blocks` groups run as one thread-block cluster that merges
    their partials itself (no merge launch): 2..CLUSTER_SPLITS splits, and the clusters the GPU holds at
    once (held(splits), asked only for such a count: a cluster's blocks must share one GPC) take no more
    waves than the plain grid over `slots` resident blocks."""
    if not 2 <= splits <= CLUSTER_SPLITS:
        return False
    active = held(splits)
    return active >= 1 and -(-blocks // active) <= -(-(blocks * splits) // slots)


class Occupancy:
    """A decode kernel entry's launch shape on one device: the dynamic shared memory it asks for and
    the SMs and blocks per SM that gives (the driver's occupancy figure)."""

    def __init__(self, kernel, suffix: str, device: int, in_flight_per_block: int, most: int | None = None):
        from cupy.cuda import driver, runtime

        attr = lambda a: runtime.deviceGetAttribute(a, device)  # noqa: E731
        function = kernel.function(suffix)
        self.sms = attr(runtime.cudaDevAttrMultiProcessorCount)
        natural = kernel.resident(device, suffix)[1]
        self.blocks_per_sm = target_blocks_per_sm(in_flight_per_block, natural, most)
        self.shared_bytes = kernel.shared_bytes
        if self.blocks_per_sm < natural:
            static = driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, function.ptr)
            capped = capped_shared_bytes(kernel.shared_bytes, self.blocks_per_sm,
                                         attr(runtime.cudaDevAttrMaxSharedMemoryPerMultiprocessor),
                                         attr(runtime.cudaDevAttrReservedSharedMemoryPerBlock),
                                         attr(runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin), static)
            driver.funcSetAttribute(function.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, capped)
            got = driver.occupancyMaxActiveBlocksPerMultiprocessor(function.ptr, kernel.threads, capped)
            if 1 <= got < natural:  # else the cap did not take: launch as the kernel is
                self.blocks_per_sm, self.shared_bytes = got, capped
            else:
                self.blocks_per_sm = natural


def occupancy(kernel, suffix: str, device: int, in_flight_per_block: int, most: int | None = None) -> Occupancy:
    """The Occupancy of a kernel entry on a device, worked out once per kernel."""
    key = (device, suffix)
    found = kernel.launch_shapes.get(key)
    if found is None:
        found = kernel.launch_shapes[key] = Occupancy(kernel, suffix, device, in_flight_per_block, most)
    return found
