"""Scoring requests: the summed logprob of given continuations equals transformers', with the
prompt shared by all continuations of a row through the prefix plan."""
from __future__ import annotations

import random

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from batchinfer.engine.config import EngineConfig  # noqa: E402
from batchinfer.engine.engine import Engine  # noqa: E402
from batchinfer.engine.types import Request, SamplingParams  # noqa: E402
from tests.engine_utils import demo_engine_fp32  # noqa: E402
from tests.jobs_fixtures import make_tokenizer_checkpoint  # noqa: E402
from tests.model_utils import hf_greedy, hf_logits, hf_reference, make_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("scoring"), "qwen3_5", seed=4)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return hf_reference(checkpoint)


@pytest.fixture(scope="module")
def cases(reference):
    """(prompt, continuations) rows: long prompts (several prefill chunks), continuations that
    are prefixes of one another or repeat, and the greedy continuation."""
    rng = random.Random(2)
    rows = []
    for length in (70, 9, 62):  # 62: a tracked state (every 32) falls inside the continuations
        prompt = [rng.randrange(1, 256) for _ in range(length)]
        a = [rng.randrange(1, 256) for _ in range(4)]
        rows.append((prompt, [a, a[:2], [rng.randrange(1, 256)], hf_greedy(reference, prompt, 5), a]))
    return rows


def _requests(cases):
    requests = []
    for row, (prompt, continuations) in enumerate(cases):
        for j, continuation in enumerate(continuations):
            requests.append(Request((row, j), tuple(prompt + continuation), SamplingParams(max_tokens=1),
                                    seed_key=row, score_tokens=len(continuation)))
    return requests


def _scores(checkpoint, cases, **config):
    settings = dict(device="cpu", dtype="fp32", memory_budget_bytes=8 << 20, ring_len=4, track_interval=32)
    engine = Engine.from_pretrained(str(checkpoint), EngineConfig(**{**settings, **config}))
    outputs = {o.request_id: o for o in engine.generate(_requests(cases))}
    return engine, outputs


def _expected(reference, prompt, continuation):
    logp = hf_logits(reference, prompt + continuation).log_softmax(dim=-1)
    rows = logp[len(prompt) - 1:len(prompt) + len(continuation) - 1]
    picked = rows.gather(1, torch.tensor(continuation)[:, None])[:, 0]
    return picked.double().sum().item(), bool((rows.argmax(dim=1) == torch.tensor(continuation)).all())


@pytest.mark.parametrize("config", [{}, {"prefix_cache": False}, {"state_cache": "no_buffer"},
                                    {"max_batch_tokens": 48}, {"max_running": 1, "state_cache": "no_buffer"},
                                    {"max_running": 1}])
def test_scores_equal_transformers_summed_continuation_logprobs(checkpoint, reference, cases, config):
    engine, outputs = _scores(checkpoint, cases, **config)
    assert len(outputs) == sum(len(c) for _, c in cases)
    for row, (prompt, continuations) in enumerate(cases):
        for j, continuation in enumerate(continuations):
            out = outputs[(row, j)]
            assert out.finish_reason == "stop" and out.token_ids == () and out.completion_tokens == 0
            logprob, greedy = _expected(reference, prompt, continuation)
            assert abs(out.score.logprob - logprob) < 1e-4, (row, j)
            assert out.score.tokens == len(continuation) and out.score.greedy == greedy, (row, j)
        assert outputs[(row, 3)].score.greedy  # transformers' own greedy continuation
    if "prefix_cache" not in config and "state_cache" not in config:  # no_buffer tracks no branch states
        # k continuations cost one prompt plus k suffixes: all but the first reuse the prompt
        # up to its last token, which each computes again (its logits score the first token).
        for row, (prompt, continuations) in enumerate(cases):
            cached = [outputs[(row, j)].cached_tokens for j in range(len(continuations))]
            assert sorted(cached)[1:] == [len(prompt) - 1] * (len(continuations) - 1), (row, cached)


def test_scores_with_and_without_prefix_reuse_are_the_same(checkpoint, cases):
    _, shared = _scores(checkpoint, cases)
    _, alone = _scores(checkpoint, cases, prefix_cache=False)
    assert shared.keys() == alone.keys()
    for key, out in shared.items():
        assert abs(out.score.logprob - alone[key].score.logprob) < 1e-4, key
        assert (out.score.tokens, out.score.greedy) == (alone[key].score.tokens, alone[key].score.greedy), key


def test_scoring_and_generation_share_a_batch(checkpoint, reference, cases):
    prompt = cases[0][0]
    requests = _requests(cases[:1]) + [Request("gen", tuple(prompt), SamplingParams(max_tokens=4, ignore_eos=True))]
    settings = dict(device="cpu", dtype="fp32", memory_budget_bytes=8 << 20, ring_len=4, track_interval=32)
    engine = Engine.from_pretrained(str(checkpoint), EngineConfig(**settings))
    outputs = {o.request_id: o for o in engine.generate(requests)}
    assert list(outputs["gen"].token_ids) == hf_greedy(reference, prompt, 4)
    for j, continuation in enumerate(cases[0][1]):
        assert abs(outputs[(0, j)].score.logprob - _expected(reference, prompt, continuation)[0]) < 1e-4


def test_a_continuation_without_a_prompt_is_an_error_row(checkpoint):
    settings = dict(device="cpu", dtype="fp32", memory_budget_bytes=8 << 20, ring_len=4, track_interval=32)
    engine = Engine.from_pretrained(str(checkpoint), EngineConfig(**settings))
    out = next(iter(engine.generate([Request(0, (5, 6), SamplingParams(), score_tokens=2)])))
    assert out.finish_reason == "error" and "needs a prompt before it" in out.error


# ---- jobs: task score, continuation columns, choice_accuracy --------------------------------
@pytest.fixture(scope="module")
def tokenizer_checkpoint(tmp_path_factory):
    return make_tokenizer_checkpoint(tmp_path_factory.mktemp("ckpt"))


CHOICES = [["Paris", "Lyon", "Nice"], ["red", "blue"], "yes", [], ["a", "b", "c", "d"], ["Paris", "Lyon", "Nice"]]


@pytest.mark.parametrize("plan", ["global", "window"])
def test_a_score_job_writes_continuation_columns_and_choice_accuracy(tmp_path, tokenizer_checkpoint, plan):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from rich.console import Console

    from batchinfer.jobs.run.prepare import prepare_job
    from batchinfer.jobs.run.runner import run_job
    from batchinfer.jobs.tasks.scoring import continuation_token_ids
    from batchinfer.jobs.spec.job_file import load_job_file
    from tests.jobs_fixtures import job_entry, write_job_file, write_parquet

    rows = len(CHOICES)
    table = pa.table({"question": [f"Question {r % 5}: pick one." for r in range(rows)],
                      "choices": [[c] if isinstance(c, str) else c for c in CHOICES],
                      "answer": [0, 1, 0, 0, 3, 2]})
    write_parquet(table, tmp_path / "data" / "rag.parquet")
    entry = job_entry(model=str(tokenizer_checkpoint), prompt={"template": "{question} Answer:"},
                      task="score", score={"continuations_column": "choices"},
                      eval={"answer_column": "answer", "metric": "choice_accuracy"})
    job = prepare_job(load_job_file(write_job_file(tmp_path, [entry])).jobs[0])
    stats = run_job(job, Console(quiet=True), engine_factory=lambda _j, _w: demo_engine_fp32(), window_rows=4,
                    plan=plan)
    assert stats["status"] == "done"
    out = pq.read_table(tmp_path / "out" / "rag").sort_by("row_index").to_pylist()
    assert out[3]["finish_reason"] == "error" and "no continuations" in out[3]["error"]
    engine = demo_engine_fp32()
    judged = []
    for r, row in enumerate(out):
        if r == 3:
            continue
        choices = CHOICES[r] if isinstance(CHOICES[r], list) else [CHOICES[r]]
        assert len(row["continuation_logprobs"]) == len(row["continuation_tokens"]) == len(choices)
        prompt = job.tokenizer.encode_batch([f"Question {r % 5}: pick one. Answer:"])[0]
        ids = continuation_token_ids(job.tokenizer, prompt, choices)
        assert row["continuation_tokens"] == [len(c) for c in ids]
        direct = {o.request_id: o.score for o in engine.generate(
            Request(j, tuple(prompt + c), SamplingParams(), score_tokens=len(c)) for j, c in enumerate(ids))}
        for j in range(len(choices)):
            assert abs(row["continuation_logprobs"][j] - direct[j].logprob) < 1e-4
            assert row["continuation_greedy"][j] == direct[j].greedy
        best = max(range(len(choices)), key=lambda j: (row["continuation_logprobs"][j], -j))
        assert row["correct"] == (best == table["answer"][r].as_py())
        judged.append(row["correct"])
    assert stats["eval"]["judged"] == len(judged)
    assert stats["eval"]["accuracy"] == pytest.approx(sum(judged) / len(judged))
    # Rows 0 and 5 are the same question and choices: the same scores.
    assert out[0]["continuation_logprobs"] == pytest.approx(out[5]["continuation_logprobs"], abs=1e-5)


def test_continuation_tokens_follow_the_joint_tokenisation(tokenizer_checkpoint):
    from batchinfer.jobs.tasks.scoring import continuation_token_ids
    from batchinfer.jobs.inputs.tokenizer import CheckpointTokenizer

    tokenizer = CheckpointTokenizer.from_checkpoint(tokenizer_checkpoint)
    prompt = tokenizer.encode_batch(["The capital is"], add_special_tokens=False)[0]
    [joint] = continuation_token_ids(tokenizer, prompt, [" Paris"])
    full = tokenizer.encode_batch(["The capital is Paris"], add_special_tokens=False)[0]
    assert prompt + joint == full
    # A prompt whose last token would merge with the continuation: the continuation alone.
    cut = tokenizer.encode_batch(["The capital is Par"], add_special_tokens=False)[0]
    [alone] = continuation_token_ids(tokenizer, cut, ["is"])
    if cut + tokenizer.encode_batch(["is"], add_special_tokens=False)[0] != \
            tokenizer.encode_batch(["The capital is Paris"], add_special_tokens=False)[0]:
        assert alone == tokenizer.encode_batch(["is"], add_special_tokens=False)[0]


def test_a_score_job_needs_one_sample(tmp_path, tokenizer_checkpoint):
    import pyarrow as pa

    from batchinfer.jobs.errors import JobError
    from batchinfer.jobs.run.prepare import prepare_job
    from batchinfer.jobs.spec.job_file import load_job_file
    from tests.jobs_fixtures import job_entry, write_job_file, write_parquet

    write_parquet(pa.table({"question": ["q"], "choices": [["a"]]}), tmp_path / "data" / "rag.parquet")
    entry = job_entry(model=str(tokenizer_checkpoint), prompt={"template": "{question}"}, task="score",
                      score={"continuations_column": "choices"}, sampling={"n": 2})
    with pytest.raises(JobError) as caught:
        prepare_job(load_job_file(write_job_file(tmp_path, [entry])).jobs[0])
    assert "sampling.n" in str(caught.value) and "must be 1" in str(caught.value)


class _FailingAfter:
    """An engine that raises after streaming `left` outputs (a crash mid-job)."""

    def __init__(self, engine, left):
        self.engine, self.left = engine, left

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def _limit(self, stream):
        for output in stream:
            if self.left == 0:
                raise RuntimeError("simulated crash")
            self.left -= 1
            yield output

    def generate(self, requests):
        return self._limit(self.engine.generate(requests))

    def generate_units(self, units):
        return self._limit(self.engine.generate_units(units))


@pytest.mark.parametrize("plan", ["global", "window"])
def test_a_crashed_score_job_resumes_with_every_row_once(tmp_path, tokenizer_checkpoint, plan):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from rich.console import Console

    from batchinfer.jobs.run.prepare import prepare_job
    from batchinfer.jobs.run.runner import run_job
    from batchinfer.jobs.spec.job_file import load_job_file
    from tests.jobs_fixtures import job_entry, write_job_file, write_parquet

    rows = 9
    write_parquet(pa.table({"question": [f"Q{r}?" for r in range(rows)], "choices": [["x", "yy", "z"]] * rows}),
                  tmp_path / "data" / "rag.parquet")
    entry = job_entry(model=str(tokenizer_checkpoint), prompt={"template": "{question}"}, task="score",
                      score={"continuations_column": "choices"},
                      output={"path": "out/rag", "flush_rows": 2})
    job_file = write_job_file(tmp_path, [entry])
    job = prepare_job(load_job_file(job_file).jobs[0])
    with pytest.raises(Exception):
        run_job(job, Console(quiet=True), engine_factory=lambda _j, _w: _FailingAfter(demo_engine_fp32(), 14),
                window_rows=4, plan=plan)
    assert list((tmp_path / "out" / "rag").glob("part-*.parquet"))  # finished rows were committed before the crash
    job = prepare_job(load_job_file(job_file).jobs[0])
    assert run_job(job, Console(quiet=True), engine_factory=lambda _j, _w: demo_engine_fp32(),
                   window_rows=4, plan=plan)["status"] == "done"
    out = pq.read_table(tmp_path / "out" / "rag").to_pylist()
    assert sorted(row["row_index"] for row in out) == list(range(rows))
    assert all(len(row["continuation_logprobs"]) == 3 for row in out)
