"""The shard format: what is written comes back byte for byte; damage is named, never read."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scratchd.dataset.layout import HEADER_SIZE, INDEX_RECORD_SIZE, MANIFEST_NAME
from scratchd.dataset.shard import (
    RecordMeta,
    ShardError,
    ShardWriter,
    check_shards,
    open_shards,
)

Item = tuple[RecordMeta, bytes, bytes | None]

metas = st.builds(
    RecordMeta,
    rel=st.text(min_size=1, max_size=40),
    group=st.sampled_from(["sd900/Sc", "sd900/In", "mtile/free", "mtile/crack", "."]),
    split=st.sampled_from(["train", "val"]),
    width=st.integers(1, 4096),
    height=st.integers(1, 4096),
    image_format=st.sampled_from(["PNG", "BMP", "JPEG"]),
    mask_repaired_pixels=st.integers(0, 2**40),
)
items = st.lists(
    st.tuples(metas, st.binary(max_size=600), st.none() | st.binary(max_size=300)),
    max_size=25,
)


def write(out: Path, records: list[Item], shard_size: int) -> None:
    writer = ShardWriter(out, shard_size)
    for meta, image, mask in records:
        writer.add(meta, image, mask)
    writer.finish(source="test", val_fraction=0.2)


def sample_items(count: int = 12) -> list[Item]:
    return [
        (
            RecordMeta(
                rel=f"g/img_{i}.png",
                group="sd900/Sc" if i % 3 else "mtile/free",
                split="val" if i % 4 == 0 else "train",
                width=10 + i,
                height=20 + i,
                image_format="PNG",
            ),
            bytes([i]) * (100 + 7 * i),
            None if i % 5 == 0 else bytes([255 - i]) * (40 + i),
        )
        for i in range(count)
    ]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(records=items, shard_size=st.integers(HEADER_SIZE + INDEX_RECORD_SIZE, 4000))
def test_round_trip_returns_every_record_in_order(records: list[Item], shard_size: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        write(out, records, shard_size)
        with open_shards(out) as shards:
            assert len(shards) == len(records)
            assert len(shards.manifest.shards) >= (1 if records else 0)
            for i, (meta, image, mask) in enumerate(records):
                record = shards[i]
                assert record.meta == meta
                assert bytes(record.image) == image
                assert (None if record.mask is None else bytes(record.mask)) == mask
            assert [r.meta for r in shards] == [m for m, _, _ in records]
        assert check_shards(out).ok


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=30),
    shard_size=st.integers(200, 6000),
)
def test_shards_respect_the_size_limit_unless_one_record_exceeds_it(
    sizes: list[int], shard_size: int
) -> None:
    records: list[Item] = [
        (
            RecordMeta(rel=str(i), group="g", split="train", width=1, height=1, image_format="PNG"),
            b"x" * n,
            None,
        )
        for i, n in enumerate(sizes)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        write(Path(tmp), records, shard_size)
        with open_shards(Path(tmp)) as shards:
            for info in shards.manifest.shards:
                assert info.bytes <= shard_size or info.records == 1
                assert (Path(tmp) / info.file).stat().st_size == info.bytes
            assert sum(s.records for s in shards.manifest.shards) == len(sizes)


def test_index_filters_by_split_and_group_by_whole_components(tmp_path: Path) -> None:
    records = sample_items()
    write(tmp_path, records, 500)
    with open_shards(tmp_path) as shards:
        assert len(shards.manifest.shards) > 2
        want_val = [i for i, (m, _, _) in enumerate(records) if m.split == "val"]
        assert shards.indices(split="val") == want_val
        assert shards.indices(group_prefix="mtile") == [0, 3, 6, 9]
        assert shards.indices(group_prefix="sd900/") == [1, 2, 4, 5, 7, 8, 10, 11]
        assert shards.indices(group_prefix="sd9") == []
        assert shards.indices(split="val", group_prefix="mtile/free") == [0]
        assert shards[-1].meta == shards.meta(-1) == records[-1][0]
        for bad in (len(records), -len(records) - 1):
            with pytest.raises(IndexError):
                shards[bad]
            with pytest.raises(IndexError):
                shards.meta(bad)


def test_records_are_views_that_outlive_close(tmp_path: Path) -> None:
    write(tmp_path, sample_items(3), 10_000)
    shards = open_shards(tmp_path)
    record = shards[1]
    assert isinstance(record.image, memoryview) and record.image.readonly
    shards.close()
    assert bytes(record.image) == sample_items(3)[1][1]


def _shard_files(out: Path) -> list[Path]:
    return sorted(out.glob("shard-*.scs"))


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def _first_error(out: Path) -> ShardError:
    """Open and read every record; the ShardError raised on the way (one must be)."""
    with pytest.raises(ShardError) as info, open_shards(out) as shards:
        for _ in shards:
            pass
    return info.value


@pytest.fixture
def built(tmp_path: Path) -> Path:
    write(tmp_path, sample_items(), 700)
    assert len(_shard_files(tmp_path)) >= 3
    return tmp_path


def test_flipped_image_byte_names_shard_and_record(built: Path) -> None:
    with open_shards(built) as shards:
        shard = shards.shards[1]
        entry = shard.index[1]
        target = int(entry["offset"]) + int(entry["meta_len"]) + 3
    _flip(shard.path, target)
    error = _first_error(built)
    assert (error.shard, error.record) == (shard.name, 1)
    report = check_shards(built)
    assert [(e.shard, e.record) for e in report.errors] == [(shard.name, 1)]
    assert report.records == len(sample_items()) - 1


def test_flipped_mask_and_metadata_bytes_name_the_record(built: Path) -> None:
    path = _shard_files(built)[0]
    with open_shards(built) as shards:
        entry = shards.shards[0].index[1]
        assert shards[1].mask is not None
    meta_byte = int(entry["offset"]) + 2
    last_mask_byte = (
        meta_byte - 2 + sum(int(entry[k]) for k in ("meta_len", "image_len", "mask_len")) - 1
    )
    for offset in (meta_byte, last_mask_byte):  # metadata is checked at open, the mask on access
        _flip(path, offset)
        error = _first_error(built)
        assert (error.shard, error.record) == (path.name, 1)
        _flip(path, offset)
    assert check_shards(built).ok


@pytest.mark.parametrize("field_offset", [0, 8, 12, 20, 24, 28])
def test_flipped_index_byte_names_shard_and_record(built: Path, field_offset: int) -> None:
    path = _shard_files(built)[1]
    _flip(path, HEADER_SIZE + INDEX_RECORD_SIZE * 1 + field_offset)
    error = _first_error(built)
    assert error.shard == path.name
    assert error.record is not None and error.record <= 1
    assert "index" in error.reason
    assert not check_shards(built).ok


@pytest.mark.parametrize("offset", [0, 9, 13, 20, 41, 49, 53, 61])
def test_flipped_header_byte_names_the_shard(built: Path, offset: int) -> None:
    path = _shard_files(built)[2]
    _flip(path, offset)
    error = _first_error(built)
    assert error.shard == path.name and error.record is None
    report = check_shards(built)
    assert [e.shard for e in report.errors] == [path.name]


def test_any_single_flipped_byte_is_detected(built: Path) -> None:
    path = _shard_files(built)[1]
    pristine = path.read_bytes()
    for offset in range(len(pristine)):
        data = bytearray(pristine)
        data[offset] ^= 0x01
        path.write_bytes(bytes(data))
        report = check_shards(built)
        assert [e.shard for e in report.errors] == [path.name], offset
        _first_error(built)
    path.write_bytes(pristine)
    assert check_shards(built).ok


def test_truncation_names_the_record_cut_off(built: Path) -> None:
    path = _shard_files(built)[0]
    pristine = path.read_bytes()
    with open_shards(built) as shards:
        index = shards.shards[0].index.copy()
    for i in range(len(index)):
        path.write_bytes(pristine[: int(index["offset"][i]) + 1])
        error = _first_error(built)
        assert (error.shard, error.record) == (path.name, i)
        assert "truncated" in error.reason
    path.write_bytes(pristine[: HEADER_SIZE + INDEX_RECORD_SIZE + 5])
    assert _first_error(built).record == 1
    path.write_bytes(pristine[:30])
    assert _first_error(built).shard == path.name
    path.write_bytes(pristine + b"\0")
    assert _first_error(built).shard == path.name


def test_missing_shard_and_manifest_are_named(built: Path) -> None:
    victim = _shard_files(built)[1]
    victim.unlink()
    assert _first_error(built).shard == victim.name
    assert [e.shard for e in check_shards(built).errors] == [victim.name]
    (built / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(ShardError, match=MANIFEST_NAME):
        open_shards(built)


def test_a_shard_from_another_build_is_caught(tmp_path: Path) -> None:
    write(tmp_path / "a", sample_items(), 100_000)
    other = sample_items()
    other[3] = (other[3][0], b"changed", other[3][2])
    write(tmp_path / "b", other, 100_000)
    shard = _shard_files(tmp_path / "a")[0]
    shard.write_bytes((tmp_path / "b" / shard.name).read_bytes())
    errors = check_shards(tmp_path / "a").errors
    assert errors and errors[0].shard == shard.name


def test_rebuild_with_fewer_shards_removes_stale_files(tmp_path: Path) -> None:
    write(tmp_path, sample_items(), 500)
    write(tmp_path, sample_items(2), 100_000)
    assert [p.name for p in _shard_files(tmp_path)] == ["shard-00000.scs"]
    assert check_shards(tmp_path).ok
