"""Configuration: the docs/design.md skeleton decodes, unknown keys are named, flags win."""

from __future__ import annotations

from pathlib import Path

import pytest

from scratchd.daemon.config import ConfigError, load_config
from scratchd.protocol.defaults import DEFAULT_SOCKET, socket_path

SKELETON = """
[server]
socket = "/run/scratchd/scratchd.sock"
bind = "127.0.0.1"
health_port = 8081
metrics_port = 9108
socket_mode = 0o660
allowed_uids = []
allowed_gids = []
[queue]
slots = 256
slot_bytes = 4194304
tick_ms = 1
max_queue_delay_ms = 10
max_batch = 16
[workers]
backend = "auto"
cpu_workers = 2
gpus = "all"
[classes.safety]
priority = 7
deadline_ms = 1000
[classes.normal]
priority = 0
deadline_ms = 3000
[model]
path = ""
[drift]
window = 500
threshold = 0.15
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "scratchd.toml"
    path.write_text(text)
    return path


def test_the_design_skeleton_decodes(tmp_path: Path) -> None:
    config = load_config(_write(tmp_path, SKELETON), environ={})
    assert config.server.socket_mode == 0o660
    assert config.queue.slots == 256 and config.queue.slot_bytes == 4194304
    assert config.workers.backend == "auto" and config.workers.gpus == "all"
    assert config.classes["safety"].priority == 7
    assert config.classes["normal"].deadline_ms == 3000
    assert config.drift.threshold == pytest.approx(0.15)


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("[queue]\nslotz = 1\n", "unknown key 'queue.slotz'"),
        ("colour = 'red'\n", "unknown key 'colour'"),
        ("[classes.safety]\npriority = 7\ndeadline = 5\n", "unknown key 'classes.safety.deadline'"),
        ("[queue]\nslots = 'many'\n", "'queue.slots'"),
        ("[queue]\nslots = 0\n", "'queue.slots'"),
        ("[server]\nreceive_threads = -1\n", "'server.receive_threads': Expected `int` >= 0"),
        ("[server]\nreceive_threads = 65\n", "'server.receive_threads': Expected `int` <= 64"),
        ("[classes.fast]\npriority = 8\n", "'classes.fast.priority'"),
        ("[workers]\nbackend = 'gpu'\n", "'workers.backend'"),
        ("queue = 3\n", "'queue'"),
        ("[server\n", "not valid TOML"),
        ("[model]\nviews = 'identity'\n", "'model.views'"),
        (
            "[model]\nviews = ['identity', 'flipx']\n",
            "model.views: unknown view 'flipx' (known: identity, flip_h, flip_v, transpose)",
        ),
        ("[model]\nviews = ['flip_h', 'flip_h']\n", "model.views: view 'flip_h' is listed twice"),
    ],
)
def test_bad_keys_and_values_are_named(tmp_path: Path, text: str, named: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    assert named in str(info.value)
    assert str(path) in str(info.value)


def test_model_views_in_order_or_empty_for_the_model_files_own(tmp_path: Path) -> None:
    assert load_config(environ={}).model.views == []  # the model file's views
    text = '[model]\nviews = ["transpose", "identity"]\n'
    assert load_config(_write(tmp_path, text), environ={}).model.views == ["transpose", "identity"]


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.toml"):
        load_config(tmp_path / "nope.toml", environ={})


def test_classes_merge_over_the_built_in_ones(tmp_path: Path) -> None:
    config = load_config(_write(tmp_path, "[classes.bracket]\npriority = 5\n"), environ={})
    assert set(config.classes) == {"safety", "normal", "bracket"}
    assert config.classes["bracket"].deadline_ms == 3000  # the class default
    assert config.class_names() == ["bracket", "normal", "safety"]


def test_flags_win_over_the_environment_which_wins_over_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, '[server]\nsocket = "/file.sock"\n[workers]\ncpu_workers = 3\n')
    assert load_config(path, environ={}).server.socket == "/file.sock"
    env = {"SCRATCHD_SOCKET": "/env.sock"}
    assert load_config(path, environ=env).server.socket == "/env.sock"
    flags = {"server.socket": "/flag.sock", "workers.cpu_workers": None, "workers.backend": "cpu"}
    config = load_config(path, flags, environ=env)
    assert config.server.socket == "/flag.sock"
    assert config.workers.cpu_workers == 3  # a flag left unset does not override
    assert config.workers.backend == "cpu"


def test_a_bad_flag_value_is_named() -> None:
    with pytest.raises(ConfigError, match=r"'workers\.cpu_workers'"):
        load_config(None, {"workers.cpu_workers": 0}, environ={})


def test_client_socket_resolution() -> None:
    assert socket_path("/a.sock", {"SCRATCHD_SOCKET": "/b.sock"}) == "/a.sock"
    assert socket_path(None, {"SCRATCHD_SOCKET": "/b.sock"}) == "/b.sock"
    assert socket_path(None, {}) == DEFAULT_SOCKET
