"""tools/mma_ceiling.py on a machine with no GPU: its loops compile for each MMA and arch, the PTX
holds the MMA asked for, and the default loop gives each chain its own operands (so ptxas cannot
merge the chains: more live registers than the shared-operand loop). CPU only."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import mma_ceiling  # noqa: E402

from qattn.engine.compile import compile_cuda  # noqa: E402


@pytest.mark.parametrize("shape", sorted(mma_ceiling.SHAPES))
@pytest.mark.parametrize("arch", ["sm_89", "sm_90a"])
def test_loop_compiles_with_its_mma(shape, arch):
    ptx_shape, types, *_ = mma_ceiling.SHAPES[shape]
    distinct = compile_cuda(mma_ceiling.source(shape, False), arch, f"mma_{shape}", entry="mma_loop")
    shared = compile_cuda(mma_ceiling.source(shape, True), arch, f"mma_{shape}", entry="mma_loop")
    for binary in (distinct, shared):
        assert f"mma.sync.aligned.{ptx_shape}.row.col.{types}" in binary.ptx
        assert binary.resources["spill_stores"] == 0
    assert distinct.resources["registers"] > shared.resources["registers"]
