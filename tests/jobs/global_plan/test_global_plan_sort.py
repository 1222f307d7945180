"""Sort keys and the external merge sort of the global plan, against Python's sorted()."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchinfer.jobs.global_plan.external_sort import RunWriter, SortBudget, merge_runs
from batchinfer.jobs.global_plan.keys import common_prefix_tokens, decode_key, encode_key
from batchinfer.jobs.global_plan.sorted_rows import SortedRowsReader, row_group_rows_for, write_sorted_rows

token_lists = st.lists(st.integers(0, (1 << 32) - 1) | st.integers(0, 3), max_size=12)


def naive_lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@given(token_lists, token_lists)
def test_key_order_is_token_order_and_the_common_prefix_is_counted_in_tokens(a, b):
    ka, kb = encode_key(a), encode_key(b)
    assert decode_key(ka) == a
    assert (ka < kb) == (a < b) and (ka == kb) == (a == b)
    assert common_prefix_tokens(ka, kb) == naive_lcp(a, b)


def test_common_prefix_of_a_byte_level_difference_inside_a_token():
    # 0x01FF vs 0x0200 differ in the third byte of the token; 256 vs 257 in the last
    assert common_prefix_tokens(encode_key([7, 0x01FF, 9]), encode_key([7, 0x0200, 9])) == 1
    assert common_prefix_tokens(encode_key([256]), encode_key([257])) == 0
    assert common_prefix_tokens(b"", encode_key([1])) == 0


def random_rows(rng: random.Random, count: int) -> list[tuple[list[int], int]]:
    """Token lists that are duplicates and prefixes of each other, with empty-ish lengths."""
    stems = [[rng.randrange(6) for _ in range(rng.randrange(0, 8))] for _ in range(12)]
    rows = []
    for row_index in range(count):
        stem = rng.choice(stems)
        kind = rng.random()
        if kind < 0.3:
            tokens = list(stem)                                  # duplicate
        elif kind < 0.6:
            tokens = stem[:rng.randrange(len(stem) + 1)]         # a prefix (maybe empty)
        else:
            tokens = stem + [rng.randrange(300) for _ in range(rng.randrange(1, 4))]  # an extension
        rows.append((tokens, row_index))
    rng.shuffle(rows)
    return rows


def external_sort(rows, folder: Path, budget: SortBudget, chunk: int = 7) -> tuple[list, int]:
    writer = RunWriter(folder / "runs", budget)
    for start in range(0, len(rows), chunk):
        part = rows[start:start + chunk]
        writer.add_many([r for _, r in part], [encode_key(t) for t, _ in part],
                        [None if t else f"empty {r}" for t, r in part])
    runs = writer.finish()
    return list(merge_runs(runs, folder, budget)), len(runs)


@pytest.mark.parametrize("seed, run_bytes, fan_in", [(0, 1, 2), (1, 40, 2), (2, 40, 3), (3, 200, 5), (4, 10**9, 64)])
def test_external_sort_equals_sorted_across_many_runs_and_merge_levels(tmp_path, seed, run_bytes, fan_in):
    rows = random_rows(random.Random(seed), 500)
    budget = SortBudget(run_bytes=run_bytes, merge_bytes=64, fan_in=fan_in)
    merged, runs = external_sort(rows, tmp_path, budget)
    expected = sorted(rows)
    assert [(decode_key(key), row) for key, row, _ in merged] == expected
    assert [error for _, _, error in merged] == [None if t else f"empty {r}" for t, r in expected]
    if run_bytes < 100:
        assert runs > fan_in ** 2  # so at least two merge passes ran before the final one
    # intermediate runs are deleted once merged: only the last pass's inputs remain
    assert len(list((tmp_path / "runs").glob("*.parquet"))) + len(list(tmp_path.glob("merge-*"))) <= fan_in


@settings(max_examples=25, deadline=None)
@given(st.lists(token_lists, max_size=40), st.integers(1, 300), st.integers(2, 4))
def test_external_sort_property(tmp_path_factory, lists, run_bytes, fan_in):
    rows = [(tokens, index) for index, tokens in enumerate(lists)]
    random.Random(len(rows)).shuffle(rows)
    merged, _ = external_sort(rows, tmp_path_factory.mktemp("sort"), SortBudget(run_bytes, 16, fan_in), chunk=3)
    assert [(decode_key(key), row) for key, row, _ in merged] == sorted(rows)


def test_sorted_rows_store_lcp_totals_and_ranges(tmp_path):
    rows = sorted(random_rows(random.Random(5), 300))
    stream = [(encode_key(t), r, None if t else "no prompt") for t, r in rows]
    counted = []
    totals = write_sorted_rows(stream, tmp_path / "sorted.parquet", on_rows=counted.append, row_group_rows=16)
    assert sum(counted) == len(rows)
    prompts = [t for t, _ in rows if t]
    lcps = [0] + [naive_lcp(a, b) for a, b in zip(prompts, prompts[1:])]
    assert totals.rows == len(rows) and totals.error_rows == len(rows) - len(prompts)
    assert totals.prompt_tokens == sum(map(len, prompts))
    assert totals.first_sample_reuse == sum(min(lcp, len(t) - 1) for lcp, t in zip(lcps, prompts))
    assert totals.further_sample_reuse == sum(len(t) - 1 for t in prompts)
    reader = SortedRowsReader(tmp_path / "sorted.parquet")
    assert reader.num_rows == len(rows)
    for start, count in [(0, 1), (0, 300), (15, 2), (16, 16), (17, 100), (299, 1), (40, 0)]:
        got = reader.read(start, count)
        assert [(r.row_index, r.token_ids if r.error is None else None) for r in got] == \
            [(r, t if t else None) for t, r in rows[start:start + count]]
    with pytest.raises(IndexError):
        reader.read(290, 11)


def test_row_groups_grow_so_the_footer_stays_small():
    assert row_group_rows_for(0) == row_group_rows_for(1_000_000) == 1024
    assert row_group_rows_for(100_000_000) == 12_208  # 8,192 row groups
