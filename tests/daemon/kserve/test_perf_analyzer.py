"""Triton's perf_analyzer drives scratchd's endpoint as it drives Triton (HTTP and gRPC, real
images through --input-data); skipped only where its binary cannot run."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from .kserve_daemon import KServeDaemon

SCRIPTS = Path(__file__).resolve().parents[3] / "scripts"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

import bench_kserve  # noqa: E402

PROBLEM = bench_kserve.perf_analyzer_problem()


@pytest.mark.skipif(PROBLEM is not None, reason=PROBLEM or "")
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_measures_the_endpoint(protocol: str, tmp_path: Path) -> None:
    data = bench_kserve.write_input_data(bench_kserve.images(0, 2), tmp_path / "input.json")
    report = tmp_path / "report.csv"
    d = KServeDaemon(workers=1, slots=32, slot_bytes=1 << 18)
    with d:
        port = d.http_port if protocol == "http" else d.grpc_port
        command = [
            bench_kserve.perf_analyzer_binary(),
            *("-m", "scratchnet", "-i", protocol, "-u", f"127.0.0.1:{port}"),
            *("--input-data", str(data), "--concurrency-range", "2"),
            *("--measurement-mode", "count_windows", "--measurement-request-count", "6"),
            *("--stability-percentage", "1000", "--max-trials", "3", "-f", str(report)),
        ]
        run = subprocess.run(
            command, capture_output=True, text=True, env=bench_kserve.perf_analyzer_env(),
            timeout=300, check=False,
        )  # fmt: skip
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        served = d.status().requests
    with report.open() as f:
        row = next(csv.DictReader(f))
    assert float(row["Inferences/Second"]) > 0
    assert served.get("ok", 0) >= 6 and set(served) == {"ok"}
