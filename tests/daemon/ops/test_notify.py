"""sd_notify messages reach a socket bound the way systemd binds it; socket activation."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from scratchd.client.api import Client
from scratchd.daemon.ops.notify import (
    Notifier,
    Watchdog,
    inherited_listener,
    start_watchdog,
    watchdog_interval,
)

from ..live_daemon import daemon_config, live_daemon, real_crops


def _bind_notify_socket(address: str | bytes) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(2.0)
    return sock


def _fields(sock: socket.socket) -> dict[str, str]:
    data = sock.recv(4096).decode()
    return dict(line.split("=", 1) for line in data.split("\n"))


def test_ready_status_and_stopping_reach_a_path_socket(tmp_path: Path) -> None:
    path = str(tmp_path / "notify")
    with _bind_notify_socket(path) as listener:
        env = {"NOTIFY_SOCKET": path}
        notifier = Notifier.from_env(env)
        assert "NOTIFY_SOCKET" not in env, "workers must not inherit the notify address"
        assert notifier.ready("2 workers ready")
        assert _fields(listener) == {"READY": "1", "STATUS": "2 workers ready"}
        assert notifier.status("draining\nREADY=1")
        assert _fields(listener) == {"STATUS": "draining READY=1"}
        assert notifier.stopping()
        assert _fields(listener) == {"STOPPING": "1"}
        notifier.close()


def test_abstract_socket_and_reloading_carries_monotonic_stamp() -> None:
    name = f"scratchd-test-{os.getpid()}"
    with _bind_notify_socket(b"\0" + name.encode()) as listener:
        notifier = Notifier(f"@{name}")
        before = time.monotonic_ns() // 1000
        assert notifier.reloading("reloading model")
        fields = _fields(listener)
        assert fields["RELOADING"] == "1" and fields["STATUS"] == "reloading model"
        # CLOCK_MONOTONIC in µs, taken between our two readings of the same clock.
        assert before <= int(fields["MONOTONIC_USEC"]) <= time.monotonic_ns() // 1000
        assert notifier.extend_timeout(90)
        assert _fields(listener) == {"EXTEND_TIMEOUT_USEC": "90000000"}
        notifier.close()


def test_without_notify_socket_nothing_is_sent() -> None:
    notifier = Notifier.from_env({})
    assert not notifier.enabled
    assert not notifier.ready()
    assert not notifier.watchdog()


def test_an_unreachable_manager_does_not_raise(tmp_path: Path) -> None:
    notifier = Notifier(str(tmp_path / "nobody-listens"))
    assert not notifier.ready()


def test_a_manager_that_does_not_read_never_blocks_the_daemon(tmp_path: Path) -> None:
    # A datagram socket's queue holds net.unix.max_dgram_qlen (10) messages; a blocking send
    # would hang the event loop from the 11th on. The notifier drops them instead.
    path = str(tmp_path / "notify")
    with _bind_notify_socket(path):
        notifier = Notifier(path)
        sent = [notifier.status(f"update {i}") for i in range(200)]  # a block: for ever
        assert sent[0] and not all(sent), "the queue must have filled and been skipped"
        notifier.close()


def test_unsupported_address_is_refused() -> None:
    with pytest.raises(ValueError, match="vsock"):
        Notifier("vsock:2:1234")


def test_watchdog_interval_is_half_of_watchdog_usec() -> None:
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert watchdog_interval({}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "junk"}) is None
    mine = {"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}
    assert watchdog_interval(mine) == 1.0
    assert watchdog_interval({**mine, "WATCHDOG_PID": str(os.getpid() + 1)}) is None


def test_watchdog_pings_periodically_only_while_healthy(tmp_path: Path) -> None:
    path = str(tmp_path / "notify")
    healthy = [True]

    async def scenario(listener: socket.socket) -> tuple[int, int]:
        env = {"WATCHDOG_USEC": "100000"}  # ping every 50 ms
        task = start_watchdog(Notifier(path), lambda: healthy[0], env)
        assert task is not None
        await asyncio.sleep(0.33)
        healthy[0] = False
        pings_while_healthy = _drain(listener)
        await asyncio.sleep(0.3)
        pings_while_sick = _drain(listener)
        task.cancel()
        return pings_while_healthy, pings_while_sick

    with _bind_notify_socket(path) as listener:
        listener.setblocking(False)
        healthy_pings, sick_pings = asyncio.run(scenario(listener))
    assert healthy_pings >= 4, f"only {healthy_pings} pings in 330 ms at a 50 ms interval"
    assert sick_pings <= 1, "an unhealthy pool must let the watchdog expire"


def _drain(listener: socket.socket) -> int:
    count = 0
    while True:
        try:
            data = listener.recv(4096)
        except BlockingIOError:
            return count
        assert data == b"WATCHDOG=1"
        count += 1


def test_watchdog_counts_skipped_beats() -> None:
    notifier = Notifier(None)
    dog = Watchdog(notifier, 1.0, lambda: True)
    assert not dog.beat(), "no manager: nothing sent"
    assert (dog.pings, dog.skipped) == (0, 1)
    with pytest.raises(ValueError):
        Watchdog(notifier, 0, lambda: True)


def test_status_is_sent_when_it_changes_and_pings_keep_their_interval(tmp_path: Path) -> None:
    path = str(tmp_path / "notify")
    summary = ["1/2 workers ready"]
    with _bind_notify_socket(path) as listener:
        dog = Watchdog(Notifier(path), 10.0, lambda: True, lambda: summary[0])
        assert dog.period == 1.0, "STATUS is checked every second even with a slow watchdog"
        assert dog.beat(now=100.0)
        assert _fields(listener) == {"STATUS": "1/2 workers ready", "WATCHDOG": "1"}
        assert not dog.beat(now=101.0)  # nothing changed, no ping due: nothing sent
        summary[0] = "2/2 workers ready"
        assert not dog.beat(now=102.0)
        assert _fields(listener) == {"STATUS": "2/2 workers ready"}
        assert dog.beat(now=110.0)
        assert _fields(listener) == {"WATCHDOG": "1"}


def test_status_only_without_a_watchdog(tmp_path: Path) -> None:
    path = str(tmp_path / "notify")

    async def scenario() -> asyncio.Task[None] | None:
        task = start_watchdog(Notifier(path), lambda: True, {}, summary=lambda: "serving")
        await asyncio.sleep(0.05)
        if task is not None:
            task.cancel()
        return task

    with _bind_notify_socket(path) as listener:
        assert asyncio.run(scenario()) is not None
        assert _fields(listener) == {"STATUS": "serving"}


def test_no_watchdog_task_without_watchdog_usec(tmp_path: Path) -> None:
    async def scenario() -> object:
        return start_watchdog(Notifier(str(tmp_path / "n")), lambda: True, {})

    assert asyncio.run(scenario()) is None


def test_inherited_listener_ignores_variables_meant_for_another_process() -> None:
    env = {"LISTEN_FDS": "1", "LISTEN_PID": str(os.getpid() + 1)}
    assert inherited_listener(env) is None
    assert env == {}, "LISTEN_* must never reach the workers"
    assert inherited_listener({}) is None


_ACTIVATED_CHILD = textwrap.dedent(
    """
    import os, sys
    fd = int(sys.argv[1])
    os.dup2(fd, 3)
    os.close(fd)
    os.environ.update(LISTEN_FDS="1", LISTEN_PID=str(os.getpid()), LISTEN_FDNAMES="x")
    from scratchd.daemon.ops.notify import inherited_listener
    listener = inherited_listener()
    assert "LISTEN_FDS" not in os.environ
    listener.setblocking(True)
    conn, _ = listener.accept()
    conn.sendall(b"served by the inherited socket")
    conn.close()
    """
)


def test_inherited_listener_serves_on_the_socket_systemd_passed(tmp_path: Path) -> None:
    path = str(tmp_path / "activated.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()
    fd = listener.fileno()
    child = subprocess.Popen([sys.executable, "-c", _ACTIVATED_CHILD, str(fd)], pass_fds=(fd,))
    listener.close()  # only the child holds it now, as after systemd's fork
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.settimeout(10)
        client.connect(path)
        assert client.recv(100) == b"served by the inherited socket"
    assert child.wait(timeout=10) == 0


def test_inherited_listener_rejects_a_socket_that_is_not_listening() -> None:
    script = textwrap.dedent(
        """
        import os, socket
        a, b = socket.socketpair()
        os.dup2(a.fileno(), 3)
        os.environ.update(LISTEN_FDS="1", LISTEN_PID=str(os.getpid()))
        from scratchd.daemon.ops.notify import inherited_listener
        try:
            inherited_listener()
        except RuntimeError as exc:
            print(exc)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert "not listening" in out.stdout


def test_live_daemon_says_ready_then_pings_the_watchdog(tmp_path: Path) -> None:
    env = {"WATCHDOG_USEC": "200000"}  # systemd's WatchdogSec=0.2s: a ping every 100 ms
    with live_daemon(tmp_path, daemon_config(), env=env) as daemon:
        ready = [m for m in daemon.notifications if m.get("READY") == "1"]
        assert ready and "1/1 workers ready" in ready[0]["STATUS"]
        window = daemon.read_notifications(1.0)
        pings = [m for m in window if m.get("WATCHDOG") == "1"]
        assert len(pings) >= 6, f"{len(pings)} pings in 1 s at a 100 ms interval: {window}"
        daemon.proc.send_signal(signal.SIGTERM)
        assert daemon.proc.wait(60) == 0
        stopping = [m for m in daemon.read_notifications(0.5) if m.get("STOPPING") == "1"]
        assert stopping and "draining" in stopping[0]["STATUS"]


def test_socket_activation_serves_on_the_socket_systemd_holds(
    tmp_path: Path, data_dir: Path
) -> None:
    held = Path(tempfile.mkdtemp(prefix="sd-act-", dir="/tmp")) / "activated.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(held))
    listener.listen(64)
    try:
        with live_daemon(tmp_path, daemon_config(), activation=listener) as daemon:
            assert not Path(daemon.socket_path).exists(), "it must not bind a socket of its own"
            crop = real_crops(data_dir, 1)[0]
            with Client(str(held), timeout=60) as client:
                reply = client.infer(crop, deadline_ms=60_000)
            assert reply.status == "ok", reply.error
            assert daemon.stop() == 0
        # systemd's socket outlives the daemon: gateways queue in its backlog meanwhile.
        assert held.exists()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as late:
            late.connect(str(held))
    finally:
        listener.close()
        held.unlink(missing_ok=True)
        held.parent.rmdir()
