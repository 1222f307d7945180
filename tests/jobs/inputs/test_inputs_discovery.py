"""Input discovery: every real file once, whatever links a glob walks through."""
from __future__ import annotations

import glob
import os
from pathlib import Path

import pytest

from batchinfer.jobs.inputs.files import open_inputs
from tests.jobs_fixtures import rag_table, write_parquet

ROWS = 7


def test_a_symlink_loop_under_a_double_star_glob_reads_the_file_once(tmp_path):
    write_parquet(rag_table(ROWS), tmp_path / "data" / "a" / "rag.parquet")
    os.symlink(tmp_path / "data", tmp_path / "data" / "a" / "loop")   # back to an ancestor: glob read it 41 times
    inputs = open_inputs(str(tmp_path / "data" / "**" / "*.parquet"), tmp_path / "jobs.yaml", "jobs.rag.input")
    assert inputs.paths == (tmp_path / "data" / "a" / "rag.parquet",) and inputs.num_rows == ROWS


def test_a_second_link_to_a_folder_under_a_glob_reads_its_files_once(tmp_path):
    write_parquet(rag_table(ROWS), tmp_path / "data" / "a" / "rag.parquet")
    os.symlink(tmp_path / "data" / "a", tmp_path / "data" / "again")
    for pattern in ("data/**/*.parquet", "data/*/*.parquet"):
        inputs = open_inputs(str(tmp_path / pattern), tmp_path / "jobs.yaml", "jobs.rag.input")
        assert inputs.paths == (tmp_path / "data" / "a" / "rag.parquet",) and inputs.num_rows == ROWS


def test_two_links_to_one_file_in_a_folder_are_one_input(tmp_path):
    write_parquet(rag_table(ROWS), tmp_path / "data" / "rag.parquet")
    os.symlink(tmp_path / "data" / "rag.parquet", tmp_path / "data" / "same.parquet")
    for pattern in ("data", "data/*.parquet"):
        inputs = open_inputs(str(tmp_path / pattern), tmp_path / "jobs.yaml", "jobs.rag.input")
        assert inputs.paths == (tmp_path / "data" / "rag.parquet",) and inputs.num_rows == ROWS


@pytest.mark.parametrize("pattern", ["**/*.parquet", "data/**/*.parquet", "data/*/*.parquet", "data/**",
                                     "**/x?.parquet", "data/[ab]/**/*.parquet", "data/**/b/*", "*/.h*/*.parquet"])
def test_without_links_the_walk_matches_what_glob_matches(tmp_path, pattern):
    for name in ("data/x1.parquet", "data/a/x2.parquet", "data/a/b/x3.parquet", "data/b/.hidden.parquet",
                 "data/.h/x4.parquet", "data/c/b/notes.txt", "x5.parquet"):
        write_parquet(rag_table(2), tmp_path / name)
    expected = sorted(Path(p) for p in glob.glob(str(tmp_path / pattern), recursive=True) if Path(p).is_file())
    from batchinfer.jobs.inputs.input_glob import glob_files

    assert glob_files(str(tmp_path / pattern)) == expected and expected
