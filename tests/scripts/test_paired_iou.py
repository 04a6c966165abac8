"""scripts/paired_iou.py: the paired bootstrap of two models' per-image IoUs."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.scripts.test_train import _mod

ious = st.dictionaries(
    st.text("abcdef", min_size=1, max_size=6), st.floats(0.0, 0.9), min_size=2, max_size=40
)


@settings(max_examples=40, deadline=None)
@given(a=ious, shift=st.floats(-0.05, 0.1))
def test_a_constant_shift_is_found_exactly_and_with_no_spread(a: dict, shift: float) -> None:
    paired = _mod("paired_iou").paired
    b = {k: v + shift for k, v in a.items()}
    row = paired(a, b)
    assert row["images"] == len(a)
    assert row["diff"] == pytest.approx(shift, abs=1e-4)
    assert row["se"] == pytest.approx(0.0, abs=1e-4)
    lo, hi = row["ci95"]
    assert lo == pytest.approx(shift, abs=1e-4) and hi == pytest.approx(shift, abs=1e-4)


@settings(max_examples=40, deadline=None)
@given(a=ious, b=ious)
def test_swapping_the_models_negates_the_difference_over_common_images(a: dict, b: dict) -> None:
    paired = _mod("paired_iou").paired
    common = set(a) & set(b)
    if len(common) < 2:
        with pytest.raises(ValueError, match="in common"):
            paired(a, b)
        return
    ab, ba = paired(a, b), paired(b, a)
    assert ab["images"] == len(common)
    assert ab["diff"] == pytest.approx(-ba["diff"], abs=2e-4)
    assert ab["b_better"] == ba["a_better"] and ab["a_better"] == ba["b_better"]
    lo, hi = ab["ci95"]
    assert lo <= ab["diff"] + 1e-4 and ab["diff"] - 1e-4 <= hi


def test_the_command_compares_per_group_from_the_anatomy_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    mod = _mod("paired_iou")
    images = {f"img{i}": ("sd900/In" if i % 2 else "sd900/Sc", i / 10) for i in range(8)}
    for name, shift in (("a", 0.0), ("b", 0.05)):
        per = {k: {"group": g, "iou": v + (shift if g == "sd900/In" else 0)}
               for k, (g, v) in images.items()}  # fmt: skip
        body = {"version": name, "iou_per_image": {"inner": per}}
        (tmp_path / f"{name}.json").write_text(json.dumps(body))
    assert set(mod.of_group(per, "sd900")) == set(images)
    assert set(mod.of_group(per, "sd900/In")) == {
        k for k, (g, _) in images.items() if g == "sd900/In"
    }
    out = tmp_path / "out.json"
    argv = ["paired_iou.py", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
            "--groups", "sd900", "sd900/In", "sd900/Sc", "--json", str(out)]  # fmt: skip
    monkeypatch.setattr("sys.argv", argv)
    mod.main()
    got = json.loads(out.read_text())["groups"]
    assert got["sd900/In"]["diff"] == pytest.approx(0.05) and got["sd900/Sc"]["diff"] == 0.0
    assert got["sd900"]["diff"] == pytest.approx(0.025)
    assert "sd900/In" in capsys.readouterr().out
