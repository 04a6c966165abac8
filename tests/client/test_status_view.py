"""The operator's `scratchd status` view: what an operator reads off the table, and the JSON."""

from __future__ import annotations

import io
import json
import re
from typing import Any

import msgspec
import pytest
from rich.console import Console

from scratchd.client.status_view import (
    missing_keys,
    queue_depths,
    render_status,
    status_document,
    to_json,
    watch_status,
)
from scratchd.protocol import wire

DOC: dict[str, Any] = {
    "state": "serving",
    "pid": 4100,
    "model_version": "scratchnet-7",
    "model_views": ["identity", "flip_h"],
    "backend": "cpu",
    "uptime_s": 3725.2,
    "workers": [
        {"id": 0, "name": "cpu0", "pid": 4242, "state": "ready", "device": "cpu",
         "restarts": 2, "requests": 100, "batches": 40, "batch_size_mean": 2.5,
         "compute_ms_p50": 21.3},
        {"id": 1, "name": "cpu1", "pid": 0, "state": "restarting", "device": "cpu",
         "restarts": 0},
    ],
    "queue": {"depth": [3, 0, 0, 0, 0, 0, 0, 1], "slots": 256, "in_use": 9, "in_flight": 5},
    "latency": {
        "safety": {"p50_ms": 12.0, "p99_ms": 1200.0, "count": 40, "deadline_ms": 1000},
        "normal": {"p50_ms": 15.5, "p99_ms": 40.0, "count": 100, "deadline_ms": 3000},
    },
    "throughput": {"rps": 12.5, "by_status": {"ok": 12.0, "timeout": 0.5, "error": 0.0}},
    "drift": {"score": 0.2134, "threshold": 0.15, "over_threshold": True, "window": 500,
              "samples": 500},
    "entropy": {"bits": 0.0512, "window": 500, "samples": 100},
}  # fmt: skip


def _text(doc: dict[str, Any]) -> str:
    console = Console(width=120, record=True, color_system=None)
    console.print(render_status(doc))
    return console.export_text()


def test_table_shows_what_an_operator_needs() -> None:
    text = _text(DOC)
    assert "serving  pid 4100  model scratchnet-7  views identity,flip_h  backend cpu" in text
    assert "0d 01:02:05" in text and "12.5 req/s" in text
    # workers: device, state, pid, restarts, batch size, compute time
    row = next(line for line in text.splitlines() if "4242" in line)
    cells = re.split(r"\s{2,}", row.strip())  # columns are two spaces apart at least
    assert cells == ["cpu0", "ready", "4242", "2", "100", "40", "2.5", "21.3 ms"]
    assert "restarting" in text
    # queue depth per priority: 3 at priority 0, 1 at priority 7; 5 in flight, 9 of 256 slots
    queue_row = next(line for line in text.splitlines() if line.startswith("3 "))
    assert queue_row.split() == [
        "3", "0", "0", "0", "0", "0", "0", "1", "5", "9", "256",
    ]  # fmt: skip
    # latency per class with the deadline beside it
    safety = next(line for line in text.splitlines() if "safety" in line)
    for cell in ("12.0 ms", "1200.0 ms", "1000 ms", "40"):
        assert cell in safety
    assert "data drift 0.213 (threshold 0.15) over 500/500 requests" in text
    assert "output entropy 0.051 bits over 100 answers" in text


def test_drift_and_entropy_warming_up_show_no_alarm() -> None:
    drift = {**DOC["drift"], "samples": 18, "warming_up": True, "over_threshold": False}
    entropy = {**DOC["entropy"], "samples": 18, "warming_up": True}
    text = _text({**DOC, "drift": drift, "entropy": entropy})
    assert "data drift warming up over 18/500 requests" in text
    assert "output entropy warming up over 18 answers" in text
    assert "0.213" not in text


def test_an_empty_daemon_renders_without_errors() -> None:
    doc = {"workers": [], "queue": [0] * 8, "latency": {}, "drift": {}, "entropy": {}}
    text = _text(doc)
    assert "none" in text and "(no requests in the window)" in text


def test_json_has_the_required_keys_and_round_trips() -> None:
    # What `scratchd status` renders (to_builtins of the reply) has every required key, even
    # from a daemon with nothing to report yet.
    queue = wire.QueueStatus(depth=[0] * 8, slots=1, in_use=0, in_flight=0)
    bare = wire.StatusReply(1, "starting", 1, 0.0, "cpu", [], queue)
    assert missing_keys(msgspec.to_builtins(bare)) == []
    assert missing_keys(DOC) == []
    assert missing_keys({"workers": []}) == ["queue", "latency", "drift", "entropy"]
    assert json.loads(to_json(DOC)) == DOC


def test_the_json_document_has_no_wire_fields_and_labels_its_classes() -> None:
    queue = wire.QueueStatus(depth=[0] * 8, slots=1, in_use=0, in_flight=0)
    spare = wire.WorkerStatus(id=9, name="cpu-standby", pid=7, state="ready", device="cpu",
                              restarts=0)  # fmt: skip
    reply = wire.StatusReply(
        7, "serving", 1, 0.0, "cpu", [], queue, classes={"normal": (0, 3000)},
        standby=spare, standbys=[spare],
    )  # fmt: skip
    doc = status_document(msgspec.to_builtins(reply))
    assert not {"id", "type", "standby"} & doc.keys()
    assert doc["classes"] == {"normal": {"priority": 0, "deadline_ms": 3000}}
    assert [s["name"] for s in doc["standbys"]] == ["cpu-standby"]
    assert missing_keys(doc) == []


@pytest.mark.parametrize(
    "queue",
    [{"depth": {"0": 3, "7": 1}}, {"0": 3, "7": 1}, [3, 0, 0, 0, 0, 0, 0, 1]],
    ids=["depth-map", "plain-map", "list"],
)
def test_queue_depth_shapes(queue: Any) -> None:
    depths = queue_depths(queue)
    assert depths[0] == 3 and depths[7] == 1 and sum(depths.values()) == 4


def test_watch_refreshes_and_survives_a_daemon_restart() -> None:
    calls = {"n": 0}

    def fetch() -> dict[str, Any]:
        calls["n"] += 1
        if calls["n"] == 2:
            raise ConnectionRefusedError("daemon restarting")
        return {**DOC, "uptime_s": float(calls["n"])}

    def watch(iterations: int) -> str:
        console = Console(width=120, record=True, color_system=None, file=io.StringIO())
        watch_status(fetch, interval_s=0.0, console=console, iterations=iterations)
        return console.export_text()  # a non-terminal Live keeps the last frame

    assert "status unavailable: daemon restarting" in watch(2)
    calls["n"] = 0
    assert "up 0d 00:00:03" in watch(3)  # fetched again after the failure
    assert calls["n"] == 3


def _gpu(doc: dict[str, Any]) -> dict[str, Any]:
    workers = [{**w, "name": f"cuda{i}", "device": "cuda:0000:c1:00.0"} for i, w in
               enumerate(doc["workers"])]  # fmt: skip
    return {**doc, "workers": workers}


def _mid_reload(doc: dict[str, Any]) -> dict[str, Any]:
    return {**doc, "workers": [{**w, "model_version": "scratchnet-8"} for w in doc["workers"]]}


@pytest.mark.parametrize("shape", ["cpu", "gpu", "cpu-mid-reload"])
def test_the_table_fits_80_columns_without_cutting_a_header(shape: str) -> None:
    doc = {"cpu": DOC, "gpu": _gpu(DOC), "cpu-mid-reload": _mid_reload(DOC)}[shape]
    console = Console(width=80, record=True, color_system=None)
    console.print(render_status(doc))
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 80
    assert not any("…" in line for line in lines)
    headers = {
        "worker": ["worker", "state", "pid", "restarts", "requests", "batches", "batch",
                   "compute"],
        "0": ["0", "7", "in", "flight", "use", "slots"],
        "class": ["class", "p50", "p99", "deadline", "requests"],
    }  # fmt: skip
    headers["worker"] += (["device"] if shape == "gpu" else []) + (
        ["model"] if shape == "cpu-mid-reload" else []
    )
    for first, words in headers.items():
        (line,) = [line for line in lines if line.split()[:1] == [first]]
        assert set(words) <= set(line.split()), line
