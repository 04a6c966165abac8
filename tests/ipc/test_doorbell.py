"""Doorbells: rings are never lost, waits time out, the fd crosses an exec."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from scratchd.ipc.doorbell import Doorbell


@pytest.fixture
def bell() -> Iterator[Doorbell]:
    bell = Doorbell.create()
    yield bell
    bell.close()


def test_a_ring_before_the_wait_is_not_lost(bell: Doorbell) -> None:
    bell.ring()
    bell.ring()
    assert bell.wait(0.0)  # counter was non-zero: returns at once and drains
    assert bell.drain() == 0
    assert not bell.wait(0.0)


def test_wait_times_out_without_a_ring(bell: Doorbell) -> None:
    start = time.monotonic()
    assert not bell.wait(0.05)
    assert time.monotonic() - start >= 0.045


def test_drain_counts_pending_rings(bell: Doorbell) -> None:
    for _ in range(3):
        bell.ring()
    assert bell.drain() == 3
    assert bell.drain() == 0


def test_an_exec_d_process_rings_an_inherited_fd(bell: Doorbell) -> None:
    fd = bell.fileno()
    code = f"from scratchd.ipc.doorbell import Doorbell; Doorbell.from_fd({fd}).ring()"
    child = subprocess.run([sys.executable, "-c", code], pass_fds=(fd,), check=False)
    assert child.returncode == 0
    assert bell.wait(5.0)


def test_close_on_exec_by_default(bell: Doorbell) -> None:
    code = f"import os; os.fstat({bell.fileno()})"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, check=False)
    # not passed: the fd does not leak into children (and that, not another error, failed)
    assert child.returncode != 0 and b"Bad file descriptor" in child.stderr
