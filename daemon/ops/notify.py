"""systemd readiness, status and watchdog, spoken directly on the notify socket.

No libsystemd: the protocol is one datagram per message on the ``AF_UNIX`` socket named by
``NOTIFY_SOCKET`` (a path, or an abstract name written with a leading ``@``), each message
newline-separated ``KEY=VALUE`` assignments (sd_notify(3)). What scratchd sends, and when:

    start ──▶ READY=1 + STATUS=…         once the pool is up (every worker READY) and the
                                         socket is open: a worker that cannot boot fails
                                         the start instead of following a READY
          ──▶ WATCHDOG=1                 every WATCHDOG_USEC / 2, only while the pool is healthy
          ──▶ STATUS=…                   on each change worth one line (workers, reload, drain)
    SIGHUP ─▶ RELOADING=1 + MONOTONIC_USEC=…  … READY=1 when the last worker is replaced
    SIGTERM ▶ STOPPING=1                 before the drain starts

(``EXTEND_TIMEOUT_USEC=`` is available as :meth:`Notifier.extend_timeout` but not sent: the
unit's ``TimeoutStartSec`` covers a cold CUDA warm-up, and the supervisor's boot timeout
kills a worker that hangs in it.)

A watchdog ping that is skipped because the health check fails is the point: systemd then
kills and restarts a daemon whose pool has wedged, instead of a daemon that merely runs.

Socket activation (sd_listen_fds(3)): systemd passes listening sockets from fd 3 on, with
``LISTEN_FDS`` (how many) and ``LISTEN_PID`` (for whom: a child that inherited the
environment must not take them). :func:`inherited_listener` returns the Unix stream listener
so ``serve`` can skip ``bind()``; the socket unit then owns the path and its mode.

Everything here is a no-op outside systemd (``NOTIFY_SOCKET`` unset), so ``scratchd serve``
in a terminal behaves the same minus the messages.
"""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import time
from collections.abc import Callable, Mapping, MutableMapping
from math import inf

LISTEN_FDS_START = 3


class Notifier:
    """Sends sd_notify messages to the service manager, or nothing when not under one."""

    def __init__(self, address: str | None) -> None:
        self._address = _socket_address(address) if address else None
        self._sock: socket.socket | None = None

    @classmethod
    def from_env(cls, environ: MutableMapping[str, str] | None = None) -> Notifier:
        """The notifier for ``NOTIFY_SOCKET``, which is then removed from the environment.

        Removing it keeps exec'd workers from inheriting the address: with the default
        ``NotifyAccess=main`` systemd would drop their messages anyway, and a worker saying
        READY=1 on the daemon's behalf would be a lie.
        """
        env = os.environ if environ is None else environ
        return cls(env.pop("NOTIFY_SOCKET", None))

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def send(self, **fields: str | int) -> bool:
        """Send one message, e.g. ``send(READY=1, STATUS="2 workers")``; False if not sent.

        A failed send is not an error for the daemon: the manager may be restarting or
        not reading, and serving parts matters more than telling it so. Sends never block.
        """
        if self._address is None or not fields:
            return False
        message = "\n".join(f"{key}={_one_line(value)}" for key, value in fields.items())
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            # Never block the event loop on the manager: a datagram socket whose reader is
            # slow (or a test that never reads) fills after net.unix.max_dgram_qlen messages,
            # and a blocking send would then stall every client. Drop the message instead.
            self._sock.sendto(message.encode(), socket.MSG_DONTWAIT, self._address)
        except OSError:
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        return self.send(READY=1, **({"STATUS": status} if status else {}))

    def status(self, text: str) -> bool:
        return self.send(STATUS=text)

    def reloading(self, status: str | None = None) -> bool:
        """RELOADING=1 with the CLOCK_MONOTONIC stamp that Type=notify-reload requires."""
        stamp = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        extra = {"STATUS": status} if status else {}
        return self.send(RELOADING=1, MONOTONIC_USEC=stamp, **extra)

    def stopping(self, status: str | None = None) -> bool:
        return self.send(STOPPING=1, **({"STATUS": status} if status else {}))

    def watchdog(self) -> bool:
        return self.send(WATCHDOG=1)

    def extend_timeout(self, seconds: float) -> bool:
        """Ask for ``seconds`` more before the start (or stop) timeout fires."""
        return self.send(EXTEND_TIMEOUT_USEC=int(seconds * 1_000_000))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _socket_address(address: str) -> str | bytes:
    if address.startswith("@"):
        return b"\0" + address[1:].encode()
    if address.startswith("/"):
        return address
    raise ValueError(
        f"NOTIFY_SOCKET={address!r}: only Unix paths and @abstract names are supported"
    )


def _one_line(value: str | int) -> str:
    # A newline inside a value would start a new assignment that the manager would obey.
    return str(value).replace("\n", " ")


def watchdog_interval(environ: Mapping[str, str] | None = None) -> float | None:
    """Seconds between pings (half of ``WATCHDOG_USEC``), or None when no watchdog is asked.

    ``WATCHDOG_PID``, when set, names the process the watchdog is meant for; anyone else
    (a worker that inherited the environment) must not ping.
    """
    env = os.environ if environ is None else environ
    pid = env.get("WATCHDOG_PID")
    if pid is not None and pid.strip() != str(os.getpid()):
        return None
    try:
        usec = int(env.get("WATCHDOG_USEC", "0"))
    except ValueError:
        return None
    return usec / 2 / 1_000_000 if usec > 0 else None


class Watchdog:
    """Pings the service manager every ``interval`` seconds while ``healthy()`` holds.

    ``healthy`` is the daemon's own judgement (at least one worker ready, the event loop
    turning — which it is, if this coroutine runs at all). It must be cheap and not block.
    With ``summary``, the one-line summary is checked every ``STATUS_INTERVAL`` (or each
    ping, if that is more often) and sent as ``STATUS=`` when it changed, so
    ``systemctl status`` follows the pool without a message per event. ``interval=None``
    keeps only the status updates (no watchdog was asked for).
    """

    def __init__(
        self,
        notifier: Notifier,
        interval: float | None,
        healthy: Callable[[], bool],
        summary: Callable[[], str] | None = None,
    ) -> None:
        if interval is not None and interval <= 0:
            raise ValueError(f"watchdog interval must be positive, not {interval}")
        self._notifier = notifier
        self.interval = interval
        self.period = min(interval or STATUS_INTERVAL, STATUS_INTERVAL if summary else inf)
        self._healthy = healthy
        self._summary = summary
        self._last_summary = ""
        self._last_ping = -inf
        self.pings = 0
        self.skipped = 0

    def beat(self, now: float | None = None) -> bool:
        """One tick: ping if one is due and the pool is healthy; send a changed STATUS.
        True when a ping was sent."""
        now = time.monotonic() if now is None else now
        fields: dict[str, str | int] = {}
        if self._summary is not None:
            text = self._summary()
            if text != self._last_summary:
                fields["STATUS"] = self._last_summary = text
        due = self.interval is not None and now - self._last_ping >= self.interval * 0.95
        ping = due and self._healthy()
        if ping:
            fields["WATCHDOG"] = 1
        sent = self._notifier.send(**fields) if fields else False
        if due and not (ping and sent):
            self.skipped += 1
        if ping and sent:
            self._last_ping = now
            self.pings += 1
        return ping and sent

    async def run(self) -> None:
        """Beat until cancelled; the first beat is at once."""
        while True:
            self.beat()
            await asyncio.sleep(self.period)


STATUS_INTERVAL = 1.0
"""Seconds between checks of the STATUS= summary."""


def start_watchdog(
    notifier: Notifier,
    healthy: Callable[[], bool],
    environ: Mapping[str, str] | None = None,
    summary: Callable[[], str] | None = None,
) -> asyncio.Task[None] | None:
    """Start the pinging (and STATUS) task on the running loop; None when there is nothing
    to send (not under systemd, or neither a watchdog nor a summary)."""
    interval = watchdog_interval(environ)
    if not notifier.enabled or (interval is None and summary is None):
        return None
    dog = Watchdog(notifier, interval, healthy, summary)
    return asyncio.get_running_loop().create_task(dog.run(), name="sd-watchdog")


def inherited_listener(
    environ: MutableMapping[str, str] | None = None,
) -> socket.socket | None:
    """The Unix stream listening socket passed by socket activation, or None.

    The ``LISTEN_*`` variables are removed so that workers never see them. Exactly one
    listening ``AF_UNIX`` stream socket is accepted; anything else is a unit misconfiguration
    that must stop ``serve`` rather than be guessed around.
    """
    env = os.environ if environ is None else environ
    fds = env.pop("LISTEN_FDS", None)
    pid = env.pop("LISTEN_PID", None)
    env.pop("LISTEN_FDNAMES", None)
    if fds is None or pid is None or pid.strip() != str(os.getpid()):
        return None
    count = int(fds)
    if count != 1:
        raise RuntimeError(f"socket activation passed {count} sockets; scratchd takes exactly one")
    return _adopt_listener(LISTEN_FDS_START)


def _adopt_listener(fd: int) -> socket.socket:
    if not stat.S_ISSOCK(os.fstat(fd).st_mode):
        raise RuntimeError(f"socket activation: fd {fd} is not a socket")
    os.set_inheritable(fd, False)
    sock = socket.socket(fileno=fd)
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
        sock.detach()
        raise RuntimeError(f"socket activation: fd {fd} is not a Unix stream socket")
    if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        sock.detach()
        raise RuntimeError(f"socket activation: fd {fd} is not listening")
    sock.setblocking(False)
    return sock
