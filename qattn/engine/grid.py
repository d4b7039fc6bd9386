"""The grid of a kernel that works through query blocks of every (batch, head) as work items (the wgmma
prefill kernels, templates/cuda/wgmma_attention.cuh.j2: work_item): a block per item, or with the option
persistent "on" as many blocks as the SMs hold at once, each taking items in turn (causal: in pairs of a
heavy and a light query block)."""
from __future__ import annotations

import functools


def work_grid(spec, items: int, device_id: int, blocks_per_sm: int) -> tuple:
    """The flat grid over `items` work items of spec's kernel, of which blocks_per_sm fit on one SM."""
    if items >= 2**31:
        raise ValueError(f"q: {items} query blocks of {spec.tile.block_m} rows over batch and heads, more than a "
                         "launch indexes (2^31 - 1): split the call")
    if spec.family.values.get("persistent") != "on":
        return (items, 1, 1)
    units = -(-items // 2) if spec.causal else items
    return (min(units, sm_count(device_id) * blocks_per_sm), 1, 1)


@functools.lru_cache(maxsize=None)
def sm_count(device_id: int) -> int:
    import cupy

    return int(cupy.cuda.runtime.getDeviceProperties(device_id)["multiProcessorCount"])
