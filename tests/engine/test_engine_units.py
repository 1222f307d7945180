"""Work units on a tiny random model (fp32, CPU): a unit is planned as one whole, and achieved
reuse equals that plan — the global ideal for a whole job in one unit, shuffled or grouped —
under a state pool far smaller than the plan's branch states, with the tokens of a run
without prefix caching. A plan that cannot fit the pool completes too, and says so."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from batchinfer.engine.types import Request, SamplingParams
from tests.engine_utils import TINY_VOCAB, collect, make_engine, tiny_model, tokens_of

GREEDY = SamplingParams(max_tokens=2, ignore_eos=True)
# 16 running sequences, so 16 working slots plus plan_pools' minimum of 8 cached states: far
# fewer than the branch states the plans below open (a document, question openers, samples).
SMALL_POOL = dict(max_running=16, memory_budget_bytes=16 << 20, track_interval=16)


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=1)


def rag_prompts(docs: int, questions: int, doc_len: int, seed: int, root_len: int = 0) -> list[list[int]]:
    """`docs` documents × `questions` questions, grouped by document. A question starts with one
    of three opener tokens (nested branch points below its document); `root_len` > 0 puts one
    shared root (a system prompt) before every document."""
    rng = random.Random(seed)
    root = [rng.randrange(TINY_VOCAB) for _ in range(root_len)]
    openers = [rng.randrange(TINY_VOCAB) for _ in range(3)]
    prompts = []
    for _ in range(docs):
        doc = root + [rng.randrange(TINY_VOCAB) for _ in range(doc_len)]
        for _ in range(questions):
            tail = [rng.randrange(TINY_VOCAB) for _ in range(rng.randrange(2, 5))]
            prompts.append(doc + [rng.choice(openers)] + tail)
    return prompts


def global_ideal(prompts, n: int) -> int:
    """Σ over the globally sorted rows (a prompt once per sample) of min(lcp with the row
    before, len − 1): every shared token computed once, the last one of each row again."""
    rows = sorted(tuple(p) for p in prompts for _ in range(n))
    total = 0
    for before, row in zip(rows, rows[1:]):
        lcp = next((i for i, (a, b) in enumerate(zip(before, row)) if a != b), min(len(before), len(row)))
        total += min(lcp, len(row) - 1)
    return total


def unit_of(prompts, order, params) -> list[Request]:
    """The requests of `prompts` in `order`; ids follow the prompt, not its place."""
    return [Request(request_id=i, prompt_token_ids=tuple(prompts[i]), seed_key=i, sampling=params) for i in order]


def run_units(engine, units) -> dict:
    return collect(engine, engine.generate_units(units))


@pytest.mark.slow
@pytest.mark.parametrize("n,root_len", [(1, 0), (2, 0), (1, 12)], ids=["rag", "rag_n2", "rag_system_root"])
def test_one_unit_reaches_the_global_ideal_shuffled_or_grouped(model, n, root_len):
    prompts = rag_prompts(docs=16, questions=5, doc_len=16, seed=n + root_len, root_len=root_len)
    params = replace(GREEDY, n=n)
    grouped = list(range(len(prompts)))
    shuffled = grouped[:]
    random.Random(7).shuffle(shuffled)
    ideal = global_ideal(prompts, n)
    reference = tokens_of(run_units(make_engine(model, prefix_cache=False, replayssm=False, overlap_decode=False),
                                    [unit_of(prompts, grouped, params)]))
    for order in (grouped, shuffled):
        engine = make_engine(model, **SMALL_POOL)
        assert (engine.pool_plan.state_slots, engine.pool_plan.cache_state_slots) == (24, 8)
        outputs = run_units(engine, [unit_of(prompts, order, params)])
        assert tokens_of(outputs) == reference
        stats = engine.stats
        assert stats.cached_tokens == stats.theoretical_max_cached_tokens == ideal
        assert all(out.cached_tokens == out.theoretical_max_cached_tokens for out in outputs.values())
        assert stats.planned_reuse_lost_tokens == 0 and stats.branch_states_over_capacity == 0
        assert stats.states_evicted > 0  # the pool was short: interval states made way


def comb_prompts(teeth: int, seed: int) -> list[list[int]]:
    """A comb: one long prompt, and `teeth` rows that each share 3, 6, 9, … of its tokens and
    sort after it. The long one leads every one of those branch points, so all their states
    come to life during its prefill and wait for rows that can start only after it (one runs
    at a time): more branch states at once than a small pool holds."""
    rng = random.Random(seed)
    spine = [rng.randrange(400) for _ in range(3 * teeth + 4)]
    return [spine] + [spine[:3 * k + 3] + [500 + k] for k in range(teeth)]


def test_a_plan_wider_than_the_pool_recomputes_and_says_so(model):
    prompts = comb_prompts(teeth=12, seed=3)
    order = list(range(len(prompts)))
    random.Random(1).shuffle(order)
    requests = unit_of(prompts, order, GREEDY)
    reference = tokens_of(run_units(make_engine(model, prefix_cache=False, replayssm=False, overlap_decode=False),
                                    [requests]))
    engine = make_engine(model, max_running=1, track_interval=64)
    assert engine.pool_plan.state_slots == 9  # 1 working slot + 8 cached: not 12 branch states
    outputs = run_units(engine, [requests])
    assert tokens_of(outputs) == reference
    stats = engine.stats
    assert stats.theoretical_max_cached_tokens == global_ideal(prompts, 1)
    assert stats.branch_states_over_capacity == 4
    lost = stats.theoretical_max_cached_tokens - stats.cached_tokens
    assert lost > 0 and stats.planned_reuse_lost_tokens == lost
    assert sum(max(0, o.theoretical_max_cached_tokens - o.cached_tokens) for o in outputs.values()) == lost


def test_unit_outputs_say_their_unit_and_mark_its_last(model):
    prompts = rag_prompts(docs=3, questions=3, doc_len=10, seed=4)
    units = [unit_of(prompts, range(0, 4), GREEDY), unit_of(prompts, range(4, 9), replace(GREEDY, n=2))]
    units.insert(1, [replace(r, skip_samples=(0,)) for r in unit_of(prompts, range(2), GREEDY)])  # nothing to do
    units.append([Request(request_id="bad", prompt_token_ids=())])  # rejected outright: an error output
    engine = make_engine(model, max_running=3)
    pulled_while_waiting = []

    def pull():
        for unit in units:
            pulled_while_waiting.append(len(engine.scheduler.waiting))
            yield unit

    stream = list(engine.generate_units(pull()))
    assert pulled_while_waiting == [0, 0, 0, 0]  # each unit pulled once nothing waits for admission
    by_unit = {u: [o for o in stream if o.unit_index == u] for u in range(4)}
    assert [len(by_unit[u]) for u in range(4)] == [4, 0, 10, 1]
    for u in (0, 2, 3):
        marked = [o for o in by_unit[u] if o.unit_done]
        assert marked == [by_unit[u][-1]]  # exactly one mark: the unit's last output in the stream
    assert by_unit[3][0].finish_reason == "error"


def test_generate_runs_plan_windows_as_units(model):
    prompts = rag_prompts(docs=2, questions=3, doc_len=10, seed=5)
    engine = make_engine(model, plan_window=4)
    outputs = list(engine.generate(unit_of(prompts, range(len(prompts)), GREEDY)))
    assert sorted(o.unit_index for o in outputs) == [0, 0, 0, 0, 1, 1]
    assert sum(o.unit_done for o in outputs) == 2


def test_closing_early_leaves_no_state_held_for_followers(model):
    prompts = rag_prompts(docs=4, questions=4, doc_len=20, seed=6)
    engine = make_engine(model, max_running=4)
    stream = engine.generate_units([unit_of(prompts, range(len(prompts)), GREEDY)])
    next(stream)
    stream.close()  # followers still waiting for their branch states
    tree = engine.cache.tree
    assert tree.num_states > 0 and tree.evictable(spare_expected=True)[1] == tree.num_states


def test_a_follower_that_fails_stops_holding_its_branch_state(model):
    """A follower too long for the KV pool even alone fails; its branch state is not kept
    for it for ever (it would shrink the pool for every later unit)."""
    rng = random.Random(8)
    head = [rng.randrange(TINY_VOCAB) for _ in range(12)]
    prompts = [head, head + [1, 2, 3], head + [9] * 450]  # followers of the state at 12, the long one last
    engine = make_engine(model, max_running=1, memory_budget_bytes=400_000, max_model_len=1024)
    assert engine.pool_plan.kv_slots < 450
    outputs = run_units(engine, [unit_of(prompts, range(3), GREEDY)])
    assert outputs[(2, 0)].finish_reason == "error" and outputs[(1, 0)].cached_tokens == 12
    tree = engine.cache.tree
    assert tree.num_states > 0 and tree.evictable(spare_expected=True)[1] == tree.num_states


def test_a_leader_resuming_at_its_branch_point_keeps_that_state(model):
    """Unit 2's leader resumes at its own branch point from a state unit 1 left (a shared root
    split over units). Its interval tracks then fill a small pool; the root state must stay
    for unit 2's follower rather than be evicted like any old state."""
    rng = random.Random(9)
    root = [rng.randrange(100) for _ in range(12)]
    first = [root + [200 + i] + [rng.randrange(TINY_VOCAB) for _ in range(4 + i)] for i in range(2)]
    second = [root + [300] + [rng.randrange(TINY_VOCAB) for _ in range(40)], root + [400, 5, 6]]
    engine = make_engine(model, max_running=1, track_interval=4)
    second_unit = [replace(r, request_id=("second", r.request_id)) for r in unit_of(second, range(2), GREEDY)]
    outputs = run_units(engine, [unit_of(first, range(2), GREEDY), second_unit])
    follower = outputs[(("second", 1), 0)]
    assert follower.theoretical_max_cached_tokens == 12 and follower.cached_tokens == 12
    assert engine.stats.states_evicted > 0 and engine.stats.planned_reuse_lost_tokens == 0
