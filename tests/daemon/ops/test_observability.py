"""The daemon's observability wiring: `Observability.account` alone, then end to end on a
real CPU daemon (shipped model) fed the committed real images.

One daemon for the module. The committed images (the full sets' mix of products, so their
histograms are like the training set's), three rounds of them, go through in a shuffled
order with two part classes (plus a few requests that must be refused and a few with a 1 ms
deadline), then 150 inverted frames; the metrics, the status reply and /readyz are checked against
what the client saw. `drift.window` is 150 here so that 150 shifted frames fill it (with
the default 500, a 150-frame shift is 30 % of the window and the score stays ~0.05: see
daemon/ops/drift.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import scratchd
from scratchd.client.api import AsyncClient
from scratchd.daemon.config import Config, ModelConfig
from scratchd.daemon.frontend.dispatch import InFlight
from scratchd.daemon.ops.observability import (
    ModelReference,
    Observability,
    read_model_reference,
)
from scratchd.dataset.folders import scan_dataset
from scratchd.ipc.queue import Completion, Handle, Result, Status
from scratchd.model.scratchnet import DEFAULT_PATH, META_KEY, load_model
from scratchd.protocol.image import decode_image, encode_png
from scratchd.protocol.wire import Reply, Timings
from tests.daemon.harness import DaemonProcess

WINDOW = 150
CONFIG = f"""
[drift]
window = {WINDOW}
threshold = 0.15
"""  # the harness gives both classes generous deadlines: nothing times out by accident
Options = dict[str, Any]


@dataclass
class Run:
    """What the client sent and saw, and what the daemon reported, phase by phase."""

    sent: Counter[tuple[str, str]] = field(default_factory=Counter)  # (class label, status)
    with_worker: int = 0  # replies computed by a worker (ok, or error from the model)
    status_normal: dict[str, Any] = field(default_factory=dict)
    status_shifted: dict[str, Any] = field(default_factory=dict)
    metrics_text: str = ""


async def _send(socket: str, items: list[tuple[bytes, Options]]) -> list[Reply]:
    gate = asyncio.Semaphore(8)
    async with await AsyncClient.connect(socket) as client:

        async def one(data: bytes, options: Options) -> Reply:
            async with gate:
                return await client.infer(data, **options)

        return list(await asyncio.gather(*(one(d, o) for d, o in items)))


def _status(daemon: DaemonProcess) -> dict[str, Any]:
    import msgspec

    doc: dict[str, Any] = msgspec.to_builtins(daemon.status())
    return doc


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.fixture(scope="module")
def line_images(data_dir: Path) -> list[bytes]:
    files = [s.image.read_bytes() for s in scan_dataset(data_dir)] * 3  # over 400 requests
    order = np.random.default_rng(6).permutation(len(files))
    return [files[i] for i in order]


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    """The shipped model with one test-time view (``model.views``, the harness's ``extra``
    continues its ``[model]`` table): 4x cheaper on CI's two cores; drift and counts do not
    depend on it, and the status must say it."""
    extra = 'views = ["identity"]\n' + CONFIG
    with DaemonProcess(workers=2, max_batch=4, extra=extra) as d:
        yield d


@pytest.fixture(scope="module")
def run(daemon: DaemonProcess, line_images: list[bytes]) -> Run:
    result = Run()
    classes = ["safety", "normal"]
    items: list[tuple[bytes, Options]] = [
        (data, {"part_class": classes[i % 2]}) for i, data in enumerate(line_images)
    ]
    items += [(line_images[0], {"part_class": "no-such-class"})] * 3  # invalid, label `other`
    items += [(line_images[1], {"part_class": "normal", "deadline_ms": 1})] * 3  # likely timeout
    replies = asyncio.run(_send(daemon.socket, items))
    for (_, options), reply in zip(items, replies, strict=True):
        label = options["part_class"] if options["part_class"] in classes else "other"
        result.sent[label, reply.status] += 1
        result.with_worker += reply.worker is not None and reply.status in ("ok", "error")
    result.status_normal = _status(daemon)

    inverted = [encode_png(255 - decode_image(data)) for data in line_images[:150]]
    shifted = asyncio.run(_send(daemon.socket, [(d, {"part_class": "normal"}) for d in inverted]))
    for reply in shifted:
        result.sent["normal", reply.status] += 1
        result.with_worker += reply.worker is not None and reply.status in ("ok", "error")
    result.status_shifted = _status(daemon)
    _, result.metrics_text = _get(result.status_shifted["metrics_port"], "/metrics")
    return result


def _completion(i: int, status: Status, result: Result | None, worker: int = 0) -> Completion:
    return Completion(
        handle=Handle(i, 1), request_id=i, conn_id=1, part_class=0, priority=0, status=status,
        result=result, enqueue_ns=0, claim_ns=1000 + i // 2, done_ns=0, worker=worker,
    )  # fmt: skip


def _flight(i: int, part_class: str = "normal") -> InFlight:
    conn: Any = None  # account() never touches the connection
    return InFlight(conn=conn, request_id=i, part_class=part_class, priority=0, received_ns=0)


def _obs(monkeypatch: pytest.MonkeyPatch, disabled: bool = False) -> Observability:
    monkeypatch.setenv("SCRATCHD_NO_METRICS", "1" if disabled else "")
    reference = ModelReference("unit", np.ones(64))
    return Observability(Config(), reference, devices=["cpu"], worker_states=["ready"])


def test_account_feeds_drift_and_entropy_from_ok_results_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    obs = _obs(monkeypatch)
    flat = np.full(64, 10, np.uint32)
    ok = Result(Status.OK, entropy=0.25, histogram=flat, compute_ns=2_000_000, batch_size=2)
    failed = Result(Status.ERROR, histogram=np.zeros(64, np.uint32), batch_size=2)
    for i, (status, result) in enumerate(
        [(Status.OK, ok), (Status.OK, ok), (Status.ERROR, failed)]
    ):
        name = status.name.lower()
        timings = Timings(queue_ms=1.0, total_ms=5.0)
        reply = Reply(id=i, status=name, timings=timings, worker="cpu0")  # type: ignore[arg-type]
        obs.account(_flight(i), reply, _completion(i, status, result))
    assert obs.completed == 3
    assert obs.entropy.snapshot() == {
        "bits": 0.25, "window": 500, "samples": 2, "warming_up": True
    }  # fmt: skip
    assert obs.drift is not None and obs.drift.samples == 2 and obs.drift.score() < 1e-9
    assert obs.metrics.workers["cpu0"].batches == 2  # claim_ns 1000 (ok, ok) and 1001 (error)
    fields = obs.status_fields()
    assert fields["drift"].samples == 2 and fields["entropy"].bits == 0.25


def test_a_computed_result_answered_timeout_is_counted_late(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The dispatcher answers a result past its deadline ``timeout``; its completion is
    ``OK``: counted in ``scratchd_late_results_total`` and as a timeout, while a request
    that expired in the queue is a timeout only."""
    obs = _obs(monkeypatch)
    ok = Result(Status.OK, compute_ns=2_000_000, batch_size=1)
    timings = Timings(queue_ms=1.0, total_ms=5.0)
    reply = Reply(id=1, status="timeout", timings=timings, worker="cpu0")
    obs.account(_flight(1), reply, _completion(1, Status.OK, ok))
    obs.account(_flight(2), Reply(id=2, status="timeout"), _completion(2, Status.TIMEOUT, None))
    text = obs.metrics.exposition().decode()
    assert 'scratchd_late_results_total{part_class="normal"} 1.0' in text
    assert 'scratchd_requests_total{part_class="normal",status="timeout"} 2.0' in text


def test_status_names_the_views_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    """``model.views`` when configured, else the model file's own (read from its metadata)."""
    monkeypatch.setenv("SCRATCHD_NO_METRICS", "")
    shipped = read_model_reference(os.environ.get("SCRATCHD_TEST_MODEL", ""))
    file_views = list(load_model(os.environ.get("SCRATCHD_TEST_MODEL") or None).views)
    assert list(shipped.views) == file_views
    obs = Observability(Config(), shipped, devices=["cpu"], worker_states=["ready"])
    assert obs.status_fields()["model_views"] == file_views
    chosen = Config(model=ModelConfig(views=["identity", "transpose"]))
    assert file_views != ["identity", "transpose"]  # else the reload could not show
    obs.apply_config(chosen)  # a reload to a configured choice
    assert obs.status_fields()["model_views"] == ["identity", "transpose"]


def _write_meta(path: Path, meta: dict[str, Any]) -> None:
    """A model file of metadata only (all ``read_model_reference`` reads)."""
    arrays: dict[str, Any] = {META_KEY: np.frombuffer(json.dumps(meta).encode(), np.uint8)}
    np.savez(path, **arrays)


def test_a_model_file_without_views_is_read_with_the_default_view(tmp_path: Path) -> None:
    """The metadata is parsed as ``load_model`` parses it: what the file leaves out gets
    ``ModelMeta``'s defaults; a file ``load_model`` would refuse gives no reference."""
    with np.load(os.environ.get("SCRATCHD_TEST_MODEL") or DEFAULT_PATH) as data:
        meta = json.loads(data[META_KEY].tobytes().decode())
    del meta["views"]
    path = tmp_path / "model.npz"
    _write_meta(path, meta)
    reference = read_model_reference(str(path))
    assert reference.views == ("identity",) and reference.version == meta["version"]
    assert reference.histogram is not None and reference.histogram.tolist() == meta["histogram"]
    del meta["threshold"]  # a required field
    _write_meta(path, meta)
    broken = read_model_reference(str(path))
    assert broken.histogram is None and "threshold" in broken.problem


def test_accounting_never_raises_and_can_be_switched_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    obs = _obs(monkeypatch)
    broken = Result(Status.OK, entropy=float("nan"), histogram=np.zeros(64, np.uint32))
    reply = Reply(id=1, status="ok")
    obs.account(_flight(1), reply, _completion(1, Status.OK, broken))
    assert obs.metrics.requests.labels("normal", "ok")._value.get() == 1  # counted, then failed
    off = _obs(monkeypatch, disabled=True)
    off.account(_flight(1), reply, None)
    assert off.metrics.requests.labels("normal", "ok")._value.get() == 0


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:  # fields after "(comm)": state, ppid, ...
            out.append(int(stat.parent.name))
    assert out, f"no worker processes under {pid}"
    return out


def _samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_metrics_count_every_request_by_class_and_status(run: Run) -> None:
    counted = {
        (dict(k)["part_class"], dict(k)["status"]): v
        for k, v in _samples(run.metrics_text, "scratchd_requests_total").items()
    }
    assert {k: v for k, v in counted.items() if v} == dict(run.sent)
    assert run.sent["other", "invalid"] == 3
    assert sum(run.sent.values()) > 400
    durations = _samples(run.metrics_text, "scratchd_request_duration_seconds_count")
    for part_class in ("safety", "normal"):
        queued = sum(run.sent[part_class, s] for s in ("ok", "timeout", "error"))
        assert durations[(("part_class", part_class),)] == queued
    # Every request a worker computed is in exactly one batch.
    batch_sum = _samples(run.metrics_text, "scratchd_batch_size_sum")
    assert batch_sum[(("device", "cpu"),)] == run.with_worker
    compute = _samples(run.metrics_text, "scratchd_compute_seconds_count")
    assert 0 < compute[(("device", "cpu"),)] <= run.with_worker


def test_a_scrape_has_build_info_and_the_process_metrics(run: Run) -> None:
    (labels,) = _samples(run.metrics_text, "scratchd_build_info")
    assert dict(labels) == {
        "version": scratchd.__version__,
        "model": run.status_normal["model_version"],
    }
    assert _samples(run.metrics_text, "process_resident_memory_bytes")[()] > 0
    assert _samples(run.metrics_text, "process_cpu_seconds_total")[()] > 0


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_live_metrics_pass_promtool(run: Run) -> None:
    check = subprocess.run(
        ["promtool", "check", "metrics"], input=run.metrics_text.encode(), capture_output=True
    )
    assert check.returncode == 0, check.stdout.decode() + check.stderr.decode()


def test_drift_stays_under_on_images_like_training_and_rises_on_inverted(run: Run) -> None:
    normal, shifted = run.status_normal["drift"], run.status_shifted["drift"]
    assert normal["samples"] == shifted["samples"] == WINDOW
    assert normal["score"] < 0.15 and not normal["over_threshold"], normal
    assert shifted["score"] > 0.15 and shifted["over_threshold"], shifted
    gauge = _samples(run.metrics_text, "scratchd_data_drift_score")[()]
    assert gauge == pytest.approx(shifted["score"], abs=1e-4)
    # The output entropy is exported and moves on out-of-distribution input.
    before, after = run.status_normal["entropy"]["bits"], run.status_shifted["entropy"]["bits"]
    assert 0 < before < 1 and 0 < after < 1
    assert after != pytest.approx(before, rel=0.05), (before, after)
    assert _samples(run.metrics_text, "scratchd_model_output_entropy")[()] == pytest.approx(
        after, abs=1e-4
    )


def test_status_json_and_table(run: Run, daemon: DaemonProcess) -> None:
    env = {**os.environ, "SCRATCHD_SOCKET": daemon.socket}
    cli = [sys.executable, "-c", "from scratchd.daemon.cli import main; main()", "status"]
    out = subprocess.run([*cli, "--json"], capture_output=True, text=True, env=env, check=True)
    doc = json.loads(out.stdout)
    assert {"workers", "queue", "latency", "drift", "entropy"} <= set(doc)
    assert doc["model_views"] == ["identity"]  # model.views, not the shipped file's four
    assert {w["state"] for w in doc["workers"]} == {"ready"}
    assert all(w["batch_size_mean"] and w["compute_ms_p50"] for w in doc["workers"])
    assert len(doc["queue"]["depth"]) == 8
    answered_ok = sum(n for (_, status), n in run.sent.items() if status == "ok")
    assert doc["drift"]["samples"] == WINDOW
    assert doc["entropy"]["samples"] == min(answered_ok, WINDOW)  # also over drift.window
    # Latency is a 60 s window: read the classes from the snapshot taken right after the
    # two-class phase (the CLI's may come later than that).
    for part_class in ("safety", "normal"):
        row = run.status_normal["latency"][part_class]
        assert 0 < row["p50_ms"] <= row["p99_ms"]
        assert row["deadline_ms"] == doc["classes"][part_class]["deadline_ms"]
    table = subprocess.run(cli, capture_output=True, text=True, env=env, check=True).stdout
    assert "latency by part class" in table and "data drift" in table
    assert "views identity " in table


def test_readyz_is_503_without_ready_workers_and_200_after_recovery(
    run: Run, daemon: DaemonProcess
) -> None:
    port = run.status_shifted["health_port"]
    assert _get(port, "/readyz")[0] == 200
    assert _get(port, "/livez")[0] == 200
    # Every worker process at once, the warm standby included (it would take over at once).
    # The standby boots in the background after the pool is READY: wait until it is READY too,
    # so the scan below finds every process (a standby spawned after it would take over within
    # milliseconds and the 503 would be too short to see). It dies first: killed after a
    # worker, it could be handed that worker's slot in between and die as a worker.
    assert daemon.proc is not None
    deadline = time.monotonic() + 60
    while (standby := daemon.status().standby) is None or standby.state != "ready":
        assert time.monotonic() < deadline, f"no READY standby: {standby}"
        time.sleep(0.05)
    others = [pid for pid in _children(daemon.proc.pid) if pid != standby.pid]
    for pid in [standby.pid, *others]:
        os.kill(pid, signal.SIGKILL)
    seen: list[tuple[int, str]] = []  # changes of answer, from the first 503 on
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # both dead: 503 until a replacement sends READY
        code, body = _get(port, "/readyz")
        if (seen or code == 503) and (not seen or seen[-1][0] != code):
            seen.append((code, body.strip()))  # (200s before the deaths are noticed: skipped)
        if code == 200 and seen:
            break
        time.sleep(0.002)
    assert [c for c, _ in seen] == [503, 200], seen
    assert seen[0][1].startswith("no worker is ready (0 of 2)")
    daemon.wait_ready(restarts={"cpu0": 1, "cpu1": 1})
    _, text = _get(run.status_shifted["metrics_port"], "/metrics")
    # Both workers restarted; on a loaded machine the supervisor may hand a slot to the
    # killed standby before it has seen that death, which then counts as one more restart.
    # The metric says what the status says, either way.
    restarts = sum(w.restarts for w in daemon.status().workers)
    assert restarts >= 2
    assert _samples(text, "scratchd_worker_restarts_total")[(("device", "cpu"),)] == restarts
    assert _samples(text, "scratchd_workers")[(("state", "ready"),)] == 2
