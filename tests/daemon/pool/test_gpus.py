"""Backend and card placement (daemon/pool/gpus.py), with NVML's answer replaced."""

from __future__ import annotations

import pytest

from scratchd.daemon.config import ConfigError, load_config
from scratchd.daemon.pool.gpus import place


def cards(n: int, why: str = "NVML lists no GPU"):
    return lambda: (n, "" if n else why)


def test_cpu_is_cpu_whatever_the_machine_has() -> None:
    p = place(load_config(overrides={"workers.backend": "cpu"}), cards(8))
    assert (p.backend, p.gpus, p.workers) == ("cpu", [], 2)


def test_auto_takes_every_card_when_there_are_cards() -> None:
    p = place(load_config(overrides={"workers.backend": "auto"}), cards(2))
    assert (p.backend, p.gpus, p.workers) == ("cuda", [0, 1], 2)


def test_auto_falls_back_to_cpu_and_says_why() -> None:
    p = place(load_config(overrides={"workers.backend": "auto"}), cards(0, "CuPy is not installed"))
    assert p.backend == "cpu"
    assert "CuPy is not installed" in p.why


def test_cuda_without_a_card_is_a_configuration_error_naming_the_cause() -> None:
    with pytest.raises(ConfigError, match="NVML unavailable: no driver"):
        place(
            load_config(overrides={"workers.backend": "cuda"}),
            cards(0, "NVML unavailable: no driver"),
        )


def test_a_gpu_list_picks_those_cards_and_refuses_missing_or_repeated_ones() -> None:
    cfg = load_config(overrides={"workers.backend": "cuda", "workers.gpus": [1]})
    assert place(cfg, cards(2)).gpus == [1]
    with pytest.raises(ConfigError, match=r"card\(s\) \[3\]"):
        place(load_config(overrides={"workers.backend": "cuda", "workers.gpus": [3]}), cards(2))
    with pytest.raises(ConfigError, match="distinct"):
        place(load_config(overrides={"workers.backend": "cuda", "workers.gpus": [0, 0]}), cards(2))


def test_gpu_worker_settings_decode_from_toml(tmp_path) -> None:
    f = tmp_path / "c.toml"
    f.write_text("[workers]\ngpu_reserve_mb = 2048\ngpu_warm_sizes = [[512, 640], [1024, 1024]]\n")
    w = load_config(f).workers
    assert w.gpu_reserve_mb == 2048
    assert [tuple(s) for s in w.gpu_warm_sizes] == [(512, 640), (1024, 1024)]
    f.write_text("[workers]\ngpu_warm_sizes = [[0, 640]]\n")
    with pytest.raises(ConfigError, match="gpu_warm_sizes"):
        load_config(f)
