"""A real ``scratchd serve`` in a child process, as systemd would run it, for the ops tests.

The child gets a ``NOTIFY_SOCKET`` bound by the test (so READY=1 tells us when it serves,
exactly as it tells systemd), a config file written from a dict, a short socket path
(``sun_path`` holds 108 bytes) and its stderr in a file whose event lines the tests parse.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from scratchd.client.api import Client
from scratchd.protocol import wire
from scratchd.protocol.image import decode_image
from scratchd.protocol.log import parse_line

BOOT_TIMEOUT_S = 90.0
MODEL_PATH = os.environ.get("SCRATCHD_TEST_MODEL", "")
"""The model the daemon serves and the expectations are computed with (default: shipped)."""


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return str(value)


def write_config(path: Path, sections: dict[str, dict[str, Any]]) -> Path:
    lines = []
    for section, table in sections.items():
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {_toml_value(value)}" for key, value in table.items())
    path.write_text("\n".join(lines) + "\n")
    return path


@dataclass
class LiveDaemon:
    proc: subprocess.Popen[bytes]
    socket_path: str
    config_path: Path
    stderr_path: Path
    notify: socket.socket
    notifications: list[dict[str, str]] = field(default_factory=list)

    def client(self, timeout: float = 30.0) -> Client:
        # With a timeout the connect is non-blocking, and a Unix socket whose backlog is full
        # (a storm of connections just ended) answers EAGAIN: retry for a while.
        end = time.monotonic() + timeout
        while True:
            try:
                return Client(self.socket_path, timeout=timeout)
            except BlockingIOError:
                if time.monotonic() > end:
                    raise
                time.sleep(0.01)

    def status(self) -> wire.StatusReply:
        with self.client() as client:
            return client.status()

    def events(self, name: str | None = None) -> list[dict[str, str]]:
        lines = self.stderr_path.read_text(errors="replace").splitlines()
        parsed = [parse_line(line) for line in lines if "event=" in line]
        return [e for e in parsed if name is None or e.get("event") == name]

    def read_notifications(self, timeout: float) -> list[dict[str, str]]:
        """Messages that arrive within ``timeout`` seconds (also kept in ``notifications``)."""
        got: list[dict[str, str]] = []
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0:
            self.notify.settimeout(left)
            try:
                data = self.notify.recv(4096).decode()
            except TimeoutError:
                break
            got.append(dict(line.split("=", 1) for line in data.split("\n") if "=" in line))
        self.notifications.extend(got)
        return got

    def wait_ready(self, timeout: float = BOOT_TIMEOUT_S) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {self.proc.returncode}: {self.stderr_tail()}")
            for message in self.read_notifications(0.2):
                if message.get("READY") == "1":
                    return
        raise TimeoutError(f"no READY=1 within {timeout} s: {self.stderr_tail()}")

    def stderr_tail(self, n: int = 3000) -> str:
        return self.stderr_path.read_text(errors="replace")[-n:]

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def wait_settled(self, timeout: float = 20.0) -> wire.StatusReply:
        """Status once nothing is in flight and no slot is in use (or the last one seen)."""
        end = time.monotonic() + timeout
        status = self.status()
        while (status.queue.in_use or status.queue.in_flight) and time.monotonic() < end:
            time.sleep(0.05)
            status = self.status()
        return status


# What systemd does between fork and exec for a socket-activated service.
_ACTIVATE = """
import os, sys
fd = int(sys.argv[1])
if fd != 3:
    os.dup2(fd, 3)
    os.close(fd)
os.environ.update(LISTEN_FDS="1", LISTEN_PID=str(os.getpid()), LISTEN_FDNAMES="scratchd.socket")
os.execv(sys.argv[2], sys.argv[2:])
"""


def daemon_config(**sections: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Small defaults for tests: one CPU worker, 32 slots of 256 KiB."""
    config: dict[str, dict[str, Any]] = {
        "queue": {"slots": 32, "slot_bytes": 256 * 1024},
        "workers": {"backend": "cpu", "cpu_workers": 1},
        "model": {"path": MODEL_PATH},
    }
    for name, table in sections.items():
        config.setdefault(name, {}).update(table)
    return config


@contextlib.contextmanager
def live_daemon(
    tmp_path: Path,
    config: dict[str, dict[str, Any]] | None = None,
    env: dict[str, str] | None = None,
    wait: bool = True,
    activation: socket.socket | None = None,
) -> Iterator[LiveDaemon]:
    """Start ``scratchd serve`` and stop it (SIGTERM) afterwards, whatever happened.

    ``activation``: a listening socket handed over as systemd's socket activation does
    (fd 3, ``LISTEN_FDS=1``, ``LISTEN_PID`` = the daemon's pid); the daemon is then
    expected to serve on it rather than on ``server.socket``.
    """
    short = Path(tempfile.mkdtemp(prefix="sd-", dir="/tmp"))
    sock_path = str(short / "s.sock")
    notify_path = str(short / "notify")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(notify_path)
    sections = config if config is not None else daemon_config()
    sections.setdefault("server", {})["socket"] = sock_path
    # Health and metrics: let the kernel pick free ports, tests run side by side.
    sections["server"].setdefault("health_port", 0)
    sections["server"].setdefault("metrics_port", 0)
    config_path = write_config(tmp_path / "scratchd.toml", sections)
    stderr_path = tmp_path / "daemon.stderr"
    child_env = {**os.environ, "NOTIFY_SOCKET": notify_path, **(env or {})}
    child_env.pop("WATCHDOG_PID", None)
    argv = [
        *(sys.executable, "-c", "from scratchd.daemon.cli import main; main()"),
        *("serve", "--config", str(config_path)),
    ]
    pass_fds: tuple[int, ...] = ()
    if activation is not None:
        pass_fds = (activation.fileno(),)
        argv = [sys.executable, "-c", _ACTIVATE, str(activation.fileno()), *argv]
    with open(stderr_path, "wb") as stderr:
        proc = subprocess.Popen(
            argv,
            pass_fds=pass_fds,
            env=child_env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    daemon = LiveDaemon(proc, sock_path, config_path, stderr_path, notify)
    try:
        if wait:
            daemon.wait_ready()
        yield daemon
    finally:
        with contextlib.suppress(subprocess.TimeoutExpired):
            daemon.stop()
        notify.close()
        with contextlib.suppress(OSError):
            os.unlink(notify_path)
        with contextlib.suppress(OSError):
            os.unlink(sock_path)
        with contextlib.suppress(OSError):
            short.rmdir()


def real_images(data_dir: Path, count: int) -> list[tuple[Path, bytes]]:
    """``count`` real defect photographs (PNG, 200x200) with their encoded bytes."""
    paths = sorted((data_dir / "sd900" / "images").glob("*.png"))
    step = max(1, len(paths) // count)
    chosen = paths[::step][:count]
    return [(p, p.read_bytes()) for p in chosen]


def real_crops(data_dir: Path, count: int, size: int = 64) -> list[np.ndarray]:
    """``count`` ``size`` x ``size`` grey crops of real images (raw frames: quick on CPU)."""
    crops = []
    for _, data in real_images(data_dir, count):
        image = decode_image(data)
        y, x = (image.shape[0] - size) // 2, (image.shape[1] - size) // 2
        crops.append(np.ascontiguousarray(image[y : y + size, x : x + size]))
    return crops


def expected_predictions(images: list[tuple[Path, bytes]]) -> list[tuple[str, float]]:
    """(verdict, score) of the shipped model for each image, computed in this process."""
    from scratchd.model.scratchnet import load_model

    model = load_model(MODEL_PATH or None)
    preds = model.predict([decode_image(data) for _, data in images])
    return [(str(p.verdict), float(p.score)) for p in preds]


def assert_served_correctly(daemon: LiveDaemon, images: list[tuple[Path, bytes]]) -> None:
    expected = expected_predictions(images)
    with daemon.client(timeout=120) as client:
        # A generous deadline: CI machines are slow and shared; correctness is the point.
        replies = dict(client.map([d for _, d in images], concurrency=8, deadline_ms=60_000))
    for i, (path, _) in enumerate(images):
        reply = replies[i]
        assert reply.status == "ok", f"{path.name}: {reply.status} {reply.error}"
        verdict, score = expected[i]
        assert reply.verdict == verdict, f"{path.name}: {reply.verdict} != {verdict}"
        assert np.isclose(reply.score, score, atol=1e-4), f"{path.name}: {reply.score} != {score}"
