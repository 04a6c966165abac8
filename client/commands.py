"""The user's commands that talk to a running daemon: ``infer``, ``status`` and ``reload``
(wired into ``scratchd`` by ``daemon/cli.py``).

Every command takes ``--socket`` and otherwise honours ``SCRATCHD_SOCKET``.

``scratchd infer IMAGE...`` prints one line per image, in the order given (``--json``: one
object per line with ``image`` — the path exactly as given —, ``status``, ``verdict``,
``score``, ``boxes``, ``latency_ms`` (client round trip), ``worker``, plus ``error`` when
not ok). ``--mask-out DIR`` writes each mask as ``DIR/<image stem>.png`` (0/255, the input's
size; a repeated stem gets ``-<n>``).

Exit status, the same for every command here (``infer`` lists them in its ``--help``): 0 all
is well; 1 some image was not answered ``ok`` (``infer``) or the reload failed (``reload``);
2 a usage error (click's); 3 the daemon could not be reached, or the connection was lost or
timed out (the message names the socket).

``scratchd reload`` finds the daemon's pid in its status reply, sends SIGHUP (so only the
daemon's user or root may reload), waits for the status's reload counter to move and exits 1
when the reload failed (``reload_error``: a bad file, or keys only a restart applies, then
named in ``reload_needs_restart``; the daemon applied nothing). systemd's ``ExecReload`` runs
it, so ``systemctl reload`` reports the failure.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import click
import msgspec
from rich.console import Console

from scratchd.client import status_view
from scratchd.client.api import AsyncClient, Client, unpack_mask
from scratchd.protocol.defaults import DEFAULT_SOCKET, SOCKET_ENV, socket_path
from scratchd.protocol.image import ImageError, decode_image, encode_png
from scratchd.protocol.wire import StatusReply

EXIT_OK = 0
EXIT_NOT_OK = 1
"""``infer``: some image was not answered ok; ``reload``: the reload failed."""
EXIT_USAGE = 2
"""click's own usage errors (a bad option value, a missing argument)."""
EXIT_UNREACHABLE = 3
"""The daemon could not be reached, or the connection was lost or timed out."""


class Unreachable(click.ClickException):
    """No answer from the daemon: exit 3. The client's errors already name the socket."""

    exit_code = EXIT_UNREACHABLE


socket_option = click.option(
    "--socket",
    "socket_opt",
    default=None,
    metavar="PATH",
    help=f"Daemon socket (default: ${SOCKET_ENV}, else {DEFAULT_SOCKET}).",
)


@click.command(
    epilog="Exit status: 0 every image answered ok; 1 some image not ok (its line says why); "
    "2 usage error; 3 daemon unreachable (or the connection lost)."
)
@socket_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.option(
    "--concurrency",
    type=click.IntRange(1, 4096),
    default=8,
    show_default=True,
    help="Requests in flight at once on the connection.",
)
@click.option(
    "--priority",
    type=click.IntRange(0, 7),
    default=None,
    help="0 .. 7, 7 most urgent (default: the part class's).",
)
@click.option("--part-class", default=None, help="Configured part class (default: normal).")
@click.option(
    "--deadline-ms",
    type=click.IntRange(min=1),
    default=None,
    help="Answer `timeout` if not served within this (default: the part class's).",
)
@click.option(
    "--mask-out",
    type=click.Path(file_okay=False),
    default=None,
    metavar="DIR",
    help="Write each defect mask as DIR/<image name>.png (0/255, the image's size).",
)
@click.option(
    "--zero-copy",
    is_flag=True,
    help="Decode each image here and pass its pixels through shared memory, not the socket "
    "(the daemon must run on this machine; sent over the socket when it cannot be used).",
)
@click.argument("images", nargs=-1, required=True)
def infer(
    socket_opt: str | None,
    as_json: bool,
    concurrency: int,
    priority: int | None,
    part_class: str | None,
    deadline_ms: int | None,
    mask_out: str | None,
    zero_copy: bool,
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
    runner = _InferRun(socket_path(socket_opt), concurrency, options, as_json, masks, zero_copy)
    try:
        all_ok = asyncio.run(runner.run(images))
    except BrokenPipeError:  # our stdout went away (`| head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(EXIT_NOT_OK)
    except OSError as exc:
        raise Unreachable(str(exc)) from None
    sys.exit(EXIT_OK if all_ok else EXIT_NOT_OK)


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
        zero_copy: bool = False,
    ) -> None:
        self.zero_copy = zero_copy  # decoded here, pixels through the client's region
        self.path = path
        self.concurrency = concurrency
        self.options = options
        self.as_json = as_json
        self.masks = masks

    async def run(self, images: tuple[str, ...]) -> bool:
        gate = asyncio.Semaphore(self.concurrency)
        async with await AsyncClient.connect(self.path, zero_copy=self.zero_copy) as client:
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
                data: Any = Path(image).read_bytes()
                data = decode_image(data) if self.zero_copy else data
            except (OSError, ImageError) as exc:
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
@socket_option
@click.option("--json", "as_json", is_flag=True, help="Print the status as one JSON line.")
@click.option("--watch", is_flag=True, help="Refresh every --interval seconds until Ctrl-C.")
@click.option(
    "--interval",
    type=click.FloatRange(min=0.1),
    default=1.0,
    show_default=True,
    help="Seconds between refreshes with --watch.",
)
def status(socket_opt: str | None, as_json: bool, watch: bool, interval: float) -> None:
    """Show workers, queue depth per priority, latency per part class, drift and entropy."""
    path = socket_path(socket_opt)

    def fetch() -> dict[str, Any]:
        with Client(path, timeout=10.0) as client:
            return status_view.status_document(msgspec.to_builtins(client.status()))

    if watch and not as_json:
        status_view.watch_status(fetch, interval_s=interval)
        return
    while True:
        try:
            doc = fetch()
        except OSError as exc:
            raise Unreachable(str(exc)) from None
        if as_json:
            click.echo(status_view.to_json(doc))
        else:
            Console().print(status_view.render_status(doc))
        if not watch:
            return
        time.sleep(interval)  # --watch --json: one line per interval, for scripts


@click.command("reload")
@socket_option
@click.option(
    "--timeout",
    type=click.FloatRange(min=0),
    default=120.0,
    show_default=True,
    help="Seconds to wait for the reload to finish.",
)
def reload(socket_opt: str | None, timeout: float) -> None:
    """Re-read the config and model; replace workers one at a time (same as SIGHUP)."""
    path = socket_path(socket_opt)
    try:
        with Client(path, timeout=10.0) as client:
            before = client.status()
            _signal_daemon(before.pid)
            after = _wait_for_reload(client, before.reloads, timeout)
    except OSError as exc:
        raise Unreachable(str(exc)) from None
    versions = ", ".join(f"{w.name}={w.model_version}" for w in after.workers)
    if after.reload_error:
        click.echo(f"reload failed: {after.reload_error}", err=True)
        sys.exit(EXIT_NOT_OK)
    click.echo(f"reloaded: {versions}")


def _signal_daemon(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGHUP)
    except PermissionError:
        raise click.ClickException(
            f"not allowed to signal the daemon (pid {pid}): run as its user or root, "
            "or use `systemctl reload scratchd`"
        ) from None
    except ProcessLookupError:
        raise click.ClickException(
            f"the daemon's pid {pid} is not visible here (another pid namespace?)"
        ) from None


def _wait_for_reload(client: Client, before: int, timeout: float) -> StatusReply:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = client.status()
        if status.reloads > before:
            return status
        time.sleep(0.1)
    raise TimeoutError(f"scratchd at {client.path}: no reload finished within {timeout:.0f} s")
