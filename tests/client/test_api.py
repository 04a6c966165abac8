"""The Python client, sync and asyncio, against a real daemon (and a rude fake one)."""

from __future__ import annotations

import asyncio
import io
import socket
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import uvloop
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as npst
from PIL import Image

from scratchd.client.api import (
    AsyncClient,
    Client,
    Reply,
    build_request,
    request_frame,
    unpack_mask,
)
from scratchd.protocol import wire
from scratchd.protocol.image import decode_image

from ..daemon.harness import DaemonProcess


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with DaemonProcess(workers=2, slots=32) as d:
        yield d


@pytest.fixture(scope="module")
def images(data_dir: Path) -> list[Path]:
    return sorted((data_dir / "sd900" / "images").glob("Sc_*.png"))[:12]


def test_every_kind_of_image_input_gives_the_same_answer(
    daemon: DaemonProcess, images: list[Path]
) -> None:
    path = images[0]
    grey = decode_image(path.read_bytes())
    with Client(daemon.socket, timeout=60) as client:
        replies = [
            client.infer(path, want_mask=True),
            client.infer(str(path), want_mask=True),
            client.infer(path.read_bytes(), want_mask=True),
            client.infer(grey, want_mask=True),
        ]
    first = replies[0]
    assert first.status == "ok"
    for reply in replies[1:]:
        assert (reply.status, reply.verdict, reply.score, reply.boxes) == (
            first.status,
            first.verdict,
            first.score,
            first.boxes,
        )
        np.testing.assert_array_equal(unpack_mask(reply), unpack_mask(first))


def test_raw_rgb_is_converted_to_luma_like_pillow(daemon: DaemonProcess) -> None:
    rgb = np.random.default_rng(4).integers(0, 256, (64, 80, 3), dtype=np.uint8)
    luma = np.asarray(Image.fromarray(rgb, "RGB").convert("L"))
    png = io.BytesIO()
    Image.fromarray(rgb, "RGB").save(png, format="PNG")
    with Client(daemon.socket, timeout=60) as client:
        from_rgb = client.infer(rgb, want_mask=True)
        from_luma = client.infer(luma, want_mask=True)
        from_png = client.infer(png.getvalue(), want_mask=True)
    for other in (from_luma, from_png):
        assert from_rgb.status == other.status == "ok"
        assert from_rgb.score == other.score and from_rgb.boxes == other.boxes
        np.testing.assert_array_equal(unpack_mask(from_rgb), unpack_mask(other))


def _png(grey: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(grey).save(out, format="PNG")
    return out.getvalue()


def test_pipelined_frames_bigger_than_the_read_buffer_each_get_their_own_answer(
    daemon: DaemonProcess, images: list[Path]
) -> None:
    """Raw frames larger than a connection's 64 KiB head (grey, and RGB, which goes to the
    decode pool) interleaved with small ones on one connection: each is answered exactly as
    the same image sent alone as a PNG, so no frame's bytes bleed into another's through the
    daemon's reused read buffers."""
    tiles = [decode_image(p.read_bytes()) for p in images[:5]]
    greys = [
        np.tile(tiles[0], (2, 2)),  # 400x400: 160 KiB
        tiles[1],  # 200x200: 40 KiB, read in place
        np.tile(tiles[2], (2, 3)),  # sent as RGB 400x600x3: 703 KiB, converted in the pool
        np.tile(tiles[3], (3, 2)),  # 600x400 grey right after it: its body buffer is reused
        np.tile(tiles[4], (2, 3)),  # RGB again
    ]
    rgb = {2, 4}
    sent = [np.stack([g, g, g], axis=-1) if k in rgb else g for k, g in enumerate(greys)]

    async def pipelined() -> list[Reply]:
        async with await AsyncClient.connect(daemon.socket) as client:
            return list(await asyncio.gather(*(client.infer(x, want_mask=True) for x in sent * 2)))

    replies = asyncio.run(pipelined())
    with Client(daemon.socket, timeout=60) as client:
        alone = [client.infer(_png(g), want_mask=True) for g in greys]
    for k, reply in enumerate(replies):
        expected = alone[k % len(greys)]
        assert reply.status == expected.status == "ok"
        assert (reply.score, reply.boxes) == (expected.score, expected.boxes)
        np.testing.assert_array_equal(unpack_mask(reply), unpack_mask(expected))


def test_map_pipelines_and_returns_each_image_once(
    daemon: DaemonProcess, images: list[Path]
) -> None:
    with Client(daemon.socket, timeout=60) as client:
        out = list(client.map(images, concurrency=5, part_class="safety"))
        status = client.status()
    assert sorted(index for index, _ in out) == list(range(len(images)))
    assert {reply.status for _, reply in out} == {"ok"}
    assert status.state == "serving"


def test_async_client_has_many_requests_in_flight_on_one_connection(
    daemon: DaemonProcess, images: list[Path]
) -> None:
    async def scenario() -> None:
        async with await AsyncClient.connect(daemon.socket) as client:
            replies = await asyncio.gather(*(client.infer(p, priority=3) for p in images))
            status = await client.status()
        assert [r.status for r in replies] == ["ok"] * len(images)
        assert len({r.id for r in replies}) == len(images)
        assert sum(status.requests.values()) >= len(images)

    asyncio.run(scenario())


def test_a_lost_connection_fails_the_requests_in_flight(tmp_path: Path) -> None:
    path = str(tmp_path / "rude.sock")

    async def rude(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(4)  # a frame starts arriving; hang up
        writer.close()

    async def scenario() -> None:
        server = await asyncio.start_unix_server(rude, path=path)
        async with server:
            client = await AsyncClient.connect(path)
            with pytest.raises(ConnectionError):
                await asyncio.wait_for(client.infer(np.zeros((8, 8), np.uint8)), 10)
            with pytest.raises(ConnectionError):
                await client.infer(np.zeros((8, 8), np.uint8))
            await client.close()

    asyncio.run(scenario())


def test_connecting_to_nothing_raises_os_error(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        Client(str(tmp_path / "nobody.sock"))


def test_bad_arrays_are_refused_before_sending(daemon: DaemonProcess) -> None:
    with Client(daemon.socket, timeout=60) as client, pytest.raises(ValueError, match="uint8"):
        client.infer(np.zeros((8, 8), np.float32))


arrays = st.one_of(
    st.tuples(st.integers(1, 40), st.integers(1, 40)),
    st.tuples(st.integers(1, 20), st.integers(1, 20), st.just(3)),
).flatmap(lambda shape: npst.arrays(np.uint8, shape))


@settings(max_examples=60, deadline=None)
@given(
    image=arrays,
    flip=st.booleans(),
    request_id=st.integers(0, 2**63 - 1),
    part_class=st.none() | st.text(max_size=20),
    priority=st.none() | st.integers(-5, 12),
    deadline_ms=st.none() | st.integers(-1, 10**9),
    want_mask=st.booleans(),
)
def test_a_request_frame_is_the_bytes_encode_frame_gives(
    image: np.ndarray,
    flip: bool,
    request_id: int,
    part_class: str | None,
    priority: int | None,
    deadline_ms: int | None,
    want_mask: bool,
) -> None:
    """The one-copy frame is byte for byte the frame of the request ``build_request`` makes
    (strided arrays too): the wire format is unchanged, and the daemon decodes the pixels."""
    image = image[::-1, ::2] if flip else image  # not C-contiguous
    options = {"part_class": part_class, "priority": priority, "deadline_ms": deadline_ms}
    request = build_request(request_id, image, want_mask=want_mask, **options)  # type: ignore[arg-type]
    assert isinstance(request.pixels, bytes) and request.pixels == image.tobytes()
    frame = request_frame(request_id, image, want_mask=want_mask, **options)  # type: ignore[arg-type]
    assert frame == wire.encode_frame(request)
    decoded = wire.decode_client_message(frame[wire.PREFIX_BYTES :])
    assert decoded == request


def test_a_request_frame_for_encoded_bytes_is_the_same_too() -> None:
    request = build_request(9, b"\x89PNG\r\n\x1a\n...", part_class="safety")
    assert request_frame(9, b"\x89PNG\r\n\x1a\n...", part_class="safety") == wire.encode_frame(
        request
    )


def test_an_arrays_pixels_are_copied_into_the_frame_only_once() -> None:
    """At most the frame's own buffer is allocated (msgpack grows it by half as it writes:
    the pages past its end are never touched), not a ``bytes`` copy of the pixels first."""
    image = np.random.default_rng(1).integers(0, 256, (1024, 1024), np.uint8)
    tracemalloc.start()
    try:
        frame = request_frame(1, image)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(frame) > image.nbytes and peak < 1.75 * len(frame)


class Echo:
    """A fake daemon: answers each request ``ok`` with the sum of its pixels as the score,
    after ``delay_s`` (replies in any order), and keeps every frame it got. It reads nothing
    in its first ``stall_s`` (the client's socket fills, its transport buffers the rest)."""

    def __init__(self, delay_s: float = 0.0, stall_s: float = 0.0) -> None:
        self.delay_s, self.stall_s = delay_s, stall_s
        self.frames: list[bytes] = []

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(self.stall_s)

        async def answer(request: wire.InferRequest) -> None:
            await asyncio.sleep(self.delay_s * (request.id % 3))
            score = float(np.frombuffer(request.pixels or b"", np.uint8).sum())
            writer.write(wire.encode_frame(wire.Reply(id=request.id, status="ok", score=score)))

        tasks = set()
        try:
            while True:
                prefix = await reader.readexactly(wire.PREFIX_BYTES)
                body = await reader.readexactly(wire.frame_length(prefix))
                request = wire.decode_client_message(body)
                if isinstance(request, wire.Ping):  # what a client sends as it connects
                    writer.write(wire.encode_frame(wire.Pong(id=request.id)))
                    continue
                self.frames.append(prefix + body)
                assert isinstance(request, wire.InferRequest)
                tasks.add(asyncio.create_task(answer(request)))
        except asyncio.IncompleteReadError:
            await asyncio.gather(*tasks)
            writer.close()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_frames_reusing_a_buffer_each_arrive_as_built(tmp_path: Path, loop: str) -> None:
    """The async and the blocking client reuse a sent frame's buffer for the next request,
    never one the transport still holds (the daemon reads nothing at first: 1.2 MB of frames
    pipelined outgrow the socket): pipelined, out of order and one at a time, every frame
    arrives exactly as ``encode_frame`` builds it, every reply to its own request."""
    path = str(tmp_path / "echo.sock")
    rng = np.random.default_rng(2)
    images = [rng.integers(0, 256, (300 + 7 * k, 290), np.uint8) for k in range(12)]
    echo = Echo(delay_s=0.002, stall_s=0.2)

    async def scenario() -> None:
        server = await asyncio.start_unix_server(echo.serve, path=path)
        async with server:
            client = await AsyncClient.connect(path, zero_copy=False)  # frames with pixels
            sock = client._writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)  # fills sooner
            replies = [await client.infer(images[0]), await client.infer(images[1])]
            assert client._spare is not None  # the first frame's buffer came back
            replies += await asyncio.gather(*(client.infer(image) for image in images[2:]))
            await client.close()
            with Client(path, timeout=10, zero_copy=False) as blocking:
                spare = None
                for image in images[:3]:
                    replies.append(await asyncio.to_thread(blocking.infer, image))
                    assert spare is None or blocking._spare is spare
                    spare = blocking._spare
            await asyncio.sleep(0.05)

        sent = [*images, *images[:3]]
        assert [r.score for r in replies] == [float(i.sum()) for i in sent]
        ids = [*range(2, 14), 2, 3, 4]  # id 1: each client's ping
        expected = [
            bytes(wire.encode_frame(build_request(k, i))) for k, i in zip(ids, sent, strict=True)
        ]
        assert sorted(echo.frames) == sorted(expected)

    factory = uvloop.new_event_loop if loop == "uvloop" else asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(scenario())
