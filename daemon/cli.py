"""The `scratchd` command line.

Subcommands live in the modules that own them and are imported only when invoked, so
`scratchd infer` does not pay for importing the daemon or numpy-heavy model code.
Each entry maps a command name to ``module:attribute`` of a click command or group.
"""

from __future__ import annotations

import importlib
from typing import Any

import click

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("scratchd.daemon.commands", "serve"),
    "infer": ("scratchd.client.commands", "infer"),
    "status": ("scratchd.client.commands", "status"),
    "reload": ("scratchd.client.commands", "reload"),
    "shard": ("scratchd.dataset.cli", "shard"),
    "eval": ("scratchd.model.cli", "eval_cmd"),
    "model": ("scratchd.model.cli", "model"),
}


class LazyGroup(click.Group):
    """A click group whose subcommands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(COMMANDS))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.commands:
            return self.commands[cmd_name]
        target = COMMANDS.get(cmd_name)
        if target is None:
            return None
        module = importlib.import_module(target[0])
        command: Any = getattr(module, target[1])
        if not isinstance(command, click.Command):
            raise TypeError(f"{target[0]}:{target[1]} is not a click command")
        return command


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="scratchd")
def main() -> None:
    """scratchd: surface-defect inspection daemon."""
