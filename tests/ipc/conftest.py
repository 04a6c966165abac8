"""The ``queue`` fixture of the ipc tests: a fresh small queue, closed afterwards."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from scratchd.ipc.queue import RequestQueue
from tests.ipc.queue_helpers import GEOMETRY, shm_name


@pytest.fixture
def queue() -> Iterator[RequestQueue]:
    q = RequestQueue.create(shm_name("q"), GEOMETRY)
    yield q
    q.close()
