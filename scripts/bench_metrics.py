"""What the metrics cost on the request path: per reply, per scrape, and end to end.

    python scripts/bench_metrics.py                          # in-process costs only
    python scripts/bench_metrics.py --serve --rates 10,30    # + bench_serve with and without

1. `Observability.account` per reply (what the dispatcher pays for each answer: counters,
   latency windows, queue wait, batch de-duplication, drift ring, entropy ring), timed over
   `--replies` realistic ok replies from batches of 4, two part classes.
2. `/metrics` exposition per scrape (two part classes, one device, full windows) and the
   status fields (`scratchd status`) per call.
3. With `--main-cpu`: the daemon's main process CPU time per request (all its threads, from
   /proc/<pid>/task/*/schedstat) over `--requests` small frames, accounting on and off, in
   alternating rounds: the direct cost of the metrics on the request path.
4. With `--serve`: scripts/bench_serve.py twice against a CPU daemon it starts, once with
   accounting on and once with `SCRATCHD_NO_METRICS=1` (listeners still up, nothing
   accounted), the same open-loop Poisson rates; the p50/p99 difference is the end-to-end
   cost (on a CPU backend it is far below the run-to-run noise of ~100 ms inferences).

Prints a table and writes JSON (`--json`, default docs/bench/metrics.json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from scratchd.daemon.config import Config
from scratchd.daemon.frontend.dispatch import InFlight
from scratchd.daemon.ops.observability import ModelReference, Observability
from scratchd.ipc.queue import Completion, Handle, Result, Status
from scratchd.protocol import wire

ROOT = Path(__file__).resolve().parent.parent


def _replies(n: int) -> list[tuple[InFlight, wire.Reply, Completion]]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        hist = rng.integers(0, 1000, 64).astype(np.uint32)
        result = Result(
            Status.OK, entropy=0.05, histogram=hist, compute_ns=40_000_000, batch_size=4
        )
        completion = Completion(
            handle=Handle(i % 256, i), request_id=i, conn_id=1, part_class=i % 2,
            priority=7 * (i % 2), status=Status.OK, result=result, enqueue_ns=0,
            claim_ns=(i // 4) * 1000, done_ns=0, worker=i % 2,
        )  # fmt: skip
        flight = InFlight(
            conn=None,  # type: ignore[arg-type]  # account() never touches the connection
            request_id=i, part_class=("safety", "normal")[i % 2], priority=7 * (i % 2),
            received_ns=0,
        )  # fmt: skip
        reply = wire.Reply(
            id=i, status="ok", verdict="clean", worker=("cpu0", "cpu1")[i % 2],
            timings=wire.Timings(queue_ms=2.0, compute_ms=40.0, total_ms=45.0 + i % 7),
        )  # fmt: skip
        out.append((flight, reply, completion))
    return out


def in_process(replies: int) -> dict[str, float]:
    reference = ModelReference("bench", np.ones(64) / 64)
    obs = Observability(Config(), reference, devices=["cpu"], worker_states=["ready"])
    items = _replies(replies)
    start = time.perf_counter_ns()
    for flight, reply, completion in items:
        obs.account(flight, reply, completion)
    per_reply_us = (time.perf_counter_ns() - start) / replies / 1e3
    assert obs.completed == replies
    scrapes = 200
    start = time.perf_counter_ns()
    for _ in range(scrapes):
        text = obs.metrics.exposition()
    per_scrape_ms = (time.perf_counter_ns() - start) / scrapes / 1e6
    start = time.perf_counter_ns()
    for _ in range(scrapes):
        obs.status_fields()
    per_status_ms = (time.perf_counter_ns() - start) / scrapes / 1e6
    return {
        "account_us_per_reply": round(per_reply_us, 2),
        "exposition_ms_per_scrape": round(per_scrape_ms, 3),
        "exposition_bytes": len(text),
        "status_fields_ms": round(per_status_ms, 3),
    }


def serve(rates: str, duration: float, model: str) -> dict[str, Any]:
    """bench_serve with and without per-request accounting, same load."""
    runs: dict[str, Any] = {}
    for label, env_value in (("metrics on", ""), ("metrics off", "1")):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "serve.json"
            env = {**os.environ, "SCRATCHD_NO_METRICS": env_value}
            cmd = [sys.executable, str(ROOT / "scripts" / "bench_serve.py"), "--rates", rates,
                   "--duration", str(duration), "--kills", "0", "--json", str(out),
                   "--model", model]  # fmt: skip
            subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
            runs[label] = json.loads(out.read_text())
    return runs


def _cpu_ns(pid: int) -> int:
    """CPU time of every thread of `pid` so far (schedstat: nanoseconds, not 10 ms ticks)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            total += int((task / "schedstat").read_text().split()[0])
    return total


def main_process_cost(requests: int, rounds: int, model: str) -> dict[str, Any]:
    """Main-process CPU per request (acceptor + dispatcher + accounting), on and off.

    Small raw frames (64x64) keep the workers fast so the run is short; the main process's
    work per request does not depend on the image size except for the copy into the slot.
    Rounds alternate on/off so that a change of machine load hits both alike.
    """
    import msgspec

    from scratchd.client.api import Client

    frame = np.random.default_rng(0).integers(0, 255, (64, 64), dtype=np.uint8)
    per_request: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(rounds):
        for label, env_value in (("on", ""), ("off", "1")):
            with tempfile.TemporaryDirectory(prefix="sdbm-", dir="/tmp") as tmp:
                sock = f"{tmp}/s.sock"
                config = Path(tmp) / "c.toml"
                config.write_text(
                    f'[server]\nsocket = "{sock}"\nhealth_port = 0\nmetrics_port = 0\n'
                    f'[workers]\nbackend = "cpu"\ncpu_workers = 2\n[model]\npath = "{model}"\n'
                    "[classes.safety]\ndeadline_ms = 60000\n[classes.normal]\ndeadline_ms = 60000\n"
                )
                env = {**os.environ, "SCRATCHD_NO_METRICS": env_value}
                cmd = [sys.executable, "-c", "from scratchd.daemon.cli import main; main()",
                       "serve", "--config", str(config)]  # fmt: skip
                proc = subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL)
                try:
                    pid = _wait_serving(sock)
                    with Client(sock, timeout=60) as client:
                        list(client.map([frame] * 200, concurrency=8))  # warm up
                        before = _cpu_ns(pid)
                        replies = [r for _, r in client.map([frame] * requests, concurrency=8)]
                        used = _cpu_ns(pid) - before
                        assert all(r.status == "ok" for r in replies)
                        doc = msgspec.to_builtins(client.status())
                    assert doc["requests"].get("ok", 0) == requests + 200
                    per_request[label].append(used / requests / 1e3)
                finally:
                    proc.send_signal(signal.SIGTERM)
                    try:
                        proc.wait(60)
                    except subprocess.TimeoutExpired:  # a wedged daemon must not outlive us
                        proc.kill()
                        proc.wait()
    med = {k: round(float(np.median(v)), 1) for k, v in per_request.items()}
    return {
        "requests_per_round": requests,
        "main_cpu_us_per_request": {k: [round(x, 1) for x in v] for k, v in per_request.items()},
        "median_on_us": med["on"],
        "median_off_us": med["off"],
        "accounting_us": round(med["on"] - med["off"], 1),
    }


def _wait_serving(sock: str) -> int:
    from scratchd.client.api import Client

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with Client(sock, timeout=5) as client:
                status = client.status()
            if status.state == "serving":
                return status.pid
        except OSError:
            pass
        time.sleep(0.05)
    raise SystemExit("daemon not serving after 120 s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--replies", type=int, default=20_000)
    p.add_argument("--serve", action="store_true", help="also run bench_serve with and without")
    p.add_argument("--rates", default="10,30")
    p.add_argument("--duration", type=float, default=15.0)
    p.add_argument("--main-cpu", action="store_true", help="main-process CPU per request")
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default="", help="model file for bench_serve (default: shipped)")
    p.add_argument("--json", default=str(ROOT / "docs" / "bench" / "metrics.json"))
    args = p.parse_args()
    costs = in_process(args.replies)
    print(f"{'in-process cost':<34}{'value':>12}")
    for key, value in costs.items():
        print(f"{key:<34}{value:>12}")
    result: dict[str, Any] = {"machine": platform.node(), "in_process": costs}
    if args.main_cpu:
        cost = main_process_cost(args.requests, args.rounds, args.model)
        result["main_process"] = cost
        print(f"main-process CPU per request: on {cost['median_on_us']} us, off "
              f"{cost['median_off_us']} us (rounds {cost['main_cpu_us_per_request']})")  # fmt: skip
    if args.serve:
        result["serve"] = serve(args.rates, args.duration, args.model)
        print(f"{'bench_serve load':<26}{'metrics':>9}{'p50 ms':>9}{'p99 ms':>9}{'ok/s':>8}")
        for label, run in result["serve"].items():
            for row in run["loads"]:
                print(
                    f"{row['load']:<26}{label.split()[1]:>9}{row['p50_ms']!s:>9}"
                    f"{row['p99_ms']!s:>9}{row['throughput_ok_per_s']!s:>8}"
                )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
