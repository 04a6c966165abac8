"""The `scratchd` command line imports a command's module only when it is invoked, so the
client commands start without the daemon, the model or the CUDA code."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from scratchd.daemon.cli import COMMANDS

CLIENT_COMMANDS = [name for name, (module, _) in COMMANDS.items() if ".client." in module]
HEAVY = ("scratchd.model", "scratchd.kernels", "scratchd.gpu", "scratchd.workers", "scratchd.ipc")


@pytest.mark.parametrize("command", CLIENT_COMMANDS)
def test_client_commands_import_no_model_or_cuda_code(command: str) -> None:
    script = (
        "import json, sys\n"
        f"sys.argv = ['scratchd', {command!r}, '--help']\n"
        "from scratchd.daemon.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('scratchd'))))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    heavy = [m for m in loaded if m.startswith(HEAVY)]
    assert not heavy, f"`scratchd {command} --help` imported {heavy}"
