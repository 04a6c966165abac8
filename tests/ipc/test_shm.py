"""The segment's lifecycle: mode 0600, stale replacement, live-owner refusal, unlink on close."""

from __future__ import annotations

import contextlib
import os
import signal
import stat
from collections.abc import Iterator

import posix_ipc
import pytest

from scratchd.ipc.layout import HEADER_BYTES, Geometry
from scratchd.ipc.queue import RequestQueue
from scratchd.ipc.shm import Segment, SegmentError

SMALL = Geometry(slots=4, slot_bytes=100, tick_ms=2, max_workers=2, wheel_ticks=32)


@pytest.fixture
def name() -> Iterator[str]:
    shm = f"/scratchd-test-shm-{os.getpid()}"
    yield shm
    with contextlib.suppress(posix_ipc.ExistentialError):
        posix_ipc.unlink_shared_memory(shm)


def dev_shm(name: str) -> str:
    return "/dev/shm/" + name.lstrip("/")


def test_created_private_and_unlinked_on_close(name: str) -> None:
    old_umask = os.umask(0)  # a permissive umask must not widen the mode
    try:
        q = RequestQueue.create(name, SMALL)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(os.stat(dev_shm(name)).st_mode) == 0o600
    worker = RequestQueue.attach(name)
    assert worker.geometry == SMALL
    worker.close()
    assert os.path.exists(dev_shm(name))  # a worker's close leaves it alone
    q.close()
    assert not os.path.exists(dev_shm(name))
    with pytest.raises(SegmentError, match="does not exist"):
        RequestQueue.attach(name)


def test_a_live_owner_is_refused(name: str) -> None:
    q = RequestQueue.create(name, SMALL)
    try:
        with pytest.raises(
            SegmentError, match=f"in use by a running daemon \\(pid {os.getpid()}\\)"
        ):
            RequestQueue.create(name, SMALL)
        worker = RequestQueue.attach(name)  # and the original is intact
        assert worker.geometry == SMALL
        worker.close()
    finally:
        q.close()


def test_a_dead_owners_segment_is_replaced(name: str) -> None:
    pid = os.fork()
    if pid == 0:
        RequestQueue.create(name, Geometry(slots=2, slot_bytes=10, max_workers=1, wheel_ticks=4))
        os.kill(os.getpid(), signal.SIGKILL)  # dies without cleaning up
    os.waitpid(pid, 0)
    assert os.path.exists(dev_shm(name))
    q = RequestQueue.create(name, SMALL)
    try:
        assert q.geometry == SMALL
        assert int(q._core.seg.header["owner_pid"]) == os.getpid()
    finally:
        q.close()


def test_a_foreign_segment_is_replaced_and_never_attached(name: str) -> None:
    junk = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=HEADER_BYTES)
    os.pwrite(junk.fd, b"NOTOURS!" + bytes(100), 0)
    junk.close_fd()
    with pytest.raises(SegmentError, match="bad magic"):
        RequestQueue.attach(name)
    q = RequestQueue.create(name, SMALL)
    q.close()


def test_geometry_errors_name_the_field(name: str) -> None:
    with pytest.raises(ValueError, match="max_workers=65"):
        Segment.create(name, Geometry(max_workers=65))


def test_a_segment_larger_than_dev_shm_is_a_clear_error_not_a_later_sigbus(name: str) -> None:
    fs = os.statvfs("/dev/shm")
    slot_bytes = fs.f_bavail * fs.f_frsize // 2 + (1 << 30)
    if slot_bytes > 1 << 34:
        pytest.skip("/dev/shm is larger than the biggest geometry")
    with pytest.raises(SegmentError, match=r"needs \d+ bytes but /dev/shm has \d+ free"):
        RequestQueue.create(name, Geometry(slots=2, slot_bytes=slot_bytes, max_workers=1))
    assert not os.path.exists(dev_shm(name))
