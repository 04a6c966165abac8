"""The cascade's switches: ``[model] cascade``, ``scratchd eval --cascade``, the CPU worker."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from click.testing import CliRunner

from scratchd.daemon.cli import main
from scratchd.daemon.config import ConfigError, load_config
from scratchd.daemon.ops.reload import model_version
from scratchd.daemon.pool.supervisor import Supervisor
from scratchd.ipc.queue import Status
from scratchd.model import cascade_plan as cp
from scratchd.model.cascade import Cascade, CascadeError, resolve
from scratchd.model.scratchnet import ModelError, load_model, save_model
from scratchd.protocol.image import decode_image
from scratchd.workers.cpu import CpuBackend
from scratchd.workers.main import parse_args
from scratchd.workers.protocol import WorkerSpec
from tests.daemon.harness import SERVE
from tests.model.test_cli import small_dataset


def cascade_model(path: Path, enabled: bool) -> Path:
    """The shipped weights with cascade settings in their metadata."""
    net = load_model()
    s = cp.CascadeSettings(factor=2, threshold=0.2, margin=16, core=128,
                           halo=cp.receptive_halo(net.config), enabled=enabled)  # fmt: skip
    save_model(path, net.weights, dataclasses.replace(net.meta, cascade=s))
    return path


def _frames(data_dir: Path) -> list[np.ndarray]:
    paths = [data_dir / "sd900" / "images" / "Sc_1.png",
             sorted((data_dir / "mtile" / "free").glob("*.jpg"))[0]]  # fmt: skip
    return [decode_image(p.read_bytes()) for p in paths]


def test_the_switch_resolves_against_the_models_default(tmp_path: Path) -> None:
    off, on = cascade_model(tmp_path / "off.npz", False), cascade_model(tmp_path / "on.npz", True)
    assert resolve(load_model(off), None) is None and resolve(load_model(off), True) is not None
    assert resolve(load_model(on), None) is not None and resolve(load_model(on), False) is None
    # more views than identity: the model's default stays off, an explicit on is refused
    assert resolve(load_model(on, views=("identity", "flip_h")), None) is None
    with pytest.raises(CascadeError, match="identity view"):
        resolve(load_model(on, views=("identity", "flip_h")), True)
    with pytest.raises(CascadeError, match="no cascade settings"):
        resolve(load_model(), True)  # the shipped file has none


def test_cpu_worker_answers_through_the_cascade(tmp_path: Path, data_dir: Path) -> None:
    path = str(cascade_model(tmp_path / "m.npz", False))
    images = _frames(data_dir)
    on = CpuBackend(path, max_batch=2, cascade=True)
    on.warm_up()
    expected = Cascade(load_model(path)).predict(images)
    results = on.infer(images, [True, True])
    for result, pred in zip(results, expected, strict=True):
        assert result.status is Status.OK
        assert result.verdict_defect == (pred.verdict == "defect")
        assert result.score == pytest.approx(pred.score, abs=1e-6)
        assert result.mask is not None
        np.testing.assert_array_equal(result.mask, pred.mask)
    assert expected[0].regions  # the scratch ran at full resolution
    off = CpuBackend(path, max_batch=2, cascade=False)
    assert off.cascade is None
    full = load_model(path).predict(images)
    for result, pred in zip(off.infer(images, [False, False]), full, strict=True):
        assert result.score == pytest.approx(pred.score, abs=1e-6)
    assert CpuBackend(path, max_batch=2).cascade is None  # the file's default: off
    with pytest.raises(ModelError, match="no cascade settings"):
        CpuBackend(None, max_batch=2, cascade=True)


def test_eval_says_which_ran_and_what_stage_1_answered(data_dir: Path, tmp_path: Path) -> None:
    root = small_dataset(data_dir, tmp_path / "data")
    model = str(cascade_model(tmp_path / "m.npz", False))
    summaries = {}
    for switch in ("on", "off", None):
        args = ["eval", str(root), "--json", "--model", model]
        result = CliRunner().invoke(main, args + (["--cascade", switch] if switch else []))
        assert result.exit_code == 0, result.output
        summaries[switch] = json.loads(result.stdout.splitlines()[-1])["summary"]["cascade"]
    on = summaries["on"]
    assert on["on"] is True and on["settings"]["factor"] == 2
    assert 0.0 <= on["stage1_share"] <= 1.0 and on["full_res_pixels_per_frame"] > 0
    assert summaries["off"] == {"on": False} and summaries[None] == {"on": False}
    text = CliRunner().invoke(main, ["eval", str(root), "--model", model, "--cascade", "on"])
    assert "cascade on (stage 1 alone" in text.output
    refused = CliRunner().invoke(main, ["eval", str(root), "--cascade", "on"])
    assert refused.exit_code == 1 and "no cascade settings" in refused.output
    bad = CliRunner().invoke(main, ["eval", str(root), "--cascade", "maybe"])
    assert bad.exit_code == 2


def _config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "scratchd.toml"
    path.write_text(text)
    return path


def test_config_key_is_validated_and_checked_against_the_model(tmp_path: Path) -> None:
    assert load_config(environ={}).model.cascade is None  # unset: the model file's default
    with pytest.raises(ConfigError, match=r"'model\.cascade'"):
        load_config(_config(tmp_path, "[model]\ncascade = 'yes'\n"), environ={})
    text = "[model]\ncascade = true\nviews = ['identity', 'flip_h']\n"
    with pytest.raises(ConfigError, match=r"model\.cascade: the cascade runs one view"):
        load_config(_config(tmp_path, text), environ={})
    on = load_config(_config(tmp_path, "[model]\ncascade = true\n"), environ={})
    with pytest.raises(ModelError, match="no cascade settings"):
        model_version(on)  # what `serve` checks before any worker starts
    model = cascade_model(tmp_path / "m.npz", False)
    ok = load_config(_config(tmp_path, f"[model]\ncascade = true\npath = '{model}'\n"), {})
    assert model_version(ok) == load_model().version


@pytest.mark.parametrize(("value", "flag"), [(True, "on"), (False, "off"), (None, None)])
def test_cpu_workers_get_the_switch_and_gpu_workers_do_not(value: bool | None, flag: str) -> None:
    cfg = load_config(overrides={"model.cascade": value}, environ={})
    for device in ("cpu", "cuda"):
        pool = SimpleNamespace(config=cfg, device=device)
        max_batch, delay, extra = Supervisor._backend_args(pool)  # type: ignore[arg-type]
        spec = WorkerSpec("/q", 0, device, "", max_batch, delay, 100, 1, extra)
        args = parse_args(spec.argv(ready_fd=3, death_fd=4, work_fd=5, done_fd=6)[3:])
        assert args.cascade == (flag if device == "cpu" else None)


def test_serve_refuses_a_cascade_the_model_cannot_run(tmp_path: Path) -> None:
    """Exit 2 (systemd does not restart it) naming the reason, before any worker starts."""
    config = _config(tmp_path, '[workers]\nbackend = "cpu"\n[model]\ncascade = true\n')
    done = subprocess.run(
        [*SERVE, "--config", str(config), "--socket", str(tmp_path / "s.sock")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "no cascade settings" in done.stderr and str(config) in done.stderr
