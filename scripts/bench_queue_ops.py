"""The queue's own CPU cost per request, in one process: submit, claim, finish, complete.

One request's trip through ``RequestQueue`` with no second process and no doorbell wait, the
calls each process role makes:

- **submit** (main process, the acceptor): ``reserve`` + a 16-byte input into ``payload`` +
  ``submit``;
- **claim** (worker): ``claim_batch(slot, 1, now)``;
- **finish** (worker): ``complete(slot, claim, result)``;
- **complete** (main process, the dispatcher): ``collect_completed``.

Each repeat runs ``--rounds`` requests through all four (after ``--warmup``) twice: once
with a ``perf_counter_ns`` read between the calls, for the per-call rows (the reads' own
cost is in them, the same before and after a change), and once without, for the round-trip
row. Reported per row: the median over ``--repeats`` repeats of the mean ns per call, and the
spread (min–max over the repeats), as a table and as JSON (``--json``, default
``docs/bench/queue-ops.json``). It needs nothing beyond the package (``bench_queue.py``
compares against Redis and needs its server and client).

Run: ``python scripts/bench_queue_ops.py --rounds 20000 --repeats 5``. On a machine shared
with other work, compare runs made back to back.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from scratchd.ipc.queue import Geometry, RequestQueue, Result, Status

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_queue import submit_one

ROOT = Path(__file__).resolve().parent.parent
GEOMETRY = Geometry(slots=64, slot_bytes=4096, tick_ms=1, max_workers=2, wheel_ticks=1024)
SLOT = 1
OPS = ("submit", "claim", "finish", "complete")
ROUND_TRIP = "round trip (all four)"


def timed_calls(q: RequestQueue, rounds: int, first: int) -> dict[str, float]:
    """Mean ns per call of each op over ``rounds`` requests, a clock read between calls."""
    clock = time.perf_counter_ns
    total = dict.fromkeys(OPS, 0)
    result = Result(Status.OK, score=0.5, batch_size=1)
    for i in range(first, first + rounds):
        t0 = clock()
        submit_one(q, i)
        t1 = clock()
        (c,) = q.claim_batch(SLOT, 1, time.monotonic_ns())
        t2 = clock()
        q.complete(SLOT, c, result)
        t3 = clock()
        (done,) = q.collect_completed()
        t4 = clock()
        assert done.request_id == i
        total["submit"] += t1 - t0
        total["claim"] += t2 - t1
        total["finish"] += t3 - t2
        total["complete"] += t4 - t3
    return {op: ns / rounds for op, ns in total.items()}


def round_trips(q: RequestQueue, rounds: int, first: int) -> float:
    """Mean ns per request of the four calls back to back, no clock read between them."""
    result = Result(Status.OK, score=0.5, batch_size=1)
    t0 = time.perf_counter_ns()
    for i in range(first, first + rounds):
        submit_one(q, i)
        (c,) = q.claim_batch(SLOT, 1, time.monotonic_ns())
        q.complete(SLOT, c, result)
        q.collect_completed()
    return (time.perf_counter_ns() - t0) / rounds


def run(rounds: int, warmup: int, repeats: int) -> dict[str, dict[str, Any]]:
    samples: dict[str, list[float]] = {name: [] for name in (*OPS, ROUND_TRIP)}
    q = RequestQueue.create(f"/scratchd-bench-ops-{os.getpid()}", GEOMETRY)
    try:
        q.register_worker(SLOT, os.getpid())
        n = 0
        timed_calls(q, warmup, n)
        round_trips(q, warmup, n + warmup)
        n += 2 * warmup
        for _ in range(repeats):
            for op, ns in timed_calls(q, rounds, n).items():
                samples[op].append(ns)
            samples[ROUND_TRIP].append(round_trips(q, rounds, n + rounds))
            n += 2 * rounds
    finally:
        q.close()
    return {
        name: {"median_ns": round(statistics.median(xs), 1), "min_ns": round(min(xs), 1),
               "max_ns": round(max(xs), 1), "repeats_ns": [round(x, 1) for x in xs]}
        for name, xs in samples.items()
    }  # fmt: skip


def print_table(results: dict[str, dict[str, Any]], rounds: int, repeats: int) -> None:
    print(f"ns per call, mean over {rounds} requests; median (min-max) of {repeats} repeats")
    print(f"| {'op':<22} | {'median':>8} | {'spread':>17} |")
    print(f"|{'-' * 24}|{'-' * 10}|{'-' * 19}|")
    for name, row in results.items():
        spread = f"{row['min_ns']:.0f}-{row['max_ns']:.0f}"
        print(f"| {name:<22} | {row['median_ns']:>8.0f} | {spread:>17} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--rounds", type=int, default=20000, help="requests per repeat")
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path, default=ROOT / "docs" / "bench" / "queue-ops.json")
    args = p.parse_args()
    load_before = os.getloadavg()
    results = run(args.rounds, args.warmup, args.repeats)
    load_after = os.getloadavg()
    print_table(results, args.rounds, args.repeats)
    report = {
        "benchmark": "queue calls per request in one process: submit, claim, finish, complete",
        "command": " ".join(["python3", "scripts/bench_queue_ops.py", *sys.argv[1:]]),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "kernel": platform.release(),
            "load_avg_before": load_before,
            "load_avg_after": load_after,
        },
        "rounds": args.rounds,
        "repeats": args.repeats,
        "results": results,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
