"""Cutting the sorted rows into work units: invariants, exact reuse, optimal cuts; the balance."""
from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from batchinfer.engine.planner import make_plan
from batchinfer.jobs.run.executors.balance import predict_balance
from batchinfer.jobs.global_plan.keys import common_prefix_tokens, encode_key
from batchinfer.jobs.global_plan.sorted_rows import SpillTotals
from batchinfer.jobs.global_plan.units import UnitConfig, _row_quantities, cut_units


def profile_of(prompts: list):
    """Sorted prompts (None = an error row, sorted first) -> (totals, profile factory, sorted list)."""
    rows = sorted(prompts, key=lambda p: (p is not None, p or []))
    keys = [b"" if p is None else encode_key(p) for p in rows]
    lcp = np.array([0] + [common_prefix_tokens(a, b) if a and b else 0 for a, b in zip(keys, keys[1:])])
    tokens = np.array([0 if p is None else len(p) for p in rows])
    d = np.where(tokens > 0, np.clip(np.minimum(lcp, tokens - 1), 0, None), 0)
    totals = SpillTotals(rows=len(rows), error_rows=int((tokens == 0).sum()), prompt_tokens=int(tokens.sum()),
                         first_sample_reuse=int(d.sum()), further_sample_reuse=int(np.clip(tokens - 1, 0, None).sum()))

    def profile(batch=5):
        for start in range(0, len(rows), batch):
            yield lcp[start:start + batch], tokens[start:start + batch]
    return totals, profile, rows


def rag(documents: int, questions: int, rng: random.Random, header: tuple = ()) -> list:
    prompts = []
    for doc in range(documents):
        body = [1000 + doc] + [rng.randrange(50) for _ in range(rng.randrange(5, 30))]
        prompts += [list(header) + body + [2000 + q, rng.randrange(50)] for q in range(questions)]
    rng.shuffle(prompts)
    return prompts


def check_units(units, summary, rows, n):
    """Every row once, in order; each unit's ideal is make_plan's over its own rows; the identities."""
    assert [u.start for u in units] == list(itertools.accumulate([0] + [u.rows for u in units[:-1]]))
    assert sum(u.rows for u in units) == len(rows) == summary.rows
    for unit in units:
        prompts = [p for p in rows[unit.start:unit.stop] if p is not None]
        plan = make_plan(prompts, n).summary
        assert unit.ideal_cached_tokens == plan.theoretical_max_cached_tokens
        assert unit.prompt_tokens == plan.prompt_tokens and unit.samples == plan.rows
        assert unit.error_rows == unit.rows - len(prompts)
    everything = make_plan([p for p in rows if p is not None], n).summary
    assert summary.ideal_cached_tokens == everything.theoretical_max_cached_tokens
    assert summary.shared_prefix_groups == everything.shared_prefix_groups
    assert summary.unit_ideal_cached_tokens == sum(u.ideal_cached_tokens for u in units) \
        == summary.ideal_cached_tokens - summary.recomputed_root_tokens


@pytest.mark.parametrize("n", [1, 3])
def test_groups_that_fit_stay_whole_and_small_groups_are_packed(n):
    rng = random.Random(0)
    prompts = rag(60, 7, rng) + [None, None]
    totals, profile, rows = profile_of(prompts)
    units, summary = cut_units(profile, totals, n, 8, UnitConfig(max_rows=30, min_rows=1, target_cost=10**9))
    check_units(units, summary, rows, n)
    assert summary.recomputed_root_tokens == 0  # no document was split
    assert all(u.rows <= 30 for u in units)
    assert len(units) == 15  # 4 documents of 7 rows (+ the 2 error rows in the first) per unit: packed
    assert units[0].error_rows == 2


def test_a_group_larger_than_a_unit_is_split_below_its_root_once_per_unit():
    header = tuple(range(500, 540))  # a 40-token few-shot header shared by every row
    rng = random.Random(1)
    prompts = rag(50, 3, rng, header=header)  # 150 rows in one group
    totals, profile, rows = profile_of(prompts)
    units, summary = cut_units(profile, totals, 1, 8, UnitConfig(max_rows=32, min_rows=1, target_cost=10**9))
    check_units(units, summary, rows, 1)
    assert len(units) == 5  # ceil(150 / 32): no more splits than needed
    # each unit after the first recomputes exactly the header, and no document is split
    assert [u.recomputed_root_tokens for u in units] == [0] + [len(header)] * 4
    assert summary.recomputed_root_tokens == 4 * len(header)


def test_a_long_chain_of_prefixes_is_not_cut_into_one_row_units():
    chain = [list(range(k)) for k in range(1, 201)]  # each prompt extends the one before
    totals, profile, rows = profile_of(chain)
    units, summary = cut_units(profile, totals, 1, 4, UnitConfig(max_rows=50, min_rows=1, target_cost=10**9))
    check_units(units, summary, rows, 1)
    assert len(units) == 4  # a greedy cut at the cheapest boundary would make 1-row units here


def brute_force_best(costs: list[int], max_rows: int, rows: int) -> tuple[int, int]:
    """(min recomputed tokens, min units among those) over every partition, exhaustively."""
    best = None
    for cuts in itertools.product([False, True], repeat=rows - 1):
        starts = [0] + [b for b, cut in zip(range(1, rows), cuts) if cut]
        sizes = np.diff(starts + [rows])
        if sizes.max() > max_rows:
            continue
        score = (sum(costs[s] for s in starts[1:]), len(starts))
        best = score if best is None or score < best else best
    return best


@pytest.mark.parametrize("seed", range(12))
def test_the_cut_is_optimal_against_brute_force(seed):
    rng = random.Random(seed)
    stems = [[rng.randrange(3) for _ in range(rng.randrange(1, 6))] for _ in range(3)]
    prompts = [rng.choice(stems)[:rng.randrange(1, 6)] + [rng.randrange(4)] for _ in range(rng.randrange(3, 12))]
    totals, profile, rows = profile_of(prompts)
    max_rows = rng.randrange(1, 5)
    units, summary = cut_units(profile, totals, 1, 2, UnitConfig(max_rows=max_rows, min_rows=1, target_cost=10**9))
    check_units(units, summary, rows, 1)
    cut_costs = list(np.concatenate([q.reuse_first for q in
                                     (_row_quantities(lcp, tok, 1, 2, 1.0) for lcp, tok in profile())]))
    assert (summary.recomputed_root_tokens, len(units)) == brute_force_best(cut_costs, max_rows, len(rows))
    assert all(u.rows <= max_rows for u in units)


def test_the_cost_limit_bounds_units_and_the_automatic_target_aims_at_units_goal():
    rng = random.Random(2)
    prompts = rag(400, 5, rng)
    totals, profile, rows = profile_of(prompts)
    units, summary = cut_units(profile, totals, 2, 16, UnitConfig(units_goal=40, min_rows=1))
    check_units(units, summary, rows, 2)
    assert summary.target_cost == pytest.approx(summary.total_cost / 40)
    assert 40 <= len(units) <= 80 and summary.recomputed_root_tokens == 0
    assert max(u.cost for u in units) <= summary.target_cost
    few, _ = cut_units(profile, totals, 2, 16, UnitConfig(units_goal=40, min_rows=500))
    assert len(few) <= 2000 // 500 + 1  # min_rows keeps small jobs from being cut into crumbs


def test_no_rows_no_units():
    totals, profile, rows = profile_of([])
    units, summary = cut_units(profile, totals, 1, 4)
    assert units == () and summary.units == 0 and summary.ideal_cached_tokens == 0


def test_lpt_balance():
    balance = predict_balance([5, 4, 3, 3, 3], 2)
    assert balance.loads == (8, 10) and balance.unit_counts == (2, 3)
    assert balance.makespan == 10 and balance.ideal == 9 and balance.overhead == pytest.approx(1 / 9)
    one_big = predict_balance([100, 1, 1], 4)
    assert one_big.ideal == 100 and one_big.makespan == 100 and one_big.overhead == 0
    assert predict_balance([], 3).makespan == 0
    with pytest.raises(ValueError):
        predict_balance([1], 0)
