"""scripts/zero_copy_record.py: the issue's record shape from bench_frontend's and bench_serve's
JSONs, every repeat of a (GPUs, path, rate) kept, losses added up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "zero_copy_record.py"


def frontend() -> dict:
    cell = {"median": 50.0, "min": 45.0, "max": 61.0, "runs": 5}
    socket = {"median": 470.0, "min": 460.0, "max": 580.0, "runs": 5}
    return {"main_cpu_us_per_request": {"1024/socket": socket, "1024/region": cell}}


def serve(
    device: str, path: str, p99s: list[float], lost: int, kill_lost: int, warmup: float = 0.0
) -> dict:
    rows = [{"rate": 2000.0, "path": path, "p99_ms": v, "lost": lost} for v in p99s]
    for row in rows if warmup else []:
        row["warmup_s"] = warmup
    return {"device": device, "open_loop": rows, "lost_under_kill": kill_lost}


def test_the_record_has_the_issues_shape(tmp_path: Path) -> None:
    files = {
        "fe.json": frontend(),
        "s1.json": serve("NVIDIA H200", "socket", [11.0, 96.8], 0, 0),
        "s2.json": serve("NVIDIA H200", "region", [3.1, 3.4, 3.2], 1, 2),
        "s3.json": serve("NVIDIA H200", "socket", [12.0, 11.9, 17.5], 0, 0),
        "s4.json": serve("2 x NVIDIA H200", "region", [6.0], 0, 0),
        "s5.json": serve("NVIDIA H200", "region", [2.9, 3.0], 0, 0, warmup=5.0),
    }
    for name, doc in files.items():
        (tmp_path / name).write_text(json.dumps(doc))
    out = tmp_path / "zero-copy.json"
    serve_files = [str(tmp_path / f"s{k}.json") for k in (1, 2, 3, 4, 5)]
    cmd = [sys.executable, str(SCRIPT), "--frontend", str(tmp_path / "fe.json"), "--serve"]
    done = subprocess.run(
        [*cmd, *serve_files, "--json", str(out)], capture_output=True, text=True, check=True
    )
    assert "region" in done.stdout and "lost under kill: 2" in done.stdout
    assert "2.9, 3  (after 5 s of warm-up)" in done.stdout
    record = json.loads(out.read_text())
    assert record["device"] == "NVIDIA H200"
    assert record["cpu_us_per_request"] == {"socket": 470.0, "region": 50.0}
    assert record["serve"] == [
        {"gpus": 1, "path": "region", "rate": 2000.0, "p99_ms": [3.1, 3.4, 3.2], "lost": 3},
        {"gpus": 1, "path": "region", "rate": 2000.0, "p99_ms": [2.9, 3.0], "lost": 0,
         "warmup_s": 5.0},
        {"gpus": 1, "path": "socket", "rate": 2000.0, "p99_ms": [11.0, 96.8, 12.0, 11.9, 17.5],
         "lost": 0},
        {"gpus": 2, "path": "region", "rate": 2000.0, "p99_ms": [6.0], "lost": 0},
    ]  # fmt: skip
    assert record["lost_under_kill"] == 2
    assert {"date", "cpu_us_per_request_range", "sources"} <= set(record)


def test_a_frontend_run_without_the_region_path_is_refused(tmp_path: Path) -> None:
    fe = frontend()
    del fe["main_cpu_us_per_request"]["1024/region"]
    (tmp_path / "fe.json").write_text(json.dumps(fe))
    (tmp_path / "s.json").write_text(json.dumps(serve("NVIDIA H200", "region", [3.0], 0, 0)))
    cmd = [sys.executable, str(SCRIPT), "--frontend", str(tmp_path / "fe.json")]
    cmd += ["--serve", str(tmp_path / "s.json"), "--json", str(tmp_path / "out.json")]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode != 0 and "1024/region" in done.stderr
    assert not (tmp_path / "out.json").exists()
