"""The Python client, sync and asyncio, against a real daemon (and a rude fake one)."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from scratchd.client import AsyncClient, Client, Reply, unpack_mask
from scratchd.ipc.image import decode_image

from .daemon.harness import DaemonProcess


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
