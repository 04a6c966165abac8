"""The Prometheus rules and the Grafana dashboard: valid, tested, and about real metrics."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from scratchd.daemon.config import DEFAULT_CLASSES, DriftConfig
from scratchd.daemon.ops.metrics import Metrics

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "scratchd-rules.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "scratchd-rules.test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "scratchd-dashboard.json"

needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool missing (Debian package `prometheus`)"
)
METRIC_NAME = re.compile(r"\b(scratchd(?::[a-z0-9_]+)+|scratchd_[a-z0-9_]+|up)\b(?!\s*\()")


def _promtool(*args: str) -> None:
    result = subprocess.run(["promtool", *args], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def _rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def _dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def _dashboard_exprs() -> list[str]:
    dash = _dashboard()
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [a["expr"] for a in dash["annotations"]["list"]]
    return exprs


def _exported_names() -> set[str]:
    """Every sample name the daemon's registry exports (histograms: _bucket/_sum/_count)."""
    m = Metrics(["safety", "normal"], ["cpu"])
    m.sources.fragmentation = lambda: {"gpu0": 0.0}  # GPU-only series
    m.observe_reply("safety", "ok", total_s=0.01)  # p99 exists once a class has requests
    lines = m.exposition().decode().splitlines()
    return {line.split("{")[0].split(" ")[0] for line in lines if not line.startswith("#")}


@needs_promtool
def test_rules_pass_promtool_check_rules() -> None:
    _promtool("check", "rules", str(RULES))


@needs_promtool
def test_alerts_fire_on_the_failures_they_name() -> None:
    _promtool("test", "rules", str(RULE_TESTS))  # the rule unit tests next to the rules


def test_the_alerts_exist() -> None:
    alerts = {r["alert"] for r in _rules() if "alert" in r}
    assert {
        "ScratchdDataDrift",  # drift over threshold
        "ScratchdConfidenceCollapse",  # entropy up: the model is unsure
        "ScratchdEntropyCollapse",  # entropy to 0: saturated on blank frames
        "ScratchdP99OverDeadline",  # p99 over a class's deadline
        "ScratchdWorkerRestarts",
        "ScratchdNoReadyWorker",
    } <= alerts
    for rule in _rules():
        if "alert" in rule:
            assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
            assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_rule_thresholds_match_the_default_config() -> None:
    deadlines = {
        r["labels"]["part_class"]: float(r["expr"].removeprefix("vector(").removesuffix(")"))
        for r in _rules()
        if r.get("record") == "scratchd:class_deadline_seconds"
    }
    assert deadlines == {name: c.deadline_ms / 1000 for name, c in DEFAULT_CLASSES.items()}
    drift = next(r for r in _rules() if r.get("alert") == "ScratchdDataDrift")
    assert drift["expr"].split() == [
        "scratchd_data_drift_score", ">", str(DriftConfig().threshold),
        "unless", "on", "(job,", "instance)", "scratchd_drift_warming_up", "==", "1",
    ]  # fmt: skip


def test_rules_and_dashboard_only_use_metrics_the_daemon_exports() -> None:
    recorded = {r["record"] for r in _rules() if "record" in r}
    known = _exported_names() | recorded | {"up"}
    queries = [r["expr"] for r in _rules() if not r["expr"].startswith("vector(")]
    for expr in queries + _dashboard_exprs():
        used = set(METRIC_NAME.findall(expr))
        assert used, expr
        assert used <= known, (used - known, expr)


def test_dashboard_shows_every_metric_and_each_operator_panel() -> None:
    used = " ".join(_dashboard_exprs())
    for name in {n.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
                 for n in _exported_names()}:  # fmt: skip
        if name.startswith("process_"):  # the client library's standard ones, for ad-hoc use
            continue
        assert name in used, f"{name} is on no dashboard panel"
    titles = " | ".join(p["title"].lower() for p in _dashboard()["panels"])
    for topic in ("latency by part class", "throughput by status", "queue depth", "batch size",
                  "compute time", "entropy", "drift", "workers by state", "restarts"):  # fmt: skip
        assert topic in titles, topic


def test_dashboard_is_well_formed_for_grafana() -> None:
    dash = _dashboard()
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert dash["uid"] and dash["schemaVersion"] >= 36
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "instance"} <= variables
    cells: set[tuple[int, int]] = set()
    for panel in dash["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert all('instance=~"$instance"' in t["expr"] or ":" in t["expr"]
                   for t in panel["targets"]), panel["title"]  # fmt: skip
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24
        area = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not area & cells, f"panel {panel['title']!r} overlaps another"
        cells |= area


@needs_promtool
def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    # promtool parses PromQL in rule files: wrap each panel query as a recording rule, with
    # Grafana's variables replaced by what Grafana would substitute.
    subst = {"$__rate_interval": "1m", "$__range": "1h", "$instance": ".*"}
    rules = []
    for i, expr in enumerate(_dashboard_exprs()):
        for var, value in subst.items():
            expr = expr.replace(var, value)
        assert "$" not in expr, expr
        rules.append({"record": f"dashboard:query_{i}", "expr": expr})
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    _promtool("check", "rules", str(path))
