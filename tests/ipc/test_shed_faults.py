"""Shedding (``RequestQueue.shed``) while workers are SIGKILLed: a shed request is answered
exactly once, by the shed's own Completion, whatever point of a claim its worker died at."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

from scratchd.ipc.queue import Completion, DescState, RequestQueue, Status
from tests.ipc.test_faults import GEOMETRY, STRESS_WORKER, collect, spawn


@pytest.fixture
def fq() -> Iterator[RequestQueue]:
    q = RequestQueue.create(f"/scratchd-test-shed-faults-{os.getpid()}", GEOMETRY)
    yield q
    q.close()


def _submit(q: RequestQueue, rid: int, priority: int = 0) -> None:
    h = q.reserve()
    assert h is not None
    image = np.full((4, 5), rid * 10, np.uint8)
    image[0, 1] = 0
    q.payload(h)[: image.size] = image.tobytes()
    q.submit(
        h, request_id=rid, conn_id=1, priority=priority, part_class=0,
        deadline_ns=time.monotonic_ns() + 30 * 10**9, height=4, width=5, want_mask=True,
    )  # fmt: skip


def _answered_once(answers: list[Completion], n: int) -> None:
    assert sorted(c.request_id for c in answers) == list(range(1, n + 1))
    for c in answers:
        if c.status == Status.OK:
            assert c.result is not None and c.result.score == c.request_id * 10
        else:
            assert c.status == Status.OVERLOADED and c.result is None and "shed" in c.error


@pytest.mark.parametrize("fault", ["claim.unlinked", "claim.marked", "claim.returned"])
@pytest.mark.parametrize("shed_first", [True, False])
def test_a_request_shed_while_its_worker_dies_claiming_it_is_answered_once(
    fq: RequestQueue, fault: str, shed_first: bool
) -> None:
    """One request; its worker dies at ``fault`` claiming it. Shedding before the
    reclaim finds it QUEUED after the repair (unlinked) or the dead worker's (marked,
    returned: then the reclaim requeues it); after the reclaim it is QUEUED. Either way
    exactly one answer comes: the shed's, or the rescuer's result."""
    _submit(fq, 1)
    victim = spawn(fq, 0, 1, fault)
    assert victim.wait(30) == -9
    answers: list[Completion] = []
    steps = ["shed", "reclaim"] if shed_first else ["reclaim", "shed"]
    for step in steps:
        if step == "shed":
            shed = fq.shed(8, "shed for a test")
            answers += [shed] if shed is not None else []
        else:
            fq.reclaim_worker(0, time.monotonic_ns())
    if not answers:
        rescuer = spawn(fq, 1, 1, None)
        answers += collect(fq, 1)
        rescuer.kill()
        rescuer.wait(10)
    _answered_once(answers, 1)
    expect_shed = fault == "claim.unlinked" or not shed_first
    assert [c.status for c in answers] == [Status.OVERLOADED if expect_shed else Status.OK]
    assert fq.collect_completed() == []
    assert fq.counts_by_state()[DescState.FREE] == GEOMETRY.slots


def test_shedding_among_randomly_killed_workers_answers_every_request_once(
    fq: RequestQueue,
) -> None:
    """Workers busy claiming are SIGKILLed at random moments while the main process keeps
    submitting and shedding; every request gets exactly one answer (its result or
    ``overloaded``) and no slot leaks."""
    rng = np.random.default_rng(21)
    total, sent, answers = 150, 0, list[Completion]()
    for round_ in range(8):
        slot = round_ % 2
        fds = (fq.work_fd(slot), fq.completion_fd)
        proc = subprocess.Popen(
            [sys.executable, "-c", STRESS_WORKER, fq.name, str(slot), *map(str, fds)],
            pass_fds=fds, stdout=subprocess.PIPE,
        )  # fmt: skip
        assert proc.stdout is not None and proc.stdout.read(1) == b"R"
        end = time.monotonic() + rng.uniform(0.005, 0.05)
        while time.monotonic() < end:
            while sent < total and (h := fq.reserve()) is not None:
                sent += 1
                fq.payload(h)[:20] = bytes([sent * 10 % 256] * 20)
                fq.submit(
                    h, request_id=sent, conn_id=1, priority=sent % 4, part_class=0,
                    deadline_ns=time.monotonic_ns() + 60 * 10**9, height=4, width=5,
                    want_mask=False,
                )  # fmt: skip
            if rng.random() < 0.3 and (shed := fq.shed(int(rng.integers(1, 5)), "shed")):
                answers.append(shed)
            answers += fq.collect_completed()
        proc.kill()
        proc.wait()
        proc.stdout.close()
        fq.reclaim_worker(slot, time.monotonic_ns(), max_kills=100)
    rescuer = spawn(fq, 3, total, None)
    answers += collect(fq, total - len(answers))
    rescuer.kill()
    rescuer.wait()
    assert sent == total
    assert sorted(c.request_id for c in answers) == list(range(1, total + 1))
    for c in answers:
        if c.status == Status.OK:
            assert c.result is not None and c.result.score == c.request_id * 10 % 256
        else:
            assert c.status == Status.OVERLOADED
    assert any(c.status == Status.OVERLOADED for c in answers)
    assert fq.counts_by_state()[DescState.FREE] == GEOMETRY.slots
