"""ipc/region_table.py and ipc/region_maps.py: a request queued naming a client region is read
in place by the worker that claims it, from its own read-only mapping; the region stays
published until the last request naming it is freed, whatever the order of events; a row
published again is never confused with the region it held before; no read leaves the region.

The worker here is a second mapping of the queue in this process (``RequestQueue.attach``):
it opens the main process's descriptors through ``/proc/<pid>/fd`` as a worker process does.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scratchd.ipc.queue import Claim, Handle, RequestQueue, Result, Status
from scratchd.ipc.regions import Region, RegionError, open_published

from .queue_helpers import GEOMETRY

SIZE = 4096
FAR = 2**62  # a deadline that never passes


def memfd_region(region_id: int = 1, fill: int | None = None, size: int = SIZE) -> Region:
    """A sealed memfd of ``size`` bytes holding 0, 1, 2, ... (or ``fill``), as the daemon
    registers it (its own duplicate of the descriptor kept)."""
    fd = os.memfd_create("scratchd-region-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        data = np.arange(size, dtype=np.uint8) if fill is None else np.full(size, fill, np.uint8)
        os.pwrite(fd, data.tobytes(), 0)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        return Region.from_descriptor(region_id, fd, size)
    finally:
        os.close(fd)


@pytest.fixture
def worker(queue: RequestQueue) -> Iterator[RequestQueue]:
    w = RequestQueue.attach(queue.name, completion_fd=queue.completion_fd)
    w.register_worker(0, os.getpid())
    yield w
    w.close()


def submit_named(
    q: RequestQueue,
    region: Region,
    offset: int,
    h: int = 2,
    w: int = 2,
    rid: int = 1,
    conn: int = 1,
) -> Handle:
    handle = q.reserve()
    assert handle is not None and region.row is not None
    q.submit(
        handle, request_id=rid, conn_id=conn, priority=0, part_class=0, deadline_ns=FAR,
        height=h, width=w, want_mask=False, region=(region.row, region.generation, offset),
    )  # fmt: skip
    return handle


def claim_all(w: RequestQueue) -> list[Claim]:
    return w.claim_batch(0, GEOMETRY.slots, time.monotonic_ns())


def ok(claim: Claim) -> Result:
    return Result(status=Status.OK, verdict_defect=False, score=0.0)


def test_a_worker_reads_the_named_pixels_in_place(queue: RequestQueue, worker: RequestQueue):
    region = memfd_region()
    assert queue.regions.shareable and queue.regions.publish(region)
    submit_named(queue, region, offset=100, h=3, w=5)
    (claim,) = claim_all(worker)
    image = worker.input_view(claim)
    assert image.shape == (3, 5) and not image.flags.writeable
    assert image.ravel().tolist() == list(range(100, 115))
    with pytest.raises(ValueError):
        image[0, 0] = 1  # a read-only view of a PROT_READ mapping
    queue.regions.retire(region)
    queue.regions.close()


def test_the_input_slot_is_not_written_for_a_named_request(queue: RequestQueue, worker):
    region = memfd_region(fill=7)
    assert queue.regions.publish(region)
    h = queue.reserve()
    assert h is not None
    slot = np.frombuffer(queue.payload(h), np.uint8)
    slot[:] = 0
    queue.submit(
        h, request_id=1, conn_id=1, priority=0, part_class=0, deadline_ns=FAR, height=2,
        width=2, want_mask=False, region=(region.row or 0, region.generation, 0),
    )  # fmt: skip
    (claim,) = claim_all(worker)
    assert worker.input_view(claim).tolist() == [[7, 7], [7, 7]]
    assert not slot.any()


def test_a_retired_region_stays_until_its_last_request_is_collected(
    queue: RequestQueue, worker: RequestQueue
) -> None:
    region = memfd_region()
    assert queue.regions.publish(region)
    row = region.row
    assert row is not None
    submit_named(queue, region, 0, rid=1)
    submit_named(queue, region, 8, rid=2)
    assert queue.regions.pins(row) == 2
    queue.regions.retire(region)  # the client left; both requests still queued
    first, second = claim_all(worker)
    assert region.fd >= 0, "released while requests name it"
    assert worker.input_view(first).ravel().tolist() == [0, 1, 2, 3]
    worker.complete(0, first, ok(first))
    assert [c.request_id for c in queue.collect_completed()] == [1]
    assert region.fd >= 0 and queue.regions.pins(row) == 1
    assert worker.input_view(second).ravel().tolist() == [8, 9, 10, 11]
    worker.complete(0, second, ok(second))
    queue.collect_completed()
    assert region.fd == -1 and len(queue.regions) == 0  # released with the last
    assert len(worker.region_maps) == 1
    worker.region_maps.forget_released()  # the worker loop's next turn
    assert len(worker.region_maps) == 0


def test_dropped_and_expired_requests_unpin(queue: RequestQueue) -> None:
    region = memfd_region()
    assert queue.regions.publish(region)
    row = region.row
    assert row is not None
    submit_named(queue, region, 0, rid=1, conn=5)
    h = queue.reserve()
    assert h is not None
    queue.submit(
        h, request_id=2, conn_id=6, priority=0, part_class=0, deadline_ns=1, height=2,
        width=2, want_mask=False, region=(row, region.generation, 0),
    )  # fmt: skip
    assert queue.regions.pins(row) == 2
    queue.abandon_connection(5)
    assert queue.regions.pins(row) == 1
    assert [c.status for c in queue.expire_due(time.monotonic_ns())] == [Status.TIMEOUT]
    assert queue.regions.pins(row) == 0
    queue.regions.retire(region)
    assert region.fd == -1


def test_a_requeued_request_is_read_by_the_next_worker(queue: RequestQueue) -> None:
    """A worker dies holding a region request: it goes back to the queue still naming the
    region, which stays published, and the replacement maps it afresh."""
    region = memfd_region()
    assert queue.regions.publish(region)
    submit_named(queue, region, 20)
    queue.regions.retire(region)  # and the client is gone too
    dead = RequestQueue.attach(queue.name, completion_fd=queue.completion_fd)
    dead.register_worker(1, os.getpid())
    (claim,) = dead.claim_batch(1, 1, time.monotonic_ns())
    dead.input_view(claim)
    dead.close()
    report = queue.reclaim_worker(1, time.monotonic_ns(), max_kills=3)
    assert report.requeued == [claim.handle]
    fresh = RequestQueue.attach(queue.name, completion_fd=queue.completion_fd)
    try:
        fresh.register_worker(2, os.getpid())
        (again,) = fresh.claim_batch(2, 1, time.monotonic_ns())
        assert fresh.input_view(again).ravel().tolist() == [20, 21, 22, 23]
        fresh.complete(2, again, ok(again))
        assert len(queue.collect_completed()) == 1
        assert region.fd == -1
    finally:
        fresh.close()


def test_a_row_published_again_is_a_new_region(queue: RequestQueue, worker: RequestQueue):
    old = memfd_region(fill=1)
    assert queue.regions.publish(old)
    submit_named(queue, old, 0, rid=1)
    (c1,) = claim_all(worker)
    assert worker.input_view(c1).ravel().tolist() == [1] * 4
    worker.complete(0, c1, ok(c1))
    queue.collect_completed()
    queue.regions.retire(old)
    new = memfd_region(fill=2)
    assert queue.regions.publish(new)
    assert new.row == old.row and new.generation != old.generation
    submit_named(queue, new, 0, rid=2)
    (c2,) = claim_all(worker)
    assert worker.input_view(c2).ravel().tolist() == [2] * 4
    queue.regions.retire(new)


def test_an_unpublished_row_or_generation_cannot_be_read(
    queue: RequestQueue, worker: RequestQueue
) -> None:
    maps = worker.region_maps
    with pytest.raises(RegionError, match="not published"):
        maps.image(3, 1, 0, 2, 2)
    region = memfd_region()
    assert queue.regions.publish(region)
    assert region.row is not None
    with pytest.raises(RegionError, match="not published"):
        maps.image(region.row, region.generation + 1, 0, 2, 2)
    with pytest.raises(RegionError, match="outside the table"):
        maps.image(10_000, 1, 0, 2, 2)
    queue.regions.retire(region)


@settings(max_examples=200, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    offset=st.one_of(st.integers(-(2**70), 2**70), st.integers(-8, SIZE + 8)),
    h=st.one_of(st.integers(-4, 80), st.integers(2**31, 2**40)),
    w=st.one_of(st.integers(-4, 80), st.integers(2**31, 2**40)),
)
def test_a_worker_never_reads_outside_the_region(
    queue: RequestQueue, worker: RequestQueue, offset: int, h: int, w: int
) -> None:
    region = memfd_region()
    assert queue.regions.publish(region)
    assert region.row is not None
    try:
        fits = h > 0 and w > 0 and offset >= 0 and offset + h * w <= SIZE
        if fits:
            image = worker.region_maps.image(region.row, region.generation, offset, h, w)
            assert image.shape == (h, w)
            assert int(image.ravel()[0]) == offset % 256
        else:
            with pytest.raises(RegionError):
                worker.region_maps.image(region.row, region.generation, offset, h, w)
    finally:
        queue.regions.retire(region)
        worker.region_maps.forget_released()


def test_a_descriptor_number_reused_for_another_file_is_refused() -> None:
    region = memfd_region()
    other = memfd_region(fill=9)
    try:
        with pytest.raises(RegionError, match="no longer the region"):
            open_published(os.getpid(), other.fd, SIZE, region.dev, region.ino)
        with pytest.raises(RegionError, match="cannot be opened"):
            open_published(os.getpid(), 10_000, SIZE, region.dev, region.ino)
        mapping = open_published(os.getpid(), region.fd, SIZE, region.dev, region.ino)
        assert mapping[5] == 5
        mapping.close()
    finally:
        region.close()
        other.close()


def test_a_full_table_publishes_nothing_and_the_region_is_copied_instead(
    queue: RequestQueue,
) -> None:
    published = []
    while True:
        region = memfd_region(size=64)
        if not queue.regions.publish(region):
            assert region.row is None
            region.close()
            break
        published.append(region)
    assert len(published) == len(queue.regions) > 0
    queue.regions.retire(published[0])
    again = memfd_region(size=64)
    assert queue.regions.publish(again) and again.row == published[0].row
    for region in [*published[1:], again]:
        queue.regions.retire(region)
    assert len(queue.regions) == 0


def test_page_lock_hooks_see_each_mapping_once_and_before_it_goes(
    queue: RequestQueue, worker: RequestQueue
) -> None:
    events: list[tuple[str, int]] = []
    worker.region_maps.set_hooks(
        lambda a: events.append(("map", a.ctypes.data)),
        lambda a: events.append(("unmap", a.ctypes.data)),
    )
    region = memfd_region()
    assert queue.regions.publish(region)
    assert region.row is not None
    for offset in (0, 4, 8):
        worker.region_maps.image(region.row, region.generation, offset, 2, 2)
    queue.regions.retire(region)
    worker.region_maps.forget_released()
    assert [e[0] for e in events] == ["map", "unmap"] and events[0][1] == events[1][1]
