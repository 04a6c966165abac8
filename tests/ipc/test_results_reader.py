"""``_results.Reader``: a collected batch's Completions built in C are exactly what the Python
definition (``MainSide._completion_of`` over ``records.read_result``) builds, for any result a
worker can write and any bytes a broken or hostile worker can leave in a result row; rows it
cannot read are refused with a clear error, nothing read."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scratchd.ipc._results import Reader
from scratchd.ipc.layout import ERROR_BYTES, MAX_BOXES, RESULT_DTYPE, result_offsets
from scratchd.ipc.main_side import MainSide
from scratchd.ipc.queue import Completion, Handle, RequestQueue, Result, Status
from scratchd.ipc.records import write_result
from tests.ipc.queue_helpers import GEOMETRY, SLOTS, shm_name

if TYPE_CHECKING:  # a type the stub names (ipc/_native.pyi), not a runtime attribute
    from scratchd.ipc._native import FinishedRow

DONE, EXPIRED, FAILED = 4, 5, 6
SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
HEIGHT, WIDTH = 4, 4  # GEOMETRY's slot holds 16 pixels


@pytest.fixture(scope="module")
def mq() -> Iterator[tuple[RequestQueue, MainSide]]:
    q = RequestQueue.create(shm_name("reader"), GEOMETRY)
    yield q, q.collect_completed.__self__  # type: ignore[attr-defined]
    q.close()


def _both(main: MainSide, rows: list[FinishedRow]) -> tuple[Any, Any]:
    """(C, Python): each the list of Completions, or the exception type raised."""

    def run(f: Any) -> Any:
        try:
            return f()
        except Exception as exc:
            return type(exc)

    seg = main._core.seg
    ours = run(lambda: main._reader.completions(seg.mm, rows, seg.r.histogram, main._masked))
    reference = run(lambda: [main._completion_of(r) for r in rows if not r[3]])
    return ours, reference


def _fields(c: Completion) -> list[Any]:
    """A Completion as comparable values (arrays as bytes and shape, NaN as a marker)."""

    def plain(v: Any) -> Any:
        if isinstance(v, np.ndarray):
            return (v.dtype.str, v.shape, v.tobytes(), v.flags.writeable)
        if isinstance(v, float) and math.isnan(v):
            return "nan"
        if isinstance(v, msgspec.Struct):
            return [(f, type(getattr(v, f)), plain(getattr(v, f))) for f in v.__struct_fields__]
        if isinstance(v, list | tuple):
            return (type(v), [plain(x) for x in v])
        return v

    return plain(c)


def _same(ours: Any, reference: Any) -> None:
    if isinstance(reference, type):
        assert ours is reference
        return
    assert isinstance(ours, list) and len(ours) == len(reference)
    for a, b in zip(ours, reference, strict=True):
        assert type(a) is Completion and type(a.handle) is Handle
        assert a.result is None or type(a.result) is Result
        assert _fields(a) == _fields(b)


def _row(i: int, state: int, *, abandoned: int = 0, kills: int = 1, rid: int = 7) -> FinishedRow:
    return (i, 3, state, abandoned, rid, 11, 1000, 2, HEIGHT, WIDTH, 5, kills, 1500, 2500, 1)


floats32 = st.floats(width=32, allow_nan=False)
box = st.tuples(floats32, floats32, floats32, floats32, floats32)
results = st.builds(
    Result,
    status=st.sampled_from(Status),
    verdict_defect=st.booleans(),
    score=floats32,
    boxes=st.lists(box, max_size=MAX_BOXES + 3),
    entropy=floats32,
    histogram=st.lists(st.integers(0, 2**32 - 1), min_size=64, max_size=64).map(
        lambda v: np.array(v, np.uint32)
    ),
    compute_ns=st.integers(-(2**63), 2**63 - 1),
    batch_size=st.integers(0, 2**32 - 1),
    error=st.text(max_size=120),
    mask=st.none()
    | st.binary(min_size=16, max_size=16).map(
        lambda b: np.frombuffer(b, np.uint8).reshape(HEIGHT, WIDTH).copy()
    ),
)


@SETTINGS
@given(
    batch=st.lists(
        st.tuples(results, st.sampled_from([DONE, EXPIRED, FAILED]), st.booleans(),
                  st.integers(0, 255)),
        min_size=1, max_size=SLOTS,
    ),
)  # fmt: skip
def test_completions_match_the_python_definition(
    mq: tuple[RequestQueue, MainSide], batch: list[tuple[Result, int, bool, int]]
) -> None:
    _, main = mq
    seg = main._core.seg
    rows = []
    for i, (result, state, abandoned, kills) in enumerate(batch):
        seg.results[i] = np.zeros((), RESULT_DTYPE)
        write_result(seg.result_block, seg.r, seg.masks, i, result, HEIGHT, WIDTH)
        rows.append(_row(i, state, abandoned=int(abandoned), kills=kills, rid=i + 1))
    ours, reference = _both(main, rows)
    assert not isinstance(reference, type)
    _same(ours, reference)


@SETTINGS
@given(
    raw=st.binary(min_size=RESULT_DTYPE.itemsize, max_size=RESULT_DTYPE.itemsize),
    status=st.integers(0, 6) | st.integers(0, 255),
    masked=st.booleans(),
)
def test_any_bytes_in_a_result_row_read_as_python_reads_them(
    mq: tuple[RequestQueue, MainSide], raw: bytes, status: int, masked: bool
) -> None:
    """Counts past their fields are cut to them, an unknown status is refused (IndexError),
    bytes that are not UTF-8 are replaced: as read_result does, never outside the row."""
    _, main = mq
    main._core.seg.results[0] = np.frombuffer(raw, RESULT_DTYPE)[0]
    main._core.seg.results[0:1]["status"] = status
    main._core.seg.results[0:1]["has_mask"] = masked
    _same(*_both(main, [_row(0, DONE)]))


def test_counts_beyond_their_fields_are_cut(mq: tuple[RequestQueue, MainSide]) -> None:
    _, main = mq
    seg = main._core.seg
    seg.results[1] = np.zeros((), RESULT_DTYPE)
    r = seg.results[1:2]
    r["n_boxes"], r["error_len"], r["status"] = 65535, 65535, int(Status.ERROR)
    r["error"] = np.frombuffer(b"\xff" * ERROR_BYTES, np.uint8)
    (c,) = main._reader.completions(seg.mm, [_row(1, DONE)], seg.r.histogram, main._masked)
    assert c.result is not None and len(c.result.boxes) == MAX_BOXES
    assert c.result.error == "\ufffd" * ERROR_BYTES
    _same([c], [main._completion_of(_row(1, DONE))])


def test_unreadable_rows_are_refused(mq: tuple[RequestQueue, MainSide]) -> None:
    _, main = mq
    seg = main._core.seg
    hist, masked = seg.r.histogram, main._masked

    def read(buf: Any, rows: Any) -> Any:
        return main._reader.completions(buf, rows, hist, masked)

    seg.results[0] = np.zeros((), RESULT_DTYPE)
    with pytest.raises(IndexError, match="outside the result table"):
        read(seg.mm, [_row(SLOTS, DONE)])
    with pytest.raises(IndexError, match="outside the result table"):
        read(seg.mm, [_row(-1, EXPIRED)])
    with pytest.raises(TypeError, match="15-tuple"):
        read(seg.mm, [_row(0, DONE)[:14]])
    with pytest.raises(TypeError, match="15-tuple"):
        read(seg.mm, [[*_row(0, DONE)]])
    with pytest.raises(TypeError, match="rows must be a list"):
        read(seg.mm, (_row(0, DONE),))
    with pytest.raises(TypeError):
        read(seg.mm, [("x", *_row(0, DONE)[1:])])
    with pytest.raises(ValueError, match="shorter than the result table"):
        read(bytes(64), [_row(0, DONE)])
    seg.results[0:1]["status"] = 200
    with pytest.raises(IndexError, match="status 200"):
        read(seg.mm, [_row(0, DONE)])
    assert read(seg.mm, []) == []
    assert read(seg.mm, [_row(0, DONE, abandoned=1)]) == []  # skipped: nothing read


def test_a_layout_that_does_not_fit_is_refused(mq: tuple[RequestQueue, MainSide]) -> None:
    _, main = mq
    good = result_offsets(main._core.seg.header)
    kit = main._reader_kit
    for key, value in (("r.score", RESULT_DTYPE.itemsize - 2), ("r.boxes", 1),
                       ("result_stride", 0), ("slots", 0)):  # fmt: skip
        with pytest.raises(ValueError):
            Reader({**good, key: value}, kit)
    with pytest.raises(KeyError, match=r"r\.error"):
        Reader({k: v for k, v in good.items() if k != "r.error"}, kit)
    with pytest.raises(TypeError, match="tuple subclass"):
        Reader(good, (kit[0], kit[1], dict, *kit[3:]))
    with pytest.raises(ValueError, match="not initialised"):
        Reader.__new__(Reader).completions(b"", [], main._core.seg.r.histogram, main._masked)
