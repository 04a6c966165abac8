"""The code base stays ruff- and mypy-clean: part of the test suite, so CI enforces it."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, check=False
    )


@pytest.mark.parametrize(
    "args", [("ruff", "check", "."), ("ruff", "format", "--check", ".")], ids=["lint", "format"]
)
def test_ruff_is_clean(args: tuple[str, ...]) -> None:
    if shutil.which("ruff") is None and _run("ruff", "--version").returncode != 0:
        pytest.fail("ruff is not installed (pip install -e '.[test]')")
    result = _run(*args)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_is_clean() -> None:
    result = _run("mypy", ".")
    assert result.returncode == 0, result.stdout + result.stderr
