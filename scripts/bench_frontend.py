"""What the daemon's front end sustains: client → Unix socket → acceptor → shared memory → reply,
with a worker that computes nothing, so the main process's own cost is what is measured.

    python scripts/bench_frontend.py                         # 1024x1024 and 16x16 raw frames
    python scripts/bench_frontend.py --sizes 1024 --duration 5 --clients 2 --window 16 \\
        --json docs/bench/frontend.json
    python scripts/bench_frontend.py --sizes 1024 --accounting            # + the daemon's metrics
    python scripts/bench_frontend.py --sizes 1024 --accounting --rate 1000 # open loop, 1000 req/s
    python scripts/bench_frontend.py --sizes 1024 --accounting --profile /tmp/fe.pstats
    python scripts/bench_frontend.py --sizes 1024 --receive-threads 0     # pixels on the loop
    python scripts/bench_frontend.py --sizes 1024 --paths socket,region --repeats 5 \
        --json docs/bench/frontend-zero-copy.json  # frames vs a registered region, alternating

``--paths``: ``socket`` sends each frame's pixels through the socket; ``region`` registers a
memfd ring per client connection (``client/regions.py``) and each request names its slot; the
acceptor queues it naming the region (workers read grey pixels in place), copying nothing.
With several paths and ``--repeats`` the runs alternate (socket, region, socket, ...) so that
a change in the machine's load falls on both; the summary gives each path's median, min and
max.

This process runs the front end exactly as the daemon wires it (``Acceptor`` +
``Dispatcher`` + ``RequestQueue`` on uvloop) and nothing else, so its CPU time
(``getrusage(RUSAGE_SELF)``, every thread) over a load divided by the replies is the main
process's CPU per request. ``--accounting`` adds what the daemon does per reply on top
(``Daemon.account``: its reply counter, then ``Observability.account``: counters, latency
window, queue wait, batch de-duplication, drift and entropy, with the shipped model's drift
reference); without it no reply is accounted. A stub worker process (``--stub-worker``)
claims batches of up to 16 and completes each claim at once with an ``ok`` result and no
mask (with ``--accounting``, a result as a real worker writes it: the batch's size and
compute time, an entropy and the 64-bin input histogram).

Client processes (``--clients``) each keep ``--window`` raw frames in flight on one
connection (closed loop: this measures capacity, not latency) or, with ``--rate``, send
Poisson arrivals at that total rate whatever the replies do (open loop, as ``bench_serve``
loads the daemon: each frame then tends to arrive, and its completion to ring, on its own
turn of the loop). Frames are real-image mosaics built as ``bench_serve`` builds them. Big
frames against tiny ones separates the cost per byte from the cost per request.
``client_cpu_us_per_request`` (the client processes' CPU, from ``RUSAGE_CHILDREN``) says how
many client processes a load generator needs for a rate.

``--receive-threads`` is ``[server] receive_threads`` (large frames' pixels received by that
many threads; 0: by the loop). The main process's CPU is split per thread: ``loop`` (the event
loop's thread, ``time.thread_time``), and from ``/proc/self/task/*/stat`` (10 ms ticks) the
``receive`` threads and every ``other`` thread (the decode pool, ...). ``latency_ms`` are the
clients' percentiles, send to reply (the closed loop's include waiting behind the window).

``--slow K`` adds one process with K connections that each send their frames (the same
mosaics, one after another, replies read as they come) in ``--slow-chunk`` byte pieces
``--slow-pause-ms`` apart: senders slow to push the rest of a frame, as a starved or
throttled client is. The ``--clients`` (say one, open loop at a modest ``--rate``) are then
the fast senders whose latency says whether slow ones hold up the others' frames (a convoy in
the receive threads: the fast latency growing with K only with ``--receive-threads`` > 0);
``slow.requests_per_s`` is what the slow ones got through::

    python scripts/bench_frontend.py --sizes 1024 --clients 1 --rate 100 --slow 8
    python scripts/bench_frontend.py --sizes 1024 --clients 1 --rate 100 --slow 8 --max-wait-ms 20

(``--max-wait-ms``: how long a receive job may wait for bytes not yet sent; the pool's own is
0. ``receive_jobs_per_request`` counts jobs over all frames, the slow ones included.)

``--profile PATH`` runs the first size under cProfile (the loop's Python side; the numbers
it prints are inflated by the profiler) and writes the pstats there; the kernel's side
(recv copies, skb frees) needs ``perf record -g -p <pid>`` on this process. On a shared
machine these numbers move with the load: ``bench_frontend_loop.py`` measures the loop's
own user-space CPU without sockets, and ``docs/bench/frontend.json`` has alternating rounds of
``--receive-threads 0`` and ``4`` (its ``history``: both, before and after receiving large raw
frames straight into their slot, with a perf breakdown).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import cProfile
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import serve_load as sl
from frontend_clients import closed_loop, open_loop, slow_senders

from scratchd.daemon.config import Config, QueueConfig, ServerConfig
from scratchd.daemon.frontend.acceptor import Acceptor
from scratchd.daemon.frontend.dispatch import Accountant, Dispatcher, InFlight
from scratchd.daemon.ops.observability import Observability, read_model_reference
from scratchd.ipc.queue import Completion, Geometry, RequestQueue, Result, Status
from scratchd.protocol import wire

ROOT = Path(__file__).resolve().parent.parent


# ---- the stub worker ----------------------------------------------------------------------


def stub_worker(args: argparse.Namespace) -> None:
    queue = RequestQueue.attach(args.queue, completion_fd=args.done_fd, work_fd=args.work_fd)
    queue.register_worker(0, os.getpid())
    histogram: np.ndarray | None = None
    while True:
        if not queue.wait_for_work(0, 0.5):
            if os.getppid() == 1:
                return
            continue
        claims = queue.claim_batch(0, 16, time.monotonic_ns())
        ok = Result(Status.OK, score=0.0, batch_size=1)
        if args.full_results and claims:
            if histogram is None:  # the first frame's, once: the stub must stay cheap
                pixels = queue.input_view(claims[0])
                histogram = np.bincount(pixels.ravel() >> 2, minlength=64).astype(np.uint32)
            ok = Result(
                Status.OK, score=0.1, entropy=0.25, histogram=histogram,
                compute_ns=1_000_000, batch_size=len(claims),
            )  # fmt: skip
        for claim in claims:
            queue.complete(0, claim, ok)


# ---- the front end ------------------------------------------------------------------------


def status_reply(request_id: int) -> wire.StatusReply:
    depth = wire.QueueStatus(depth=[0] * 8, slots=0, in_use=0, in_flight=0)
    return wire.StatusReply(request_id, "serving", os.getpid(), 0.0, "stub", [], depth)


def fault_in_slots(queue: RequestQueue, slots: int) -> None:
    """Touch every payload slot once, as a daemon that has served a while has: a slot's
    first use costs its page faults, which a short run would
    otherwise charge to the requests that happen to use each slot first."""
    handles = [queue.reserve() for _ in range(slots)]
    for h in handles:
        assert h is not None
        np.frombuffer(queue.payload(h), np.uint8)[:] = 0
    for h in handles:
        assert h is not None
        queue.release(h)


def daemon_accounting(config: Config) -> Accountant:
    """What ``Daemon.account`` does with every reply: count it, then hand it to
    ``Observability.account`` (wired as ``daemon/app.py`` wires it, listeners aside)."""
    obs = Observability(config, read_model_reference(config.model.path), ["cpu"], ["ready"])
    replies: collections.Counter[str] = collections.Counter()

    def account(flight: InFlight, reply: wire.Reply, completion: Completion | None) -> None:
        replies[reply.status] += 1
        obs.account(flight, reply, completion)

    return account


def thread_ticks() -> dict[int, int]:
    """CPU ticks (user + system) of each thread of this process, by kernel thread id."""
    ticks = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        ticks[int(task.name)] = int(fields[11]) + int(fields[12])  # utime, stime
    return ticks


def split_threads(
    before: dict[int, int], after: dict[int, int], receivers: set[int]
) -> dict[str, float]:
    """Seconds of CPU per kind of thread between two ``thread_ticks``: the event loop's
    (this process's main thread), the receive threads', the others'."""
    split = {"loop": 0.0, "receive": 0.0, "other": 0.0}
    hz = os.sysconf("SC_CLK_TCK")
    for tid, ticks in after.items():
        kind = "loop" if tid == os.getpid() else "receive" if tid in receivers else "other"
        split[kind] += (ticks - before.get(tid, 0)) / hz
    return split


def percentiles(latencies: list[float]) -> dict[str, float | None]:
    if not latencies:
        return {}
    values = np.asarray(latencies, np.float64)
    quantiles = (("p50", 50), ("p90", 90), ("p99", 99), ("p99.9", 99.9))
    return {**{k: sl.percentile(values, q) for k, q in quantiles}, "max": round(max(latencies), 2)}


def no_accounting(flight: InFlight, reply: wire.Reply, completion: Completion | None) -> None:
    return None


async def measure(
    args: argparse.Namespace, size: int, tmp: Path, profile: cProfile.Profile | None,
    path: str = "socket",
) -> dict[str, Any]:  # fmt: skip
    frames_path = tmp / f"frames-{size}.npy"
    np.save(frames_path, sl.build_frames(sl.image_paths(Path(args.data)), size, 16, 0))
    slots = max(args.clients * args.window + 16, 256)  # open loop: room for a backlog
    config = Config(
        server=ServerConfig(socket=str(tmp / "fe.sock"), receive_threads=args.receive_threads),
        queue=QueueConfig(slots=slots, slot_bytes=max(64, size * size)),
    )
    queue = RequestQueue.create(f"/sdbench-fe-{os.getpid()}-{size}", Geometry(slots, size * size))
    fault_in_slots(queue, slots)
    account = daemon_accounting(config) if args.accounting else no_accounting
    dispatcher = Dispatcher(queue, 1_000_000, account, lambda _: "stub")
    dispatcher.start()
    acceptor = Acceptor(config, queue, dispatcher, status_reply)
    await acceptor.listen(config.server.socket)
    if acceptor.receiver is not None and args.max_wait_ms is not None:
        acceptor.receiver.max_wait_s = args.max_wait_ms / 1e3
    jobs_before = acceptor.receiver.jobs if acceptor.receiver else 0
    worker = spawn_stub(queue, args.accounting)
    try:
        if profile is not None:
            profile.enable()
        before, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        kids_before = resource.getrusage(resource.RUSAGE_CHILDREN)
        ticks_before, loop_before = thread_ticks(), time.thread_time()
        slow = [spawn_slow(args, config.server.socket, frames_path)] if args.slow else []
        clients = [
            spawn_client(args, config.server.socket, frames_path, path) for _ in range(args.clients)
        ]
        outs = [await asyncio.to_thread(p.communicate) for p in clients]
        slow_outs = [await asyncio.to_thread(p.communicate) for p in slow]
        if any(p.returncode for p in clients + slow):
            raise SystemExit("a client process failed (its error is above)")
        wall = time.perf_counter() - t0
        loop_cpu, ticks_after = time.thread_time() - loop_before, thread_ticks()
        after = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)  # the clients, reaped; not the stub
        receivers = set(acceptor.receiver.native_ids()) if acceptor.receiver else set()
        jobs = (acceptor.receiver.jobs if acceptor.receiver else 0) - jobs_before
    finally:
        if profile is not None:
            profile.disable()
        worker.kill()
        worker.wait()
        acceptor.stop_listening()
        await acceptor.close_connections()
        dispatcher.stop()
        queue.close()
    statuses: dict[str, int] = {}
    latencies: list[float] = []
    for out, _ in outs:
        result = json.loads(out)
        if result["region"] != (path == "region"):
            raise SystemExit(f"a client did not use the {path} path")
        for k, v in result["statuses"].items():
            statuses[k] = statuses.get(k, 0) + v
        latencies += result["latencies_ms"]
    replies = sum(statuses.values())
    slow_statuses: dict[str, int] = {}
    for out, _ in slow_outs:
        slow_statuses = json.loads(out)["statuses"]
    slow_replies = sum(slow_statuses.values())
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    split = split_threads(ticks_before, ticks_after, receivers)
    per_request = {k: round(v / max(replies, 1) * 1e6, 1) for k, v in split.items()}
    return {
        "size": size,
        "path": path,
        "frame_bytes": size * size,
        "accounting": args.accounting,
        "rate": args.rate or None,
        "receive_threads": args.receive_threads,
        "max_wait_ms": args.max_wait_ms,
        "replies": replies,
        "statuses": statuses,
        "requests_per_s": round(replies / wall, 1),
        "mib_per_s": round(replies * size * size / wall / 2**20, 1),
        "main_cpu_us_per_request": round(cpu / max(replies, 1) * 1e6, 1),
        "main_cpu_share": round(cpu / wall, 3),
        "loop_cpu_us_per_request": round(loop_cpu / max(replies, 1) * 1e6, 1),
        "loop_cpu_share": round(loop_cpu / wall, 3),
        "thread_cpu_us_per_request": per_request,  # /proc ticks: loop, receive, other
        "latency_ms": percentiles(latencies),
        "receive_jobs_per_request": round(jobs / max(replies + slow_replies, 1), 2),
        "slow": {
            "senders": args.slow,
            "chunk_bytes": args.slow_chunk,
            "pause_ms": args.slow_pause_ms,
            "statuses": slow_statuses,
            "requests_per_s": round(slow_replies / wall, 1),
        },
        "client_cpu_us_per_request": round(
            (kids.ru_utime - kids_before.ru_utime + kids.ru_stime - kids_before.ru_stime)
            / max(replies, 1)
            * 1e6,
            1,
        ),
        "main_user_s": round(after.ru_utime - before.ru_utime, 3),
        "main_sys_s": round(after.ru_stime - before.ru_stime, 3),
        "wall_s": round(wall, 2),
    }


def spawn_stub(queue: RequestQueue, full_results: bool) -> subprocess.Popen[bytes]:
    done, work = queue.completion_fd, queue.work_fd(0)
    cmd = [sys.executable, __file__, "--stub-worker", "--queue", queue.name]
    cmd += ["--done-fd", str(done), "--work-fd", str(work)]
    cmd += ["--full-results"] if full_results else []
    return subprocess.Popen(cmd, pass_fds=(done, work))


def spawn_slow(args: argparse.Namespace, sock: str, frames: Path) -> subprocess.Popen[str]:
    cmd = [sys.executable, __file__, "--slow-client", "--socket", sock, "--frames", str(frames)]
    cmd += ["--duration", str(args.duration), "--slow", str(args.slow)]
    cmd += ["--slow-chunk", str(args.slow_chunk), "--slow-pause-ms", str(args.slow_pause_ms)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


def spawn_client(
    args: argparse.Namespace, sock: str, frames: Path, path: str
) -> subprocess.Popen[str]:
    cmd = [sys.executable, __file__, "--client", "--socket", sock, "--frames", str(frames)]
    cmd += ["--path", path]
    cmd += ["--duration", str(args.duration), "--window", str(args.window)]
    cmd += ["--rate", str(args.rate / args.clients)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


async def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="sdfe-", dir="/tmp") as tmp:
        for k, size in enumerate(args.sizes.split(",")):
            for repeat in range(args.repeats):
                for path in args.paths.split(","):
                    first = k == 0 and repeat == 0 and path == args.paths.split(",")[0]
                    profile = (
                        cProfile.Profile(time.thread_time_ns, 1e-9)
                        if args.profile and first
                        else None
                    )
                    rows.append(await measure(args, int(size), Path(tmp), profile, path))
                    if profile is not None:
                        report_profile(profile, args.profile, rows[-1]["replies"])
    return rows


def report_profile(profile: cProfile.Profile, path: str, replies: int) -> None:
    """Write the pstats to ``path`` and print the top functions by own time, per reply."""
    import pstats

    profile.dump_stats(path)
    stats: dict[Any, Any] = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:25]
    print(f"cProfile, per reply ({replies} replies; profiler overhead included):")
    print(f"{'own us':>8}{'cum us':>8}{'calls':>8}  function")
    for (file, line, name), (_, calls, own, cum, _) in rows:
        where = f"{Path(file).name}:{line}({name})" if line else name
        print(
            f"{own / replies * 1e6:8.1f}{cum / replies * 1e6:8.1f}{calls / replies:8.2f}  {where}"
        )


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per size and path ("1024/region"): the main process's CPU per request over the runs."""
    runs: dict[str, list[float]] = collections.defaultdict(list)
    for r in rows:
        runs[f"{r['size']}/{r['path']}"].append(r["main_cpu_us_per_request"])
    return {
        key: {"median": float(np.median(v)), "min": min(v), "max": max(v), "runs": len(v)}
        for key, v in runs.items()
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="1024,16")
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--window", type=int, default=16, help="requests in flight per client")
    p.add_argument("--rate", type=float, default=0.0, help="open loop: total req/s (0: closed)")
    p.add_argument("--accounting", action="store_true", help="the daemon's per-reply metrics")
    p.add_argument(
        "--receive-threads", type=int, default=ServerConfig().receive_threads,
        help="[server] receive_threads (0: large frames' pixels received on the loop)",
    )  # fmt: skip
    p.add_argument("--slow", type=int, default=0, help="connections sending frames slowly")
    p.add_argument("--slow-chunk", type=int, default=64 * 1024, help="--slow: bytes a piece")
    p.add_argument("--slow-pause-ms", type=float, default=2.0, help="--slow: between pieces")
    p.add_argument(
        "--max-wait-ms", type=float, default=None,
        help="the receive pool's max_wait_s, in ms (default: the pool's own, 0)",
    )  # fmt: skip
    p.add_argument("--paths", default="socket", help="socket, region, or both: socket,region")
    p.add_argument("--repeats", type=int, default=1, help="runs of each size and path")
    p.add_argument("--path", default="socket", help=argparse.SUPPRESS)  # a client's
    p.add_argument("--profile", default="", help="cProfile the first size into this file")
    p.add_argument("--data", default=str(ROOT.parent / "shared" / "data"))
    p.add_argument("--json", default=None)
    p.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--slow-client", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--stub-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--socket", default="", help=argparse.SUPPRESS)
    p.add_argument("--frames", default="", help=argparse.SUPPRESS)
    p.add_argument("--queue", default="", help=argparse.SUPPRESS)
    p.add_argument("--done-fd", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--work-fd", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--full-results", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.stub_worker:
        stub_worker(args)
        return
    import uvloop

    if args.slow_client:
        print(json.dumps(uvloop.run(slow_senders(args))))
        return
    if args.client:  # open loop on uvloop: asyncio's 3.11 transport copies its whole send
        # buffer on every partial send, and an open-loop client's buffer grows with the rate
        # (the closed-loop client keeps asyncio, as the numbers recorded so far were taken)
        if args.rate > 0:
            print(json.dumps(uvloop.run(open_loop(args))))
        else:
            print(json.dumps(asyncio.run(closed_loop(args))))
        return

    load_before = os.getloadavg()[0]
    rows = uvloop.run(run_all(args))
    head = f"{'size':>6}{'path':>8}{'req/s':>10}{'MiB/s':>9}{'CPU us/req':>12}{'CPU share':>11}"
    head += f"{'loop us/req':>13}{'recv us/req':>13}{'loop share':>12}"
    print(head + f"{'client us/req':>15}{'p50 ms':>9}{'p99 ms':>9}{'slow req/s':>12}  statuses")
    for r in rows:
        lat = r["latency_ms"]
        print(
            f"{r['size']:>6}{r['path']:>8}{r['requests_per_s']:>10}{r['mib_per_s']:>9}"
            f"{r['main_cpu_us_per_request']:>12}{r['main_cpu_share']:>11}"
            f"{r['loop_cpu_us_per_request']:>13}{r['thread_cpu_us_per_request']['receive']:>13}"
            f"{r['loop_cpu_share']:>12}{r['client_cpu_us_per_request']:>15}"
            f"{lat.get('p50', 0):>9}{lat.get('p99', 0):>9}{r['slow']['requests_per_s']:>12}"
            f"  {r['statuses']}"
        )
    summary = summarize(rows)
    for key, spread in summary.items():
        print(f"main CPU us/request {key}: median {spread['median']} (min {spread['min']}, "
              f"max {spread['max']}) over {spread['runs']} runs")  # fmt: skip
    load = {"loadavg_1m_before": round(load_before, 2), "loadavg_1m_after": os.getloadavg()[0]}
    print(f"load average {load}")
    if args.json:
        doc = {"machine": {"cpus": os.cpu_count(), **load}, "clients": args.clients,
               "window": args.window, "rate": args.rate or None, "accounting": args.accounting,
               "receive_threads": args.receive_threads, "slow": args.slow,
               "duration_s": args.duration, "paths": args.paths, "repeats": args.repeats,
               "main_cpu_us_per_request": summary, "rows": rows}  # fmt: skip
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
