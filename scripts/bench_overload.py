"""Overload: a real daemon driven far past its capacity, with a safety trickle on the side.

    python scripts/bench_overload.py                     # CPU daemon, 2 workers, 256 slots
    python scripts/bench_overload.py --multiples 3,10 --duration 20 --repeats 2 \\
        --json docs/bench/overload.json

It starts ``scratchd serve --backend cpu`` (``serve_daemon.py``), measures its capacity
(closed loop, ``--concurrency`` requests in flight with a deadline long enough that nothing
is refused: ``ok`` replies per second), then for each of ``--multiples`` drives it open loop
(Poisson, ``serve_load.schedule``) at that multiple of the capacity with normal-class
requests whose deadline is ``--deadline-ms``, spread over ``--connections`` connections,
plus ``--trickle`` safety-class requests per second (priority 7, the class's deadline) on a
connection of their own. Each load runs ``--repeats`` times.

Per class it reports ``ok`` (answered ``ok`` within the deadline, by this client's clock
from the send), ``late`` (``ok`` but after the deadline by this client's clock: the client's
own delays count against the daemon here), ``daemon_late`` (``ok`` with the daemon's own
``total_ms`` past the deadline: the daemon's promise, which must be 0), ``timeout``,
``overloaded`` and the p99 of the client's latency of ``ok`` replies. The daemon's main
process is sampled every ``--sample-s`` for its resident memory (``VmRSS``) and open
descriptors (``/proc/<pid>/fd``): before the load (baseline), its peak during, and after
``--settle`` s of quiet. Images: the SD-900 PNGs under ``--data``, sent encoded.

It prints a table and writes JSON: ``{"device", "date", "capacity_rps", "runs": [{"multiple",
"rate", "repeat", "classes": {name: {...}}, "rss_mib", "fds"}]}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import numpy as np
import serve_load as sl
import uvloop
from serve_daemon import SERVE, wait_ready

from scratchd.client.api import AsyncClient

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "fixtures" / "data" / "sd900" / "images"
SAFETY_CLASS: Final = "safety"


# ---- the daemon and its main process ------------------------------------------------------


def start_daemon(args: argparse.Namespace, tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    sock = str(tmp / "overload.sock")
    config = tmp / "overload.toml"
    config.write_text(
        "[server]\nhealth_port = 0\nmetrics_port = 0\n"
        f"max_in_flight_per_connection = {args.per_connection}\n"
        f"[queue]\nslots = {args.slots}\n"
        f"[classes.normal]\npriority = 0\ndeadline_ms = {args.deadline_ms}\n"
        f"[classes.safety]\npriority = 7\ndeadline_ms = {args.safety_deadline_ms}\n"
    )
    log = (tmp / "serve.log").open("wb")
    cmd = [*SERVE, "--config", str(config), "--backend", "cpu", "--socket", sock]
    proc = subprocess.Popen([*cmd, "--workers", str(args.workers)], stdout=log, stderr=log)
    wait_ready(sock, proc, spares=True)
    return proc, sock


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class Sampler:
    """The main process's RSS and descriptors every ``period`` s, in a thread."""

    def __init__(self, pid: int, period: float) -> None:
        self.pid, self.period = pid, period
        self.samples: list[tuple[float, float, int]] = []  # (t, rss MiB, fds)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), rss_mib(self.pid), open_fds(self.pid)))
            self._stop.wait(self.period)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# ---- load ---------------------------------------------------------------------------------


async def capacity(sock: str, payloads: list[bytes], seconds: float, concurrency: int) -> float:
    """``ok`` replies per second, closed loop with ``concurrency`` in flight."""
    ok = 0
    end = time.perf_counter() + seconds

    async def loop(client: AsyncClient, k: int) -> None:
        nonlocal ok
        while time.perf_counter() < end:
            reply = await client.infer(payloads[k % len(payloads)], deadline_ms=600_000)
            ok += reply.status == "ok"
            k += concurrency

    async with await AsyncClient.connect(sock) as client:
        await loop(client, 0)  # warm: one request alone first
        ok, start = 0, time.perf_counter()
        end = start + seconds
        await asyncio.gather(*(loop(client, k) for k in range(concurrency)))
        return ok / (time.perf_counter() - start)


Record = tuple[str, float, str, float, str]  # class, client latency ms, status, daemon ms, error


async def drive(
    sock: str, payloads: list[bytes], args: argparse.Namespace, rate: float, seed: int
) -> list[Record]:
    """Open loop: the normal flood at ``rate`` and the safety trickle, for ``duration`` s."""
    flood = sl.schedule("poisson", args.duration, rate, seed)
    trickle = [i / args.trickle for i in range(int(args.duration * args.trickle))]
    records: list[Record] = []
    clients = [await AsyncClient.connect(sock) for _ in range(args.connections + 1)]
    start = time.perf_counter() + 0.1
    tasks: list[asyncio.Task[None]] = []

    async def one(client: AsyncClient, name: str, i: int, at: float) -> None:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        sent = time.perf_counter()
        part_class = SAFETY_CLASS if name == SAFETY_CLASS else None
        try:
            reply = await client.infer(payloads[i % len(payloads)], part_class=part_class)
        except ConnectionError as exc:
            records.append((name, float("nan"), "connection_lost", float("nan"), str(exc)))
            return
        latency = (time.perf_counter() - sent) * 1000.0
        records.append((name, latency, reply.status, reply.timings.total_ms, reply.error))

    for i, at in enumerate(flood):
        tasks.append(asyncio.create_task(one(clients[i % args.connections], "normal", i, at)))
    for i, at in enumerate(trickle):
        tasks.append(asyncio.create_task(one(clients[-1], SAFETY_CLASS, i, at)))
    await asyncio.wait(tasks, timeout=args.duration + args.grace)
    for task in tasks:
        task.cancel()
    for client in clients:
        await client.close()
    lost = len(flood) + len(trickle) - len(records)
    records += [("normal", float("nan"), "no_reply", float("nan"), "")] * lost
    return records


def summarize_class(records: list[Record], deadline_ms: float) -> dict[str, Any]:
    statuses = Counter(status for _, _, status, _, _ in records)
    ok = [(lat, daemon) for _, lat, status, daemon, _ in records if status == "ok"]
    latencies = np.array([lat for lat, _ in ok])
    in_time = int(np.count_nonzero(latencies <= deadline_ms))
    return {
        "sent": len(records),
        "ok": in_time,
        "late": len(ok) - in_time,
        "daemon_late": sum(daemon > deadline_ms for _, daemon in ok),
        "timeout": statuses["timeout"],
        "overloaded": statuses["overloaded"],
        "other": sum(n for s, n in statuses.items() if s not in ("ok", "timeout", "overloaded")),
        "ok_share": round(in_time / len(records), 4) if records else None,
        "p99_ms": sl.percentile(latencies, 99),
        "reasons": dict(Counter(_reason(e) for _, _, s, _, e in records if s == "overloaded")),
    }


def _reason(error: str) -> str:
    """An ``overloaded`` reply's reason without its numbers (to count them by kind)."""
    return re.sub(r"\d+", "N", error)[:56]


def run_load(
    sock: str, pid: int, payloads: list[bytes], args: argparse.Namespace, multiple: float,
    cap: float, repeat: int,
) -> dict[str, Any]:  # fmt: skip
    rate = multiple * cap
    baseline = (rss_mib(pid), open_fds(pid))
    with Sampler(pid, args.sample_s) as sampler:
        records = uvloop.run(drive(sock, payloads, args, rate, seed=repeat))
    time.sleep(args.settle)
    after = (rss_mib(pid), open_fds(pid))
    peak_rss = max(s[1] for s in sampler.samples)
    peak_fds = max(s[2] for s in sampler.samples)
    deadlines = {"normal": args.deadline_ms, SAFETY_CLASS: args.safety_deadline_ms}
    classes = {
        name: summarize_class([r for r in records if r[0] == name], deadline)
        for name, deadline in deadlines.items()
    }
    return {
        "multiple": multiple,
        "rate": round(rate, 1),
        "repeat": repeat,
        "classes": classes,
        "rss_mib": {
            "baseline": round(baseline[0], 1),
            "peak": round(peak_rss, 1),
            "after": round(after[0], 1),
        },
        "fds": {"baseline": baseline[1], "peak": peak_fds, "after": after[1]},
        "timeline": [
            (round(t - sampler.samples[0][0], 2), round(r, 1), n) for t, r, n in sampler.samples
        ],
    }


# ---- report -------------------------------------------------------------------------------


def print_rows(runs: list[dict[str, Any]]) -> None:
    head = (
        f"{'load':>9} {'class':>7} {'sent':>5} {'ok':>5} {'late':>4} {'d_late':>6} "
        f"{'timeout':>7} {'overl.':>6} {'ok %':>6} {'p99 ms':>7} "
        f"{'RSS MiB base/peak/after':>24} {'fds base/peak/after':>20}"
    )
    print(head)
    for run in runs:
        rss, fds = run["rss_mib"], run["fds"]
        for name, c in run["classes"].items():
            share = f"{100 * c['ok_share']:.1f}" if c["ok_share"] is not None else "-"
            print(
                f"{run['multiple']:>4}x#{run['repeat']:<3} {name:>7} {c['sent']:>5} {c['ok']:>5} "
                f"{c['late']:>4} {c['daemon_late']:>6} {c['timeout']:>7} {c['overloaded']:>6} "
                f"{share:>6} {c['p99_ms'] or '-':>7} "
                f"{rss['baseline']:>8}/{rss['peak']}/{rss['after']:<8} "
                f"{fds['baseline']:>8}/{fds['peak']}/{fds['after']:<6}"
            )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", type=Path, default=DATA, help="folder of PNGs sent encoded")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--per-connection", type=int, default=128)
    p.add_argument("--multiples", default="3,10", help="loads, in multiples of the capacity")
    p.add_argument("--duration", type=float, default=20.0, help="s per load")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--capacity-s", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=8, help="capacity run's requests in flight")
    p.add_argument("--deadline-ms", type=int, default=1500, help="the normal class's")
    p.add_argument("--safety-deadline-ms", type=int, default=1000)
    p.add_argument("--trickle", type=float, default=2.0, help="safety requests per s")
    p.add_argument("--connections", type=int, default=4, help="for the normal flood")
    p.add_argument("--grace", type=float, default=10.0, help="s to wait for the last replies")
    p.add_argument("--settle", type=float, default=3.0, help="s of quiet before 'after'")
    p.add_argument("--sample-s", type=float, default=0.5)
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    payloads = [p.read_bytes() for p in sorted(args.data.glob("*.png"))[:64]]
    if not payloads:
        raise SystemExit(f"no PNG images under {args.data}")
    tmp = Path(tempfile.mkdtemp(prefix="bench-overload-"))
    proc, sock = start_daemon(args, tmp)
    try:
        cap = uvloop.run(capacity(sock, payloads, args.capacity_s, args.concurrency))
        print(f"capacity: {cap:.1f} ok/s (closed loop, {args.concurrency} in flight)")
        runs = []
        for multiple in (float(m) for m in args.multiples.split(",")):
            for repeat in range(args.repeats):
                runs.append(run_load(sock, proc.pid, payloads, args, multiple, cap, repeat))
                print_rows(runs[-1:])
        print()
        print_rows(runs)
        record = {
            "device": f"{platform.node()} CPU x{os.cpu_count()}, {args.workers} workers",
            "date": datetime.now(UTC).strftime("%Y-%m-%d"),
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "capacity_rps": round(cap, 2),
            "deadline_ms": {"normal": args.deadline_ms, SAFETY_CLASS: args.safety_deadline_ms},
            "runs": runs,
        }
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(record, indent=1) + "\n")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
