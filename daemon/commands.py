"""``scratchd serve``: the daemon in the foreground (wired into ``scratchd`` by daemon/cli.py).

A configuration that cannot be used (an unknown key, a backend this machine cannot run, a
``[model] path`` that is missing or not a model file, views the model cannot run) exits with
status 2 (``EXIT_CONFIG``) and a message naming the file, which systemd's
``RestartPreventExitStatus`` does not restart. The model is loaded once here, before any
worker starts, for that reason: a worker's boot failure would halt the pool with exit 1,
which systemd restarts again and again.
"""

from __future__ import annotations

import sys

import click

from scratchd.client.commands import socket_option
from scratchd.daemon import app
from scratchd.daemon.config import ConfigError, load_config
from scratchd.daemon.ops.reload import model_version
from scratchd.daemon.pool.gpus import place
from scratchd.model.scratchnet import ModelError
from scratchd.protocol.log import configure

EXIT_CONFIG = 2
"""``serve`` exit status for an unusable configuration (restarting cannot help)."""


class ConfigExit(click.ClickException):
    """A configuration error: exit status 2 (systemd's RestartPreventExitStatus, no loop)."""

    exit_code = EXIT_CONFIG


@click.command()
@click.option("--config", "config_path", default=None, metavar="FILE", help="TOML config file.")
@socket_option
@click.option(
    "--backend",
    type=click.Choice(["cpu", "cuda", "auto"]),
    default=None,
    help="Where workers compute (default: workers.backend, auto: CUDA when usable).",
)
@click.option("--workers", type=click.IntRange(min=1), default=None, help="CPU worker count.")
def serve(
    config_path: str | None, socket_opt: str | None, backend: str | None, workers: int | None
) -> None:
    """Run the daemon in the foreground until SIGTERM/SIGINT."""
    configure()
    overrides = {
        "server.socket": socket_opt,
        "workers.backend": backend,
        "workers.cpu_workers": workers,
    }
    try:
        config = load_config(config_path, overrides)
        placement = place(config)  # a backend this machine cannot run is a ConfigError
        if config.model.cascade and placement.backend == "cuda":
            raise ConfigError(
                "model.cascade = true: the CUDA backend has no cascade yet (CPU workers only)"
            )
        model_version(config)
    except ConfigError as exc:
        raise ConfigExit(str(exc)) from None
    except ModelError as exc:  # names the model file; say which file configured it
        raise ConfigExit(f"{config_path or 'defaults'}: [model] path: {exc}") from None
    sys.exit(app.serve(config, lambda: load_config(config_path, overrides), placement))
