"""Shared test configuration.

GPU tests carry ``@pytest.mark.gpu``; they are skipped unless CuPy imports and sees a device.
The real images live in ``../shared/data`` by default; ``SCRATCHD_DATA`` overrides it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

ROOT = Path(__file__).resolve().parent.parent

# CI runs on 2 shared cores: a slow draw or a slow example is load, not a defect. Property
# tests still run their full number of examples; only the timing health checks are off.
settings.register_profile("scratchd", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("scratchd")


def _gpu_available() -> bool:
    try:
        import cupy

        return bool(cupy.cuda.runtime.getDeviceCount() > 0)
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The marker, not ``item.keywords``: keywords also hold folder names (tests/gpu/).
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu_items and not _gpu_available():
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU with CuPy")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The real defect images (../shared/data unless SCRATCHD_DATA says otherwise)."""
    path = Path(os.environ.get("SCRATCHD_DATA", ROOT.parent / "shared" / "data"))
    if not path.is_dir():
        pytest.fail(f"real image data not found at {path} (set SCRATCHD_DATA)")
    return path
