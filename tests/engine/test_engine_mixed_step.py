"""The mixed step: one forward over the prefill chunks and the decode rows of a step.

It must give what a prefill forward followed by a decode forward gives (the `mixed_step=False`
arm): the same logits and caches at the model, the same tokens, logprobs and scores at the
engine, with prefix reuse and ReplaySSM on; and no running row may stall while prefill remains.
"""
from __future__ import annotations

import random
from dataclasses import fields

import pytest
import torch

from batchinfer.engine.config import MIXED_STEP_ENV
from batchinfer.engine.model_runner import DecodeRows, ModelRunner, SequenceChunk
from batchinfer.engine.types import Request, SamplingParams
from batchinfer.models.config import model_config_from_dict
from batchinfer.models.forward_batch import ModelCaches, allocate_caches
from batchinfer.models.presets import PRESETS, random_model
from tests.engine_utils import make_engine, run, tiny_model

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def dense():
    return tiny_model(seed=3)


@pytest.fixture(scope="module")
def moe():
    raw = dict(PRESETS["qwen3.5-35b-a3b"], vocab_size=512, hidden_size=64, num_hidden_layers=4, head_dim=32,
               num_attention_heads=4, num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2,
               moe_intermediate_size=32, shared_expert_intermediate_size=32, max_position_embeddings=4096)
    return random_model(model_config_from_dict(raw), torch.float32, "cpu", seed=5)


# ---- the model: one mixed forward equals a prefill forward then a decode forward ----------------

def _clone(caches: ModelCaches) -> ModelCaches:
    def copy(value):
        if isinstance(value, torch.Tensor):
            return value.clone()
        return [t.clone() for t in value]
    return ModelCaches(**{f.name: copy(getattr(caches, f.name)) for f in fields(caches)
                          if getattr(caches, f.name) is not None})


def _tensors(caches: ModelCaches) -> list[torch.Tensor]:
    out = []
    for f in fields(caches):
        value = getattr(caches, f.name)
        out += [value] if isinstance(value, torch.Tensor) else list(value)
    return out


def test_one_mixed_forward_equals_prefill_then_decode(dense):
    """Chunks (fresh, continued, and one on a slot with ReplaySSM entries pending) and decode rows
    (a full ring among them) in one batch: the same logits rows and the same caches afterwards."""
    rng = random.Random(0)
    config = dense.config
    caches = allocate_caches(config, num_state_slots=8, num_kv_slots=400, dtype=torch.float32, device="cpu",
                             replay_ring_len=4)
    runner = ModelRunner(dense, caches, CPU, replay=True)
    kv = {s: torch.arange(60 * s, 60 * s + 60) for s in range(1, 7)}  # each slot's own KV slots
    tokens = {s: [rng.randrange(config.vocab_size) for _ in range(60)] for s in kv}

    def chunk(slot, start, n, **kw):
        return SequenceChunk(token_ids=tokens[slot][start:start + n], start=start, state_slot=slot,
                             context_kv=kv[slot][:start + n], wants_logits=kw.get("wants", True),
                             score_logits=kw.get("score", 0))

    def rows(slots_positions):
        return DecodeRows(token_ids=[tokens[s][p] for s, p in slots_positions], positions=[p for _, p in slots_positions],
                          state_slots=[s for s, _ in slots_positions],
                          kv_indices=torch.cat([kv[s][:p + 1] for s, p in slots_positions]),
                          shared_with_prev=[0] * len(slots_positions))

    # Before: slots 1-3 prefilled and decoded 5 steps (slot 1's ring fills: 4 entries, then a fold),
    # slot 4 prefilled part of its prompt.
    runner.prefill([chunk(1, 0, 20), chunk(2, 0, 9), chunk(3, 0, 14), chunk(4, 0, 10, wants=False)])
    for step in range(5):
        runner.decode(rows([(1, 20 + step), (2, 9 + step), (3, 14 + step)]))
    chunks = [chunk(5, 0, 13), chunk(4, 10, 7, wants=False, score=3), chunk(3, 19, 3)]  # slot 3: ring entries pending
    decode = rows([(1, 25), (2, 14)])

    apart = _clone(caches)
    mixed_logits = runner.mixed(chunks, decode)
    separate = ModelRunner(dense, apart, CPU, replay=True)
    expected = torch.cat([separate.prefill(chunks), separate.decode(decode)])
    assert mixed_logits.shape == expected.shape == (1 + 3 + 1 + 2, config.vocab_size)
    torch.testing.assert_close(mixed_logits, expected, rtol=1e-5, atol=1e-5)
    for got, want in zip(_tensors(caches), _tensors(apart)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Five steps filled the rings (4 entries) and folded them (1); the mixed step appended one;
    # the prefilled slots start from folded states.
    assert caches.cursor[[1, 2, 3, 5]].tolist() == [2, 2, 0, 0]


# ---- the engine: mixed steps against separate forwards -------------------------------------------

def _staggered_requests(vocab: int, seed: int, rows: int = 14) -> list[Request]:
    """Rows of staggered prompt lengths and output budgets, some sharing prefixes (reuse), with
    sampled, logprob, repetition-penalty, n = 2 and scoring rows among the greedy ones."""
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(40)]
    requests = []
    for i in range(rows):
        prompt = shared[:rng.choice((0, 21, 40))] + [rng.randrange(vocab) for _ in range(rng.randrange(2, 45))]
        params = SamplingParams(max_tokens=rng.randrange(2, 13), ignore_eos=True)
        if i % 5 == 1:
            params = SamplingParams(max_tokens=params.max_tokens, ignore_eos=True, temperature=0.9, top_k=40, seed=7)
        if i == 3:
            params = SamplingParams(max_tokens=9, ignore_eos=True, logprobs=2)
        if i == 4:
            params = SamplingParams(max_tokens=7, ignore_eos=True, repetition_penalty=1.3)
        if i == 5:
            params = SamplingParams(max_tokens=5, ignore_eos=True, n=2, temperature=1.0, seed=3)
        requests.append(Request(request_id=i, prompt_token_ids=tuple(prompt), sampling=params, seed_key=i,
                                score_tokens=4 if i == 8 else 0))
    return requests


def _summary(outputs: dict) -> dict:
    return {key: (out.token_ids, out.finish_reason, out.cached_tokens, out.error) for key, out in outputs.items()}


def _assert_same_outputs(mixed: dict, separate: dict) -> None:
    assert _summary(mixed) == _summary(separate)
    for key, out in separate.items():
        if out.logprobs:
            got = mixed[key].logprobs
            assert [lp.top_ids for lp in got] == [lp.top_ids for lp in out.logprobs]
            assert [lp.logprob for lp in got] == pytest.approx([lp.logprob for lp in out.logprobs], abs=1e-4)
        if out.score is not None:
            assert mixed[key].score.greedy == out.score.greedy and mixed[key].score.tokens == out.score.tokens
            assert mixed[key].score.logprob == pytest.approx(out.score.logprob, abs=1e-4)


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("overlap", [True, False])
def test_mixed_steps_give_the_tokens_of_separate_forwards(request, kind, overlap):
    """Few running places, so rows are admitted (and prefilled) while others decode; small steps,
    so long prompts take several chunks beside the decode rows."""
    model = request.getfixturevalue(kind)
    requests = _staggered_requests(model.config.vocab_size, seed=11)
    settings = dict(max_running=3, max_batch_tokens=24, track_interval=16, overlap_decode=overlap)
    separate = make_engine(model, mixed_step=False, **settings)
    mixed = make_engine(model, mixed_step=True, **settings)
    assert mixed.mixed_step and mixed.settings()["mixed_step"]
    expected, got = run(separate, requests), run(mixed, requests)
    _assert_same_outputs(got, expected)
    assert sum(out.cached_tokens for out in got.values()) > 0  # prefix reuse was on the path
    assert mixed.stats.mixed_steps > 0 and separate.stats.mixed_steps == 0
    assert mixed.stats.replayssm_flushes == separate.stats.replayssm_flushes > 0


def test_the_mixed_step_is_off_by_default_and_the_environment_switches_it(dense, monkeypatch):
    assert not make_engine(dense).mixed_step
    monkeypatch.setenv(MIXED_STEP_ENV, "1")
    assert make_engine(dense).mixed_step


def test_an_environment_switch_selects_separate_forwards(dense, monkeypatch):
    monkeypatch.setenv(MIXED_STEP_ENV, "0")
    engine = make_engine(dense, mixed_step=True, max_running=3, max_batch_tokens=24)
    assert not engine.mixed_step and engine.settings()["mixed_step"] is False
    run(engine, _staggered_requests(dense.config.vocab_size, seed=2, rows=5))
    assert engine.stats.mixed_steps == 0 and engine.stats.decode_steps > 0


def test_running_rows_decode_in_every_step_while_prefill_remains(dense):
    """Each step: every running row with one token to feed decodes, in the same (one) forward as
    the step's prefill chunks, and prefill tokens plus decode rows stay within max_batch_tokens."""
    budget = 20
    engine = make_engine(dense, mixed_step=True, max_running=4, max_batch_tokens=budget, track_interval=16)
    scheduler, forwards, steps = engine.scheduler, [0], []
    schedule, forward = scheduler.schedule, engine.model.forward

    def recording_schedule():
        plan = schedule()
        decodable = {id(s) for s in scheduler.running if s.handle is not None and s.pending == 1
                     and not s.awaits_last_token(scheduler.max_model_len)}
        steps.append((plan, decodable, forwards[0]))
        return plan

    def counting_forward(*args, **kwargs):
        forwards[0] += 1
        return forward(*args, **kwargs)

    scheduler.schedule = recording_schedule
    engine.model.forward = counting_forward
    run(engine, _staggered_requests(dense.config.vocab_size, seed=4, rows=10))
    mixed = 0
    for i, (plan, decodable, before) in enumerate(steps):
        assert not plan.needs_host_tokens  # the pool is large: nothing is preempted here
        assert {id(s) for s in plan.decode} == decodable, f"step {i}: a running row did not decode"
        assert sum(n for _, n in plan.prefill) + len(plan.decode) <= budget, f"step {i}: over the token budget"
        after = steps[i + 1][2] if i + 1 < len(steps) else forwards[0]
        assert after - before == int(bool(plan.prefill or plan.decode)), f"step {i}: one forward per step"
        mixed += bool(plan.prefill and plan.decode)
    assert mixed >= 5  # admissions happened while rows decoded


def test_the_precompile_trace_covers_mixed_steps_eager_decode_sizes():
    """Mixed steps run their decode rows eagerly at any count: the trace holds one of each
    integer class Triton specialises on (1, a multiple of 16, neither) in each launch range."""
    from batchinfer.engine.step_shapes import StepShapes, mixed_decode_sizes

    shapes = StepShapes(decode_buckets=[1, 2, 256], graph_ctx_cap=64, decode_hint=True, max_batch_tokens=8192,
                        max_running=256, max_model_len=4096, replay=True, mixed_step=True)
    sizes = mixed_decode_sizes(shapes)
    for low, high in ((1, 31), (32, 127), (128, 256)):
        inside = [b for b in sizes if low <= b <= high]
        assert any(b % 16 == 0 for b in inside) and any(b % 16 and b != 1 for b in inside), (low, high, sizes)
    assert 1 in sizes and max(sizes) == 256
    assert max(mixed_decode_sizes(StepShapes(**{**shapes.__dict__, "max_running": 20}))) == 20
