"""The metrics registry: the docs/design.md table exactly, matching counts, promtool-clean text."""

from __future__ import annotations

import shutil
import subprocess
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

import scratchd
from scratchd.daemon.ops.metrics import DURATION_BUCKETS, STATUSES, Metrics

# docs/design.md, "Metrics": name -> (type, labels). The contract dashboards and alerts rely on.
TABLE = {
    "scratchd_requests_total": ("counter", {"part_class", "status"}),
    "scratchd_late_results_total": ("counter", {"part_class"}),
    "scratchd_request_duration_seconds": ("histogram", {"part_class"}),
    "scratchd_request_p99_seconds": ("gauge", {"part_class"}),
    "scratchd_queue_wait_seconds": ("histogram", {"priority"}),
    "scratchd_queue_depth": ("gauge", {"priority"}),
    "scratchd_batch_size": ("histogram", {"device"}),
    "scratchd_compute_seconds": ("histogram", {"device"}),
    "scratchd_model_output_entropy": ("gauge", set()),
    "scratchd_data_drift_score": ("gauge", set()),
    "scratchd_drift_warming_up": ("gauge", set()),
    "scratchd_workers": ("gauge", {"state"}),
    "scratchd_worker_restarts_total": ("counter", {"device"}),
    "scratchd_vram_fragmentation_ratio": ("gauge", {"device"}),
    "scratchd_build_info": ("gauge", {"version", "model"}),
}
PROCESS = {
    "process_cpu_seconds_total",
    "process_resident_memory_bytes",
    "process_virtual_memory_bytes",
    "process_open_fds",
    "process_max_fds",
    "process_start_time_seconds",
}
"""prometheus_client's standard process metrics (ProcessCollector, Linux)."""


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _families(metrics: Metrics) -> dict[str, tuple[str, list[tuple[str, dict[str, str], float]]]]:
    text = metrics.exposition().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        name = family.name + ("_total" if family.type == "counter" else "")
        out[name] = (family.type, [(s.name, s.labels, s.value) for s in family.samples])
    return out


def _busy_metrics() -> Metrics:
    m = Metrics(["safety", "normal"], ["cpu"])
    m.observe_reply("safety", "ok", total_s=0.012, priority=7, queue_wait_s=0.001)
    m.observe_reply("normal", "timeout", total_s=3.0, priority=0, queue_wait_s=3.0)
    m.observe_reply("nonsense", "invalid", total_s=0.0001)
    m.observe_batch(worker="cpu0", device="cpu", batch_key=(0, 1), batch_size=2, compute_s=0.02)
    m.sources.restarts = lambda: {"cpu": 1}
    m.sources.queue_depth = lambda: [4, 0, 0, 0, 0, 0, 0, 1]
    m.sources.worker_states = lambda: {"ready": 1, "starting": 1}
    m.sources.drift_score = lambda: 0.02
    m.sources.output_entropy = lambda: 0.11
    return m


def test_registry_is_exactly_the_design_table() -> None:
    families = _families(_busy_metrics())
    assert set(families) == set(TABLE) | PROCESS
    for name, (kind, labels) in TABLE.items():
        got_kind, samples = families[name]
        assert got_kind == kind, name
        for sample_name, sample_labels, _ in samples:
            assert set(sample_labels) - {"le"} == labels, (name, sample_name)
            assert not sample_name.endswith("_created")


def test_build_info_names_the_package_and_the_model_served() -> None:
    m = _busy_metrics()
    m.sources.model_version = lambda: "scratchnet-9"
    (sample,) = _families(m)["scratchd_build_info"][1]
    assert sample[1:] == ({"version": scratchd.__version__, "model": "scratchnet-9"}, 1.0)
    families = _families(m)
    samples = {name: families[name][1][0][2] for name in PROCESS}
    assert samples["process_resident_memory_bytes"] > 0 and samples["process_open_fds"] > 0


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_exposition_passes_promtool_check_metrics() -> None:
    m = _busy_metrics()
    m.sources.fragmentation = lambda: {"gpu0": 0.125}
    result = subprocess.run(
        ["promtool", "check", "metrics"],
        input=m.exposition(),
        capture_output=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["safety", "normal", "typo", ""]), st.sampled_from(STATUSES)),
        max_size=60,
    )
)
def test_request_counters_match_what_was_answered(replies: list[tuple[str, str]]) -> None:
    m = Metrics(["safety", "normal"])
    for part_class, status in replies:
        m.observe_reply(part_class, status, total_s=0.01)
    sent = Counter(
        (c if c in ("safety", "normal") else "other", s) for c, s in replies
    )  # unknown classes are folded into `other`, so a client cannot grow the label set
    _, samples = _families(m)["scratchd_requests_total"]
    got = {(s[1]["part_class"], s[1]["status"]): s[2] for s in samples}
    assert set(got) == {(c, s) for c in ("safety", "normal", "other") for s in STATUSES}
    for key, value in got.items():
        assert value == sent[key], key
    queued = sum(1 for _, s in replies if s in ("ok", "timeout", "error"))
    _, duration = _families(m)["scratchd_request_duration_seconds"]
    counts = sum(v for n, _, v in duration if n.endswith("_count"))
    assert counts == queued  # only requests that went through the queue have a duration


def test_unknown_status_is_a_bug_not_a_label() -> None:
    with pytest.raises(ValueError, match="status"):
        Metrics(["normal"]).observe_reply("normal", "maybe", total_s=0.1)


def test_duration_buckets_resolve_milliseconds_and_hit_the_deadlines() -> None:
    within_20ms = [b for b in DURATION_BUCKETS if 0.001 <= b <= 0.020]
    assert len(within_20ms) >= 7
    # The default class deadlines are bucket bounds: "slower than the deadline" is exact.
    assert 1.0 in DURATION_BUCKETS and 3.0 in DURATION_BUCKETS
    m = Metrics(["normal"])
    m.observe_reply("normal", "ok", total_s=0.0015)
    m.observe_reply("normal", "ok", total_s=0.0025)
    _, samples = _families(m)["scratchd_request_duration_seconds"]
    buckets = {
        s[1]["le"]: s[2]
        for s in samples
        if s[0].endswith("_bucket") and s[1]["part_class"] == "normal"
    }
    assert (buckets["0.001"], buckets["0.002"], buckets["0.003"]) == (0.0, 1.0, 2.0)


def test_p99_is_over_a_sliding_window_per_class() -> None:
    clock = FakeClock()
    m = Metrics(["safety", "normal"], window_s=60.0, clock=clock)
    for i in range(1, 101):
        m.observe_reply("safety", "ok", total_s=i / 1000)
    m.observe_reply("normal", "ok", total_s=2.0)
    p99 = m.p99_by_class()
    assert p99["safety"] == pytest.approx(0.09901)  # numpy's linear p99 of 1..100 ms
    assert p99["normal"] == 2.0
    assert m.latency_summary()["safety"]["p50_ms"] == pytest.approx(50.5)
    clock.now += 30
    m.observe_reply("safety", "ok", total_s=0.5)
    clock.now += 31  # the first 100 samples leave the window; the 0.5 s one stays
    assert m.p99_by_class() == {"safety": 0.5}
    _, samples = _families(m)["scratchd_request_p99_seconds"]
    assert [(s[1]["part_class"], s[2]) for s in samples] == [("safety", 0.5)]


def test_batches_are_counted_once_per_batch_not_per_request() -> None:
    m = Metrics(["normal"], ["cpu"])
    for _ in range(3):  # three completions of one batch of three
        m.observe_batch(
            worker="cpu1", device="cpu", batch_key=(1, 42), batch_size=3, compute_s=0.03
        )
    m.observe_batch(worker="cpu1", device="cpu", batch_key=(1, 43), batch_size=1, compute_s=0.01)
    _, samples = _families(m)["scratchd_batch_size"]
    assert {n: v for n, _, v in samples if not n.endswith("_bucket")} == {
        "scratchd_batch_size_count": 2.0,
        "scratchd_batch_size_sum": 4.0,
    }
    assert m.workers["cpu1"].summary() == {
        "batches": 2,
        "batch_size_mean": 2.0,
        "compute_ms_p50": 20.0,
    }


def test_a_batch_on_a_device_not_announced_gets_its_own_series_and_no_restart_count() -> None:
    m = Metrics(["normal"], ["cuda"])
    for key in range(3):
        m.observe_batch(worker="cuda1", device="cuda1", batch_key=(1, key), batch_size=4,
                        compute_s=0.001)  # fmt: skip
    _, samples = _families(m)["scratchd_batch_size"]
    counts = {s[1]["device"]: s[2] for s in samples if s[0] == "scratchd_batch_size_count"}
    assert counts == {"cuda": 0.0, "cuda1": 3.0}
    _, restarts = _families(m)["scratchd_worker_restarts_total"]
    assert {s[1]["device"] for s in restarts} == {"cuda"}


def test_fragmentation_is_absent_on_cpu_and_present_per_gpu() -> None:
    m = _busy_metrics()
    assert _families(m)["scratchd_vram_fragmentation_ratio"][1] == []
    m.sources.fragmentation = lambda: {"gpu0": 0.25, "gpu1": 0.0}
    samples = _families(m)["scratchd_vram_fragmentation_ratio"][1]
    assert sorted((s[1]["device"], s[2]) for s in samples) == [("gpu0", 0.25), ("gpu1", 0.0)]


def test_live_gauges_read_their_sources_at_scrape_time() -> None:
    m = _busy_metrics()
    fam = _families(m)
    depth = {s[1]["priority"]: s[2] for s in fam["scratchd_queue_depth"][1]}
    assert depth == {str(p): v for p, v in enumerate([4, 0, 0, 0, 0, 0, 0, 1])}
    assert {s[1]["state"]: s[2] for s in fam["scratchd_workers"][1]} == {
        "ready": 1,
        "starting": 1,
        "stopping": 0,  # known states are exported at 0, so "no ready worker" is a value
        "exited": 0,
    }
    assert fam["scratchd_data_drift_score"][1][0][2] == 0.02
    assert fam["scratchd_model_output_entropy"][1][0][2] == 0.11
    assert fam["scratchd_worker_restarts_total"][1][0][2] == 1.0
    assert fam["scratchd_drift_warming_up"][1][0][2] == 0.0
    m.sources.signals_warming_up = lambda: True
    assert _families(m)["scratchd_drift_warming_up"][1][0][2] == 1.0
    m.sources.queue_depth = lambda: [0] * 8
    assert all(s[2] == 0 for s in _families(m)["scratchd_queue_depth"][1])


def test_throughput_per_status_over_the_window() -> None:
    clock = FakeClock()
    m = Metrics(["normal"], window_s=10.0, clock=clock)
    clock.now += 10
    for i in range(20):
        m.observe_reply("normal", "ok" if i % 4 else "overloaded", total_s=0.01)
    tp = m.throughput()
    assert tp.rps == 2.0
    assert tp.by_status == {"ok": 1.5, "timeout": 0, "overloaded": 0.5, "invalid": 0, "error": 0}
    clock.now += 11
    assert m.throughput().rps == 0.0
