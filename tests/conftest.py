import os

# One BLAS thread: the emulators' many small products slow down by an order of magnitude when
# OpenBLAS threads compete on a loaded 2-core CI machine. Set before NumPy loads OpenBLAS.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import pytest  # noqa: E402


@pytest.fixture
def rng():
    """Fresh inputs on every run; the seed is printed so that a failure can be replayed."""
    import numpy as np

    seed = np.random.SeedSequence().entropy % 2 ** 32
    print(f"seed {seed}")
    return np.random.default_rng(seed)


def _has_gpu() -> bool:
    from qattn.engine.spec import device_arch

    return device_arch() is not None


def pytest_collection_modifyitems(config, items):
    if any("gpu" in item.keywords for item in items) and not _has_gpu():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the device machine)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


def check_spills(entry: str, res: dict, *, attention: bool, allowed: int = 0) -> None:
    """ptxas's spills for one entry point: an attention entry spills at most `allowed` bytes each
    way; a quantization entry never reloads a spill (at four blocks per SM ptxas may keep 8 bytes
    on the stack)."""
    assert res, f"no ptxas report for {entry}"
    if attention:
        assert res["spill_stores"] <= allowed and res["spill_loads"] <= allowed, (entry, res)
    else:
        assert res["spill_stores"] <= 8 and res["spill_loads"] == 0, (entry, res)


def entry_ptx(ptx: str, entry: str) -> str:
    """The PTX text of one .entry (up to the next one)."""
    start = ptx.index(f".entry {entry}(")
    nxt = ptx.find(".entry ", start + 1)
    return ptx[start:nxt if nxt >= 0 else len(ptx)]


def check_grid_dependency(ptx: str, entry: str, programmatic: bool) -> None:
    """An entry launched programmatically (packed.programmatic: sm_90+) waits for the kernel ahead of
    it (griddepcontrol.wait) before its first global access; before sm_90 it has no such instruction."""
    body = entry_ptx(ptx, entry)
    if programmatic:
        first_access = min(body.find(op) for op in ("ld.global", "st.global", "cp.async", "red.global", "atom.global")
                           if op in body)
        assert 0 <= body.find("griddepcontrol.wait") < first_access, entry
    else:
        assert "griddepcontrol" not in body, entry
