"""The systemd units are valid, hardened without breaking the GPU, and install cleanly.

``systemd-analyze`` comes from Debian's ``systemd`` package (CI installs it when missing);
these tests skip only when the tool is absent.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from scratchd.daemon.config import load_config

ROOT = Path(__file__).resolve().parent.parent
UNITS = ROOT / "systemd"
INSTALLED_ENTRY = "/opt/scratchd/venv/bin/scratchd"
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed")


def _directives(unit: Path) -> Iterator[tuple[str, str, str]]:
    """(section, key, value) for every assignment; keys may repeat, as in systemd."""
    section = ""
    for raw in unit.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        yield section, key.strip(), value.strip()


def _values(unit: Path, key: str) -> list[str]:
    return [value for _, k, value in _directives(unit) if k == key]


def _entry_point() -> Path:
    """The `scratchd` console script installed for the interpreter running the tests."""
    beside = Path(sys.executable).parent / "scratchd"
    if beside.exists():
        return beside
    found = shutil.which("scratchd")
    if found is None:
        pytest.fail("the scratchd entry point is not installed (pip install -e .)")
    return Path(found)


def _units_pointing_at(entry: Path, dest: Path, source: Path = UNITS) -> Path:
    """Copy both units from ``source`` to ``dest`` with ExecStart naming ``entry``."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("scratchd.service", "scratchd.socket"):
        text = (source / name).read_text().replace(INSTALLED_ENTRY, str(entry))
        (dest / name).write_text(text)
    return dest / "scratchd.service"


def _verify(*units: Path) -> None:
    assert ANALYZE is not None
    result = subprocess.run(
        [ANALYZE, "verify", *map(str, units)],
        capture_output=True,
        text=True,
        cwd=units[0].parent,
        check=False,
    )
    # verify also reports on units we do not own (missing system units in a container);
    # only lines about ours, or a failing exit status, are our problem.
    ours = [line for line in result.stderr.splitlines() if "scratchd" in line]
    assert result.returncode == 0 and not ours, result.stdout + result.stderr


def _exposure(service: Path) -> float:
    assert ANALYZE is not None
    result = subprocess.run(
        [ANALYZE, "security", "--offline=yes", "--no-pager", str(service)],
        capture_output=True,
        text=True,
        cwd=service.parent,
        check=False,
    )
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", result.stdout)
    assert found, result.stdout + result.stderr
    return float(found.group(1))


@needs_analyze
def test_units_verify_with_execstart_at_the_installed_entry_point(tmp_path: Path) -> None:
    service = _units_pointing_at(_entry_point(), tmp_path)
    _verify(service, tmp_path / "scratchd.socket")


@needs_analyze
def test_verify_catches_a_missing_entry_point(tmp_path: Path) -> None:
    # The check above can fail: the same units, pointing nowhere, are rejected.
    service = _units_pointing_at(tmp_path / "no" / "scratchd", tmp_path / "units")
    with pytest.raises(AssertionError, match="not executable"):
        _verify(service)


@needs_analyze
def test_security_exposure_is_at_most_two(tmp_path: Path) -> None:
    service = _units_pointing_at(_entry_point(), tmp_path)
    exposure = _exposure(service)
    # The unit must stay under 3.0; hold it at 2.0 so a weakening shows before that.
    assert exposure <= 2.0, f"exposure {exposure} > 2.0"


@needs_analyze
def test_exposure_measure_reacts_to_hardening(tmp_path: Path) -> None:
    service = _units_pointing_at(_entry_point(), tmp_path)
    stripped = [
        line
        for line in service.read_text().splitlines()
        if not line.startswith(("Protect", "Restrict", "SystemCall", "Capability", "Private"))
    ]
    weak = tmp_path / "weak" / "scratchd.service"
    weak.parent.mkdir()
    weak.write_text("\n".join(stripped) + "\n")
    assert _exposure(weak) > _exposure(service) + 2.0


def test_service_keeps_the_gpu_reachable_and_the_peer_uids_real() -> None:
    service = UNITS / "scratchd.service"
    keys = {key for _, key, _ in _directives(service)}
    assert _values(service, "Type") == ["notify"]
    assert _values(service, "KillMode") == ["mixed"]
    # An OOM-killed worker is replaced by the supervisor, not a reason to stop the service.
    assert _values(service, "OOMPolicy") == ["continue"]
    assert _values(service, "Restart") == ["on-failure"]
    assert _values(service, "RuntimeDirectory") == ["scratchd"]
    assert _values(service, "User") == ["scratchd"]
    assert _values(service, "WatchdogSec")
    assert _values(service, "DevicePolicy") == ["closed"]
    allowed = " ".join(_values(service, "DeviceAllow"))
    for device in ("/dev/nvidiactl", "/dev/nvidia-uvm", "char-nvidia-frontend"):
        assert device in allowed
    # PrivateDevices hides /dev/nvidia*, MemoryDenyWriteExecute breaks the JIT, and
    # PrivateUsers maps every peer to uid 65534, which would defeat allowed_uids.
    assert not keys & {"PrivateDevices", "MemoryDenyWriteExecute", "PrivateUsers"}
    # ProcSubset=pid would hide /proc/driver/nvidia, which the CUDA driver reads.
    assert "ProcSubset" not in keys


def test_socket_unit_matches_the_service() -> None:
    socket_unit = UNITS / "scratchd.socket"
    config = load_config(UNITS / "scratchd.toml", environ={})
    assert _values(socket_unit, "ListenStream") == [config.server.socket]
    assert int(_values(socket_unit, "SocketMode")[0], 8) == config.server.socket_mode
    assert _values(socket_unit, "Service") == ["scratchd.service"]


def test_execstart_config_is_the_shipped_one_and_loads() -> None:
    (command,) = _values(UNITS / "scratchd.service", "ExecStart")
    argv = command.split()
    assert argv[:2] == [INSTALLED_ENTRY, "serve"]
    assert argv[argv.index("--config") + 1] == "/etc/scratchd/scratchd.toml"
    config = load_config(UNITS / "scratchd.toml", environ={})
    assert config.server.socket.startswith("/run/scratchd/")  # inside RuntimeDirectory
    assert config.server.bind == "127.0.0.1"


def test_execreload_waits_for_the_reload_and_can_fail() -> None:
    """``systemctl reload`` runs ``scratchd reload`` (which waits for the outcome and exits
    non-zero when the reload failed) on the socket the units serve, and gives up before
    systemd's own reload timeout (TimeoutStartSec) so its reason is what the journal shows."""
    (command,) = _values(UNITS / "scratchd.service", "ExecReload")
    argv = command.split()
    assert argv[:2] == [INSTALLED_ENTRY, "reload"]
    assert argv[argv.index("--socket") + 1] == _values(UNITS / "scratchd.socket", "ListenStream")[0]
    (start_timeout,) = _values(UNITS / "scratchd.service", "TimeoutStartSec")
    assert float(argv[argv.index("--timeout") + 1]) < float(start_timeout.removesuffix("s"))


def _wheel(dest: Path) -> Path:
    """A wheel of this checkout: built offline with the installed setuptools where it can
    be (setuptools >= 68 with bdist_wheel), else in pip's isolated build environment (which
    fetches setuptools); skips only when neither works, e.g. offline with an old setuptools.

    Built from a copy: setuptools writes ``build/`` and ``*.egg-info`` into the source tree.
    """
    source = dest / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*_NOT_SOURCE))
    base = (sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest))
    errors = []
    for extra in (("--no-build-isolation", "--no-index"), ()):
        result = subprocess.run(
            [*base, *extra, str(source)], capture_output=True, text=True, check=False
        )
        wheels = sorted(dest.glob("scratchd-*.whl"))
        if result.returncode == 0 and wheels:
            return wheels[0]
        errors.append(result.stderr.strip()[-200:])
    pytest.skip(f"cannot build a wheel here: {errors}")


_NOT_SOURCE = (
    *(".git", ".venv", ".whl", ".devdata", "runs", "build", "*.egg-info", "__pycache__"),
    *(".hypothesis", ".mypy_cache", ".pytest_cache", ".ruff_cache", "docs", "tests"),
)


def _install(stage: Path, wheel: Path, *extra: str) -> str:
    result = subprocess.run(
        [
            *("bash", str(ROOT / "scripts" / "install-systemd.sh"), "--root", str(stage)),
            *("--pip-args", "--no-deps --no-index", *extra, str(wheel)),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_install_script_is_idempotent_and_upgrades_by_release(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path / "wheel")
    stage = tmp_path / "root"
    first = _install(stage, wheel)
    assert "wrote" in first
    venv = stage / "opt" / "scratchd" / "venv"
    first_release = os.readlink(venv)
    config = stage / "etc" / "scratchd" / "scratchd.toml"
    config.write_text(config.read_text().replace("cpu_workers = 2", "cpu_workers = 3"))

    second = _install(stage, wheel, "--keep", "1")
    second_release = os.readlink(venv)
    assert second_release != first_release
    assert "wrote" not in second, "an operator's config must never be overwritten"
    assert "cpu_workers = 3" in config.read_text()
    assert (config.parent / "scratchd.toml.dist").read_text() == (
        UNITS / "scratchd.toml"
    ).read_text()
    releases = sorted(p.name for p in (venv.parent / "releases").iterdir())
    assert [f"releases/{r}" for r in releases] == [second_release], "old release not pruned"

    entry = venv / "bin" / "scratchd"
    # The entry point runs the release's own python, so a running daemon stays on its code.
    assert entry.read_text().splitlines()[0] == f"#!{venv.parent / second_release}/bin/python3"
    unit = stage / "etc" / "systemd" / "system" / "scratchd.service"
    assert _values(unit, "ExecStart")[0].startswith(f"{INSTALLED_ENTRY} serve")
    if ANALYZE is not None:
        service = _units_pointing_at(entry, tmp_path / "verify", unit.parent)
        _verify(service, service.parent / "scratchd.socket")


def test_install_script_refuses_unprivileged_real_installs(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("running as root: the refusal is for other users")
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "install-systemd.sh")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0 and "root" in result.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_install_script_passes_shellcheck() -> None:
    result = subprocess.run(
        ["shellcheck", str(ROOT / "scripts" / "install-systemd.sh")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout
