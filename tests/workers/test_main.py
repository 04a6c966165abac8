"""A worker process on its own: READY after warm-up, serving the queue, leaving on SIGTERM or
when its parent is gone, and BOOT_ERROR with a reason when it cannot start."""

from __future__ import annotations

import contextlib
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest

from scratchd.ipc.queue import Completion, Geometry, RequestQueue, Status
from scratchd.model.scratchnet import load_model
from scratchd.protocol.image import decode_image
from scratchd.protocol.log import parse_line
from scratchd.workers.main import StopFlag, WorkerLoop, await_takeover
from scratchd.workers.protocol import ExitCode, WorkerSpec, parse_ready, take_message

FD_SETSIZE = 1024
"""``select()`` refuses descriptors numbered this or more."""

MODEL = os.environ.get("SCRATCHD_TEST_MODEL", "")


@pytest.fixture
def queue() -> Iterator[RequestQueue]:
    q = RequestQueue.create(
        f"/scratchd-test-worker-{os.getpid()}", Geometry(slots=8, slot_bytes=1 << 18, max_workers=4)
    )
    yield q
    q.close()


@dataclass
class WorkerProc:
    proc: subprocess.Popen[bytes]
    ready_r: int
    death_w: int

    def read_ready(self, timeout: float = 60.0) -> bytes:
        data = b""
        deadline = time.monotonic() + timeout
        while b"\n" not in data and time.monotonic() < deadline:
            readable, _, _ = select.select([self.ready_r], [], [], 0.5)
            if readable:
                chunk = os.read(self.ready_r, 4096)
                if not chunk:
                    break
                data += chunk
        return data

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for fd in (self.ready_r, self.death_w):
            with contextlib.suppress(OSError):
                os.close(fd)


def spawn(
    queue: RequestQueue,
    *,
    model: str = MODEL,
    parent_pid: int | None = None,
    extra: tuple[str, ...] = (),
    stderr: int | None = None,
) -> WorkerProc:
    spec = WorkerSpec(
        queue=queue.name,
        slot=1,
        backend="cpu",
        model_path=model,
        max_batch=2,
        max_delay_ms=1,
        heartbeat_ms=100,
        parent_pid=os.getpid() if parent_pid is None else parent_pid,
        extra=extra,
    )
    ready_r, ready_w = os.pipe()
    death_r, death_w = os.pipe()
    fds = (ready_w, death_r, queue.work_fd(1), queue.completion_fd)
    argv = spec.argv(ready_fd=ready_w, death_fd=death_r, work_fd=fds[2], done_fd=fds[3])
    proc = subprocess.Popen(argv, pass_fds=fds, stderr=stderr)
    os.close(ready_w)
    os.close(death_r)
    return WorkerProc(proc, ready_r, death_w)


def submit(queue: RequestQueue, image: np.ndarray, request_id: int) -> None:
    h = queue.reserve()
    assert h is not None
    np.frombuffer(queue.payload(h), np.uint8, count=image.size)[:] = image.ravel()
    queue.submit(
        h, request_id=request_id, conn_id=1, priority=0, part_class=0,
        deadline_ns=time.monotonic_ns() + 60 * 10**9, height=image.shape[0],
        width=image.shape[1], want_mask=True,
    )  # fmt: skip


def wait_completions(queue: RequestQueue, n: int, timeout: float = 60.0) -> list[Completion]:
    done: list[Completion] = []
    deadline = time.monotonic() + timeout
    while len(done) < n and time.monotonic() < deadline:
        select.select([queue.completion_fd], [], [], 0.5)
        done.extend(queue.collect_completed())
    return done


def test_ready_after_warm_up_then_serves_the_queue(queue: RequestQueue, data_dir: Path) -> None:
    worker = spawn(queue)
    try:
        parsed = parse_ready(worker.read_ready())
        assert parsed is not None
        device, version = parsed
        assert device == "cpu" and version == load_model(MODEL or None).version
        (row,) = queue.worker_rows()
        assert (row.slot, row.pid) == (1, worker.proc.pid)
        images = [
            decode_image((data_dir / "sd900" / "images" / f"Sc_{i}.png").read_bytes())
            for i in (1, 2, 33)
        ]
        for i, image in enumerate(images):
            submit(queue, image, 10 + i)
        done = sorted(wait_completions(queue, 3), key=lambda c: c.request_id)
        expected = load_model(MODEL or None).predict(images)
        assert [c.request_id for c in done] == [10, 11, 12]
        for completion, pred in zip(done, expected, strict=True):
            assert completion.status is Status.OK and completion.worker == 1
            assert completion.result is not None
            assert completion.result.score == pytest.approx(pred.score, abs=1e-6)
            assert completion.result.mask is not None
            np.testing.assert_array_equal(completion.result.mask, pred.mask)
        worker.proc.send_signal(signal.SIGTERM)
        assert worker.proc.wait(30) == ExitCode.OK
    finally:
        worker.close()


def test_a_worker_started_with_views_serves_those_views(
    queue: RequestQueue, data_dir: Path
) -> None:
    """``--views`` (config ``model.views``): the worker's answers are those views' average,
    which differ from the model file's own views' answers on this tile."""
    image = decode_image((data_dir / "mtile" / "crack" / "exp1_num_249594.jpg").read_bytes())
    views = ("identity", "flip_h", "flip_v", "transpose")
    chosen = load_model(MODEL or None, views=views).predict([image])[0]
    shipped = load_model(MODEL or None).predict([image])[0]
    assert tuple(load_model(MODEL or None).views) != views
    assert not np.array_equal(chosen.mask, shipped.mask)  # else this test could not fail
    worker = spawn(queue, extra=("--views=" + ",".join(views),))
    try:
        assert parse_ready(worker.read_ready()) is not None
        submit(queue, image, 7)
        (done,) = wait_completions(queue, 1)
        assert done.status is Status.OK and done.result is not None
        assert done.result.score == pytest.approx(chosen.score, abs=1e-6)
        assert done.result.mask is not None
        np.testing.assert_array_equal(done.result.mask, chosen.mask)
    finally:
        worker.close()


def test_sigterm_wakes_a_sleeping_worker_at_once(queue: RequestQueue) -> None:
    worker = spawn(queue)
    try:
        assert parse_ready(worker.read_ready()) is not None
        time.sleep(0.3)  # asleep on its doorbell
        start = time.monotonic()
        worker.proc.send_signal(signal.SIGTERM)
        assert worker.proc.wait(30) == ExitCode.OK
        assert time.monotonic() - start < 20.0  # the doorbell, not the 30 s a hang would take
    finally:
        worker.close()


def test_a_worker_leaves_when_the_main_process_is_gone(queue: RequestQueue) -> None:
    worker = spawn(queue)
    try:
        assert parse_ready(worker.read_ready()) is not None
        os.close(worker.death_w)  # what the kernel does when the main process dies
        worker.death_w = -1
        assert worker.proc.wait(30) == ExitCode.PARENT_GONE
    finally:
        worker.close()


def test_a_worker_started_for_another_parent_leaves_at_once(queue: RequestQueue) -> None:
    worker = spawn(queue, parent_pid=1)
    try:
        assert worker.proc.wait(30) == ExitCode.PARENT_GONE
        assert worker.read_ready(1.0) == b""
    finally:
        worker.close()


def test_a_worker_that_cannot_load_its_model_reports_boot_error(
    queue: RequestQueue, tmp_path: Path
) -> None:
    missing = tmp_path / "missing.npz"
    worker = spawn(queue, model=str(missing))
    try:
        line = worker.read_ready()
        assert line.startswith(b"BOOT_ERROR ") and str(missing).encode() in line
        assert worker.proc.wait(30) == ExitCode.BOOT_ERROR
    finally:
        worker.close()


def test_a_workers_log_lines_are_the_daemons_key_value_lines(
    queue: RequestQueue, tmp_path: Path
) -> None:
    log = tmp_path / "worker.log"
    with log.open("wb") as f:
        worker = spawn(queue, stderr=f.fileno())
    try:
        assert parse_ready(worker.read_ready()) is not None
        worker.proc.send_signal(signal.SIGTERM)
        assert worker.proc.wait(30) == ExitCode.OK
    finally:
        worker.close()
    (line,) = [ln for ln in log.read_text().splitlines() if "event=worker_booted" in ln]
    fields = parse_line(line)
    assert fields["level"] == "info" and fields["event"] == "worker_booted"
    assert fields["worker"] == "1" and fields["device"] == "cpu"
    assert int(fields["pid"]) == worker.proc.pid and int(fields["boot_ms"]) > 0


def test_a_boot_failure_is_one_error_line(queue: RequestQueue, tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    with log.open("wb") as f:
        worker = spawn(queue, model=str(tmp_path / "missing.npz"), stderr=f.fileno())
    try:
        worker.read_ready()
        assert worker.proc.wait(30) == ExitCode.BOOT_ERROR
    finally:
        worker.close()
    (line,) = log.read_text().splitlines()
    fields = parse_line(line)
    assert (fields["level"], fields["event"]) == ("error", "worker_boot_failed")
    assert "missing.npz" in fields["reason"]


def test_boot_time_is_measured_from_exec() -> None:
    from scratchd.workers.boot_log import since_exec_ms

    child = subprocess.run(
        [sys.executable, "-c", "import time; time.sleep(0.3)\n"
         "from scratchd.workers.boot_log import since_exec_ms; print(since_exec_ms())"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert 300 <= float(child.stdout) < 60_000  # the sleep counts: the clock starts at exec
    assert since_exec_ms() > 0


@pytest.fixture
def high_fds() -> Iterator[None]:
    """This process holds descriptors up to ``FD_SETSIZE``, as the main process does with a
    thousand client connections: every descriptor opened now is numbered past it, and a
    worker it starts inherits those numbers (``pass_fds``)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = FD_SETSIZE + 256
    if soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {want}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    held: list[int] = []
    try:
        while not held or held[-1] < FD_SETSIZE:
            held.append(os.open(os.devnull, os.O_RDONLY))
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_standby_waits_on_descriptors_past_fd_setsize(high_fds: None) -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    death_r, death_w = os.pipe()
    work_fd = os.eventfd(0)
    control_fd = theirs.detach()  # await_takeover owns it from here
    try:
        assert min(control_fd, death_r, work_fd) >= FD_SETSIZE
        socket.send_fds(ours, [take_message(3)], [work_fd])
        taken = await_takeover(control_fd, death_r, StopFlag(-1))
        assert taken is not None and taken[0] == 3  # told its slot, handed its doorbell
        os.close(taken[1])
        # The serving loop checks its death pipe every turn, on the same numbers.
        backend = cast(Any, SimpleNamespace(max_batch=1))
        loop = WorkerLoop(cast(Any, None), 3, backend, StopFlag(-1), death_r, 0, 100)
        assert not loop.parent_gone()
        os.close(death_w)
        death_w = -1
        assert loop.parent_gone()  # the main process is gone: EOF
    finally:
        ours.close()
        for fd in (death_r, death_w, work_fd):
            if fd >= 0:
                os.close(fd)


def test_a_standby_whose_parent_dies_past_fd_setsize_leaves(high_fds: None) -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    death_r, death_w = os.pipe()
    control_fd = theirs.detach()  # await_takeover owns it (closed with its socket object)
    try:
        assert min(control_fd, death_r) >= FD_SETSIZE
        os.close(death_w)
        assert await_takeover(control_fd, death_r, StopFlag(-1)) is None
    finally:
        ours.close()
        os.close(death_r)
