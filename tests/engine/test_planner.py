"""Planner: ideal reuse against a brute-force trie count, and plan feasibility by simulation."""
from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from batchinfer.engine.planner import make_plan, plan_prompts


def ideal_by_trie(prompts, n):
    """Every distinct non-empty prefix is computed once; every further copy of an identical
    prompt (duplicate rows, extra samples) recomputes only its last token."""
    rows = [tuple(p) for p, k in zip(prompts, n) for _ in range(k)]
    prefixes = {r[:d] for r in rows for d in range(1, len(r) + 1)}
    computed = len(prefixes) + len(rows) - len(set(rows))
    return sum(len(r) for r in rows) - computed


def simulate(plan, prompts):
    """Run the plan in DFS order: each resume state must have been checkpointed before."""
    available = set()
    for row in plan.rows:
        tokens = tuple(prompts[row.prompt_index])
        if row.resume_depth:
            assert tokens[:row.resume_depth] in available, (row, "resumes from a state nobody made")
        for depth in row.branch_points:
            assert row.resume_depth < depth <= len(tokens), "checkpoint outside the row's own prefill"
            available.add(tokens[:depth])


prompt_lists = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=7), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(prompts=prompt_lists, data=st.data())
def test_ideal_matches_trie_count_and_plan_is_feasible(prompts, data):
    n = data.draw(st.lists(st.integers(1, 3), min_size=len(prompts), max_size=len(prompts)))
    plan = make_plan(prompts, n)
    assert plan.summary.theoretical_max_cached_tokens == ideal_by_trie(prompts, n)
    assert sum(r.resume_depth for r in plan.rows) == plan.summary.theoretical_max_cached_tokens
    assert plan.summary.rows == sum(n) == len(plan.rows)
    simulate(plan, prompts)
    keys = [tuple(prompts[r.prompt_index]) for r in plan.rows]
    assert keys == sorted(keys)


def test_groups_of_shared_prefixes_with_nested_sharing():
    rng = random.Random(3)
    prefix = [rng.randrange(1000, 2000) for _ in range(70)]
    prompts, expected_ideal = [], 0
    for g in range(3):
        head = [g] + prefix                          # three groups, each with a 71-token prefix
        for i in range(4):
            suffix = [rng.randrange(10_000) for _ in range(5 + 2 * i)]
            prompts.append(head + suffix)
            expected_ideal += 71 if i else 0
    prompts.append(prompts[0] + [7, 7, 7])           # nested: extends a whole earlier prompt
    expected_ideal += len(prompts[0])
    rng.shuffle(prompts)
    plan = make_plan(prompts)
    assert plan.summary.theoretical_max_cached_tokens == expected_ideal
    assert plan.summary.shared_prefix_groups == 3
    # One branch point per group at depth 71 plus the nested prompt's end; each led exactly once.
    assert plan.summary.branch_points == 4
    simulate(plan, prompts)


def test_samples_share_all_but_the_last_prompt_token():
    prompts = [[5, 6, 7, 8], [9, 9]]
    summary = plan_prompts(prompts, n=[3, 1])
    assert summary.rows == 4 and summary.prompts == 2
    assert summary.prompt_tokens == 3 * 4 + 2
    assert summary.theoretical_max_cached_tokens == 2 * 3
    plan = make_plan(prompts, n=[3, 1])
    first = [r for r in plan.rows if r.prompt_index == 0 and r.sample_index == 0][0]
    assert first.branch_points == (3,) and first.resume_depth == 0


def test_no_sharing_and_single_token_prompts():
    summary = plan_prompts([[1], [1], [2, 3], [4, 5]])
    assert summary.theoretical_max_cached_tokens == 0   # a 1-token prompt can reuse nothing
    assert summary.shared_prefix_groups == 0 and summary.branch_points == 0
    assert summary.hit_rate == 0.0
    assert plan_prompts([]).rows == 0
