"""The README's examples as a new user copies them."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from scratchd.daemon.config import Config, load_config

README = Path(__file__).resolve().parent.parent / "README.md"


def _toml_blocks() -> list[str]:
    return re.findall(r"```toml\n(.*?)```", README.read_text(encoding="utf-8"), re.S)


def test_every_sample_config_loads_and_leaves_the_model_as_shipped(tmp_path: Path) -> None:
    """Copying a sample must not change what the model answers: ``model.views`` is the
    model file's own unless the operator chooses (the README says what one view costs)."""
    blocks = _toml_blocks()
    assert blocks
    for i, block in enumerate(blocks):
        tomllib.loads(block)  # each block is valid TOML on its own
        path = tmp_path / f"sample{i}.toml"
        path.write_text(block, encoding="utf-8")
        config = load_config(path, environ={})
        assert config.model == Config().model, block


def test_example_paths_exist_after_a_clone() -> None:
    """The examples name images a fresh clone has (the committed fixture), nothing beside
    the checkout."""
    text = README.read_text(encoding="utf-8")
    # No path that leaves the checkout (../anything): a fresh clone has nothing beside it.
    assert not re.findall(r"\.\./[\w.-]+", text)
    root = README.parent
    paths = set(re.findall(r"tests/fixtures/data/[\w/.*-]+", text))
    assert paths
    for path in paths:
        assert list(root.glob(path)), path
