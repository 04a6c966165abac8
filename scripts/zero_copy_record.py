"""Assemble the zero-copy record (``docs/bench/zero-copy.json``) from one ``bench_frontend.py``
JSON and the ``bench_serve.py`` JSONs of the same device run, print it as a table, write it.

    python scripts/zero_copy_record.py --frontend fe.json --serve serve-*.json \\
        --json docs/bench/zero-copy.json

``--frontend``: ``bench_frontend.py --sizes 1024 --paths socket,region --repeats N`` (the
main process's CPU per 1024x1024 request, the median over the repeats of each path).
``--serve``: any number of ``bench_serve.py --size 1024 --path socket|region`` records; every
open-loop row of one (GPU count, path, rate) is a repeat, in the order the files are given
(a record run with ``--rates 2000,2000,...`` holds several). The record::

    {"device", "date", "cpu_us_per_request": {"socket": x, "region": y},
     "serve": [{"gpus": n, "path": "socket" | "region", "rate": r,
                "p99_ms": [one per repeat], "lost": n}],
     "lost_under_kill": n}

and, beside it, ``cpu_us_per_request_range`` (min, max over the repeats of each path) and
``sources`` (the files read). ``lost`` adds up the repeats' lost requests;
``lost_under_kill`` those of every kill run.
"""

from __future__ import annotations

import argparse
import json
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

SIZE = 1024


def gpus_of(device: str) -> tuple[int, str]:
    """``"2 x NVIDIA H200"`` → (2, "NVIDIA H200"); a single device name → (1, name)."""
    match = re.fullmatch(r"(\d+) x (.+)", device)
    return (int(match[1]), match[2]) if match else (1, device)


def cpu_per_request(frontend: dict[str, Any]) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Per path, the median and (min, max) of the main process's CPU per 1024² request."""
    medians: dict[str, float] = {}
    ranges: dict[str, list[float]] = {}
    for path in ("socket", "region"):
        cell = frontend["main_cpu_us_per_request"].get(f"{SIZE}/{path}")
        if cell is None:
            raise ValueError(f"the bench_frontend JSON has no {SIZE}/{path} runs")
        medians[path] = cell["median"]
        ranges[path] = [cell["min"], cell["max"]]
    return medians, ranges


def serve_rows(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """One row per (GPUs, path, rate, warm-up) with every repeat's p99, and the lost under
    kill. Loads measured after a warm-up (``bench_serve.py --warmup``) are rows of their own,
    with ``warmup_s``."""
    grouped: dict[tuple[int, str, float, float], dict[str, Any]] = {}
    lost_under_kill = 0
    for record in records:
        gpus, _ = gpus_of(record["device"])
        for row in record["open_loop"]:
            warmup = float(row.get("warmup_s", 0.0))
            key = (gpus, row.get("path", "socket"), float(row["rate"]), warmup)
            entry = grouped.setdefault(
                key, {"gpus": gpus, "path": key[1], "rate": key[2], "p99_ms": [], "lost": 0}
            )
            if warmup:
                entry["warmup_s"] = warmup
            entry["p99_ms"].append(row["p99_ms"])
            entry["lost"] += int(row["lost"])
        lost_under_kill += int(record.get("lost_under_kill", 0))
    return [grouped[k] for k in sorted(grouped)], lost_under_kill


def assemble(frontend: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, Any]:
    if not records:
        raise ValueError("no bench_serve records given")
    medians, ranges = cpu_per_request(frontend)
    serve, lost_under_kill = serve_rows(records)
    return {
        "device": gpus_of(records[0]["device"])[1],
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cpu_us_per_request": medians,
        "serve": serve,
        "lost_under_kill": lost_under_kill,
        "cpu_us_per_request_range": ranges,
    }


def table(record: dict[str, Any]) -> str:
    cpu, spread = record["cpu_us_per_request"], record["cpu_us_per_request_range"]
    lines = [
        f"{record['device']}, {record['date']}",
        "main-process CPU per 1024x1024 request, median (min-max) us:",
    ]
    for path in ("socket", "region"):
        lo, hi = spread[path]
        lines.append(f"  {path:7s} {cpu[path]:8.1f} ({lo:.1f}-{hi:.1f})")
    lines.append(f"{'gpus':>4s} {'path':7s} {'rate':>7s} {'lost':>5s}  p99 ms per repeat")
    for row in record["serve"]:
        p99 = ", ".join(f"{v:g}" for v in row["p99_ms"])
        warm = f"  (after {row['warmup_s']:g} s of warm-up)" if "warmup_s" in row else ""
        lines.append(
            f"{row['gpus']:4d} {row['path']:7s} {row['rate']:7g} {row['lost']:5d}  {p99}{warm}"
        )
    lines.append(f"lost under kill: {record['lost_under_kill']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frontend", required=True, help="bench_frontend.py's JSON")
    p.add_argument("--serve", nargs="+", required=True, help="bench_serve.py JSONs")
    p.add_argument("--json", default="docs/bench/zero-copy.json")
    args = p.parse_args(argv)
    frontend = json.loads(Path(args.frontend).read_text())
    records = [json.loads(Path(f).read_text()) for f in args.serve]
    try:
        record = assemble(frontend, records)
    except (ValueError, KeyError) as exc:
        p.error(f"cannot assemble the record: {exc}")
    record["sources"] = {"frontend": Path(args.frontend).name}
    record["sources"]["serve"] = [Path(f).name for f in args.serve]
    print(table(record))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
