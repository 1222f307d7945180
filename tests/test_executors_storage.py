"""Committing parts through a pyarrow filesystem: the rename path (local) and the copy path (object stores)."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from batchinfer.jobs.run.executors.storage import PartStore

TABLE = pa.table({"row": [1, 2, 3]})


@pytest.mark.parametrize("atomic_rename", [True, False], ids=["rename", "copy-then-delete"])
def test_commit_publishes_the_final_name_only_and_a_second_commit_rewrites_it(tmp_path, atomic_rename):
    store = PartStore(pafs.LocalFileSystem(), str(tmp_path / "out"), atomic_rename=atomic_rename)
    assert not store.exists("unit-00001-000.parquet")
    store.commit_table("unit-00001-000.parquet", TABLE)
    store.commit_table("unit-00001-000.parquet", pa.table({"row": [4]}))  # a unit run twice: same name
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["unit-00001-000.parquet"]  # no temporary left
    assert store.exists("unit-00001-000.parquet")
    assert pq.read_table(tmp_path / "out").column("row").to_pylist() == [4]


@pytest.mark.parametrize("atomic_rename", [True, False], ids=["rename", "copy-then-delete"])
def test_a_write_that_fails_leaves_neither_the_part_nor_its_temporary(tmp_path, atomic_rename):
    store = PartStore(pafs.LocalFileSystem(), str(tmp_path), atomic_rename=atomic_rename)

    def half_then_fail(stream):
        stream.write(b"PAR1 partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        store.commit("part.parquet", half_then_fail)
    assert list(tmp_path.iterdir()) == []


def test_open_picks_the_filesystem_from_a_uri_or_a_plain_path(tmp_path):
    from_uri = PartStore.open(f"file://{tmp_path}/a")
    assert isinstance(from_uri.fs, pafs.LocalFileSystem) and from_uri.atomic_rename
    from_uri.commit_table("x.parquet", TABLE)
    assert (tmp_path / "a" / "x.parquet").is_file()
    assert PartStore.open(str(tmp_path / "b")).root == str(tmp_path / "b")
    mock = PartStore(pafs._MockFileSystem(), "bucket/out")  # any non-local filesystem: copy, then delete
    assert not mock.atomic_rename
    mock.commit_table("x.parquet", TABLE)
    assert [info.base_name for info in mock.fs.get_file_info(pafs.FileSelector("bucket/out"))] == ["x.parquet"]
