"""The daemon's shared-memory segment against a squatter: another process (another user where
the test runs as root) that created and flocks the name the daemon used to take, and names
under its prefix, does not stop the daemon from starting, and is left alone."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import numpy as np
import posix_ipc

from scratchd.client.api import Client
from scratchd.daemon.app import queue_prefix
from scratchd.protocol.wire import Reply

from ..ipc.test_shm import SQUAT, dev_shm
from .harness import DaemonProcess


def test_a_squatted_name_never_stops_the_daemon() -> None:
    d = DaemonProcess(workers=1, slots=8)
    prefix = queue_prefix(d.socket)
    squatted = [prefix.rstrip("-"), prefix + "0" * 16, prefix + "squat"]
    squatter = subprocess.Popen(
        [sys.executable, "-c", SQUAT, *squatted],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert squatter.stdout is not None and squatter.stdout.readline().strip() == "squatting"
        with d:
            segment = d.shm_path
            assert segment.name.startswith(prefix.lstrip("/"))
            assert "/" + segment.name not in squatted
            with Client(d.socket, timeout=60) as client:
                reply = client.infer(np.zeros((32, 32), np.uint8), deadline_ms=60_000)
            assert isinstance(reply, Reply) and reply.status == "ok"
        assert not segment.exists()
        assert all(os.path.exists(dev_shm(n)) for n in squatted)  # another's: untouched
    finally:
        assert squatter.stdin is not None
        squatter.stdin.close()
        squatter.wait(30)
        for n in squatted:
            with contextlib.suppress(posix_ipc.ExistentialError, posix_ipc.PermissionsError):
                posix_ipc.unlink_shared_memory(n)
