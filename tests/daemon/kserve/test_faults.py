"""Every non-``ok`` outcome through the KServe endpoint, with the status a client retries on,
and the daemon's crash and drain guarantees holding for its calls (a real CPU daemon,
tritonclient's HTTP and gRPC clients, nothing mocked)."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tgrpc
from tritonclient.utils import InferenceServerException

from .kserve_daemon import KServeDaemon, fixture_images, grpc_input, http_input


def _errors(d: KServeDaemon, image: np.ndarray, **kwargs: object) -> tuple[str, str]:
    """The HTTP and the gRPC status of the same failing call."""
    with pytest.raises(InferenceServerException) as http_error:
        d.http().infer("scratchnet", [http_input(image)], **kwargs)
    with pytest.raises(InferenceServerException) as grpc_error:
        d.grpc().infer("scratchnet", [grpc_input(image)], **kwargs)
    return str(http_error.value.status()), str(grpc_error.value.status())


def test_a_full_queue_is_503_and_unavailable(data_dir: Path) -> None:
    # A batch of more images than the queue has slots: the acceptor admits them in one turn
    # of the loop, so the ones past the last free slot are `overloaded`, whatever the timing.
    batch = np.stack(fixture_images(data_dir, 6))
    with KServeDaemon(workers=1, slots=4, slot_bytes=1 << 18) as d:
        statuses = _errors(d, batch)
        assert statuses == ("503", "StatusCode.UNAVAILABLE")
        deadline = time.monotonic() + 60
        while (queue := d.status().queue).in_use or queue.in_flight:  # all slots come back
            assert time.monotonic() < deadline, queue
            time.sleep(0.02)


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_a_deadline_passed_in_the_queue_is_504_and_deadline_exceeded(
    data_dir: Path, transport: str
) -> None:
    # One worker serves a batch two images at a time; the last of eight waits several
    # forward passes, far past a 1 ms deadline, and is answered `timeout` unserved. A fresh
    # daemon each: once it has measured its service rate, the door refuses a deadline that
    # short (`overloaded`, 503) instead of queueing it (daemon/frontend/overload.py).
    batch = np.stack(fixture_images(data_dir, 8))
    with KServeDaemon(workers=1, slots=16, slot_bytes=1 << 18) as d:
        with pytest.raises(InferenceServerException) as error:
            if transport == "http":
                d.http().infer("scratchnet", [http_input(batch)], parameters={"deadline_ms": 1})
            else:
                d.grpc().infer("scratchnet", [grpc_input(batch)], parameters={"deadline_ms": 1})
        want = "504" if transport == "http" else "StatusCode.DEADLINE_EXCEEDED"
        assert str(error.value.status()) == want


def test_a_request_that_kills_its_workers_is_500_and_internal(data_dir: Path) -> None:
    env = {"SCRATCHD_WORKER_FAULT": "*=claim.returned"}  # every worker dies on its first claim
    image = fixture_images(data_dir, 1)[0]
    with KServeDaemon(workers=1, slots=8, env=env) as d:
        with pytest.raises(InferenceServerException) as error:
            d.grpc().infer("scratchnet", [grpc_input(image)])
        assert str(error.value.status()) == "StatusCode.INTERNAL"
        assert "quarantined" in error.value.message()
        d.wait_ready(restarts={"cpu0": 3})
        with pytest.raises(InferenceServerException) as http_error:
            d.http().infer("scratchnet", [http_input(image)])
        assert str(http_error.value.status()) == "500"


def test_a_call_during_drain_is_refused_and_accepted_ones_are_answered(data_dir: Path) -> None:
    images = fixture_images(data_dir, 24)
    d = KServeDaemon(workers=1, slots=64, slot_bytes=1 << 18)
    with d, ThreadPoolExecutor(1) as pool:
        # 24 images queued on one worker: seconds of work for the drain to wait on.
        accepted = pool.submit(d.grpc().infer, "scratchnet", [grpc_input(np.stack(images))])
        while d.status().queue.in_flight < len(images) // 2:
            assert not accepted.done(), accepted.exception()
            time.sleep(0.01)
        assert d.proc is not None
        d.proc.send_signal(signal.SIGTERM)
        while "event=drain" not in d.log():
            time.sleep(0.01)
        with pytest.raises(InferenceServerException) as refused:
            d.grpc().infer("scratchnet", [grpc_input(images[0])])
        assert str(refused.value.status()) == "StatusCode.UNAVAILABLE"
        assert "shutting down" in refused.value.message()
        scores = accepted.result(timeout=120).as_numpy("score")
        assert scores.shape == (len(images),)
        assert d.proc.wait(60) == 0


def test_every_call_is_answered_through_a_worker_kill(data_dir: Path) -> None:
    images = fixture_images(data_dir, 8)
    with KServeDaemon(workers=2, slots=64, slot_bytes=1 << 18) as d:
        expected = [float(d.grpc().infer("scratchnet", [grpc_input(i)]).as_numpy("score")[0])
                    for i in images]  # fmt: skip
        victim = d.worker_pids()["cpu0"]
        killed = threading.Event()
        grpc = d.grpc()

        def call(n: int) -> float:
            image = images[n % len(images)]
            if n % 2:
                result = d.http().infer("scratchnet", [http_input(image)])
            else:
                result = grpc.infer("scratchnet", [grpc_input(image)])
            if n == 12:  # mid-load, with calls in flight on both transports
                os.kill(victim, signal.SIGKILL)
                killed.set()
            return float(result.as_numpy("score")[0])

        with ThreadPoolExecutor(6) as pool:
            scores = list(pool.map(call, range(48)))
        assert killed.is_set()
        assert scores == [expected[n % len(images)] for n in range(48)]
        assert any(e for e in d.log().splitlines() if "event=worker_died" in e)
        assert isinstance(grpc, tgrpc.InferenceServerClient)
