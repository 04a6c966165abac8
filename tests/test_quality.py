"""The code base stays ruff- and mypy-clean: part of the test suite, so CI enforces it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )


@pytest.mark.parametrize(
    "args", [("ruff", "check", "."), ("ruff", "format", "--check", ".")], ids=["lint", "format"]
)
def test_ruff_is_clean(args: tuple[str, ...]) -> None:
    result = _run(*args)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_is_clean(tmp_path: Path) -> None:
    # The repository root is the `scratchd` package whatever the checkout is called, so give
    # mypy a search path in which it is found under that name.
    (tmp_path / "scratchd").symlink_to(ROOT, target_is_directory=True)
    env = {**os.environ, "MYPYPATH": str(tmp_path)}
    result = _run("mypy", "-p", "scratchd", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    scripts = sorted(str(p) for p in (ROOT / "scripts").glob("*.py"))
    if scripts:
        result = _run("mypy", *scripts, env=env)
        assert result.returncode == 0, result.stdout + result.stderr


MAX_LINES = 500


def test_no_python_file_is_over_500_lines() -> None:
    # A module that outgrows this holds more than one concept: split it by concept or role.
    listed = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    too_long = {}
    for name in listed:
        path = ROOT / name
        if path.is_file():
            lines = len(path.read_text(encoding="utf-8").splitlines())
            if lines > MAX_LINES:
                too_long[name] = lines
    assert not too_long, f"over {MAX_LINES} lines: {too_long}"
