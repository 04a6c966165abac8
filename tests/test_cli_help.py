"""Every option of every ``scratchd`` command says what it does in ``--help``."""

from __future__ import annotations

from collections.abc import Iterator

import click

from scratchd.daemon.cli import main

NOT_OURS = {"eval"}
"""Commands whose help belongs to another part of the tree (model/cli.py's eval)."""


def _commands(
    group: click.Group, ctx: click.Context, path: str
) -> Iterator[tuple[str, click.Command]]:
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        assert command is not None, name
        where = f"{path} {name}"
        if isinstance(command, click.Group):
            yield from _commands(command, ctx, where)
        else:
            yield where, command


def test_every_option_has_help() -> None:
    ctx = click.Context(main)
    commands = dict(_commands(main, ctx, "scratchd"))
    assert {"scratchd serve", "scratchd infer", "scratchd status", "scratchd reload",
            "scratchd shard build", "scratchd model info"} <= commands.keys()  # fmt: skip
    missing = [
        f"{where} {'/'.join(param.opts)}"
        for where, command in commands.items()
        if where.split()[1] not in NOT_OURS
        for param in command.params
        if isinstance(param, click.Option) and not (param.help or "").strip()
    ]
    assert missing == []
