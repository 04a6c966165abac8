"""Reload: which keys apply live, the reload sequence, and (live) a SIGHUP under load."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import msgspec
import numpy as np
import pytest
from click.testing import CliRunner

from scratchd.client.api import Client
from scratchd.daemon.cli import main
from scratchd.daemon.config import Config, ConfigError, load_config
from scratchd.daemon.ops import reload as reload_module
from scratchd.daemon.ops.notify import Notifier
from scratchd.daemon.ops.reload import Reloader, config_changes, model_version
from scratchd.model.scratchnet import ScratchNet, load_model, save_model

from ..live_daemon import (
    MODEL_PATH,
    assert_served_correctly,
    daemon_config,
    live_daemon,
    real_crops,
    real_images,
    write_config,
)


def _config(**overrides: object) -> Config:
    return load_config(None, overrides, environ={})


def test_live_and_restart_only_changes_are_told_apart() -> None:
    old = _config()
    new = _config(**{"model.path": "/srv/m2.npz", "queue.slots": 512, "server.allowed_uids": [7]})
    live, fixed = config_changes(old, new)
    assert live == ["model", "server.allowed_uids"]
    assert fixed == ["queue.slots"]
    assert config_changes(old, old) == ([], [])
    limits = _config(**{"server.max_connections": 10, "server.frame_timeout_ms": 50})
    assert config_changes(old, limits) == (
        ["server.frame_timeout_ms", "server.max_connections"],
        [],
    )


def test_classes_change_live() -> None:
    old = _config()
    raw = msgspec.structs.replace(old, classes={**old.classes})
    raw.classes["bracket"] = msgspec.structs.replace(old.classes["safety"], deadline_ms=500)
    live, fixed = config_changes(old, raw)
    assert (live, fixed) == (["classes"], [])


class _Pool:
    def __init__(self) -> None:
        self.configs: list[Config] = []
        self.restarts = 0

    def apply(self, config: Config) -> None:
        self.configs.append(config)

    async def rolling_restart(self) -> None:
        self.restarts += 1


def _reloader(pool: _Pool, read: Callable[[], Config], check: Callable[[Config], str]) -> Reloader:
    current = _config()
    return Reloader(
        read_config=read,
        current=lambda: current,
        apply=pool.apply,
        rolling_restart=pool.rolling_restart,
        notifier=Notifier(None),
        summary=lambda: "2/2 workers ready",
        check_model=check,
    )


def test_a_reload_applies_then_replaces_workers() -> None:
    pool = _Pool()
    new = _config(**{"model.path": "/srv/m2.npz"})
    reloader = _reloader(pool, lambda: new, lambda c: "v2")
    outcome = asyncio.run(reloader.reload_once())
    assert outcome.ok and "v2" in outcome.message and "model" in outcome.message
    assert pool.restarts == 1 and pool.configs[-1].model.path == "/srv/m2.npz"
    assert (reloader.count, reloader.last_error) == (1, "")


def test_a_reload_keeps_the_configured_views(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reload reading ``model.views``: the model is checked with those views and the
    workers are replaced with them (the file's own four are not what gets served)."""
    pool = _Pool()
    new = _config(**{"model.path": "", "model.views": ["identity"]})
    checked: list[Config] = []
    loaded_with: list[list[str] | None] = []

    def recording(path: str | Path | None = None, views: Sequence[str] | None = None) -> ScratchNet:
        loaded_with.append(None if views is None else list(views))
        return load_model(path, views)

    monkeypatch.setattr(reload_module, "load_model", recording)

    def check(config: Config) -> str:
        checked.append(config)
        return model_version(config)

    reloader = _reloader(pool, lambda: new, check)
    outcome = asyncio.run(reloader.reload_once())
    assert outcome.ok and pool.restarts == 1
    assert checked[0].model.views == pool.configs[-1].model.views == ["identity"]
    assert loaded_with == [["identity"]]  # model_version loaded the file with those views
    assert config_changes(_config(), new) == (["model"], [])  # views change live


def test_a_bad_config_keeps_everything_running() -> None:
    pool = _Pool()

    def broken() -> Config:
        raise ConfigError("scratchd.toml: unknown key 'queue.slotz'")

    reloader = _reloader(pool, broken, lambda c: "v2")
    outcome = asyncio.run(reloader.reload_once())
    assert not outcome.ok and "queue.slotz" in outcome.message
    assert pool.restarts == 0 and pool.configs == [], "nothing may be touched"
    assert reloader.count == 1 and "queue.slotz" in reloader.last_error


def test_a_key_that_needs_a_restart_refuses_the_whole_reload() -> None:
    """Nothing applied (not even the live keys beside it), no worker replaced, the keys
    named: the running daemon stays exactly the configuration someone wrote."""
    pool = _Pool()
    new = _config(**{"workers.cpu_workers": 5, "model.path": "/srv/m2.npz"})
    reloader = _reloader(pool, lambda: new, lambda c: "v2")
    outcome = asyncio.run(reloader.reload_once())
    assert not outcome.ok and outcome.needs_restart == ("workers.cpu_workers",)
    assert "workers.cpu_workers" in outcome.message and "restart" in outcome.message
    assert pool.restarts == 0 and pool.configs == []
    assert reloader.needs_restart == ("workers.cpu_workers",)
    assert "workers.cpu_workers" in reloader.last_error


def test_a_broken_model_is_refused_before_any_worker_is_replaced() -> None:
    pool = _Pool()

    def check(config: Config) -> str:
        raise ValueError("m2.npz: not a readable model file")

    outcome = asyncio.run(_reloader(pool, _config, check).reload_once())
    assert not outcome.ok and "m2.npz" in outcome.message
    assert pool.restarts == 0


def test_signals_during_a_reload_fold_into_one_more() -> None:
    pool = _Pool()
    reloader = _reloader(pool, _config, lambda c: "v1")

    async def scenario() -> None:
        task = asyncio.create_task(reloader.run())
        for _ in range(5):
            reloader.request()
        await asyncio.sleep(0.05)
        reloader.request()
        await asyncio.sleep(0.05)
        task.cancel()

    asyncio.run(scenario())
    assert pool.restarts == 2


# ---- live: a real daemon under load ----------------------------------------------------


def _model_copy(path: Path, version: str) -> Path:
    """The served model's weights under another version string (same predictions)."""
    model = load_model(MODEL_PATH or None)
    save_model(path, model.weights, dataclasses.replace(model.meta, version=version))
    return path


class _Load:
    """Real images sent continuously from a thread, ``concurrency`` in flight, until stopped;
    every reply recorded."""

    def __init__(self, socket_path: str, images: list[np.ndarray], concurrency: int = 8) -> None:
        self.socket_path = socket_path
        self.images = images
        self.concurrency = concurrency
        self.statuses: collections.Counter[str] = collections.Counter()
        self.errors: list[str] = []
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def __enter__(self) -> _Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)

    def wait_for(self, replies: int, timeout: float = 60.0) -> None:
        end = time.monotonic() + timeout
        while sum(self.statuses.values()) < replies and time.monotonic() < end:
            time.sleep(0.02)

    def _run(self) -> None:
        with Client(self.socket_path, timeout=60) as client:
            replies = client.map(self._stream(), concurrency=self.concurrency, deadline_ms=60_000)
            for _, reply in replies:
                self.statuses[reply.status] += 1
                if reply.status != "ok":
                    self.errors.append(f"{reply.status}: {reply.error}")

    def _stream(self) -> Iterator[np.ndarray]:
        for image in itertools.cycle(self.images):
            if self._stop.is_set():
                return
            self.sent += 1
            yield image


def test_sighup_reload_under_load_loses_nothing(tmp_path: Path, data_dir: Path) -> None:
    model_a = _model_copy(tmp_path / "a.npz", "ops-test-a")
    model_b = _model_copy(tmp_path / "b.npz", "ops-test-b")
    config = daemon_config(workers={"cpu_workers": 2}, model={"path": str(model_a)})
    images = real_crops(data_dir, 24)
    with live_daemon(tmp_path, config) as daemon:
        before = daemon.status()
        assert {w.model_version for w in before.workers} == {"ops-test-a"}
        with _Load(daemon.socket_path, images) as load:
            load.wait_for(20)
            config["model"]["path"] = str(model_b)
            write_config(daemon.config_path, config)
            daemon.read_notifications(0.05)  # room in the notify queue for RELOADING=1
            daemon.proc.send_signal(signal.SIGHUP)
            _wait(lambda: daemon.status().reloads == 1, 120)
            served_during = sum(load.statuses.values())
            load.wait_for(served_during + 20)
        after = daemon.status()
        assert load.statuses["ok"] == load.sent, (load.statuses, load.errors[:5])
        assert not load.errors
        assert after.reload_error == ""
        assert {w.model_version for w in after.workers} == {"ops-test-b"}
        assert not {w.pid for w in before.workers} & {w.pid for w in after.workers}
        assert [e["event"] for e in daemon.events() if e["event"].startswith("reload")] == [
            "reload_start",
            "reload_done",
        ]
        # `scratchd status` shows each worker's model version, as JSON and in the table.
        runner = CliRunner(env={"COLUMNS": "200"})
        shown = runner.invoke(main, ["status", "--json", "--socket", daemon.socket_path])
        assert shown.exit_code == 0, shown.output
        workers = json.loads(shown.output)["workers"]
        assert [w["model_version"] for w in workers] == ["ops-test-b", "ops-test-b"]
        table = runner.invoke(main, ["status", "--socket", daemon.socket_path]).output
        # the header names the model served; a worker's only shows while it differs
        assert "model ops-test-b" in table and "ops-test-a" not in table, table
        daemon.read_notifications(0.5)
        notified = [m for m in daemon.notifications if "RELOADING" in m]
        assert notified and "MONOTONIC_USEC" in notified[0]


def test_scratchd_reload_reports_a_bad_config_and_keeps_serving(
    tmp_path: Path, data_dir: Path
) -> None:
    config = daemon_config()
    with live_daemon(tmp_path, config) as daemon:
        runner = CliRunner()
        ok = runner.invoke(main, ["reload", "--socket", daemon.socket_path])
        assert ok.exit_code == 0, ok.output
        assert "reloaded: cpu0=" in ok.output
        config["queue"]["slotz"] = 3
        write_config(daemon.config_path, config)
        bad = runner.invoke(main, ["reload", "--socket", daemon.socket_path])
        assert bad.exit_code == 1
        assert "queue.slotz" in bad.output
        status = daemon.status()
        assert status.reloads == 2 and "queue.slotz" in status.reload_error
        workers = {w.pid for w in status.workers}
        del config["queue"]["slotz"]
        config["workers"]["cpu_workers"] = 2
        write_config(daemon.config_path, config)
        restart = runner.invoke(main, ["reload", "--socket", daemon.socket_path])
        assert restart.exit_code == 1, restart.output
        assert "workers.cpu_workers" in restart.output and "restart" in restart.output
        status = daemon.status()
        assert status.reloads == 3 and status.reload_needs_restart == ["workers.cpu_workers"]
        assert {w.pid for w in status.workers} == workers, "no worker replaced for nothing"
        assert_served_correctly(daemon, real_images(data_dir, 4))


def test_sigterm_drain_under_load_answers_everything_accepted(
    tmp_path: Path, data_dir: Path
) -> None:
    config = daemon_config(workers={"cpu_workers": 2}, queue={"slots": 64})
    images = real_crops(data_dir, 48)
    with live_daemon(tmp_path, config) as daemon:
        (ready,) = daemon.events("ready")
        segment = Path("/dev/shm") / ready["queue"].lstrip("/")
        assert segment.exists()
        with daemon.client(timeout=60) as client:
            pending = client.map(images, concurrency=48, deadline_ms=60_000)  # all accepted
            first = next(pending)
            daemon.read_notifications(0.01)  # room in the notify queue for STOPPING=1
            daemon.proc.send_signal(signal.SIGTERM)  # while ~47 are queued or computing
            replies = [first, *pending]
        assert sorted(i for i, _ in replies) == list(range(48)), "a request was lost"
        assert [r.status for _, r in replies] == ["ok"] * 48, [r.error for _, r in replies]
        assert daemon.proc.wait(60) == 0
        assert [e["event"] for e in daemon.events("drain")] == ["drain"]
        assert not segment.exists(), "the drain must unlink its shared memory"
        assert any(m.get("STOPPING") == "1" for m in daemon.read_notifications(0.5))


def test_unknown_config_key_stops_serve_naming_it(tmp_path: Path) -> None:
    bad = write_config(tmp_path / "bad.toml", {"queue": {"slotz": 3}})
    result = subprocess.run(
        [
            *(sys.executable, "-c", "from scratchd.daemon.cli import main; main()", "serve"),
            *("--config", str(bad), "--socket", str(tmp_path / "s.sock")),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, result.stderr  # systemd: RestartPreventExitStatus=2
    assert "unknown key 'queue.slotz'" in result.stderr
    assert not (tmp_path / "s.sock").exists()


def _wait(condition: Callable[[], bool], timeout: float) -> None:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise TimeoutError("condition not met in time")
        time.sleep(0.05)
