"""kernels/_checks.py's env_choice: the kernels' schedule knobs from the environment."""

from __future__ import annotations

import pytest

from scratchd.kernels._checks import env_choice

KNOB = "SCRATCHD_TEST_KNOB"


def test_env_choice_is_the_default_when_unset_else_the_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(KNOB, raising=False)
    assert env_choice(KNOB, "2", ("2", "4")) == "2"
    monkeypatch.setenv(KNOB, "4")
    assert env_choice(KNOB, "2", ("2", "4")) == "4"


@pytest.mark.parametrize("value", ["3", "", " 4", "auto"])
def test_env_choice_refuses_anything_else_naming_the_variable_and_the_choices(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KNOB, value)
    with pytest.raises(ValueError, match=f"{KNOB} must be one of 2, 4, got {value!r}"):
        env_choice(KNOB, "2", ("2", "4"))
