"""A real ``scratchd serve`` in a child process, for end-to-end tests.

The daemon runs the shipped model (``[model] path = ""``); ``SCRATCHD_TEST_MODEL`` runs these
tests against another model file instead (a candidate model, before it is shipped). Sockets
live in a short temporary directory (AF_UNIX paths are limited to 108 bytes).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

from scratchd.client.api import Client
from scratchd.protocol.log import parse_line
from scratchd.protocol.wire import StatusReply

SERVE = [sys.executable, "-c", "from scratchd.daemon.cli import main; main()", "serve"]


class DaemonProcess:
    """Start with ``with DaemonProcess(...) as d:``; ``d.socket`` is its socket path."""

    def __init__(
        self,
        *,
        workers: int = 2,
        slots: int = 64,
        slot_bytes: int = 1 << 20,
        max_batch: int = 4,
        extra: str = "",
        workers_extra: str = "",
        model: str | None = None,
        env: dict[str, str] | None = None,
        backend: str = "cpu",
    ) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="sd-", dir="/tmp"))
        self.socket = str(self.dir / "s.sock")
        self.config = self.dir / "scratchd.toml"
        self.log_path = self.dir / "serve.log"
        model_path = model if model is not None else os.environ.get("SCRATCHD_TEST_MODEL", "")
        self.config.write_text(
            f'[server]\nsocket = "{self.socket}"\ndrain_timeout_ms = 20000\n'
            # health/metrics on ports the kernel picks: test daemons run side by side
            "health_port = 0\nmetrics_port = 0\n"
            f"[queue]\nslots = {slots}\nslot_bytes = {slot_bytes}\nmax_batch = {max_batch}\n"
            f'[workers]\nbackend = "{backend}"\ncpu_workers = {workers}\nheartbeat_ms = 100\n'
            f"{workers_extra}"
            # Generous deadlines: on a loaded two-core CI machine a queue of real images can
            # take seconds, and only the tests about expiry want timeouts (they ask for them).
            "[classes.normal]\ndeadline_ms = 600000\n[classes.safety]\ndeadline_ms = 300000\n"
            f'[model]\npath = "{model_path}"\n{extra}'
        )
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def shm_path(self) -> Path:
        """The daemon's segment (its name is random: the ``ready`` line names it)."""
        for line in self.log().splitlines():
            fields = parse_line(line) if "event=ready" in line else {}
            if fields.get("event") == "ready":
                return Path("/dev/shm") / fields["queue"].lstrip("/")
        raise AssertionError(f"no ready line in the log:\n{self.log()}")

    def start(self, wait: bool = True) -> DaemonProcess:
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [*SERVE, "--config", str(self.config)], stdout=log, stderr=log, env=self.env
            )
        if wait:
            self.wait_ready()
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def status(self) -> StatusReply:
        with Client(self.socket, timeout=10.0) as client:
            return client.status()

    def wait_ready(self, timeout: float = 120.0, restarts: dict[str, int] | None = None) -> float:
        """Until serving with every worker ready (and, if given, at least these restart
        counts); returns the seconds waited."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited {self.proc.returncode}:\n{self.log()}")
            try:
                status = self.status()
            except OSError:
                time.sleep(0.02)
                continue
            by_name = {w.name: w for w in status.workers}
            if (
                status.state == "serving"
                and all(w.state == "ready" for w in status.workers)
                and all(by_name[n].restarts >= k for n, k in (restarts or {}).items())
            ):
                return time.monotonic() - start
            time.sleep(0.01)
        raise AssertionError(f"daemon not ready after {timeout} s:\n{self.log()}")

    def worker_pids(self) -> dict[str, int]:
        return {w.name: w.pid for w in self.status().workers}

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def __enter__(self) -> DaemonProcess:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
