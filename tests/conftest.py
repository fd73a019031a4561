"""Shared pytest setup: tests marked ``gpu`` run only where a Hopper (sm_90) GPU is present."""
import os

import pytest

# The GPU suites pin their configs or use the heuristic default: tuning every new shape would take minutes.
# tests/test_autotune.py and test_kernel_cache.py unset it (the autotune_unset fixture).
os.environ.setdefault("CODA_AUTOTUNE", "0")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a Hopper (sm_90) GPU")


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    from coda._device import hopper_available

    if hopper_available():
        return
    skip = pytest.mark.skip(reason="needs a Hopper (sm_90) GPU")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty CODA cache directory (CODA_CACHE_DIR) and an empty in-memory tuning table, for this test only."""
    import coda.autotune as at
    d = tmp_path / "coda-cache"
    monkeypatch.setenv("CODA_CACHE_DIR", str(d))
    at._memory.clear()
    yield d
    at._memory.clear()


@pytest.fixture
def autotune_unset(monkeypatch):
    """CODA_AUTOTUNE unset for this test (this file sets it to 0 for the GPU suites): the library's default, store
    lookups and no tuning (tests/test_autotune.py and test_kernel_cache.py; the former turns tuning on where it
    tests it)."""
    monkeypatch.delenv("CODA_AUTOTUNE", raising=False)
