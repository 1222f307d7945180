"""The concurrent step: a step's prefill forward on a second stream beside its decode forward.

On the CPU the two forwards run in turn, decode first; the engine must give exactly what the
default order (prefill, then decode) gives: the same tokens, logprobs, scores and reuse, with
prefix sharing, ReplaySSM and the decode overlap on. On CUDA the same engine runs them on two
streams (the GPU test at the end).
"""
from __future__ import annotations

import pytest
import torch

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.side_stream import SideStream
from batchinfer.engine.types import Request, SamplingParams
from batchinfer.models.presets import preset_config, random_model
from tests.engine.test_engine_mixed_step import _assert_same_outputs, _staggered_requests
from tests.engine_utils import make_engine, run, tiny_model


@pytest.fixture(scope="module")
def dense():
    return tiny_model(seed=3)


@pytest.mark.parametrize("overlap", [True, False])
def test_concurrent_steps_give_the_tokens_of_forwards_in_turn(dense, overlap):
    """Few running places and small steps: rows are admitted and prefilled, in several chunks,
    while others decode, so most steps hold both forwards."""
    requests = _staggered_requests(dense.config.vocab_size, seed=11)
    settings = dict(max_running=3, max_batch_tokens=24, track_interval=16, overlap_decode=overlap)
    in_turn = make_engine(dense, **settings)
    concurrent = make_engine(dense, concurrent_prefill=True, **settings)
    assert concurrent.settings()["concurrent_prefill"] and not in_turn.settings()["concurrent_prefill"]
    expected, got = run(in_turn, requests), run(concurrent, requests)
    _assert_same_outputs(got, expected)
    assert sum(out.cached_tokens for out in got.values()) > 0  # prefix reuse was on the path
    stats, base = concurrent.stats, in_turn.stats
    assert stats.concurrent_steps >= 5 and base.concurrent_steps == 0
    # Each concurrent step is one decode forward: the counts match the forwards in turn.
    assert (stats.decode_steps, stats.decode_seq_steps) == (base.decode_steps, base.decode_seq_steps)
    assert stats.replayssm_flushes == base.replayssm_flushes > 0
    assert stats.concurrent_seconds > 0


def test_steps_with_one_kind_of_work_run_as_before(dense):
    """A prefill-only or decode-only step has nothing to run beside: no concurrent step."""
    engine = make_engine(dense, concurrent_prefill=True, max_running=16, max_batch_tokens=4096)
    # Unrelated prompts, all admitted and prefilled in the first step, then decoded together.
    requests = [Request(i, tuple(range(3 * i + 1, 3 * i + 30)), SamplingParams(max_tokens=5, ignore_eos=True))
                for i in range(4)]
    run(engine, requests)
    stats = engine.stats
    assert stats.concurrent_steps == 0 and stats.decode_steps > 0 and stats.prefill_seconds > 0


@pytest.mark.parametrize("fields", [dict(mixed_step=True), dict(pipeline_stages=2)])
def test_concurrent_prefill_does_not_combine_with_one_forward_or_stages(fields):
    with pytest.raises(ValueError, match="concurrent_prefill"):
        EngineConfig(concurrent_prefill=True, **fields)


def test_the_side_stream_is_a_no_op_on_the_cpu():
    side = SideStream(torch.device("cpu"))
    t = torch.arange(3)
    with side.launch():
        u = t + 1
    assert side.stream is None and side.join(u) is u


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_side_stream_results_are_ordered_after_the_caller_and_before_its_reads():
    """The side stream starts after the caller's queued writes and the caller reads its result
    only after it: a long caller kernel before and a read after see the right values."""
    device = torch.device("cuda")
    side = SideStream(device)
    x = torch.zeros(1 << 24, device=device)
    torch.cuda._sleep(50_000_000)  # the caller's stream busy, then its write
    x.fill_(2.0)
    with side.launch():
        y = x * 3.0  # must see 2.0, not 0.0
    y = side.join(y)
    assert side.stream is not None and torch.cuda.current_stream(device) != side.stream
    assert y.eq(6.0).all().item()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_concurrent_steps_on_cuda_give_the_tokens_of_forwards_in_turn():
    """Two real streams: the same greedy tokens as the forwards in turn (fp32, graphs on)."""
    model = random_model(preset_config("tiny"), torch.float32, "cuda", seed=3)
    requests = _staggered_requests(model.config.vocab_size, seed=11, rows=24)
    settings = dict(device="cuda", dtype="fp32", memory_budget_bytes=64 << 20, max_running=6, max_batch_tokens=32,
                    track_interval=16)
    expected = run(make_engine(model, **settings), requests)
    engine = make_engine(model, concurrent_prefill=True, **settings)
    _assert_same_outputs(run(engine, requests), expected)
    assert engine.stats.concurrent_steps > 0


def test_constrained_rows_give_the_tokens_of_forwards_in_turn(tmp_path_factory):
    """Grammar rows draw from host-side matcher state: the prefill's draws, then the decode's, in
    the same order as with the forwards in turn."""
    pytest.importorskip("jsonschema")
    from tests.engine.test_structured_engine import _engine, _requests
    from tests.engine.test_structured_engine import grammars as grammars_fixture
    from tests.engine.test_structured_engine import model as model_fixture
    from tests.engine.test_structured_engine import tokenizer as tokenizer_fixture

    # the structured-output tests' fixtures, called directly (another module's fixtures)
    tokenizer = tokenizer_fixture.__wrapped__(tmp_path_factory)
    grammars, model = grammars_fixture.__wrapped__(tokenizer), model_fixture.__wrapped__()
    requests = _requests(grammars, ("json_schema", "regex", "choice"), rows=3, max_tokens=40)
    settings = dict(max_running=3, max_batch_tokens=16)
    engine = _engine(model, tokenizer, concurrent_prefill=True, **settings)
    got = {(o.request_id, o.sample_index): o.token_ids for o in engine.generate(requests)}
    expected = {(o.request_id, o.sample_index): o.token_ids
                for o in _engine(model, tokenizer, **settings).generate(requests)}
    assert got == expected and len(got) == 18 and engine.stats.concurrent_steps > 0
