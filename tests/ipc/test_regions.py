"""ipc/regions.py: which descriptors the daemon maps, and that no read leaves the region or
faults, whatever the client does to its memfd afterwards."""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scratchd.client.regions import create_memfd
from scratchd.ipc.regions import Region, RegionError, map_region

SIZE = 64 * 1024


@contextlib.contextmanager
def opened(fd: int) -> Iterator[int]:
    try:
        yield fd
    finally:
        os.close(fd)


def memfd(size: int = SIZE, seals: int = fcntl.F_SEAL_SHRINK, fill: bytes = b"") -> int:
    fd = os.memfd_create("test-region", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if fill:
        os.pwrite(fd, fill, 0)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def test_a_sealed_memfd_is_mapped_read_only_and_read_in_bounds() -> None:
    data = bytes(range(256)) * (SIZE // 256)
    with opened(memfd(fill=data)) as fd:
        region = Region.from_descriptor(1, fd, SIZE)
    assert bytes(region.view(0, SIZE)) == data
    assert bytes(region.view(100, 7)) == data[100:107]
    with pytest.raises(TypeError):  # read-only: nothing is written through it
        region.view(0, 1)[0] = 1
    region.close()


def test_the_clients_own_memfd_helper_makes_what_the_daemon_accepts() -> None:
    with opened(create_memfd(SIZE)) as fd:
        region = Region.from_descriptor(1, fd, SIZE)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, SIZE * 2)  # sealed against growing too
    region.close()


@pytest.mark.parametrize(
    "seals", [0, fcntl.F_SEAL_GROW, fcntl.F_SEAL_SEAL], ids=["none", "grow", "seal"]
)
def test_a_memfd_that_could_shrink_is_refused(seals: int) -> None:
    with opened(memfd(seals=seals)) as fd, pytest.raises(RegionError, match="F_SEAL_SHRINK"):
        map_region(fd, SIZE)


def test_a_memfd_that_cannot_be_sealed_is_refused() -> None:
    fd = os.memfd_create("unsealable", os.MFD_CLOEXEC)  # no MFD_ALLOW_SEALING: F_SEAL_SEAL set
    os.ftruncate(fd, SIZE)
    with opened(fd), pytest.raises(RegionError, match="not sealed"):
        map_region(fd, SIZE)


def test_a_posix_shm_object_is_refused(tmp_path: Path) -> None:
    name = f"/dev/shm/scratchd-test-{os.getpid()}"
    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, SIZE)
        with pytest.raises(RegionError, match="not sealed"):
            map_region(fd, SIZE)
    finally:
        os.close(fd)
        os.unlink(name)


def test_a_file_on_disk_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(bytes(SIZE))
    with opened(os.open(path, os.O_RDONLY)) as fd, pytest.raises(RegionError, match="memfd"):
        map_region(fd, SIZE)


def test_special_files_are_refused_by_kind(tmp_path: Path) -> None:
    r, w = os.pipe()
    left, right = socket.socketpair()
    cases = {
        r: "pipe",
        os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY): "directory",
        os.open("/dev/zero", os.O_RDONLY): "character device",
        left.fileno(): "socket",
    }
    try:
        for fd, kind in cases.items():
            with pytest.raises(RegionError, match=kind):
                map_region(fd, SIZE)
    finally:
        for fd in (r, w, *list(cases)[1:3]):
            os.close(fd)
        left.close()
        right.close()


def test_a_closed_descriptor_is_refused() -> None:
    fd = memfd()
    os.close(fd)
    with pytest.raises(RegionError, match="cannot be inspected"):
        map_region(fd, SIZE)


def test_a_memfd_smaller_than_announced_is_refused() -> None:
    with opened(memfd(size=4096)) as fd, pytest.raises(RegionError, match="fewer than"):
        map_region(fd, SIZE)


def test_a_write_only_descriptor_cannot_be_mapped() -> None:
    with (
        opened(memfd()) as fd,
        opened(os.open(f"/proc/self/fd/{fd}", os.O_WRONLY)) as wfd,
        pytest.raises(RegionError, match="cannot be mapped"),
    ):
        map_region(wfd, SIZE)


def test_shrinking_after_registration_fails_and_reads_stay_safe() -> None:
    """The seal is why: the client's ftruncate is refused, so no page under the daemon's
    mapping can vanish (a read of one would be SIGBUS)."""
    with opened(memfd(fill=b"\x07" * SIZE)) as fd:
        region = Region.from_descriptor(1, fd, SIZE)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, SIZE - 1)
        os.ftruncate(fd, SIZE * 4)  # growing is allowed with only F_SEAL_SHRINK: harmless
        assert bytes(region.view(SIZE - 8, 8)) == b"\x07" * 8
        with pytest.raises(RegionError):  # the region is what was announced, not the file
            region.view(SIZE, 1)
    region.close()


HUGE = st.integers(min_value=-(2**70), max_value=2**70)


@given(
    offset=st.one_of(st.integers(-8, SIZE + 8), HUGE),
    nbytes=st.one_of(st.integers(-8, SIZE + 8), HUGE),
)
def test_a_view_is_exactly_the_bytes_asked_for_or_refused(offset: int, nbytes: int) -> None:
    region = Region(3, SIZE, mmap.mmap(-1, SIZE))
    inside = offset >= 0 and nbytes > 0 and offset + nbytes <= SIZE
    try:
        view = region.view(offset, nbytes)
    except RegionError as exc:
        assert not inside
        assert "outside region 3" in str(exc)
    else:
        assert inside and len(view) == nbytes
        view.release()
    region.close()


def test_closing_a_region_a_reader_still_views_waits_for_the_reader() -> None:
    with opened(memfd(fill=b"\x05" * SIZE)) as fd:
        region = Region.from_descriptor(1, fd, SIZE)
    view = region.view(0, 16)
    region.close()  # a conversion is still reading: the mapping stays
    assert bytes(view) == b"\x05" * 16
    assert not region.mapping.closed
    view.release()
    region.close()
    assert region.mapping.closed
