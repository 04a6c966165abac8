"""Descriptor round trip main → worker → main: scratchd's queue vs Redis vs multiprocessing.Queue.

One round trip is what a request costs the daemon beyond the model itself:

- **scratchd**: ``reserve`` + 16-byte input + ``submit`` (rings the worker's eventfd) → the
  worker wakes in ``wait_for_work``, ``claim_batch`` + ``complete`` (rings the completion
  eventfd) → the main process wakes in ``poll`` and ``collect_completed``.
- **redis**: the main process LPUSHes a msgpack descriptor, the worker BRPOPs it and LPUSHes
  a msgpack reply, the main process BRPOPs the reply — over a Unix socket to a redis-server
  the script starts itself (temporary config, no persistence) and stops at the end.
- **mp.Queue**: ``put`` / ``get`` both ways (pickle over a pipe; allowed here only as a
  comparison — never on any scratchd wire).
- **scratchd, one process**: the same queue calls with no second process and no doorbell
  wait: the CPU the queue itself costs per round trip (the rest of the first row is the two
  cross-process wake-ups, i.e. the scheduler).

Each worker is a separate process started by exec. The systems run interleaved in chunks so
that noise from other load on the machine falls on all of them alike. Reported: p50, p90,
p99, p99.9, mean and max in µs over ``--rounds`` round trips each (after ``--warmup``), as a
table and as JSON (``--json``, default ``docs/bench/queue.json``).

Install what it needs (Debian/Ubuntu)::

    apt-get install -y redis-server      # the server binary (redis-server on PATH)
    pip install -e '.[bench]'            # the redis client

Run: ``python scripts/bench_queue.py --rounds 20000``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.queues import Queue as MpQueue
from pathlib import Path
from typing import Any, Protocol, cast

import msgspec
import numpy as np

from scratchd.ipc.queue import Geometry, RequestQueue, Result, Status

ROOT = Path(__file__).resolve().parent.parent
PAYLOAD = bytes(range(16))  # a 4x4 image: the round trip, not the copy, is measured
GEOMETRY = Geometry(slots=64, slot_bytes=4096, tick_ms=1, max_workers=2, wheel_ticks=1024)
DEADLINE_NS = 60 * 10**9


class Descriptor(msgspec.Struct, array_like=True):
    """What the Redis and mp.Queue variants carry: the fields of our descriptor."""

    request_id: int
    conn_id: int
    priority: int
    part_class: int
    deadline_ns: int
    height: int
    width: int
    pixels: bytes


class Reply(msgspec.Struct, array_like=True):
    request_id: int
    status: int
    score: float


# ------------------------------------------------------------------ workers (exec'd roles)
def queue_worker(name: str, slot: int, completion_fd: int, work_fd: int) -> None:
    q = RequestQueue.attach(name, completion_fd=completion_fd, work_fd=work_fd)
    q.register_worker(slot, os.getpid())
    parent = os.getppid()
    while os.getppid() == parent:
        if not q.wait_for_work(slot, 1.0):
            continue
        for c in q.claim_batch(slot, 1, time.monotonic_ns()):
            score = float(q.input_view(c)[0, 0])
            q.complete(slot, c, Result(Status.OK, score=score, batch_size=1))


def redis_worker(socket_path: str) -> None:
    import redis

    r = redis.Redis(unix_socket_path=socket_path)
    decode, encode = msgspec.msgpack.Decoder(Descriptor).decode, msgspec.msgpack.encode
    while True:
        item = r.brpop(["req"], timeout=0)
        assert item is not None
        d = decode(cast(bytes, item[1]))  # no decode_responses: replies are bytes
        r.lpush("resp", encode(Reply(d.request_id, 0, float(d.pixels[0]))))


def mp_worker(inbox: MpQueue[Any], outbox: MpQueue[Any]) -> None:
    if os.environ.get("SCRATCHD_BENCH_PIN"):
        os.sched_setaffinity(0, {1})
    while (d := inbox.get()) is not None:
        outbox.put(Reply(d.request_id, 0, float(d.pixels[0])))


# ------------------------------------------------------------------ main-side round trips
def submit_one(q: RequestQueue, i: int) -> None:
    """The main process's half of a round trip: reserve, write 16 bytes, submit."""
    h = q.reserve()
    assert h is not None
    q.payload(h)[:16] = PAYLOAD
    q.submit(
        h, request_id=i, conn_id=1, priority=0, part_class=0,
        deadline_ns=time.monotonic_ns() + DEADLINE_NS, height=4, width=4, want_mask=False,
    )  # fmt: skip


class Bench(Protocol):
    name: str

    def round_trip(self, i: int) -> None: ...

    def close(self) -> None: ...


class QueueBench:
    name = "scratchd shm queue"

    def __init__(self) -> None:
        self.q = RequestQueue.create(f"/scratchd-bench-{os.getpid()}", GEOMETRY)
        fds = (self.q.completion_fd, self.q.work_fd(0))
        args = ["--role", "queue-worker", self.q.name, "0", *map(str, fds)]
        self.worker = subprocess.Popen([sys.executable, __file__, *args], pass_fds=fds)
        self.poll = select.poll()
        self.poll.register(self.q.completion_fd, select.POLLIN)

    def round_trip(self, i: int) -> None:
        q = self.q
        submit_one(q, i)
        while True:
            self.poll.poll()
            done = q.collect_completed()
            if done:
                assert done[0].request_id == i and done[0].status == Status.OK
                return

    def close(self) -> None:
        self.worker.terminate()
        self.worker.wait()
        self.q.close()


class InProcessQueueBench:
    """The same operations with the worker's half in this process: the queue's own CPU cost
    per round trip, without the two cross-process wake-ups."""

    name = "scratchd queue, one process"

    def __init__(self) -> None:
        self.q = RequestQueue.create(f"/scratchd-bench-inproc-{os.getpid()}", GEOMETRY)
        self.q.register_worker(1, os.getpid())

    def round_trip(self, i: int) -> None:
        q = self.q
        submit_one(q, i)
        for c in q.claim_batch(1, 1, time.monotonic_ns()):
            q.complete(1, c, Result(Status.OK, score=float(q.input_view(c)[0, 0]), batch_size=1))
        (done,) = q.collect_completed()
        assert done.request_id == i

    def close(self) -> None:
        self.q.close()


class RedisBench:
    name = "redis LPUSH/BRPOP (unix socket)"

    def __init__(self) -> None:
        import redis

        self.dir = tempfile.mkdtemp(prefix="scratchd-bench-redis-")
        self.sock = os.path.join(self.dir, "redis.sock")
        conf = os.path.join(self.dir, "redis.conf")
        Path(conf).write_text(
            f'port 0\nunixsocket {self.sock}\nunixsocketperm 700\nsave ""\n'
            f"appendonly no\ndir {self.dir}\nlogfile {self.dir}/redis.log\n"
        )
        server = shutil.which("redis-server")
        if server is None:
            raise SystemExit("redis-server not found: apt-get install -y redis-server")
        self.server = subprocess.Popen([server, conf])
        self.r = redis.Redis(unix_socket_path=self.sock)
        for _ in range(200):
            try:
                if os.path.exists(self.sock) and self.r.ping():
                    break
            except redis.ConnectionError:
                pass
            time.sleep(0.02)
        else:
            raise SystemExit(f"redis-server did not come up (see {self.dir}/redis.log)")
        self.worker = subprocess.Popen(
            [sys.executable, __file__, "--role", "redis-worker", self.sock]
        )
        self.encode = msgspec.msgpack.encode
        self.decode = msgspec.msgpack.Decoder(Reply).decode

    def round_trip(self, i: int) -> None:
        d = Descriptor(i, 1, 0, 0, time.monotonic_ns() + DEADLINE_NS, 4, 4, PAYLOAD)
        self.r.lpush("req", self.encode(d))
        item = self.r.brpop(["resp"], timeout=0)
        assert item is not None and self.decode(cast(bytes, item[1])).request_id == i

    def close(self) -> None:
        self.worker.terminate()
        self.worker.wait()
        self.r.close()
        self.server.send_signal(signal.SIGTERM)
        self.server.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class MpQueueBench:
    name = "multiprocessing.Queue"

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")  # exec, like the other workers
        self.inbox: MpQueue[Any] = ctx.Queue()
        self.outbox: MpQueue[Any] = ctx.Queue()
        self.worker = ctx.Process(target=mp_worker, args=(self.inbox, self.outbox))
        self.worker.start()

    def round_trip(self, i: int) -> None:
        d = Descriptor(i, 1, 0, 0, time.monotonic_ns() + DEADLINE_NS, 4, 4, PAYLOAD)
        self.inbox.put(d)
        assert self.outbox.get().request_id == i

    def close(self) -> None:
        self.inbox.put(None)
        self.worker.join(10)


# ------------------------------------------------------------------ measurement
def measure(round_trip: Callable[[int], None], start: int, n: int, out: list[int]) -> None:
    clock = time.perf_counter_ns
    for i in range(start, start + n):
        t0 = clock()
        round_trip(i)
        out.append(clock() - t0)


def summarize(ns: list[int]) -> dict[str, float]:
    us = np.asarray(ns, np.float64) / 1000.0
    pct = np.percentile(us, [50, 90, 99, 99.9])
    return {
        "rounds": len(ns),
        "p50_us": round(float(pct[0]), 2),
        "p90_us": round(float(pct[1]), 2),
        "p99_us": round(float(pct[2]), 2),
        "p999_us": round(float(pct[3]), 2),
        "mean_us": round(float(us.mean()), 2),
        "max_us": round(float(us.max()), 2),
        "round_trips_per_s": round(1e6 / float(us.mean())),
    }


def run(rounds: int, warmup: int, chunks: int) -> dict[str, dict[str, float]]:
    benches: list[Bench] = [QueueBench(), RedisBench(), MpQueueBench(), InProcessQueueBench()]
    samples: dict[str, list[int]] = {b.name: [] for b in benches}
    try:
        for b in benches:
            measure(b.round_trip, 0, warmup, [])
        per_chunk = -(-rounds // chunks)
        for k in range(chunks):
            for b in benches:  # interleaved: background load hits every system alike
                measure(b.round_trip, warmup + k * per_chunk, per_chunk, samples[b.name])
    finally:
        for b in benches:
            b.close()
    return {name: summarize(ns) for name, ns in samples.items()}


def print_table(results: dict[str, dict[str, float]]) -> None:
    cols = ["p50_us", "p90_us", "p99_us", "p999_us", "mean_us", "max_us", "round_trips_per_s"]
    print(f"{'system':34s}" + "".join(f"{c:>18s}" for c in cols))
    for name, row in results.items():
        print(f"{name:34s}" + "".join(f"{row[c]:>18}" for c in cols))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=20_000, help="measured round trips per system")
    ap.add_argument("--warmup", type=int, default=1_000)
    ap.add_argument("--chunks", type=int, default=10, help="interleaving chunks")
    ap.add_argument("--json", type=Path, default=ROOT / "docs" / "bench" / "queue.json")
    ap.add_argument(
        "--pin", action="store_true", help="main process on CPU 0, workers on CPU 1 (Linux)"
    )
    ap.add_argument("--role", nargs="+", help=argparse.SUPPRESS)  # exec'd worker roles
    args = ap.parse_args()
    if args.pin and (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {1} if args.role else {0})
        if not args.role:
            os.environ["SCRATCHD_BENCH_PIN"] = "1"  # the exec'd workers pin themselves
    if os.environ.get("SCRATCHD_BENCH_PIN") and args.role:
        os.sched_setaffinity(0, {1})
    if args.role:
        role, *rest = args.role
        if role == "queue-worker":
            queue_worker(rest[0], int(rest[1]), int(rest[2]), int(rest[3]))
        elif role == "redis-worker":
            redis_worker(rest[0])
        return
    results = run(args.rounds, args.warmup, args.chunks)
    print_table(results)
    ours, redis_row = results[QueueBench.name], results[RedisBench.name]
    report = {
        "benchmark": "descriptor round trip main -> worker -> main",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "kernel": platform.release(), "load_avg_1m": os.getloadavg()[0]},
        "rounds_per_system": args.rounds,
        "pinned": bool(args.pin),
        "results": results,
        "targets": {"p50_us": 20, "p99_us": 100, "vs_redis": 10},
        "speedup_vs_redis": {
            "p50": round(redis_row["p50_us"] / ours["p50_us"], 2),
            "p99": round(redis_row["p99_us"] / ours["p99_us"], 2),
        },
    }  # fmt: skip
    print(f"speed-up vs redis: p50 {report['speedup_vs_redis']['p50']}x, "
          f"p99 {report['speedup_vs_redis']['p99']}x")  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
