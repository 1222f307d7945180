"""sampling.logprobs: every generated token's logprob (and the top k) equals transformers'
log_softmax of the logits at that position, whatever the sampler does after it."""
from __future__ import annotations

import random

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from batchinfer.engine import sampler  # noqa: E402
from batchinfer.engine.config import EngineConfig  # noqa: E402
from batchinfer.engine.engine import Engine  # noqa: E402
from batchinfer.engine.types import Request, SamplingParams  # noqa: E402
from tests.engine_utils import demo_engine_fp32  # noqa: E402
from tests.jobs_fixtures import make_tokenizer_checkpoint  # noqa: E402
from tests.model_utils import hf_logits, hf_reference, make_tiny_checkpoint  # noqa: E402

STEPS = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("logprobs"), "qwen3_5", seed=3)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return hf_reference(checkpoint)


def _prompts():
    rng = random.Random(1)
    base = [rng.randrange(1, 256) for _ in range(40)]
    return [base, base + [5, 6, 7], base[:20] + [rng.randrange(1, 256) for _ in range(9)],
            [rng.randrange(1, 256) for _ in range(4)]]


def _run(checkpoint, params_of, **config):
    settings = dict(device="cpu", dtype="fp32", memory_budget_bytes=8 << 20, ring_len=4, track_interval=16)
    engine = Engine.from_pretrained(str(checkpoint), EngineConfig(**{**settings, **config}))
    requests = [Request(i, tuple(p), params_of(i), seed_key=i) for i, p in enumerate(_prompts())]
    return {(o.request_id, o.sample_index): o for o in engine.generate(requests)}


@pytest.mark.parametrize("overlap", [True, False])
def test_logprobs_equal_transformers_log_softmax_at_every_generated_token(checkpoint, reference, overlap):
    # Sampled (temperature, top-k, repetition penalty) and greedy rows, k from 0 to 5, one row without.
    params = [SamplingParams(max_tokens=STEPS, ignore_eos=True, temperature=1.3, top_k=20, logprobs=5, n=2),
              SamplingParams(max_tokens=STEPS, ignore_eos=True, logprobs=0),
              SamplingParams(max_tokens=STEPS, ignore_eos=True, temperature=0.7, repetition_penalty=1.5,
                             logprobs=3),
              SamplingParams(max_tokens=STEPS, ignore_eos=True)]
    outputs = _run(checkpoint, lambda i: params[i], overlap_decode=overlap)
    prompts = _prompts()
    for (i, s), out in outputs.items():
        k = params[i].logprobs
        if k is None:
            assert out.logprobs is None
            continue
        assert len(out.logprobs) == len(out.token_ids) == STEPS
        expected = hf_logits(reference, prompts[i] + list(out.token_ids)).log_softmax(dim=-1)  # [L, V]
        for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            row = expected[len(prompts[i]) - 1 + step]
            assert abs(entry.logprob - row[token].item()) < 1e-5, (i, s, step)
            assert len(entry.top_ids) == len(entry.top_logprobs) == k
            top = row.topk(k)
            assert list(entry.top_ids) == top.indices.tolist(), (i, s, step)
            assert torch.allclose(torch.tensor(entry.top_logprobs), top.values, atol=1e-5)


def test_no_logprobs_asked_computes_none(checkpoint, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("logprobs computed with no row asking")

    monkeypatch.setattr("batchinfer.engine.postprocess.token_logprobs", fail)
    outputs = _run(checkpoint, lambda i: SamplingParams(max_tokens=3, ignore_eos=True))
    assert all(out.logprobs is None for out in outputs.values())


def test_packed_ids_survive_any_vocabulary_size():
    logits = torch.full((2, 1 << 25), -10.0)
    logits[0, (1 << 25) - 3] = 5.0  # an id fp32 cannot hold exactly
    logits[1, 7] = 5.0
    tokens = torch.tensor([(1 << 25) - 3, 7])
    packed = sampler.token_logprobs(logits, tokens, torch.tensor([0, 1]), 2)
    entries = sampler.unpack_logprobs(packed, [2, 1])
    assert entries[0].top_ids[0] == (1 << 25) - 3 and entries[1].top_ids == (7,)


# ---- jobs: the `logprobs` column and OpenAI batch `choice.logprobs` ---------------------------
@pytest.fixture(scope="module")
def tokenizer_checkpoint(tmp_path_factory):
    return make_tokenizer_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.mark.parametrize("plan", ["global", "window"])
def test_a_logprobs_job_writes_one_struct_per_output_token(tmp_path, tokenizer_checkpoint, plan):
    import pyarrow.parquet as pq
    from rich.console import Console

    from batchinfer.jobs.run.prepare import prepare_job
    from batchinfer.jobs.run.runner import run_job
    from batchinfer.jobs.spec.job_file import load_job_file
    from tests.jobs_fixtures import job_entry, rag_table, write_job_file, write_parquet

    write_parquet(rag_table(6), tmp_path / "data" / "rag.parquet")
    entry = job_entry(model=str(tokenizer_checkpoint), sampling={"max_tokens": 4, "seed": 7, "logprobs": 2,
                                                                 "temperature": 0.8})
    job = prepare_job(load_job_file(write_job_file(tmp_path, [entry])).jobs[0])
    stats = run_job(job, Console(quiet=True), engine_factory=lambda _j, _w: demo_engine_fp32(), window_rows=4,
                    plan=plan)
    assert stats["status"] == "done"
    out = pq.read_table(tmp_path / "out" / "rag").to_pylist()
    assert len(out) == 6
    for row in out:
        entries = row["logprobs"]
        assert len(entries) == row["completion_tokens"] == len(row["output_token_ids"]) > 0
        for token, entry in zip(row["output_token_ids"], entries):
            assert len(entry["top_ids"]) == len(entry["top_logprobs"]) == 2
            assert entry["logprob"] <= entry["top_logprobs"][0] + 1e-6 <= 1e-6
            assert entry["top_logprobs"][0] >= entry["top_logprobs"][1]


def test_openai_batch_lines_get_logprobs_in_openais_shape(tmp_path, tokenizer_checkpoint):
    import json

    from rich.console import Console

    from batchinfer.jobs.formats.openai_batch import OUTPUT_NAME
    from batchinfer.jobs.run.prepare import prepare_job
    from batchinfer.jobs.run.runner import run_job
    from batchinfer.jobs.spec.job_file import load_job_file
    from tests.jobs_fixtures import write_job_file

    lines = [
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "logprobs": True,
                  "top_logprobs": 2}},
        {"custom_id": "text", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "Once upon", "max_tokens": 3, "logprobs": 0}},
        {"custom_id": "plain", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Once", "max_tokens": 2}},
    ]
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    job_file = write_job_file(tmp_path, [{"name": "b", "model": str(tokenizer_checkpoint), "input": "requests.jsonl",
                                          "sampling": {"max_tokens": 6, "seed": 7},
                                          "output": {"path": "out/b", "format": "openai"}}])
    job = prepare_job(load_job_file(job_file).jobs[0])
    assert run_job(job, Console(quiet=True), engine_factory=lambda _j, _w: demo_engine_fp32())["status"] == "done"
    got = {line["custom_id"]: line["response"]["body"]["choices"][0]
           for line in map(json.loads, (tmp_path / "out" / "b" / OUTPUT_NAME).read_text().splitlines())}
    content = got["chat"]["logprobs"]["content"]
    assert content and all(len(item["top_logprobs"]) == 2 and item["logprob"] <= 0 for item in content)
    assert "".join(item["token"] for item in content).startswith(got["chat"]["message"]["content"])
    text = got["text"]["logprobs"]
    assert len(text["tokens"]) == len(text["token_logprobs"]) == len(text["text_offset"]) > 0
    assert text["top_logprobs"] == [{}] * len(text["tokens"])
    assert got["plain"]["logprobs"] is None
