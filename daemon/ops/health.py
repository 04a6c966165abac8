"""Health and metrics listeners: a minimal asyncio HTTP/1.1 server on the daemon's loop.

Two TCP listeners, both bound to `server.bind` (127.0.0.1 unless configured), kept apart
so a firewall or a scraper can reach one without the other:

    health_port  (8081)   GET /livez    200 while the event loop answers; body: loop lag
                          GET /readyz   200 "ready: ..." or 503 "<reason>"
    metrics_port (9108)   GET /metrics  Prometheus text format 0.0.4

/readyz is 503 while the daemon is not serving (starting, draining, halted), when no worker
is READY, or when the queue is not moving: requests are pending (queued or claimed) and no
worker has finished one for `stall_after_s` (the daemon uses `workers.hang_timeout_ms`).
A liveness failure means "restart me"; a readiness failure means "do not send me parts
now" — so a stalled queue is a readiness failure, and the supervisor (not the
orchestrator) is the one that replaces stuck workers.

The server runs on the daemon's own event loop: /livez answering at all is the liveness
proof, and a `LoopMonitor` task reports how late the loop has been waking (lag). It
speaks just enough HTTP/1.1 for probes and scrapers: GET and HEAD, keep-alive, request
heads up to 8 KiB, no request bodies (400), 404/405 otherwise. Every response carries
Content-Length and `Cache-Control: no-store`.

Each listener is bounded like the Unix socket: at most `max_connections` open at once (one
more is answered 503 and closed before anything is read from it), a request head must be
whole within `header_timeout_s` of its first byte (of the connection's opening, for the
first request), and a keep-alive connection idle for `IDLE_TIMEOUT_S` between requests is
closed. So a flood of connections, or of peers that trickle or never send a head, holds at
most `max_connections` descriptors per listener, for a bounded time.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

MAX_HEAD = 8192
IDLE_TIMEOUT_S = 30.0
MAX_CONNECTIONS = 64
HEADER_TIMEOUT_S = 5.0
TEXT = "text/plain; charset=utf-8"
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            500: "Internal Server Error", 503: "Service Unavailable"}  # fmt: skip


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    content_type: str = TEXT

    def encode(self, *, keep_alive: bool, head_only: bool) -> bytes:
        head = (
            f"HTTP/1.1 {self.status} {_REASONS[self.status]}\r\n"
            f"Content-Type: {self.content_type}\r\n"
            f"Content-Length: {len(self.body)}\r\n"
            "Cache-Control: no-store\r\n"
            f"Connection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n"
        ).encode("ascii")
        return head if head_only else head + self.body


def text(status: int, message: str) -> Response:
    return Response(status, (message + "\n").encode())


@dataclass(frozen=True)
class ReadinessInput:
    """What /readyz needs from the daemon, read from its status snapshot."""

    ready_workers: int
    total_workers: int
    pending: int  # accepted and not yet answered by a worker (queued + claimed)
    completed: int  # monotonic count of requests workers have finished
    lifecycle: str = "serving"  # the daemon's state; anything else is not ready


class Readiness:
    """Turns successive snapshots into a ready / not-ready decision with a reason."""

    def __init__(
        self,
        snapshot: Callable[[], ReadinessInput],
        *,
        stall_after_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._snapshot = snapshot
        self._stall_after_s = stall_after_s
        self._clock = clock
        self._last_completed: int | None = None
        self._last_moved = clock()

    def check(self) -> tuple[bool, str]:
        s, now = self._snapshot(), self._clock()
        # The queue moved if a worker finished something since the last look, or if there
        # was nothing to do; only then does the stall clock restart.
        if s.completed != self._last_completed or s.pending == 0:
            self._last_completed, self._last_moved = s.completed, now
        if s.lifecycle != "serving":
            return False, f"daemon is {s.lifecycle}: not accepting requests"
        if s.ready_workers == 0:
            return False, f"no worker is ready (0 of {s.total_workers})"
        stalled_s = now - self._last_moved
        if stalled_s > self._stall_after_s:
            return False, (
                f"queue not moving: {s.pending} pending, no request finished for {stalled_s:.1f} s"
            )
        return True, f"ready: {s.ready_workers} of {s.total_workers} workers, {s.pending} pending"


class LoopMonitor:
    """How late the event loop wakes up: a task sleeping `interval_s`, measuring overshoot."""

    def __init__(self, interval_s: float = 0.1) -> None:
        self.interval_s = interval_s
        self.last_lag_s = 0.0
        self.max_lag_s = 0.0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="loop-monitor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            expected = loop.time() + self.interval_s
            await asyncio.sleep(self.interval_s)
            self.last_lag_s = max(loop.time() - expected, 0.0)
            self.max_lag_s = max(self.max_lag_s, self.last_lag_s)


class BadRequest(Exception):
    pass


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    keep_alive: bool


async def read_request(
    reader: asyncio.StreamReader, *, idle_s: float, header_s: float
) -> Request | None:
    """One request head, its first byte within ``idle_s`` and the whole head within
    ``header_s`` of that byte (else ``TimeoutError``); None on a clean end of stream
    between requests."""
    try:
        async with asyncio.timeout(idle_s) as scope:
            first = await reader.readexactly(1)
            scope.reschedule(asyncio.get_running_loop().time() + header_s)
            head = first + await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if exc.partial.strip():
            raise BadRequest("truncated request head") from exc
        return None
    except asyncio.LimitOverrunError as exc:
        raise BadRequest(f"request head over {MAX_HEAD} bytes") from exc
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise BadRequest("malformed request line")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, sep, value = line.partition(":")
            if not sep:
                raise BadRequest("malformed header line")
            headers[name.strip().lower()] = value.strip().lower()
    if headers.get("content-length", "0") != "0" or "transfer-encoding" in headers:
        raise BadRequest("request bodies are not accepted")
    connection = headers.get("connection", "")
    keep_alive = connection != "close" if parts[2] == "HTTP/1.1" else connection == "keep-alive"
    return Request(parts[0], parts[1].split("?", 1)[0], keep_alive)


Route = Callable[[], Response]


class HealthServer:
    """The /livez + /readyz listener and the /metrics listener, started and closed together."""

    def __init__(
        self,
        bind: str,
        health_port: int,
        metrics_port: int,
        *,
        readiness: Callable[[], tuple[bool, str]],
        metrics: Callable[[], bytes],
        metrics_content_type: str = "text/plain; version=0.0.4; charset=utf-8",
        max_connections: int = MAX_CONNECTIONS,
        header_timeout_s: float = HEADER_TIMEOUT_S,
    ) -> None:
        self.bind = bind
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.open = {"health": 0, "metrics": 0}  # connections open now, per listener
        self.refused = 0  # connections answered 503 for being one too many
        self._ports = {"health": health_port, "metrics": metrics_port}
        self._readiness = readiness
        self.loop_monitor = LoopMonitor()
        self._routes: dict[str, dict[str, Route]] = {
            "health": {"/livez": self._livez, "/readyz": self._readyz},
            "metrics": {"/metrics": lambda: Response(200, metrics(), metrics_content_type)},
        }
        self._servers: list[asyncio.Server] = []
        self.bound: dict[str, int] = {}

    async def start(self) -> None:
        """Bind both listeners (port 0 picks a free one: see `bound`); raise if one fails."""
        self.loop_monitor.start()
        try:
            for name, port in self._ports.items():
                handler = functools.partial(self._serve, listener=name)
                server = await asyncio.start_server(
                    handler, self.bind, port, limit=MAX_HEAD, reuse_address=True
                )
                self._servers.append(server)
                self.bound[name] = server.sockets[0].getsockname()[1]
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        for server in self._servers:
            server.close()
        for server in self._servers:
            await server.wait_closed()
        self._servers.clear()
        await self.loop_monitor.stop()

    def _livez(self) -> Response:
        lag_ms = self.loop_monitor.last_lag_s * 1e3
        return text(200, f"ok: event loop lag {lag_ms:.1f} ms")

    def _readyz(self) -> Response:
        ready, reason = self._readiness()
        return text(200 if ready else 503, reason)

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, listener: str
    ) -> None:
        if self.open[listener] >= self.max_connections:
            self.refused += 1
            busy = text(503, f"too many connections (limit {self.max_connections}); retry later")
            writer.write(busy.encode(keep_alive=False, head_only=False))
            writer.close()  # nothing is read: the descriptor goes back at once
            return
        self.open[listener] += 1
        try:
            await self._serve_requests(reader, writer, self._routes[listener])
        finally:
            self.open[listener] -= 1

    async def _serve_requests(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        routes: Mapping[str, Route],
    ) -> None:
        idle_s = self.header_timeout_s  # a new connection's first head: no idle allowance
        try:
            while True:
                try:
                    request = await read_request(
                        reader, idle_s=idle_s, header_s=self.header_timeout_s
                    )
                except BadRequest as exc:
                    writer.write(text(400, str(exc)).encode(keep_alive=False, head_only=False))
                    break
                if request is None:
                    break
                response = self._dispatch(request, routes)
                head_only = request.method == "HEAD"
                writer.write(response.encode(keep_alive=request.keep_alive, head_only=head_only))
                async with asyncio.timeout(IDLE_TIMEOUT_S):  # a peer that never reads
                    await writer.drain()
                idle_s = IDLE_TIMEOUT_S
                if not request.keep_alive:
                    break
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    @staticmethod
    def _dispatch(request: Request, routes: Mapping[str, Route]) -> Response:
        route = routes.get(request.path)
        if route is None:
            return text(404, f"no such path {request.path}; try {', '.join(routes)}")
        if request.method not in ("GET", "HEAD"):
            return text(405, f"{request.method} not allowed; use GET")
        try:
            return route()
        except Exception as exc:  # a probe must answer, never take the listener down
            return text(500, f"{request.path} failed: {type(exc).__name__}: {exc}")
