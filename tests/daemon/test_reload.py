"""Reload: which keys apply live, the reload sequence, and (live) a SIGHUP under load."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec

from scratchd.daemon.config import Config, ConfigError, load_config
from scratchd.daemon.notify import Notifier
from scratchd.daemon.reload import Reloader, config_changes, effective_config


def _config(**overrides: object) -> Config:
    return load_config(None, overrides, environ={})


def test_live_and_restart_only_changes_are_told_apart() -> None:
    old = _config()
    new = _config(**{"model.path": "/srv/m2.npz", "queue.slots": 512, "server.allowed_uids": [7]})
    live, fixed = config_changes(old, new)
    assert live == ["model", "server.allowed_uids"]
    assert fixed == ["queue.slots"]
    effective = effective_config(old, new)
    assert effective.model.path == "/srv/m2.npz"
    assert effective.server.allowed_uids == [7]
    assert effective.queue.slots == old.queue.slots, "geometry is fixed for the process"
    assert config_changes(old, old) == ([], [])


def test_classes_change_live() -> None:
    old = _config()
    raw = msgspec.structs.replace(old, classes={**old.classes})
    raw.classes["bracket"] = msgspec.structs.replace(old.classes["safety"], deadline_ms=500)
    live, fixed = config_changes(old, raw)
    assert (live, fixed) == (["classes"], [])
    assert "bracket" in effective_config(old, raw).classes


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


def test_a_bad_config_keeps_everything_running() -> None:
    pool = _Pool()

    def broken() -> Config:
        raise ConfigError("scratchd.toml: unknown key 'queue.slotz'")

    reloader = _reloader(pool, broken, lambda c: "v2")
    outcome = asyncio.run(reloader.reload_once())
    assert not outcome.ok and "queue.slotz" in outcome.message
    assert pool.restarts == 0 and pool.configs == [], "nothing may be touched"
    assert reloader.count == 1 and "queue.slotz" in reloader.last_error


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
