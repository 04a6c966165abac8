"""The client processes of ``bench_frontend.py``: closed-loop lanes, an open-loop Poisson
sender, and slow senders that trickle their frames (the convoy case). Each runs in its own
process and prints its result as one JSON object."""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from typing import Any

import numpy as np
import serve_load as sl

from scratchd.client.api import AsyncClient, request_frame
from scratchd.protocol import wire


async def closed_loop(args: argparse.Namespace) -> dict[str, Any]:
    frames = np.load(args.frames, mmap_mode="r")
    payloads = [np.asarray(frames[k]) for k in range(frames.shape[0])]
    statuses: dict[str, int] = {}
    async with await AsyncClient.connect(args.socket, zero_copy=args.path == "region") as client:
        stop_at = time.perf_counter() + args.duration
        latencies: list[float] = []

        async def lane(k: int) -> None:
            i = k
            while (sent := time.perf_counter()) < stop_at:
                reply = await client.infer(payloads[i % len(payloads)])
                latencies.append(time.perf_counter() - sent)
                statuses[reply.status] = statuses.get(reply.status, 0) + 1
                i += args.window

        await asyncio.gather(*(lane(k) for k in range(args.window)))
        region = client.ring is not None
    return {
        "statuses": statuses,
        "latencies_ms": [round(x * 1e3, 3) for x in latencies],
        "region": region,  # the requests named slots of a registered ring
    }


async def open_loop(args: argparse.Namespace) -> dict[str, Any]:
    """Poisson arrivals at ``--rate`` (this client's share), sent whatever the replies do."""
    frames = np.load(args.frames, mmap_mode="r")
    payloads = [np.asarray(frames[k]) for k in range(frames.shape[0])]
    statuses: dict[str, int] = {}
    due = sl.schedule("poisson", args.duration, args.rate, seed=os.getpid())
    latencies: list[float] = []
    async with await AsyncClient.connect(args.socket, zero_copy=args.path == "region") as client:

        async def one(i: int) -> None:
            sent = time.perf_counter()
            reply = await client.infer(payloads[i % len(payloads)])
            latencies.append(time.perf_counter() - sent)
            statuses[reply.status] = statuses.get(reply.status, 0) + 1

        tasks = []
        start = time.perf_counter()
        for i, at in enumerate(due):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
        region = client.ring is not None
    return {
        "statuses": statuses,
        "latencies_ms": [round(x * 1e3, 3) for x in latencies],
        "region": region,
    }


async def slow_senders(args: argparse.Namespace) -> dict[str, Any]:
    """``--slow`` connections, each sending its frames one after another in ``--slow-chunk``
    byte pieces ``--slow-pause-ms`` apart (a sender slow to push the rest of its frames),
    reading its replies as they come, until ``--duration`` is over."""
    frames = np.load(args.frames, mmap_mode="r")
    statuses: dict[str, int] = {}
    stop_at = time.perf_counter() + args.duration

    async def one(k: int) -> None:
        reader, writer = await asyncio.open_unix_connection(args.socket)

        async def replies() -> None:
            while True:
                prefix = await reader.readexactly(wire.PREFIX_BYTES)
                body = await reader.readexactly(wire.frame_length(prefix))
                status = getattr(wire.decode_daemon_message(body), "status", "?")
                statuses[status] = statuses.get(status, 0) + 1

        reading = asyncio.create_task(replies())
        i = k
        while time.perf_counter() < stop_at:
            frame = memoryview(request_frame(i + 1, np.asarray(frames[i % frames.shape[0]])))
            for lo in range(0, len(frame), args.slow_chunk):
                writer.write(frame[lo : lo + args.slow_chunk])
                await writer.drain()
                await asyncio.sleep(args.slow_pause_ms / 1e3)
            i += args.slow
        await asyncio.sleep(0.3)  # the last frame's reply
        reading.cancel()
        writer.close()

    await asyncio.gather(*(one(k) for k in range(args.slow)))
    return {"statuses": statuses, "latencies_ms": []}
