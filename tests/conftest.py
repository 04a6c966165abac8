"""Shared test configuration.

GPU tests carry ``@pytest.mark.gpu``; they are skipped unless CuPy imports and sees a device.
Real images come from ``tests/fixtures/data`` (committed: a few dozen of each public data set,
see its README), so a fresh clone tests with nothing beside it. The few tests that need the
full data sets ask for ``full_data_dir``, which is ``SCRATCHD_DATA``; without it they skip.
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


FIXTURE_DATA = ROOT / "tests" / "fixtures" / "data"


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The committed real images, laid out as the full sets are (sd900/, mtile/<class>/)."""
    if not FIXTURE_DATA.is_dir():
        pytest.fail(f"the committed test images are missing from {FIXTURE_DATA}")
    return FIXTURE_DATA


@pytest.fixture(scope="session")
def full_data_dir() -> Path:
    """The full SD-900 and magnetic-tile sets at ``SCRATCHD_DATA`` (skip without it)."""
    value = os.environ.get("SCRATCHD_DATA")
    if not value:
        pytest.skip("needs the full data sets: set SCRATCHD_DATA (README, 'The data sets')")
    path = Path(value)
    if not path.is_dir():
        pytest.fail(f"SCRATCHD_DATA={value} is not a folder")
    return path
