"""Shared pytest setup: tests marked ``gpu`` run only where a Hopper (sm_90) GPU is present."""
import os

import pytest

# The GPU suites pin their configs or use the heuristic default: tuning every new shape would take minutes.
# tests/test_autotune.py turns tuning on where it tests it.
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
