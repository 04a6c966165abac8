"""perf_analyzer (Triton's load tool) against scratchd's Open Inference Protocol endpoint, over
HTTP and gRPC, beside the Unix socket at the same concurrency, all on one daemon.

    python scripts/bench_kserve.py --concurrency 1,2,4 --json docs/bench/kserve-cpu.json
    python scripts/bench_kserve.py --backend cuda --size 1024 --concurrency 1,4,16,64 \\
        --json docs/bench/kserve-gpu.json          # on the H200

Every run is closed-loop at a fixed concurrency with the same real images (fixture photographs,
resized to ``--size`` when given): perf_analyzer with ``--input-data`` (a JSON file of the
images, raw UINT8) on each transport, and the Python ``AsyncClient`` keeping as many requests
in flight on the Unix socket. Each run is repeated ``--repeats`` times (the spread is
reported). Besides throughput and latency, the daemon's main process CPU (utime + stime from
/proc) per request, so the endpoint's cost is stated next to the Unix socket's. Prints a
table; ``--json`` writes every run.

perf_analyzer is the binary the ``tritonclient`` 2.41 wheel ships; it links libcudart (the
``nvidia-cuda-runtime-cu12`` wheel, put on LD_LIBRARY_PATH here) and Debian's libb64-0d.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import csv
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from scratchd.client.api import AsyncClient
from scratchd.protocol.image import decode_image

ROOT = Path(__file__).resolve().parent.parent
SERVE = [sys.executable, "-c", "from scratchd.daemon.cli import main; main()", "serve"]


def perf_analyzer_env() -> dict[str, str]:
    """The environment perf_analyzer runs in: libcudart from its wheel on the library path."""
    env = dict(os.environ)
    try:
        import nvidia.cuda_runtime as runtime  # the nvidia-cuda-runtime-cu12 wheel

        lib = str(Path(next(iter(runtime.__path__))) / "lib")
        env["LD_LIBRARY_PATH"] = ":".join(p for p in (lib, env.get("LD_LIBRARY_PATH")) if p)
    except ImportError:
        pass
    return env


def perf_analyzer_problem() -> str | None:
    """Why perf_analyzer cannot run here (missing, or its libraries), or None."""
    binary = shutil.which("perf_analyzer") or str(Path(sys.executable).with_name("perf_analyzer"))
    if not Path(binary).exists():
        return "perf_analyzer is not installed (pip install tritonclient==2.41.0)"
    run = subprocess.run(
        [binary, "--version"], capture_output=True, text=True, env=perf_analyzer_env(), check=False
    )
    if run.returncode != 0:
        return f"perf_analyzer does not run: {(run.stderr or run.stdout).strip()}"
    return None


def perf_analyzer_binary() -> str:
    return shutil.which("perf_analyzer") or str(Path(sys.executable).with_name("perf_analyzer"))


def images(size: int, count: int) -> list[np.ndarray]:
    paths = sorted((ROOT / "tests/fixtures/data/sd900/images").glob("*.png"))[:count]
    frames = [decode_image(p.read_bytes()) for p in paths]
    if size:
        frames = [np.asarray(Image.fromarray(f).resize((size, size))) for f in frames]
    return frames


def write_input_data(frames: list[np.ndarray], path: Path) -> Path:
    """perf_analyzer's --input-data file: one entry per image, raw bytes in base64."""
    entries = [
        {"image": {"b64": base64.b64encode(f.tobytes()).decode(), "shape": list(f.shape)}}
        for f in frames
    ]
    path.write_text(json.dumps({"data": entries}))
    return path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_daemon(
    args: argparse.Namespace, tmp: Path
) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    sock, http, grpc = str(tmp / "s.sock"), free_port(), free_port()
    slot_bytes = max(1 << 18, args.size * args.size)
    config = tmp / "bench.toml"
    config.write_text(
        f'[server]\nsocket = "{sock}"\nhealth_port = 0\nmetrics_port = 0\n'
        f"[queue]\nslots = 256\nslot_bytes = {slot_bytes}\n"
        f'[workers]\nbackend = "{args.backend}"\ncpu_workers = {args.workers}\n'
        # closed loop on a shared machine: a deadline no run reaches, so every answer is `ok`
        "[classes.normal]\ndeadline_ms = 600000\n"
        f"[kserve]\nhttp_port = {http}\ngrpc_port = {grpc}\n"
    )
    log = (tmp / "serve.log").open("wb")
    proc = subprocess.Popen([*SERVE, "--config", str(config)], stdout=log, stderr=log)
    sys.path.insert(0, str(ROOT / "scripts"))
    from serve_daemon import wait_ready

    wait_ready(sock, proc, spares=True)
    return proc, {"socket": sock, "http": http, "grpc": grpc}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_perf_analyzer(
    args: argparse.Namespace, protocol: str, port: int, concurrency: int, data: Path, tmp: Path
) -> dict[str, Any]:
    report = tmp / f"pa-{protocol}-{concurrency}.csv"
    cmd = [
        perf_analyzer_binary(),
        *("-m", "scratchnet", "-i", protocol, "-u", f"127.0.0.1:{port}"),
        *("--input-data", str(data), "--concurrency-range", str(concurrency)),
        *("--measurement-mode", "count_windows"),
        *("--measurement-request-count", str(args.requests)),
        *("--stability-percentage", "100", "--max-trials", "3", "-f", str(report)),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, env=perf_analyzer_env(), check=False)
    if run.returncode != 0:
        raise RuntimeError(f"perf_analyzer failed:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
    with report.open() as f:
        row = next(csv.DictReader(f))
    return {
        "throughput": float(row["Inferences/Second"]),
        "p50_ms": float(row["p50 latency"]) / 1000,
        "p99_ms": float(row["p99 latency"]) / 1000,
    }


async def _unix_load(
    sock: str, frames: list[np.ndarray], concurrency: int, count: int
) -> list[float]:
    latencies: list[float] = []
    async with await AsyncClient.connect(sock) as client:

        async def lane(k: int) -> None:
            for n in range(k, count, concurrency):
                start = time.perf_counter()
                reply = await client.infer(frames[n % len(frames)])
                if reply.status != "ok":
                    raise RuntimeError(f"unix socket: {reply.status} {reply.error}")
                latencies.append(time.perf_counter() - start)

        await asyncio.gather(*(lane(k) for k in range(concurrency)))
    return latencies


def run_unix(
    args: argparse.Namespace, sock: str, concurrency: int, frames: list[np.ndarray]
) -> dict[str, Any]:
    count = max(args.requests * 3, concurrency * 4)
    start = time.perf_counter()
    latencies = asyncio.run(_unix_load(sock, frames, concurrency, count))
    elapsed = time.perf_counter() - start
    ms = np.asarray(latencies) * 1000
    return {
        "throughput": count / elapsed,
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "requests": count,
    }


def measure(
    args: argparse.Namespace, daemon: subprocess.Popen[bytes], ports: dict[str, Any], tmp: Path
) -> list[dict[str, Any]]:
    frames = images(args.size, args.images)
    data = write_input_data(frames, tmp / "input.json")
    runs = []
    for concurrency in [int(c) for c in args.concurrency.split(",")]:
        for transport in ("unix", "http", "grpc"):
            for repeat in range(args.repeats):
                before, served = cpu_seconds(daemon.pid), _served(ports["socket"])
                if transport == "unix":
                    result = run_unix(args, ports["socket"], concurrency, frames)
                else:
                    port = ports[transport]
                    result = run_perf_analyzer(args, transport, port, concurrency, data, tmp)
                requests = _served(ports["socket"]) - served
                result["main_cpu_us_per_request"] = (
                    (cpu_seconds(daemon.pid) - before) / max(requests, 1) * 1e6
                )
                result.update(transport=transport, concurrency=concurrency, repeat=repeat)
                runs.append(result)
                print(_row(result), flush=True)
    return runs


def _served(sock: str) -> int:
    from scratchd.client.api import Client

    with Client(sock, timeout=30) as client:
        return sum(client.status().requests.values())


def _row(r: dict[str, Any]) -> str:
    return (
        f"{r['transport']:<5} c={r['concurrency']:<3} #{r['repeat']}  "
        f"{r['throughput']:8.1f} req/s  p50 {r['p50_ms']:8.1f} ms  p99 {r['p99_ms']:8.1f} ms  "
        f"main CPU {r['main_cpu_us_per_request']:7.0f} µs/req"
    )


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (transport, concurrency): the median and the range over the repeats."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["transport"], r["concurrency"]), []).append(r)
    table = []
    for (transport, concurrency), rs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        row: dict[str, Any] = {"transport": transport, "concurrency": concurrency}
        for key in ("throughput", "p50_ms", "p99_ms", "main_cpu_us_per_request"):
            values = [r[key] for r in rs]
            row[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
        table.append(row)
    return table


def print_table(table: list[dict[str, Any]]) -> None:
    print("\n| transport | concurrency | req/s | p50 ms | p99 ms | main CPU µs/req |")
    print("|---|---|---|---|---|---|")
    for row in table:
        cells = [
            f"{row[k]['median']:.1f} ({row[k]['min']:.1f}-{row[k]['max']:.1f})"
            for k in ("throughput", "p50_ms", "p99_ms")
        ]
        cpu = row["main_cpu_us_per_request"]
        cpu_cell = f"{cpu['median']:.0f} ({cpu['min']:.0f}-{cpu['max']:.0f})"
        print(f"| {row['transport']} | {row['concurrency']} | {' | '.join(cells)} | {cpu_cell} |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--workers", type=int, default=2, help="CPU workers")
    p.add_argument("--size", type=int, default=0, help="resize images to SIZE x SIZE (0: 200x200)")
    p.add_argument("--images", type=int, default=8)
    p.add_argument("--concurrency", default="1,2,4")
    p.add_argument("--requests", type=int, default=40, help="requests per perf_analyzer window")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = perf_analyzer_problem()
    if problem:
        print(problem, file=sys.stderr)
        return 1
    tmp = Path(tempfile.mkdtemp(prefix="sd-kserve-", dir="/tmp"))
    daemon, ports = start_daemon(args, tmp)
    try:
        runs = measure(args, daemon, ports, tmp)
    finally:
        daemon.terminate()
        daemon.wait(60)
        shutil.rmtree(tmp, ignore_errors=True)
    table = summarize(runs)
    print_table(table)
    if args.json:
        record = {"command": " ".join(sys.argv), "args": vars(args), "table": table, "runs": runs}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
