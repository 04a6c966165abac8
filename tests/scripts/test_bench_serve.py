"""bench_serve's logic: when requests are sent, how rows are summarised and when the rate
stepping stops, where GPU busy time comes from, the frames, the record's schema and the
markdown section. (The load itself runs against a daemon: see the script's smoke command.)"""

from __future__ import annotations

import asyncio
import importlib
import json
import random
import sys
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

from scratchd.protocol.image import decode_image

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _script(name: str) -> ModuleType:
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    return importlib.import_module(name)


sl = _script("serve_load")
report = _script("serve_report")
bench = _script("bench_serve")
daemon = _script("serve_daemon")


# ---- schedules ----------------------------------------------------------------------------


@given(rate=st.floats(1.0, 5000.0), duration=st.floats(0.1, 5.0), seed=st.integers(0, 99))
def test_poisson_sends_are_ascending_inside_the_window_and_seeded(
    rate: float, duration: float, seed: int
) -> None:
    times = sl.schedule("poisson", duration, rate, seed)
    assert times == sorted(times)
    assert all(0.0 <= t < duration for t in times)
    assert times == sl.schedule("poisson", duration, rate, seed)


def test_poisson_sends_come_at_the_rate_asked() -> None:
    times = np.array(sl.schedule("poisson", 10.0, 2000.0, 7))
    assert abs(times.size - 20000) < 4 * np.sqrt(20000)  # 4 sigma of a Poisson count
    gaps = np.diff(times)
    assert abs(gaps.mean() - 1 / 2000) < 0.03 / 2000
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.05  # exponential: std = mean


def test_bursts_are_the_seed_pattern() -> None:
    times = sl.schedule("burst", 6.0, 0.0, 3, burst=23)
    assert len(times) == 3 * 23
    for cycle in range(3):
        inside = [t for t in times if 2.0 * cycle <= t < 2.0 * cycle + 2.0]
        assert len(inside) == 23
        assert all(t - 2.0 * cycle <= 0.3 for t in inside)


def test_a_bad_pattern_or_rate_is_refused() -> None:
    with pytest.raises(ValueError, match="pattern"):
        sl.schedule("steady", 1.0, 10.0, 0)
    with pytest.raises(ValueError, match="positive"):
        sl.schedule("poisson", 1.0, 0.0, 0)


# ---- summaries and stepping ---------------------------------------------------------------


def _client(sent: int, ok: list[float], late: list[float], **other: int) -> dict[str, Any]:
    statuses = {"ok": len(ok), **other}
    answered = sum(n for s, n in statuses.items() if s != "connection_lost")
    return {
        "sent": sent,
        "answered": answered,
        "statuses": statuses,
        "latencies_ms": ok,
        "lateness_ms": late,
        "elapsed_s": 2.0,
    }


def test_a_row_counts_what_was_lost_and_takes_percentiles_over_ok_replies() -> None:
    a = _client(60, [float(x) for x in range(1, 51)], [0.1] * 60, timeout=5)
    b = _client(50, [float(x) for x in range(51, 101)], [0.3] * 50, connection_lost=0)
    row = sl.summarize([a, b], duration=2.0)
    assert row["sent"] == 110
    assert row["lost"] == 110 - 105  # five never answered
    assert row["statuses"] == {"ok": 100, "timeout": 5, "connection_lost": 0}
    assert row["ok_share"] == round(100 / 110, 4)
    assert row["throughput"] == 50.0
    assert row["p50_ms"] == 50.5 and row["p99_ms"] == 99.01 and row["max_ms"] == 100.0
    assert row["late_p50_ms"] == 0.1 and row["late_max_ms"] == 0.3


def test_a_row_without_ok_replies_has_no_percentiles() -> None:
    row = sl.summarize([_client(10, [], [0.0] * 10, overloaded=10)], duration=1.0)
    assert row["p99_ms"] is None and row["lost"] == 0 and row["ok_share"] == 0.0
    assert not sl.meets(row, 1e9)


def _row(rate: float, p99: float, lost: int = 0, ok_share: float = 1.0) -> dict[str, Any]:
    return {"rate": rate, "p99_ms": p99, "lost": lost, "ok_share": ok_share}


def test_rates_run_as_listed_then_double_while_p99_holds() -> None:
    rates = [500.0, 1000.0]
    rows: list[dict[str, Any]] = []
    p99_at = {500.0: 3.0, 1000.0: 4.0, 2000.0: 9.0, 4000.0: 25.0}
    while rate := sl.next_rate(rates, rows, 20.0, 2.0, 64000.0):
        rows.append(_row(rate, p99_at[rate]))
    assert [r["rate"] for r in rows] == [500.0, 1000.0, 2000.0, 4000.0]  # 4000 broke 20 ms


def test_stepping_stops_at_a_loss_at_failures_and_at_the_cap() -> None:
    assert sl.next_rate([100.0], [_row(100.0, 1.0, lost=1)], 20.0, 2.0, 1e6) is None
    assert sl.next_rate([100.0], [_row(100.0, 1.0, ok_share=0.98)], 20.0, 2.0, 1e6) is None
    assert sl.next_rate([100.0], [_row(100.0, 1.0)], 20.0, 2.0, 150.0) is None
    assert sl.next_rate([100.0], [_row(100.0, 1.0)], None, 2.0, 1e6) is None  # no --until
    assert sl.next_rate([100.0], [_row(100.0, 1.0)], 20.0, 1.5, 1e6) == 150.0


def test_workers_are_killed_under_the_highest_rate_that_held() -> None:
    rows = [_row(500.0, 3.0), _row(1000.0, 9.0), _row(2000.0, 30.0), _row(4000.0, 90.0)]
    assert sl.sustained_rate(rows, 20.0) == 1000.0
    assert sl.sustained_rate(rows, None) == 4000.0  # nothing lost, all ok: every rate held
    rows[3]["lost"] = 2
    assert sl.sustained_rate(rows, None) == 2000.0
    assert sl.sustained_rate(rows, 1.0) == 500.0  # none held: the lowest rate run


# ---- readiness ----------------------------------------------------------------------------


def _status(backend: str, workers: list[tuple[str, str, int]], spares: list[str]) -> Any:
    from scratchd.protocol.wire import QueueStatus, StatusReply, WorkerStatus

    def worker(i: int, name: str, state: str, restarts: int) -> WorkerStatus:
        return WorkerStatus(
            id=i, name=name, pid=100 + i, state=state, device=backend, restarts=restarts
        )

    return StatusReply(
        id=1, state="serving", pid=1, uptime_s=1.0, backend=backend,
        workers=[worker(i, *w) for i, w in enumerate(workers)],
        queue=QueueStatus(depth=[0] * 8, slots=64, in_use=0, in_flight=0),
        standbys=[worker(9, f"standby{i}", st, 0) for i, st in enumerate(spares)],
    )  # fmt: skip


def test_the_first_load_waits_for_every_warm_standby_too() -> None:
    """A load that started before the standbys were READY would measure their warm-up (a GPU
    standby captures and times its graphs on the serving card): one per card for CUDA."""
    two_cards = [("cuda0", "ready", 0), ("cuda1", "ready", 0)]
    assert daemon.ready(_status("cuda", two_cards, []))  # workers only: as before
    assert not daemon.ready(_status("cuda", two_cards, []), spares=True)
    assert not daemon.ready(_status("cuda", two_cards, ["ready", "booting"]), spares=True)
    assert daemon.ready(_status("cuda", two_cards, ["ready", "ready"]), spares=True)
    cpu = [("cpu0", "ready", 0), ("cpu1", "ready", 0)]
    assert daemon.ready(_status("cpu", cpu, ["ready"]), spares=True)  # one for a CPU pool
    assert not daemon.ready(_status("cpu", [("cpu0", "booting", 0)], ["ready"]), spares=True)


def test_a_restart_is_ready_when_the_named_worker_restarted() -> None:
    st = _status("cuda", [("cuda0", "ready", 1)], [])
    assert daemon.ready(st, {"cuda0": 1}) and not daemon.ready(st, {"cuda0": 2})


# ---- GPU busy -----------------------------------------------------------------------------

METRICS = """# HELP scratchd_compute_seconds Compute time per batch.
# TYPE scratchd_compute_seconds histogram
scratchd_compute_seconds_bucket{device="cuda:0",le="0.001"} 3.0
scratchd_compute_seconds_sum{device="cuda:0"} 1.25
scratchd_compute_seconds_count{device="cuda:0"} 40.0
scratchd_compute_seconds_sum{device="cuda:1"} 0.5
scratchd_batch_size_sum{device="cuda:0"} 99.0
"""


def test_compute_seconds_are_read_per_device_from_the_metrics_page() -> None:
    assert sl.compute_seconds(METRICS) == {"cuda:0": 1.25, "cuda:1": 0.5}
    after = {"cuda:0": 3.25, "cuda:1": 0.5}
    assert sl.busy_share(sl.compute_seconds(METRICS), after, 4.0) == {"cuda:0": 0.5, "cuda:1": 0.0}


# ---- frames -------------------------------------------------------------------------------


def test_frames_are_mosaics_of_real_images_without_masks(data_dir: Path) -> None:
    paths = sl.image_paths(data_dir)
    assert not any("masks" in p.parts for p in paths)
    assert not any(p.suffix == ".png" and p.with_suffix(".jpg").exists() for p in paths)
    assert {p.suffix for p in paths} >= {".png", ".jpg"}  # SD-900 and magnetic tiles
    frames = sl.build_frames(paths, 64, 3, seed=5)
    assert frames.shape == (3, 64, 64) and frames.dtype == np.uint8
    first = random.Random(5).choice(paths)  # the seeded draw of the first cell
    grey = Image.fromarray(decode_image(first.read_bytes()))
    cell = grey.resize((16, 16), Image.Resampling.BILINEAR)
    assert np.array_equal(frames[0, :16, :16], np.asarray(cell))
    assert not np.array_equal(frames[0], frames[1])
    assert np.array_equal(frames, sl.build_frames(paths, 64, 3, seed=5))


def test_odd_frame_sizes_are_cropped_mosaics(data_dir: Path) -> None:
    frames = sl.build_frames(sl.image_paths(data_dir / "sd900"), 30, 1, seed=0)
    assert frames.shape == (1, 30, 30) and frames.std() > 0


# ---- the record and its section -----------------------------------------------------------


def _open_loop_row(rate: float) -> dict[str, Any]:
    row = sl.summarize([_client(10, [1.0] * 10, [0.0] * 10)], duration=1.0)
    return {"load": f"poisson@{rate:g}/s", "rate": rate, "size": 1024, **row}


def test_the_record_has_its_schema() -> None:
    rows = [_open_loop_row(500.0), _open_loop_row(1000.0)]
    burst = {**_open_loop_row(0.0), "load": "burst"}
    kill_row = {**_open_loop_row(2000.0), "lost": 0}
    kills = [{"worker": "gpu0", "restart_s": 0.0123, "replaced_by": "standby"}]
    doc = json.loads(
        json.dumps(bench.assemble_record("NVIDIA H200", rows, burst, kill_row, kills, 20.0))
    )
    assert isinstance(doc["device"], str) and doc["date"].endswith("Z")
    assert doc["restart_ms"] == [12.3] and doc["lost_under_kill"] == 0
    for row in doc["open_loop"]:
        for key in ("rate", "size", "p50_ms", "p99_ms", "p999_ms", "throughput", "lost"):
            assert key in row, key
        assert isinstance(row["lost"], int)


def _doc() -> dict[str, Any]:
    kill_row = {**_open_loop_row(2000.0), "load": "poisson@2000/s + kill -9"}
    kills = [{"worker": "gpu0", "restart_s": 0.02, "replaced_by": "standby"}]
    doc = bench.assemble_record(
        "NVIDIA H200",
        [_open_loop_row(500.0)],
        {**_open_loop_row(0.0), "load": "burst"},
        kill_row,
        kills,
        20.0,
    )
    machine = {"cpus": 16, "loadavg_1m_before": 0.1, "loadavg_1m_after": 0.2}
    daemon = {"backend": "cuda", "duration_s": 10.0, "clients": 8, "images": "mosaics"}
    return {"machine": machine, "daemon": daemon, **doc}


def test_the_markdown_section_is_replaced_in_place_and_nothing_else_moves(tmp_path: Path) -> None:
    md = tmp_path / "benchmarks.md"
    md.write_text("# Benchmarks\n\n<!-- other: start -->\nkeep\n<!-- other: end -->\n")
    section = report.record_markdown(_doc(), "docs/bench/serve-gpu.json")
    report.rewrite_section(md, section)
    first = md.read_text()
    assert first.startswith("# Benchmarks\n\n<!-- other: start -->\nkeep\n<!-- other: end -->\n")
    assert "| poisson@500/s |" in first and "gpu0 20 ms (standby)" in first
    report.rewrite_section(md, section.replace("poisson@500/s", "poisson@700/s"))
    second = md.read_text()
    assert second.count(report.markers()[0]) == 1 and "poisson@500/s" not in second
    assert second.replace("poisson@700/s", "poisson@500/s") == first


def test_the_cuda_command_line_defaults_to_the_recorded_load() -> None:
    args = bench.parse_args(["--backend", "cuda"])
    assert (args.size, args.rates, args.kill_rate) == (1024, "500,1000,2000,4000", None)
    assert args.json.endswith("docs/bench/serve-gpu.json")
    assert 2 <= args.clients <= 12
    cpu = bench.parse_args([])
    assert (cpu.size, cpu.rates, cpu.clients) == (None, "2,5,10", 2)
    assert cpu.json.endswith("serve-cpu.json")


def test_the_sender_hands_every_send_to_the_loop_in_order_and_never_early() -> None:
    offsets = sl.schedule("poisson", 0.3, 200.0, 11)
    calls: list[tuple[int, float, float]] = []

    class Loop:
        def call_soon_threadsafe(self, fn: Any, i: int, due: float) -> None:
            calls.append((i, due, time.perf_counter()))

    start = time.perf_counter() + 0.01
    sl.pace(offsets, start, Loop(), lambda i, due: None)
    assert [i for i, _, _ in calls] == list(range(len(offsets)))
    assert [due for _, due, _ in calls] == [start + at for at in offsets]
    assert all(at >= due for _, due, at in calls)


class CountingClient:
    """``AsyncClient`` for one connection that answers every request ``ok`` at once and
    counts them."""

    def __init__(self) -> None:
        self.requests = 0

    async def __aenter__(self) -> CountingClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass

    async def infer(self, image: Any) -> Any:
        self.requests += 1
        timings = SimpleNamespace(queue_ms=0.1, compute_ms=0.2, total_ms=0.5)
        return SimpleNamespace(status="ok", timings=timings)


def client_args(start_at: float) -> Any:
    return SimpleNamespace(
        socket="unused", path="region", pattern="poisson", rate=400.0, duration=0.25,
        seed=5, burst=23, grace=2.0, trace=True, start_at=start_at,
    )  # fmt: skip


@pytest.mark.parametrize("warmup_s", [0.0, 1.0])
def test_a_warm_up_sends_on_the_same_connection_and_only_the_measured_load_counts(
    monkeypatch: pytest.MonkeyPatch, warmup_s: float
) -> None:
    made: list[CountingClient] = []

    async def connect(path: str, zero_copy: bool = True) -> CountingClient:
        made.append(CountingClient())
        return made[-1]

    monkeypatch.setattr(sl.AsyncClient, "connect", connect)
    monkeypatch.setattr(sl, "load_payloads", lambda args: [np.zeros((8, 8), np.uint8)])
    start_at = time.perf_counter() + warmup_s if warmup_s else 0.0
    out = asyncio.run(sl.run_client(client_args(start_at)))
    measured = sl.schedule("poisson", 0.25, 400.0, 5)
    assert len(made) == 1  # one connection for both phases
    assert out["sent"] == out["answered"] == len(measured) == out["statuses"]["ok"]
    assert len(out["latencies_ms"]) == len(measured)
    if warmup_s:
        warm = sl.schedule("poisson", 1.0 - sl.WARM_STOP_S, 400.0, 6)  # at most this many
        assert len(measured) < made[0].requests <= len(measured) + len(warm)
        assert min(out["trace"]["due_s"]) >= start_at  # nothing sent to warm up is counted
    else:
        assert made[0].requests == len(measured)


def test_a_second_section_lives_beside_the_first(tmp_path: Path) -> None:
    md = tmp_path / "benchmarks.md"
    report.rewrite_section(md, report.record_markdown(_doc(), "a.json"))
    x2 = report.record_markdown(_doc(), "b.json", "bench_serve_gpu_x2")
    report.rewrite_section(md, x2, "bench_serve_gpu_x2")
    report.rewrite_section(md, x2, "bench_serve_gpu_x2")
    text = md.read_text()
    assert text.count("<!-- bench_serve_gpu: start -->") == 1
    assert text.count("<!-- bench_serve_gpu_x2: start -->") == 1
    assert "`a.json`" in text and "`b.json`" in text


def test_the_device_is_the_cards_in_use() -> None:
    h200 = ["NVIDIA H200", "NVIDIA H200"]
    assert bench.device_name("cuda", h200) == "2 x NVIDIA H200"
    assert bench.device_name("cuda", h200, "0") == "NVIDIA H200"
    assert bench.device_name("cpu", h200).startswith("cpu: ")


# ---- the kill run's timeline ---------------------------------------------------------------


def _traced(due: list[float], latency: list[float | None], status: list[str]) -> dict[str, Any]:
    return {"trace": {"due_s": due, "latency_ms": latency, "status": status}}


def test_the_timeline_bins_requests_by_when_they_were_due_across_clients() -> None:
    a = _traced([100.0, 100.2, 100.6], [1.0, 3.0, 50.0], ["ok", "ok", "ok"])
    b = _traced([100.1, 100.7, 101.2], [2.0, None, None], ["ok", "overloaded", ""])
    rows = sl.timeline([a, b], t0=100.0, bin_s=0.5)
    assert [r["t_s"] for r in rows] == [0.0, 0.5, 1.0]
    assert [r["sent"] for r in rows] == [3, 2, 1]
    assert rows[0]["statuses"] == {"ok": 3} and rows[0]["p50_ms"] == 2.0
    assert rows[0]["max_ms"] == 3.0
    assert rows[1]["statuses"] == {"ok": 1, "overloaded": 1} and rows[1]["p99_ms"] == 50.0
    # a request never answered counts as "none" and has no latency
    assert rows[2]["statuses"] == {"none": 1} and rows[2]["p50_ms"] is None


@given(
    due=st.lists(st.floats(0.0, 30.0), min_size=1, max_size=60),
    bin_s=st.sampled_from([0.25, 0.5, 1.0]),
)
def test_every_traced_request_lands_in_exactly_one_bin(due: list[float], bin_s: float) -> None:
    rows = sl.timeline([_traced(due, [1.0] * len(due), ["ok"] * len(due))], 0.0, bin_s)
    assert sum(r["sent"] for r in rows) == len(due)
    assert all(r["t_s"] == round(k * bin_s, 3) for k, r in enumerate(rows))


def _bin(t: float, p99: float | None, **statuses: int) -> dict[str, Any]:
    return {"t_s": t, "sent": sum(statuses.values()), "statuses": statuses, "p99_ms": p99}


def test_a_kill_is_over_at_the_end_of_the_first_normal_bin_after_it() -> None:
    timeline = [
        _bin(0.0, 8.0, ok=900),
        _bin(0.5, 300.0, ok=900),  # the kill at 0.6 s: requests due before it wait too
        _bin(1.0, 120.0, ok=800, overloaded=100),
        _bin(1.5, 12.0, ok=500, overloaded=1),  # one overloaded reply: not yet normal
        _bin(2.0, 14.0, ok=1000),
        _bin(2.5, 90.0, ok=1000),  # a later spike does not undo the recovery
    ]
    assert report.recovered_after(timeline, 0.6, 0.5) == 1.9
    assert report.recovered_after(timeline, 2.2, 0.5) is None  # nothing normal after it


def test_the_console_table_shows_the_timeline_and_each_kills_recovery(
    capsys: pytest.CaptureFixture[str],
) -> None:
    doc = _doc()
    doc["kill_run"]["timeline"] = [
        _bin(0.0, 5.0, ok=10),
        _bin(0.5, 40.0, ok=10),
        _bin(1.0, 6.0, ok=9),
    ]
    for b in doc["kill_run"]["timeline"]:
        b |= {"p50_ms": 1.0, "max_ms": 50.0}
    doc["kill_run"]["kills"][0]["at_s"] = 0.7
    doc["kill_run"]["timeline_bin_s"] = 0.5
    report.print_table(doc)
    out = capsys.readouterr().out
    assert "latency normal again after 0.8 s" in out
    assert out.count("<- kill -9") == 1
    assert "0.5     10  1/40/50  q None sb None  {'ok': 10} <- kill -9" in out
    assert "normal again after 0.8 s" in report.record_markdown(doc, "x.json")


@pytest.mark.parametrize("warmup_s", [0.0, 0.2])
def test_the_daemons_metrics_are_never_read_while_measured_requests_flow(
    monkeypatch: pytest.MonkeyPatch, warmup_s: float
) -> None:
    # A /metrics read lands on the daemon's event loop; with a warm-up the clients are
    # sending from its start, so the first read must come before they start.
    events: list[str] = []
    seconds = iter([10.0, 10.3])

    def scrape(port: int) -> dict[str, float]:
        events.append("scrape")
        return {"cuda": next(seconds)}

    def clients(*a: Any, **k: Any) -> list[str]:
        events.append("clients")
        return ["proc"]

    due = [time.perf_counter() + 0.01 * i for i in range(4)]
    result = {
        "sent": 4, "answered": 4, "statuses": {"ok": 4}, "latencies_ms": [1.0, 2.0, 3.0, 4.0],
        "lateness_ms": [0.1] * 4, "queue_ms": [0.2] * 4, "compute_ms": [0.5] * 4,
        "daemon_ms": [1.0] * 4, "elapsed_s": 0.5,
        "trace": {"due_s": due, "latency_ms": [1.0, 2.0, 3.0, 4.0], "status": ["ok"] * 4},
    }  # fmt: skip

    def collect(procs: list[str]) -> list[dict[str, Any]]:
        events.append("collect")
        return [result]

    class NoNvml:
        def __enter__(self) -> NoNvml:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def means(self) -> dict[str, float]:
            return {}

    monkeypatch.setattr(bench, "daemon_ports", lambda sock: (9999, 1))
    monkeypatch.setattr(bench, "start_clients", clients)
    monkeypatch.setattr(bench, "collect", collect)
    monkeypatch.setattr(bench, "CLIENT_START_S", 0.0)
    monkeypatch.setattr(sl, "scrape_compute", scrape)
    monkeypatch.setattr(sl, "NvmlSampler", NoNvml)
    monkeypatch.setattr(sl, "process_cpu_s", lambda pid: 0.0)
    args = SimpleNamespace(
        size=1024, warmup=warmup_s, duration=0.5, path="region", clients=2, burst=23
    )
    row = bench.run_load(args, "sock", "poisson", 2000.0)
    assert events == ["scrape", "clients", "collect", "scrape"]
    if warmup_s:
        assert row["warmup_s"] == warmup_s
        span = row["compute_busy_span_s"]
        assert span >= warmup_s  # the compute seconds cover the warm-up and the load
        # the recorded span is rounded to 0.01 s
        assert row["compute_busy"]["cuda"] == pytest.approx(0.3 / span, rel=0.05)
    else:
        assert "compute_busy_span_s" not in row
        assert row["compute_busy"] == {"cuda": round(0.3 / 0.5, 3)}
