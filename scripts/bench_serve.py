"""Open-loop load against a real CPU daemon: latency percentiles, throughput, statuses, losses,
and how long a worker takes to come back after kill -9.

    python scripts/bench_serve.py                       # starts its own daemon (CPU, 2 workers)
    python scripts/bench_serve.py --rates 2,5,10 --duration 10 --json docs/bench/serve-cpu.json
    python scripts/bench_serve.py --socket /run/scratchd/scratchd.sock   # an existing daemon

Load is open loop (requests are sent on schedule whether or not earlier ones were answered,
as a production line does) from client *processes* separate from the daemon (this script run
with ``--client``), so the generator never shares a core's event loop with the acceptor:

- ``poisson@R``: exponential inter-arrival times at R requests/s in total, split over the
  client processes (a superposition of Poisson streams is Poisson);
- ``burst``: the seed's pattern, 23 requests spread over 0.3 s, then 1.7 s idle, repeated.

Latency is measured from each request's *scheduled* send time to its reply (no coordinated
omission: a stalled client cannot hide the stall). ``lost`` counts requests without a reply
when the run ends (duration + deadline + 5 s grace) and duplicate replies; it must be 0.
Images: real SD-900 200x200 PNGs (``--data``), sent encoded, cycled.

Restart: while a light load runs, each worker is SIGKILLed in turn and the time from the kill
until ``status`` shows its replacement READY is recorded (``--kills`` per worker), with what
replaced it: the warm standby, or a fresh process (a second death in a row backs off 0.1 s
and starts one; so does a daemon without a standby).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from scratchd.client import AsyncClient, Client

ROOT = Path(__file__).resolve().parent.parent
SERVE = [sys.executable, "-c", "from scratchd.daemon.cli import main; main()", "serve"]


# ---- client process ---------------------------------------------------------------------


def schedule(pattern: str, duration: float, rate: float, seed: int) -> list[float]:
    """Send offsets in seconds from the start."""
    rng = random.Random(seed)
    times: list[float] = []
    if pattern == "burst":
        cycle = 0.0
        while cycle < duration:
            times.extend(sorted(cycle + rng.uniform(0.0, 0.3) for _ in range(23)))
            cycle += 2.0
        return times
    t = rng.expovariate(rate)
    while t < duration:
        times.append(t)
        t += rng.expovariate(rate)
    return times


async def run_client(args: argparse.Namespace) -> dict[str, Any]:
    images = [p.read_bytes() for p in sorted(Path(args.data).glob("*.png"))[:64]]
    offsets = schedule(args.pattern, args.duration, args.rate, args.seed)
    latencies: list[float] = []
    statuses: Counter[str] = Counter()
    answered = 0
    async with await AsyncClient.connect(args.socket) as client:
        start = time.perf_counter() + 0.2

        async def one(i: int, at: float) -> None:
            nonlocal answered
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            reply = await client.infer(images[i % len(images)])
            answered += 1
            statuses[reply.status] += 1
            if reply.status == "ok":
                latencies.append((time.perf_counter() - (start + at)) * 1000.0)

        tasks = [asyncio.ensure_future(one(i, at)) for i, at in enumerate(offsets)]
        _, pending = await asyncio.wait(tasks, timeout=args.duration + args.grace + 0.2)
        for task in pending:
            task.cancel()
    return {
        "sent": len(offsets),
        "answered": answered,
        "statuses": dict(statuses),
        "latencies_ms": latencies,
        "elapsed_s": time.perf_counter() - start,
    }


# ---- orchestration ----------------------------------------------------------------------


def start_daemon(workers: int, model: str, tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    sock = str(tmp / "bench.sock")
    log = (tmp / "serve.log").open("wb")
    config = tmp / "bench.toml"
    config.write_text(f'[server]\nhealth_port = 0\nmetrics_port = 0\n[model]\npath = "{model}"\n')
    proc = subprocess.Popen(
        [
            *SERVE,
            "--config",
            str(config),
            "--backend",
            "cpu",
            "--workers",
            str(workers),
            "--socket",
            sock,
        ],
        stdout=log,
        stderr=log,
    )
    wait_ready(sock, proc)
    return proc, sock


def wait_ready(
    sock: str, proc: subprocess.Popen[bytes] | None, restarts: dict[str, int] | None = None
) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"daemon exited with status {proc.returncode}")
        try:
            with Client(sock, timeout=5) as client:
                status = client.status()
        except OSError:
            time.sleep(0.005)
            continue
        by_name = {w.name: w for w in status.workers}
        serving = status.state == "serving" and all(w.state == "ready" for w in status.workers)
        if serving and all(by_name[n].restarts >= k for n, k in (restarts or {}).items()):
            return
        time.sleep(0.005)
    raise SystemExit("daemon not ready after 120 s")


def run_load(args: argparse.Namespace, sock: str, pattern: str, rate: float) -> dict[str, Any]:
    procs = []
    for k in range(args.clients):
        cmd = [sys.executable, __file__, "--client", "--socket", sock, "--pattern", pattern]
        cmd += ["--rate", str(rate / args.clients), "--duration", str(args.duration)]
        cmd += ["--seed", str(1000 * k + int(rate)), "--data", args.data]
        if pattern == "burst" and k > 0:
            continue  # one burst source: the pattern is a total, not per client
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True))
    results = [json.loads(p.communicate()[0]) for p in procs]
    latencies = np.array([x for r in results for x in r["latencies_ms"]], dtype=np.float64)
    statuses: Counter[str] = Counter()
    for r in results:
        statuses.update(r["statuses"])
    sent = sum(r["sent"] for r in results)
    answered = sum(r["answered"] for r in results)
    elapsed = max(r["elapsed_s"] for r in results)

    def pct(q: float) -> float | None:
        return round(float(np.percentile(latencies, q)), 2) if latencies.size else None

    return {
        "load": pattern if pattern == "burst" else f"poisson@{rate:g}/s",
        "sent": sent,
        "statuses": dict(statuses),
        "lost": sent - answered,
        "throughput_ok_per_s": round(statuses["ok"] / args.duration, 2),
        "p50_ms": pct(50),
        "p99_ms": pct(99),
        "p99_9_ms": pct(99.9),
        "max_ms": round(float(latencies.max()), 2) if latencies.size else None,
        "elapsed_s": round(elapsed, 2),
    }


def measure_restarts(args: argparse.Namespace, sock: str) -> list[dict[str, Any]]:
    background = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--client",
            "--socket",
            sock,
            "--pattern",
            "poisson",
            "--rate",
            "3",
            "--duration",
            str(5.0 * args.kills * 2 + 2),
            "--data",
            args.data,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    out = []
    with Client(sock, timeout=5) as client:
        workers = {w.name: w for w in client.status().workers}
    for name in sorted(workers):
        for _ in range(args.kills):
            time.sleep(3.0)  # time for a new standby to boot after the previous kill
            with Client(sock, timeout=5) as client:
                status = client.status()
            current = {w.name: w for w in status.workers}[name]
            spare = status.standby.pid if status.standby and status.standby.state == "ready" else 0
            os.kill(current.pid, signal.SIGKILL)
            t0 = time.monotonic()
            wait_ready(sock, None, {name: current.restarts + 1})
            elapsed = time.monotonic() - t0
            with Client(sock, timeout=5) as client:
                new_pid = {w.name: w.pid for w in client.status().workers}[name]
            path = "standby" if new_pid == spare else "fresh process"
            out.append({"worker": name, "restart_s": round(elapsed, 3), "replaced_by": path})
    result = json.loads(background.communicate()[0])
    lost = result["sent"] - result["answered"]
    out.append(
        {
            "background_sent": result["sent"],
            "background_lost": lost,
            "background_statuses": result["statuses"],
        }
    )
    return out


def print_table(rows: list[dict[str, Any]], restarts: list[dict[str, Any]]) -> None:
    head = f"{'load':<16}{'sent':>6}{'ok/s':>8}{'p50 ms':>9}{'p99 ms':>9}{'p99.9 ms':>10}"
    print(head + f"{'lost':>6}  statuses")
    for r in rows:
        print(
            f"{r['load']:<16}{r['sent']:>6}{r['throughput_ok_per_s']:>8}{r['p50_ms']!s:>9}"
            f"{r['p99_ms']!s:>9}{r['p99_9_ms']!s:>10}{r['lost']:>6}  {r['statuses']}"
        )
    for r in restarts:
        if "worker" in r:
            print(
                f"restart after kill -9: {r['worker']} {r['restart_s'] * 1000:.0f} ms"
                f" ({r['replaced_by']})"
            )
        else:
            print(f"background load during kills: {r}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--socket", default=None, help="use a running daemon instead of starting one")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--model", default="", help="model file (default: the shipped model)")
    p.add_argument("--rates", default="2,5,10", help="Poisson rates, requests/s")
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--clients", type=int, default=2, help="client processes per load")
    p.add_argument("--kills", type=int, default=2, help="kill -9 rounds per worker")
    p.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "sd900" / "images"))
    p.add_argument("--json", default=str(ROOT / "docs" / "bench" / "serve-cpu.json"))
    p.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--pattern", default="poisson", help=argparse.SUPPRESS)
    p.add_argument("--rate", type=float, default=10.0, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--grace", type=float, default=8.0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.client:
        print(json.dumps(asyncio.run(run_client(args))))
        return
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="sdbench-", dir="/tmp") as tmp:
        proc, sock = (
            (None, args.socket)
            if args.socket
            else start_daemon(args.workers, args.model, Path(tmp))
        )
        try:
            rows = [run_load(args, sock, "poisson", float(r)) for r in args.rates.split(",")]
            rows.append(run_load(args, sock, "burst", 0.0))
            restarts = measure_restarts(args, sock) if args.kills > 0 else []
        finally:
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)
    print_table(rows, restarts)
    doc = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            # other work on the machine shares the cores: numbers are only comparable at a
            # similar load
            "loadavg_1m_before": round(load_before[0], 2),
            "loadavg_1m_after": round(os.getloadavg()[0], 2),
        },
        "daemon": {
            "backend": "cpu",
            "workers": args.workers,
            "duration_s": args.duration,
            "clients": args.clients,
            "images": "SD-900 200x200 PNG (encoded)",
        },
        "loads": rows,
        "restarts": restarts,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
