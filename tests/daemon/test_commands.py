"""The CLI as a user runs it: ``scratchd infer`` lines and masks, ``status --json``,
``SCRATCHD_SOCKET``, and ``serve`` refusing a bad config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from scratchd.daemon.cli import main
from scratchd.protocol.image import decode_image

from .harness import SERVE, DaemonProcess


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with DaemonProcess(workers=2, slots=32) as d:
        yield d


@pytest.fixture
def images(data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Three real images as relative paths (the output must echo them exactly)."""
    monkeypatch.chdir(data_dir)
    return [
        "sd900/images/Sc_2.png",
        "sd900/images/In_2.png",
        str(sorted(Path("mtile/crack").glob("*.jpg"))[0]),
    ]


def test_infer_json_lines_in_the_order_given(daemon: DaemonProcess, images: list[str]) -> None:
    result = CliRunner().invoke(
        main, ["infer", "--socket", daemon.socket, "--json", "--concurrency", "2", *images]
    )
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.output.splitlines()]
    assert [line["image"] for line in lines] == images
    for line in lines:
        assert line["status"] == "ok"
        assert line["verdict"] in ("defect", "clean")
        assert 0.0 <= line["score"] <= 1.0
        assert all(len(box) == 5 for box in line["boxes"])
        assert line["latency_ms"] > 0
        assert line["worker"] in ("cpu0", "cpu1")


def test_infer_zero_copy_prints_what_the_socket_path_prints(
    daemon: DaemonProcess, images: list[str]
) -> None:
    """``--zero-copy`` decodes here and passes the pixels through shared memory: the same
    verdicts, scores and boxes as the encoded bytes over the socket."""
    outputs = []
    for flag in ([], ["--zero-copy"]):
        result = CliRunner().invoke(
            main, ["infer", "--socket", daemon.socket, "--json", *flag, *images]
        )
        assert result.exit_code == 0, result.output
        lines = [json.loads(line) for line in result.output.splitlines()]
        outputs.append(
            [(x["image"], x["status"], x["verdict"], x["score"], x["boxes"]) for x in lines]
        )
    assert outputs[0] == outputs[1]


def test_infer_writes_masks_of_the_input_size(
    daemon: DaemonProcess, images: list[str], tmp_path: Path
) -> None:
    out = tmp_path / "masks"
    result = CliRunner().invoke(
        main,
        # the first image twice: a second mask file, not an overwrite
        [
            "infer",
            "--socket",
            daemon.socket,
            "--mask-out",
            str(out),
            "--part-class",
            "safety",
            *images,
            images[0],
        ],
    )
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [Path(images[0]).stem + ".png", Path(images[0]).stem + "-2.png"]
        + [Path(i).stem + ".png" for i in images[1:]]
    )
    for image in images:
        mask = decode_image((out / (Path(image).stem + ".png")).read_bytes())
        assert mask.shape == decode_image(Path(image).read_bytes()).shape
        assert set(mask.ravel().tolist()) <= {0, 255}
    assert len(result.output.splitlines()) == len(images) + 1


def test_infer_reports_each_failure_and_exits_nonzero(
    daemon: DaemonProcess, images: list[str], tmp_path: Path
) -> None:
    junk = tmp_path / "junk.png"
    junk.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    result = CliRunner().invoke(
        main,
        ["infer", "--socket", daemon.socket, "--json", images[0], "missing.png", str(junk)],
    )
    assert result.exit_code == 1
    lines = [json.loads(line) for line in result.output.splitlines()]
    assert [line["status"] for line in lines] == ["ok", "invalid", "invalid"]
    assert "cannot read" in lines[1]["error"]
    assert "PNG" in lines[2]["error"]


def test_infer_priority_and_deadline_flags(daemon: DaemonProcess, images: list[str]) -> None:
    result = CliRunner().invoke(
        main,
        [
            "infer",
            "--socket",
            daemon.socket,
            "--json",
            "--priority",
            "6",
            "--deadline-ms",
            "30000",
            images[0],
        ],
    )
    assert result.exit_code == 0, result.output
    bad = CliRunner().invoke(main, ["infer", "--socket", daemon.socket, "--priority", "8", "x"])
    assert bad.exit_code == 2  # click's usage error: 0..7


def test_status_json_and_the_socket_environment_variable(daemon: DaemonProcess) -> None:
    result = CliRunner().invoke(main, ["status", "--json"], env={"SCRATCHD_SOCKET": daemon.socket})
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    workers = sorted(doc["workers"], key=lambda w: w["id"])
    assert [w["id"] for w in workers] == [0, 1]
    for w in workers:
        assert w["state"] == "ready" and w["device"] == "cpu" and w["restarts"] == 0
        assert w["pid"] > 0
    assert len(doc["queue"]["depth"]) == 8
    # the documented schema (client/status_view.py): no wire fields, labelled classes, each
    # standby once
    assert not {"id", "type", "standby"} & doc.keys()
    assert doc["classes"]["normal"] == {"priority": 0, "deadline_ms": 600000}
    assert len(doc["standbys"]) <= 1 and "name" in (doc["standbys"] or [{"name": 0}])[0]


def test_infer_honours_the_socket_environment_variable(
    daemon: DaemonProcess, images: list[str]
) -> None:
    env = {**os.environ, "SCRATCHD_SOCKET": daemon.socket}
    cmd = [sys.executable, "-c", "from scratchd.daemon.cli import main; main()", "infer"]
    done = subprocess.run([*cmd, images[0]], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(images[0] + "  ok  ")


def test_commands_without_a_daemon_say_where_they_looked(tmp_path: Path) -> None:
    sock = str(tmp_path / "none.sock")
    for args in (["status", "--socket", sock], ["infer", "--socket", sock, "x.png"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 3 and f"scratchd at {sock}: [Errno 2]" in result.output


def test_infer_lists_its_exit_statuses_in_help() -> None:
    shown = CliRunner().invoke(main, ["infer", "--help"], terminal_width=200)
    assert shown.exit_code == 0
    text = " ".join(shown.output.split())
    for status in ("0 every image answered ok", "1 some image not ok", "2 usage", "3 daemon"):
        assert status in text, text


def test_serve_refuses_an_unknown_config_key_naming_it(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("[queue]\nslotz = 3\n")
    done = subprocess.run(
        [*SERVE, "--config", str(config), "--socket", str(tmp_path / "s.sock")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "unknown key 'queue.slotz'" in done.stderr and str(config) in done.stderr


@pytest.mark.parametrize("model", ["garbage", "missing"])
def test_serve_refuses_a_bad_model_file_naming_it(tmp_path: Path, model: str) -> None:
    """Exit 2 (systemd does not restart it) with the config and model files named, before a
    worker starts; not numpy's advice to unpickle the file, not a pool halt's exit 1."""
    path = tmp_path / f"{model}.npz"
    if model == "garbage":
        path.write_bytes(b"this is not a model\n" * 50)
    config = tmp_path / "scratchd.toml"
    config.write_text(f'[workers]\nbackend = "cpu"\n[model]\npath = "{path}"\n')
    done = subprocess.run(
        [*SERVE, "--config", str(config), "--socket", str(tmp_path / "s.sock")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert str(config) in done.stderr and str(path) in done.stderr
    assert "pickle" not in done.stderr and "worker" not in done.stderr
