"""The segment's lifecycle: mode 0600, stale replacement, live-owner refusal, unlink on close."""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator

import posix_ipc
import pytest

from scratchd.ipc.layout import HEADER_BYTES, Geometry
from scratchd.ipc.queue import RequestQueue
from scratchd.ipc.shm import Segment, SegmentError, remove_dead

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


SQUAT = """
import fcntl, os, sys
import posix_ipc
if os.geteuid() == 0:
    os.setuid(65534)  # as another user, where the test may
held = []
for name in sys.argv[1:]:  # created first, world-writable, flocked for as long as it runs
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o666, size=4096)
    fcntl.flock(shm.fd, fcntl.LOCK_EX)
    held.append(shm)
print("squatting", flush=True)
sys.stdin.read()
"""

DIE_OWNING = """
import sys
from scratchd.ipc.layout import Geometry
from scratchd.ipc.queue import RequestQueue
queue = RequestQueue.create_unique(sys.argv[1], Geometry(slots=4, slot_bytes=100, tick_ms=2,
                                   max_workers=2, wheel_ticks=32))
print(queue.name, flush=True)
"""


def test_a_unique_segment_is_never_stopped_by_squatters_and_leaves_them_alone(
    name: str,
) -> None:
    prefix = name + "-"
    squatted = [prefix + "0" * 16, name, prefix + "f" * 16]
    squatter = subprocess.Popen(
        [sys.executable, "-c", SQUAT, *squatted],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert squatter.stdout is not None and squatter.stdout.readline().strip() == "squatting"
        queue = RequestQueue.create_unique(prefix, SMALL)
        try:
            assert queue.name.startswith(prefix) and queue.name not in squatted
            assert stat.S_IMODE(os.stat(dev_shm(queue.name)).st_mode) == 0o600
            assert all(os.path.exists(dev_shm(n)) for n in squatted)  # untouched
            worker = RequestQueue.attach(queue.name)
            worker.close()
        finally:
            queue.close()
        assert not os.path.exists(dev_shm(queue.name))
    finally:
        assert squatter.stdin is not None
        squatter.stdin.close()
        squatter.wait(30)
        for n in squatted:
            with contextlib.suppress(posix_ipc.ExistentialError, posix_ipc.PermissionsError):
                posix_ipc.unlink_shared_memory(n)


def test_only_dead_whole_segments_of_this_user_are_removed(name: str) -> None:
    prefix = name + "-"
    live = RequestQueue.create_unique(prefix, SMALL)
    died = subprocess.run(  # an owner that exits without closing: its segment stays
        [sys.executable, "-c", DIE_OWNING, prefix], capture_output=True, text=True, check=True
    )
    dead_name = died.stdout.strip()
    assert os.path.exists(dev_shm(dead_name))
    blank = posix_ipc.SharedMemory(prefix + "blank", posix_ipc.O_CREX, mode=0o600, size=4096)
    blank.close_fd()  # no header: a segment being created looks like this
    try:
        assert remove_dead(prefix) == [dead_name]
        assert os.path.exists(dev_shm(live.name)) and os.path.exists(dev_shm(prefix + "blank"))
    finally:
        live.close()
        posix_ipc.unlink_shared_memory(prefix + "blank")
