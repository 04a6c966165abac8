"""The health and metrics listeners, spoken to over real TCP sockets."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families

from scratchd.daemon.ops.health import HealthServer, Readiness, ReadinessInput
from scratchd.daemon.ops.metrics import Metrics


class Daemon:
    """The parts of a daemon's state /readyz looks at, changed by the tests."""

    def __init__(self) -> None:
        self.input = ReadinessInput(ready_workers=2, total_workers=2, pending=0, completed=0)
        self.now = 0.0

    def set(self, **changes: int | str) -> None:
        self.input = ReadinessInput(**{**self.input.__dict__, **changes})


@pytest.fixture
def daemon() -> Daemon:
    return Daemon()


@pytest.fixture
def readiness(daemon: Daemon) -> Readiness:
    return Readiness(lambda: daemon.input, stall_after_s=5.0, clock=lambda: daemon.now)


async def _start(readiness: Callable[[], tuple[bool, str]], metrics: Metrics) -> HealthServer:
    server = HealthServer(
        "127.0.0.1", 0, 0, readiness=readiness, metrics=metrics.exposition
    )  # port 0: the kernel picks free ports, read back from `bound`
    await server.start()
    return server


def with_server(
    scenario: Callable[[HealthServer], Awaitable[None]],
    readiness: Callable[[], tuple[bool, str]],
) -> None:
    """Run `scenario` against a started server on a fresh event loop, then close it."""

    async def main() -> None:
        server = await _start(readiness, Metrics(["normal"], ["cpu"]))
        try:
            await scenario(server)
        finally:
            await server.close()

    asyncio.run(main())


async def http(port: int, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send raw request bytes, read one response (Content-Length framed)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        return await read_response(reader)
    finally:
        writer.close()


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
    status = int(head[0].split(" ")[1])
    headers = {k.lower(): v.strip() for k, v in (h.split(":", 1) for h in head[1:] if h)}
    body = await reader.readexactly(int(headers["content-length"]))
    return status, headers, body


def get(path: str, extra: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n{extra}\r\n".encode()


def test_livez_answers_while_the_loop_runs(readiness: Readiness) -> None:
    async def scenario(server: HealthServer) -> None:
        status, headers, body = await http(server.bound["health"], get("/livez"))
        assert status == 200 and body.startswith(b"ok: event loop lag")
        assert headers["cache-control"] == "no-store"

    with_server(scenario, readiness.check)


def test_readyz_is_503_without_a_ready_worker_and_200_after_recovery(
    readiness: Readiness, daemon: Daemon
) -> None:
    async def scenario(server: HealthServer) -> None:
        port = server.bound["health"]
        assert (await http(port, get("/readyz")))[0] == 200
        daemon.set(ready_workers=0)
        status, _, body = await http(port, get("/readyz"))
        assert status == 503 and body == b"no worker is ready (0 of 2)\n"
        daemon.set(ready_workers=1)  # a replacement worker sent READY
        status, _, body = await http(port, get("/readyz"))
        assert status == 200 and body.startswith(b"ready: 1 of 2 workers")

    with_server(scenario, readiness.check)


def test_readyz_is_503_when_the_queue_stops_moving(readiness: Readiness, daemon: Daemon) -> None:
    async def scenario(server: HealthServer) -> None:
        port = server.bound["health"]
        daemon.set(pending=5, completed=10)
        assert (await http(port, get("/readyz")))[0] == 200
        daemon.now = 4.0  # nothing finished for 4 s: still within stall_after_s
        assert (await http(port, get("/readyz")))[0] == 200
        daemon.now = 6.0
        status, _, body = await http(port, get("/readyz"))
        assert status == 503
        assert body == b"queue not moving: 5 pending, no request finished for 6.0 s\n"
        daemon.set(completed=11)  # a worker finished one: moving again
        assert (await http(port, get("/readyz")))[0] == 200
        daemon.set(pending=0)  # an idle queue is never "stalled"
        daemon.now = 100.0
        assert (await http(port, get("/readyz")))[0] == 200

    with_server(scenario, readiness.check)


def test_readyz_is_503_while_draining(readiness: Readiness, daemon: Daemon) -> None:
    async def scenario(server: HealthServer) -> None:
        daemon.set(lifecycle="draining")
        status, _, body = await http(server.bound["health"], get("/readyz"))
        assert (status, body) == (503, b"daemon is draining: not accepting requests\n")

    with_server(scenario, readiness.check)


def test_metrics_listener_serves_prometheus_text_and_nothing_else(readiness: Readiness) -> None:
    async def scenario(server: HealthServer) -> None:
        status, headers, body = await http(server.bound["metrics"], get("/metrics"))
        assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
        names = {f.name for f in text_string_to_metric_families(body.decode())}
        assert "scratchd_requests" in names and "scratchd_queue_depth" in names
        # Each listener has only its own paths.
        assert (await http(server.bound["metrics"], get("/readyz")))[0] == 404
        assert (await http(server.bound["health"], get("/metrics")))[0] == 404
        assert server.bound["health"] != server.bound["metrics"]

    with_server(scenario, readiness.check)


def test_keep_alive_head_and_bad_requests(readiness: Readiness) -> None:
    async def scenario(server: HealthServer) -> None:
        port = server.bound["health"]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(get("/livez") + get("/readyz"))  # pipelined on one connection
        first, second = await read_response(reader), await read_response(reader)
        assert (first[0], second[0]) == (200, 200)
        writer.write(b"HEAD /livez HTTP/1.1\r\nConnection: close\r\n\r\n")
        head = await reader.read()  # closed after the response; no body for HEAD
        assert head.startswith(b"HTTP/1.1 200 OK\r\n") and head.endswith(b"\r\n\r\n")
        writer.close()
        assert (await http(port, b"POST /readyz HTTP/1.1\r\nContent-Length: 0\r\n\r\n"))[0] == 405
        body_request = b"GET /livez HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello"
        assert (await http(port, body_request))[0] == 400
        assert (await http(port, b"garbage\r\n\r\n"))[0] == 400
        status, _, body = await http(port, get("/livez", "X-Pad: " + "a" * 9000 + "\r\n"))
        assert status == 400 and b"8192" in body

    with_server(scenario, readiness.check)


def test_a_failing_probe_answers_500_and_the_listener_survives() -> None:
    async def scenario() -> None:
        def broken() -> tuple[bool, str]:
            raise RuntimeError("queue segment gone")

        srv = await _start(broken, Metrics(["normal"]))
        try:
            status, _, body = await http(srv.bound["health"], get("/readyz"))
            assert status == 500 and b"queue segment gone" in body
            assert (await http(srv.bound["health"], get("/livez")))[0] == 200
        finally:
            await srv.close()

    asyncio.run(scenario())


def test_close_releases_the_ports(readiness: Readiness) -> None:
    async def scenario() -> None:
        srv = await _start(readiness.check, Metrics(["normal"]))
        port = srv.bound["health"]
        await srv.close()
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)

    asyncio.run(scenario())


def test_garbage_never_takes_the_listeners_down(readiness: Readiness) -> None:
    rng = random.Random(6)
    valid = get("/readyz")
    payloads = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 3000))) for _ in range(60)]
    for _ in range(60):  # mutations of a valid request: flipped, cut, repeated bytes
        b = bytearray(valid)
        for _ in range(rng.randrange(1, 6)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        payloads.append(bytes(b[: rng.randrange(1, len(b) + 1)]) + b"\r\n\r\n" * rng.randrange(3))

    async def scenario(server: HealthServer) -> None:
        for port in server.bound.values():
            for payload in payloads:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(payload)
                writer.write_eof()
                answer = await asyncio.wait_for(reader.read(), 5)
                assert answer == b"" or answer.startswith(b"HTTP/1.1 ")
                writer.close()
        assert (await http(server.bound["health"], get("/livez")))[0] == 200
        assert (await http(server.bound["metrics"], get("/metrics")))[0] == 200

    with_server(scenario, readiness.check)


def test_a_connection_flood_is_capped_and_a_trickled_head_times_out(readiness: Readiness) -> None:
    async def scenario() -> None:
        server = HealthServer(
            "127.0.0.1", 0, 0, readiness=readiness.check, metrics=Metrics(["normal"]).exposition,
            max_connections=4, header_timeout_s=0.3,
        )  # fmt: skip
        await server.start()
        port = server.bound["health"]
        try:
            held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]
            held[0][1].write(b"GET /livez HTTP/1.1\r\n")  # a head that never ends
            await asyncio.sleep(0.1)
            assert server.open["health"] == 4
            extra, extra_writer = await asyncio.open_connection("127.0.0.1", port)
            status, _, body = await read_response(extra)  # answered without being read
            assert (status, body) == (503, b"too many connections (limit 4); retry later\n")
            extra_writer.close()
            assert (await http(server.bound["metrics"], get("/metrics")))[0] == 200  # its own cap
            for reader, _ in held:  # silent or trickling: closed after the header timeout
                assert await asyncio.wait_for(reader.read(), 2) == b""
            assert server.open["health"] == 0 and server.refused == 1
            assert (await http(port, get("/livez")))[0] == 200
        finally:
            await server.close()

    asyncio.run(scenario())
