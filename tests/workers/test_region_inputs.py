"""A worker process reads a request's pixels from the client region its descriptor names, in
place, and answers a request whose region it cannot read ``error`` alone, the rest of its batch
served (workers/main.py ``WorkerLoop.inputs``); workers/host_memory.py's page-locking of read-only
mappings, with a stand-in for CUDA's runtime (the GPU path itself: tests/workers/test_cuda.py)."""

from __future__ import annotations

import fcntl
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from scratchd.ipc.queue import Geometry, RequestQueue, Status
from scratchd.ipc.regions import Region
from scratchd.model.scratchnet import load_model
from scratchd.protocol.image import decode_image
from scratchd.workers.host_memory import HOST_REGISTER_READ_ONLY, PinnedHost
from scratchd.workers.protocol import ExitCode

from .test_main import MODEL, spawn, wait_completions


@pytest.fixture
def queue() -> Iterator[RequestQueue]:
    q = RequestQueue.create(
        f"/scratchd-test-region-worker-{os.getpid()}",
        Geometry(slots=8, slot_bytes=1 << 18, max_workers=4),
    )
    yield q
    q.close()


def sealed_region(images: list[np.ndarray]) -> Region:
    data = b"".join(i.tobytes() for i in images)
    fd = os.memfd_create("scratchd-region-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, len(data))
        os.pwrite(fd, data, 0)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        return Region.from_descriptor(1, fd, len(data))
    finally:
        os.close(fd)


def test_a_worker_reads_region_pixels_in_place_and_answers_an_unreadable_one_alone(
    queue: RequestQueue, data_dir: Path
) -> None:
    images = [
        decode_image((data_dir / "sd900" / "images" / f"Sc_{i}.png").read_bytes())[:128, :160]
        for i in (1, 2)
    ]
    images = [np.ascontiguousarray(i) for i in images]
    region = sealed_region(images)
    assert queue.regions.publish(region) and region.row is not None
    offsets = [0, images[0].size]
    named = [(region.row, region.generation, o) for o in offsets]
    named.insert(1, (region.row, region.generation + 1, 0))  # a generation never published
    worker = spawn(queue)
    try:
        assert worker.read_ready()
        for rid, where in enumerate(named):
            h = queue.reserve()
            assert h is not None
            queue.submit(
                h, request_id=rid, conn_id=1, priority=0, part_class=0,
                deadline_ns=time.monotonic_ns() + 60 * 10**9, height=128, width=160,
                want_mask=True, region=where,
            )  # fmt: skip
        done = sorted(wait_completions(queue, 3), key=lambda c: c.request_id)
        assert [c.status for c in done] == [Status.OK, Status.ERROR, Status.OK]
        assert done[1].result is not None and "not published" in done[1].result.error
        expected = load_model(MODEL or None).predict(images)
        for completion, pred in zip([done[0], done[2]], expected, strict=True):
            assert completion.result is not None
            assert completion.result.score == pytest.approx(pred.score, abs=1e-6)
            np.testing.assert_array_equal(completion.result.mask, pred.mask)
        maps = Path(f"/proc/{worker.proc.pid}/maps").read_text()
        assert "memfd:scratchd-region-test" in maps  # its own mapping, read in place
        queue.regions.retire(region)
        deadline = time.monotonic() + 30
        while "memfd:scratchd-region-test" in maps and time.monotonic() < deadline:
            time.sleep(0.05)  # the worker drops it on its next turn (a heartbeat at most)
            maps = Path(f"/proc/{worker.proc.pid}/maps").read_text()
        assert "memfd:scratchd-region-test" not in maps
        worker.proc.send_signal(signal.SIGTERM)
        assert worker.proc.wait(30) == ExitCode.OK
    finally:
        worker.close()


class FakeRuntime:
    """CUDA's ``hostRegister`` / ``hostUnregister``, recording calls; read-only registration
    refused when ``read_only_supported`` is False, as a device without the attribute does."""

    class CUDARuntimeError(RuntimeError):
        pass

    def __init__(self, read_only_supported: bool) -> None:
        self.read_only_supported = read_only_supported
        self.locked: dict[int, tuple[int, int]] = {}

    def hostRegister(self, ptr: int, nbytes: int, flags: int) -> None:
        if flags & HOST_REGISTER_READ_ONLY and not self.read_only_supported:
            raise self.CUDARuntimeError("cudaErrorNotSupported")
        assert ptr not in self.locked, "page-locked twice"
        self.locked[ptr] = (nbytes, flags)

    def hostUnregister(self, ptr: int) -> None:
        del self.locked[ptr]


def fake_cupy(runtime: FakeRuntime) -> Any:
    return SimpleNamespace(cuda=SimpleNamespace(runtime=runtime))


def test_a_region_mapping_is_page_locked_read_only_once_and_unlocked() -> None:
    runtime = FakeRuntime(read_only_supported=True)
    host = PinnedHost(fake_cupy(runtime), copy_stream=None)
    slots, region = np.zeros(1 << 16, np.uint8), np.zeros(1 << 16, np.uint8)
    assert host.register(slots) and host.register(region, read_only=True)
    assert host.register(region, read_only=True)  # again: already locked, no second call
    flags = {ptr: f for ptr, (_, f) in runtime.locked.items()}
    assert flags == {slots.ctypes.data: 0, region.ctypes.data: HOST_REGISTER_READ_ONLY}
    assert host.registered(region.ctypes.data + 100, 1000)
    assert not host.registered(region.ctypes.data + len(region) - 10, 20)  # runs past the end
    host.unregister(region)
    assert list(runtime.locked) == [slots.ctypes.data]
    host.unregister_all()
    assert runtime.locked == {}


def test_a_device_that_cannot_lock_read_only_memory_falls_back_to_staging() -> None:
    runtime = FakeRuntime(read_only_supported=False)
    host = PinnedHost(fake_cupy(runtime), copy_stream=None)
    region = np.zeros(4096, np.uint8)
    assert not host.register(region, read_only=True)
    assert not host.registered(region.ctypes.data, 16)  # its frames go through the staging
    host.unregister(region)  # nothing to undo, nothing raised
    assert runtime.locked == {}
