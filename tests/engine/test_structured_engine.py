"""Structured output in the engine: with random weights, every output of a constrained request
parses and validates (the grammar alone guarantees it) unless the token budget ran out, and
seeded sampling under a grammar does not depend on the batch."""
from __future__ import annotations

import json
import random
import re

import pytest
import torch

from batchinfer.demo import DEMO_CONFIG
from batchinfer.engine.config import EngineConfig
from batchinfer.engine.engine import Engine
from batchinfer.engine.types import Request, SamplingParams
from batchinfer.models.config import model_config_from_dict
from batchinfer.models.presets import random_model
from batchinfer.jobs.tasks.structured import compile_grammar
from batchinfer.jobs.spec.task import GrammarSpec
from batchinfer.jobs.inputs.tokenizer import CheckpointTokenizer
from tests.jobs_fixtures import make_tokenizer_checkpoint
from tests.jobs.tasks.test_structured import SCHEMA

jsonschema = pytest.importorskip("jsonschema")

VOCAB = DEMO_CONFIG["vocab_size"]
REGEX = r"[a-z]{2,5}-[0-9]{1,3}"
CHOICES = ["yes", "no", "maybe so"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> CheckpointTokenizer:
    return CheckpointTokenizer.from_checkpoint(make_tokenizer_checkpoint(tmp_path_factory.mktemp("ckpt")))


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return {kind: compile_grammar(GrammarSpec(kind, value), tokenizer, VOCAB)
            for kind, value in (("json_schema", json.dumps(SCHEMA)), ("regex", REGEX), ("choice", tuple(CHOICES)))}


@pytest.fixture(scope="module")
def model():
    return random_model(model_config_from_dict(DEMO_CONFIG), torch.float32, "cpu", seed=3)


def _engine(model, tokenizer, **settings):
    base = dict(device="cpu", dtype="fp32", memory_budget_bytes=32 << 20, ring_len=4, track_interval=16)
    return Engine(model, EngineConfig(**{**base, **settings}), eos_token_ids=tokenizer.eos_token_ids)


def _requests(grammars, kinds, rows=4, temperature=1.0, max_tokens=160, logprobs=None):
    rng = random.Random(0)
    shared = [rng.randrange(3, VOCAB) for _ in range(20)]
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=11, n=2, logprobs=logprobs)
    return [Request((kind, r), tuple(shared + [rng.randrange(3, VOCAB) for _ in range(r + 1)]), params, seed_key=r,
                    grammar=grammars[kind]) for kind in kinds for r in range(rows)]


def _check(kind, text):
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES, text


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_every_constrained_output_parses_and_validates(model, tokenizer, grammars, temperature):
    kinds = ("json_schema", "regex", "choice")
    outputs = list(_engine(model, tokenizer).generate(_requests(grammars, kinds, temperature=temperature)))
    assert len(outputs) == 3 * 4 * 2
    stopped = 0
    for out in outputs:
        assert out.finish_reason in ("stop", "length"), out.error
        if out.finish_reason == "stop":
            stopped += 1
            _check(out.request_id[0], tokenizer.decode(out.token_ids))
    assert stopped >= 0.8 * len(outputs)  # the budget rarely runs out: the test sees real completions


def test_without_the_grammar_the_model_writes_no_json(model, tokenizer, grammars):
    requests = [Request(r.request_id, r.prompt_token_ids, r.sampling, r.seed_key) for r in
                _requests(grammars, ("json_schema",), max_tokens=40)]
    texts = [tokenizer.decode(o.token_ids) for o in _engine(model, tokenizer).generate(requests)]
    with pytest.raises(Exception):
        for text in texts:
            jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("settings", [{"max_running": 1}, {"max_running": 3}, {"overlap_decode": False},
                                      {"prefix_cache": False}])
def test_seeded_sampling_under_a_grammar_is_batch_invariant(model, tokenizer, grammars, settings):
    requests = _requests(grammars, ("json_schema", "regex"), rows=3)
    reference = {(o.request_id, o.sample_index): o.token_ids for o in _engine(model, tokenizer).generate(requests)}
    got = {(o.request_id, o.sample_index): o.token_ids for o in _engine(model, tokenizer, **settings).generate(requests)}
    assert got == reference


def test_constrained_rows_batch_with_free_ones_and_keep_raw_logprobs(model, tokenizer, grammars):
    constrained = _requests(grammars, ("choice",), rows=2, logprobs=2)
    free = [Request(("free", r.request_id[1]), r.prompt_token_ids, r.sampling, r.seed_key) for r in constrained]
    outputs = {(o.request_id, o.sample_index): o for o in _engine(model, tokenizer).generate(constrained + free)}
    alone = {(o.request_id, o.sample_index): o for o in _engine(model, tokenizer).generate(free)}
    for key, out in alone.items():
        assert outputs[key].token_ids == out.token_ids  # free rows unchanged by their constrained neighbours
    for (rid, s), out in outputs.items():
        if rid[0] == "choice":
            assert tokenizer.decode(out.token_ids) in CHOICES
            # Logprobs are the raw distribution's: the same first-token entry as the free twin's
            # (same prompt), whatever the mask allowed.
            twin = outputs[(("free", rid[1]), s)]
            assert out.logprobs[0].top_ids == twin.logprobs[0].top_ids


# ---- jobs: a constrained job, per-row schemas, OpenAI batch response_format -----------------
def _job_engine(job, model):
    return Engine(model, EngineConfig(device="cpu", dtype="fp32", memory_budget_bytes=32 << 20, ring_len=4,
                                      track_interval=16), eos_token_ids=job.tokenizer.eos_token_ids)


def _run_job(tmp_path, entry, model, plan="global"):
    from rich.console import Console

    from batchinfer.jobs.run.prepare import prepare_job
    from batchinfer.jobs.run.runner import run_job
    from batchinfer.jobs.spec.job_file import load_job_file
    from tests.jobs_fixtures import write_job_file

    job = prepare_job(load_job_file(write_job_file(tmp_path, [entry])).jobs[0])
    stats = run_job(job, Console(quiet=True), engine_factory=lambda _j, _w: _job_engine(job, model), window_rows=3,
                    plan=plan)
    assert stats["status"] == "done"
    return job


@pytest.mark.parametrize("plan", ["global", "window"])
def test_a_json_schema_job_and_per_row_schemas_write_valid_json(tmp_path, tokenizer, model, plan):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.jobs_fixtures import job_entry, write_parquet

    small = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False}
    schemas = [json.dumps(SCHEMA), json.dumps(small), None, json.dumps({"type": "objectx"}), json.dumps(small)]
    write_parquet(pa.table({"q": [f"Describe pet {r}." for r in range(5)], "schema": schemas}),
                  tmp_path / "data" / "rag.parquet")
    model_dir = str(make_tokenizer_checkpoint(tmp_path / "ckpt"))
    for name, sampling in (("job", {"json_schema": SCHEMA}), ("rows", {"json_schema_column": "schema"})):
        entry = job_entry(name=name, model=model_dir, prompt={"template": "{q}"},
                          sampling={"max_tokens": 160, "temperature": 1.0, "seed": 3, **sampling},
                          output={"path": f"out/{name}", "flush_rows": 2})
        _run_job(tmp_path, entry, model, plan)
        out = pq.read_table(tmp_path / "out" / name).sort_by("row_index").to_pylist()
        for r, row in enumerate(out):
            schema = SCHEMA if name == "job" or r == 0 else small if schemas[r] else None
            if name == "rows" and r == 3:
                assert row["finish_reason"] == "error" and "cannot be compiled" in row["error"]
            elif schema is not None and row["finish_reason"] == "stop":
                jsonschema.validate(json.loads(row["generated_text"]), schema)
            elif schema is not None:
                assert row["finish_reason"] == "length"
        assert sum(row["finish_reason"] == "stop" for row in out) >= 3


def test_openai_batch_response_format_lines_return_valid_json(tmp_path, model):
    from batchinfer.jobs.formats.openai_batch import OUTPUT_NAME

    small = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
             "required": ["n"], "additionalProperties": False}
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": f"Pick {i}"}], "max_tokens": 40, "temperature": 1,
                       "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": small}}}}
             for i in range(3)]
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    model_dir = str(make_tokenizer_checkpoint(tmp_path / "ckpt"))
    _run_job(tmp_path, {"name": "b", "model": model_dir, "input": "requests.jsonl", "sampling": {"seed": 1},
                        "output": {"path": "out/b", "format": "openai"}}, model)
    for line in map(json.loads, (tmp_path / "out" / "b" / OUTPUT_NAME).read_text().splitlines()):
        choice = line["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), small)


def test_constrained_steps_stay_in_flight(model, tokenizer, grammars, monkeypatch):
    """A constrained step's tokens stay on the device while the next step launches: the host
    reads step k (and fills step k + 1's masks from it) only after step k + 1's forward is queued."""
    from batchinfer.engine import draws

    events = []

    class RecordingDownload(draws.Download):
        def tolist(self):
            events.append("R")
            return super().tolist()

    monkeypatch.setattr(draws, "Download", RecordingDownload)
    engine = _engine(model, tokenizer)
    launch_draw = engine.stepper.launch_draw  # entered once a step that draws (decode or mixed) has launched its forward
    engine.stepper.launch_draw = lambda seqs, logits: (events.append("L") if seqs else None) or launch_draw(seqs, logits)
    outputs = list(engine.generate(_requests(grammars, ("json_schema",), rows=2, max_tokens=12)))
    assert all(o.finish_reason in ("stop", "length") for o in outputs)
    assert "LLRLR" in "".join(events)
