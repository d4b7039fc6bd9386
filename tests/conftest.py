import pytest


def _has_gpu() -> bool:
    from qattn.codegen.spec import device_arch

    return device_arch() is not None


def pytest_collection_modifyitems(config, items):
    if any("gpu" in item.keywords for item in items) and not _has_gpu():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the device machine)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
