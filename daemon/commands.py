"""The ``serve``, ``infer`` and ``status`` commands (wired into ``scratchd`` by daemon/cli.py).

Every command takes ``--socket`` and otherwise honours ``SCRATCHD_SOCKET``.

``scratchd infer IMAGE...`` prints one line per image, in the order given (``--json``: one
object per line with ``image`` — the path exactly as given —, ``status``, ``verdict``,
``score``, ``boxes``, ``latency_ms`` (client round trip), ``worker``, plus ``error`` when
not ok). It exits 0 when every image was answered ``ok``, 1 otherwise. ``--mask-out DIR``
writes each mask as ``DIR/<image stem>.png`` (0/255, the input's size; a repeated stem gets
``-<n>``).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import click

from scratchd.daemon.config import ConfigError, load_config, socket_path

EXIT_CONFIG = 2
"""``serve`` exit status for an unusable configuration (restarting cannot help)."""


class ConfigExit(click.ClickException):
    """A configuration error: exit status 2 (systemd's RestartPreventExitStatus, no loop)."""

    exit_code = EXIT_CONFIG


_socket_option = click.option(
    "--socket",
    "socket_opt",
    default=None,
    metavar="PATH",
    help="Daemon socket (default: $SCRATCHD_SOCKET, else /run/scratchd/scratchd.sock).",
)


@click.command()
@click.option("--config", "config_path", default=None, metavar="FILE", help="TOML config file.")
@_socket_option
@click.option("--backend", type=click.Choice(["cpu", "cuda", "auto"]), default=None)
@click.option("--workers", type=click.IntRange(min=1), default=None, help="CPU worker count.")
def serve(
    config_path: str | None, socket_opt: str | None, backend: str | None, workers: int | None
) -> None:
    """Run the daemon in the foreground until SIGTERM/SIGINT."""
    from scratchd.daemon import app
    from scratchd.daemon.gpus import place
    from scratchd.daemon.log import configure

    configure()
    overrides = {
        "server.socket": socket_opt,
        "workers.backend": backend,
        "workers.cpu_workers": workers,
    }
    try:
        config = load_config(config_path, overrides)
        placement = place(config)  # a backend this machine cannot run is a ConfigError
    except ConfigError as exc:
        raise ConfigExit(str(exc)) from None
    sys.exit(app.serve(config, lambda: load_config(config_path, overrides), placement))


@click.command()
@_socket_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.option("--concurrency", type=click.IntRange(1, 4096), default=8, show_default=True)
@click.option("--priority", type=click.IntRange(0, 7), default=None)
@click.option("--part-class", default=None, help="Configured part class (default: normal).")
@click.option("--deadline-ms", type=click.IntRange(min=1), default=None)
@click.option("--mask-out", type=click.Path(file_okay=False), default=None, metavar="DIR")
@click.argument("images", nargs=-1, required=True)
def infer(
    socket_opt: str | None,
    as_json: bool,
    concurrency: int,
    priority: int | None,
    part_class: str | None,
    deadline_ms: int | None,
    mask_out: str | None,
    images: tuple[str, ...],
) -> None:
    """Send IMAGE files to the daemon and print each verdict."""
    options: dict[str, Any] = {
        "priority": priority,
        "part_class": part_class,
        "deadline_ms": deadline_ms,
        "want_mask": mask_out is not None,
    }
    masks = _MaskWriter(Path(mask_out)) if mask_out else None
    runner = _InferRun(socket_path(socket_opt), concurrency, options, as_json, masks)
    try:
        all_ok = asyncio.run(runner.run(images))
    except BrokenPipeError:  # our stdout went away (`| head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    except OSError as exc:
        raise click.ClickException(f"scratchd at {runner.path}: {exc}") from None
    sys.exit(0 if all_ok else 1)


class _MaskWriter:
    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.used: set[str] = set()

    def path_for(self, image: str) -> Path:
        stem, n = Path(image).stem, 1
        name = stem
        while name in self.used:
            n += 1
            name = f"{stem}-{n}"
        self.used.add(name)
        return self.directory / f"{name}.png"


class _InferRun:
    def __init__(
        self,
        path: str,
        concurrency: int,
        options: dict[str, Any],
        as_json: bool,
        masks: _MaskWriter | None,
    ) -> None:
        self.path = path
        self.concurrency = concurrency
        self.options = options
        self.as_json = as_json
        self.masks = masks

    async def run(self, images: tuple[str, ...]) -> bool:
        from scratchd.client import AsyncClient

        gate = asyncio.Semaphore(self.concurrency)
        async with await AsyncClient.connect(self.path) as client:
            tasks = [asyncio.ensure_future(self._one(client, gate, image)) for image in images]
            all_ok = True
            try:
                for task in tasks:
                    line = await task
                    all_ok &= line["status"] == "ok"
                    self._print(line)
            finally:
                for task in tasks:
                    task.cancel()
        return all_ok

    async def _one(self, client: Any, gate: asyncio.Semaphore, image: str) -> dict[str, Any]:
        async with gate:
            try:
                data = Path(image).read_bytes()
            except OSError as exc:
                return {"image": image, "status": "invalid", "error": f"cannot read: {exc}"}
            start = time.perf_counter()
            reply = await client.infer(data, **self.options)
            latency_ms = (time.perf_counter() - start) * 1000.0
        line: dict[str, Any] = {
            "image": image,
            "status": reply.status,
            "verdict": reply.verdict or None,
            "score": reply.score,
            "boxes": [list(box) for box in reply.boxes],
            "latency_ms": round(latency_ms, 3),
            "worker": reply.worker,
        }
        if reply.error:
            line["error"] = reply.error
        if self.masks is not None and reply.status == "ok":
            line["mask"] = str(self._write_mask(reply, image))
        return line

    def _write_mask(self, reply: Any, image: str) -> Path:
        from scratchd.client import unpack_mask
        from scratchd.ipc.image import encode_png

        assert self.masks is not None
        mask = unpack_mask(reply)
        path = self.masks.path_for(image)
        if mask is not None:
            path.write_bytes(encode_png(mask))
        return path

    def _print(self, line: dict[str, Any]) -> None:
        if self.as_json:
            click.echo(json.dumps(line))
            return
        if line["status"] != "ok":
            click.echo(f"{line['image']}  {line['status']}  {line.get('error', '')}")
            return
        click.echo(
            f"{line['image']}  ok  {line['verdict']:<6}  score={line['score']:.3f}  "
            f"boxes={len(line['boxes'])}  {line['latency_ms']:.1f} ms  {line['worker']}"
        )


@click.command()
@_socket_option
@click.option("--json", "as_json", is_flag=True, help="Print the status as one JSON line.")
@click.option("--watch", is_flag=True, help="Refresh every --interval seconds until Ctrl-C.")
@click.option("--interval", type=click.FloatRange(min=0.1), default=1.0, show_default=True)
def status(socket_opt: str | None, as_json: bool, watch: bool, interval: float) -> None:
    """Show workers, queue depth per priority, latency per part class, drift and entropy."""
    import msgspec

    from scratchd.client import Client
    from scratchd.daemon import status_view

    path = socket_path(socket_opt)

    def fetch() -> dict[str, Any]:
        with Client(path, timeout=10.0) as client:
            doc: dict[str, Any] = msgspec.to_builtins(client.status())
            return doc

    if watch and not as_json:
        status_view.watch_status(fetch, interval_s=interval)
        return
    while True:
        try:
            doc = fetch()
        except OSError as exc:
            raise click.ClickException(f"scratchd at {path}: {exc}") from None
        if as_json:
            click.echo(status_view.to_json(doc))
        else:
            from rich.console import Console

            Console().print(status_view.render_status(doc))
        if not watch:
            return
        time.sleep(interval)  # --watch --json: one line per interval, for scripts
