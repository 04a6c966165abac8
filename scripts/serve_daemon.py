"""The daemon under ``bench_serve.py``: started with the benchmark's config, waited for until
every worker (and warm standby) is READY, its workers killed and their replacements timed."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from scratchd.client.api import Client
from scratchd.protocol.wire import StatusReply

SERVE = [sys.executable, "-c", "from scratchd.daemon.cli import main; main()", "serve"]


def start_daemon(args: argparse.Namespace, tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    sock = str(tmp / "bench.sock")
    log = (tmp / "serve.log").open("wb")
    config = tmp / "bench.toml"
    text = f'[server]\nhealth_port = 0\nmetrics_port = 0\n[model]\npath = "{args.model}"\n'
    if args.views:  # model.views: the test-time views the workers run (default: the model's)
        text += f"views = {json.dumps(args.views.split(','))}\n"
    if args.size:
        slot_bytes = max(64, args.size * args.size)
        text += f"[queue]\nslots = {args.slots}\nslot_bytes = {slot_bytes}\n"
        text += f"max_batch = {args.max_batch}\n"
    if args.gpus != "all":  # one worker per listed card (the multi-GPU scaling run)
        text += f"[workers]\ngpus = [{args.gpus}]\n"
    config.write_text(text)
    cmd = [*SERVE, "--config", str(config), "--backend", args.backend, "--socket", sock]
    if args.backend == "cpu":
        cmd += ["--workers", str(args.workers)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=log)
    wait_ready(sock, proc, spares=True)
    return proc, sock


def ready(
    status: StatusReply, restarts: dict[str, int] | None = None, spares: bool = False
) -> bool:
    """The daemon serves with every worker READY (each named one restarted at least as many
    times as asked), and with ``spares`` every warm standby READY too: one per card for a
    CUDA pool, one for a CPU pool. The supervisor starts the standbys once the pool is READY,
    and a GPU standby captures and times its graphs on the card the pool serves from, so a
    load started before they are READY measures their warm-up as well."""
    by_name = {w.name: w for w in status.workers}
    serving = status.state == "serving" and all(w.state == "ready" for w in status.workers)
    if not serving or any(by_name[n].restarts < k for n, k in (restarts or {}).items()):
        return False
    want = len(status.workers) if status.backend == "cuda" else 1
    return not spares or sum(s.state == "ready" for s in status.standbys) >= want


def wait_ready(
    sock: str,
    proc: subprocess.Popen[bytes] | None,
    restarts: dict[str, int] | None = None,
    spares: bool = False,
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
        if ready(status, restarts, spares):
            return
        time.sleep(0.005)
    what = "daemon (and its warm standbys)" if spares else "daemon"
    raise SystemExit(f"{what} not ready after 120 s")


def kill_worker(sock: str, name: str) -> tuple[dict[str, Any], float]:
    """SIGKILL worker ``name``; time until status shows its replacement READY. Also returns
    when it was killed (CLOCK_MONOTONIC)."""
    with Client(sock, timeout=5) as client:
        status = client.status()
    current = {w.name: w for w in status.workers}[name]
    spares = {s.pid for s in status.standbys if s.state == "ready"}
    os.kill(current.pid, signal.SIGKILL)
    t0 = time.monotonic()
    wait_ready(sock, None, {name: current.restarts + 1})
    elapsed = time.monotonic() - t0
    with Client(sock, timeout=5) as client:
        new_pid = {w.name: w.pid for w in client.status().workers}[name]
    path = "standby" if new_pid in spares else "fresh process"
    return {"worker": name, "restart_s": round(elapsed, 3), "replaced_by": path}, t0


def worker_names(sock: str) -> list[str]:
    with Client(sock, timeout=5) as client:
        return sorted(w.name for w in client.status().workers)


def daemon_ports(sock: str) -> tuple[int, int]:
    """The daemon's /metrics port and its main process id."""
    with Client(sock, timeout=5) as client:
        status = client.status()
    return status.metrics_port, status.pid
