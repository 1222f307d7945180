"""OpenAI batch files: request lines in, one output line per request line that ran out, the lines that could
not run in the error file as OpenAI writes them (or in the output, in vLLM's form, when the job asks)."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from rich.console import Console

from batchinfer.jobs.inputs.tokenizer import CheckpointTokenizer
from batchinfer.jobs.errors import JobError, JobRuntimeError
from batchinfer.jobs.formats.openai_batch import ERRORS_NAME, OUTPUT_NAME, LineError, parse_line
from batchinfer.jobs.run.prepare import prepare_job
from batchinfer.jobs.run.runner import run_job
from batchinfer.jobs.spec.job_file import load_job_file, parse_job_file
from tests.fake_engine import FakeEngine
from tests.jobs_fixtures import make_tokenizer_checkpoint, write_job_file


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tokenizer_checkpoint(tmp_path_factory.mktemp("ckpt"))


def chat(custom_id, text, **body):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                                           {"role": "user", "content": text}], **body}})


def completion(custom_id, prompt, **body):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": prompt, **body}})


LINES = [
    chat("c1", "What is a river?", max_tokens=3, seed=5),
    completion("t1", "Once upon a time", max_tokens=5, n=2, temperature=0.7),
    "{not json",
    chat("c2", "Name a colour.", max_completion_tokens=4, stop=["zz"]),
    json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}),
    completion("t1", "duplicate id"),
    json.dumps({"custom_id": "e1", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}),
    "",
    completion("t2", "The library opens at", n=3, max_tokens=2),
]


def write_batch(folder: Path, checkpoint: Path, lines=LINES, **output) -> Path:
    (folder / "requests.jsonl").write_text("\n".join(lines) + "\n")
    return write_job_file(folder, [{"name": "b", "model": str(checkpoint), "input": "requests.jsonl",
                                    "sampling": {"max_tokens": 6, "seed": 7},
                                    "output": {"path": "out/b", "flush_rows": 2, "format": "openai", **output}}])


def run(job_file: Path, engine: FakeEngine, plan: str = "global") -> dict:
    job = prepare_job(load_job_file(job_file).jobs[0])
    return run_job(job, Console(quiet=True), engine_factory=lambda _j, _w: engine, window_rows=3, plan=plan)


def read_lines(folder: Path, name: str = OUTPUT_NAME) -> list[dict]:
    path = folder / "out" / "b" / name
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def read_errors(folder: Path) -> list[dict]:
    return read_lines(folder, ERRORS_NAME)


def without_created(lines):
    """The lines less what differs between runs: the time, and cached tokens (the cache's history)."""
    def body(value):
        if value is None or "usage" not in value:
            return value
        usage = {k: v for k, v in value["usage"].items() if k != "prompt_tokens_details"}
        return {**{k: v for k, v in value.items() if k != "created"}, "usage": usage}

    return [line if line["response"] is None else
            {**line, "response": {**line["response"], "body": body(line["response"]["body"])}} for line in lines]


@pytest.mark.parametrize("plan", ["global", "window"])
def test_a_batch_file_round_trips_with_an_output_line_per_request_line(tmp_path, checkpoint, plan):
    engine = FakeEngine()
    stats = run(write_batch(tmp_path, checkpoint), engine, plan)
    assert stats["status"] == "done"
    lines, errors = read_lines(tmp_path), read_errors(tmp_path)
    assert [line["custom_id"] for line in lines] == ["c1", "t1", "c2", "t2"]  # the lines that ran
    assert [line["custom_id"] for line in errors] == [None, None, "t1", "e1"]  # the error file, in line order
    for line, what in zip(errors, ["invalid JSON", "custom_id: missing", "duplicate of an earlier line",
                                   "'/v1/embeddings' is not supported"]):
        assert line["error"] is None and line["response"]["status_code"] == 400  # as OpenAI's parser reads it
        error = line["response"]["body"]["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
        assert what in error["message"], line
    c1, t1, c2, t2 = lines
    assert c1["error"] is None and c1["response"]["status_code"] == 200
    body = c1["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == checkpoint.name  # the model that ran
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    assert t1["response"]["body"]["object"] == "text_completion"
    assert [c["index"] for c in t1["response"]["body"]["choices"]] == [0, 1]
    assert [c["index"] for c in t2["response"]["body"]["choices"]] == [0, 1, 2]
    texts = [c["text"] for c in t2["response"]["body"]["choices"]]
    assert len(set(texts)) > 1  # the choices of a line are different samples
    # per-line sampling reached the engine: max_tokens, seed, stop, temperature
    sent = {req.prompt_token_ids: req.sampling for call in engine.calls for req in call}
    by_budget = sorted((s.max_tokens, s.seed, s.stop, s.temperature) for s in sent.values())
    assert by_budget == [(2, 7, (), 0.0), (3, 5, (), 0.0), (4, 7, ("zz",), 0.0), (5, 7, (), 0.7)]
    assert c1["response"]["body"]["usage"]["completion_tokens"] <= 3
    assert t2["response"]["body"]["usage"]["completion_tokens"] <= 3 * 2
    parts = pq.read_table(tmp_path / "out" / "b")
    assert parts.num_rows == 1 + 2 + 1 + 1 + 1 + 1 + 1 + 3  # one row per (line, choice), one per bad line


def test_a_chat_line_is_rendered_through_the_chat_template(tmp_path, checkpoint):
    job = prepare_job(load_job_file(write_batch(tmp_path, checkpoint)).jobs[0])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a river?"}]
    rendered = job.tokenizer.render_messages(messages)
    assert rendered.endswith("<|im_start|>assistant\n") and "Be brief." in rendered
    first = job.inputs.table.slice(0, 1).to_pylist()[0]
    assert first["prompt_token_ids"] == job.tokenizer.encode_batch([rendered], add_special_tokens=False)[0]


def test_after_a_failure_the_rerun_writes_each_line_exactly_once(tmp_path, checkpoint):
    reference = tmp_path / "ref"
    reference.mkdir()
    run(write_batch(reference, checkpoint), FakeEngine())
    expected = without_created(read_lines(reference)), read_errors(reference)
    job_file = write_batch(tmp_path, checkpoint)
    with pytest.raises(JobRuntimeError):
        run(job_file, FakeEngine(fail_after=3))
    assert not (tmp_path / "out" / "b" / OUTPUT_NAME).exists()  # written only once the job is complete
    run(job_file, FakeEngine())
    assert (without_created(read_lines(tmp_path)), read_errors(tmp_path)) == expected
    (tmp_path / "out" / "b" / OUTPUT_NAME).unlink()  # as if killed while writing it
    engine = FakeEngine()
    run(job_file, engine)
    assert not engine.calls and (without_created(read_lines(tmp_path)), read_errors(tmp_path)) == expected


@pytest.mark.parametrize("text, what", [
    ("[1, 2]", "must be a JSON object"),
    (json.dumps({"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}), "method: must be POST"),
    (completion("a", "p", frequency_penalty=0.5), "frequency_penalty: not supported"),
    (completion("a", "p", suffix="x"), "body.suffix: not supported"),
    (completion("a", ""), "body.prompt: must be a non-empty string"),
    (completion("a", "p", n=0), "body.n: must be an integer in [1, 128]"),
    (completion("a", "p", temperature=3), "body.temperature"),
    (chat("a", "q", top_logprobs=2), "needs logprobs: true"),
    (chat("a", "q", max_tokens=2, max_completion_tokens=3), "not both"),
    (json.dumps({"custom_id": "a", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user",
                 "content": [{"type": "image_url"}]}]}}), "only text parts"),
])
def test_a_line_that_cannot_run_says_why(text, what):
    with pytest.raises(LineError) as caught:
        parse_line(text)
    assert what in str(caught.value)


def test_a_good_line_parses_with_its_overrides():
    fields = parse_line(chat("a", "q", max_completion_tokens=9, n=2, stop="END", seed=3, top_p=0.5,
                             frequency_penalty=0, response_format={"type": "text"}))
    assert (fields["max_tokens"], fields["choices"], fields["stop"], fields["seed"], fields["top_p"]) == \
        (9, 2, ["END"], 3, 0.5)
    assert fields["messages"][1] == {"role": "user", "content": "q"}


@pytest.mark.parametrize("job, where, what", [
    ("    prompt: {column: q}\n", "jobs.b.prompt", "not used with an OpenAI batch input"),
    ("    sampling: {n: 2}\n", "jobs.b.sampling.n", "set n in each request line"),
    ("    output: {path: o, format: openai, order: completion}\n", "jobs.b.output.order", "must be input"),
])
def test_batch_job_mistakes_are_one_line(job, where, what):
    text = "jobs:\n  - name: b\n    model: demo\n    input: r.jsonl\n" + job
    with pytest.raises(JobError) as caught:
        parse_job_file(text, Path("/p/jobs.yaml"))
    assert where in str(caught.value) and what in str(caught.value)


def test_format_openai_needs_a_batch_input():
    text = "jobs:\n  - name: b\n    model: demo\n    input: r.parquet\n    prompt: {column: q}\n" \
           "    output: {path: o, format: openai}\n"
    with pytest.raises(JobError) as caught:
        parse_job_file(text, Path("/p/jobs.yaml"))
    assert "jobs.b.output.format" in str(caught.value)


def test_a_batch_file_with_no_requests_is_refused(tmp_path, checkpoint):
    job_file = write_batch(tmp_path, checkpoint, lines=["", "  "])
    with pytest.raises(JobError) as caught:
        prepare_job(load_job_file(job_file).jobs[0])
    assert "has no request lines" in str(caught.value)


def test_limit_counts_request_lines_so_a_line_keeps_all_its_choices(tmp_path, checkpoint):
    job_file = write_batch(tmp_path, checkpoint)
    text = job_file.read_text().replace("  output:", "  limit: 2\n  output:")
    job_file.write_text(text)
    job = prepare_job(load_job_file(job_file).jobs[0])
    assert job.rows == 3  # c1, and t1's two choices
    run(job_file, FakeEngine())
    lines = read_lines(tmp_path)
    assert [line["custom_id"] for line in lines] == ["c1", "t1"]
    assert len(lines[1]["response"]["body"]["choices"]) == 2


def test_a_line_s_own_stop_string_cuts_its_text(tmp_path, checkpoint):
    first = tmp_path / "first"
    first.mkdir()
    run(write_batch(first, checkpoint, lines=[completion("a", "Once upon", max_tokens=8)]), FakeEngine())
    text = read_lines(first)[0]["response"]["body"]["choices"][0]["text"]
    assert len(text) >= 4
    stop = text[2:4]
    run(write_batch(tmp_path, checkpoint, lines=[completion("a", "Once upon", max_tokens=8, stop=[stop])]),
        FakeEngine())
    assert read_lines(tmp_path)[0]["response"]["body"]["choices"][0]["text"] == text[:text.find(stop)]


def test_chat_lines_are_rendered_with_the_jobs_template_kwargs(tmp_path, checkpoint, monkeypatch):
    seen = []
    render = CheckpointTokenizer.render_messages

    def spy(self, messages, template_kwargs=None):
        seen.append(dict(template_kwargs or {}))
        return render(self, messages, template_kwargs)

    monkeypatch.setattr(CheckpointTokenizer, "render_messages", spy)
    (tmp_path / "requests.jsonl").write_text(chat("c1", "What is a river?") + "\n")
    job_file = write_job_file(tmp_path, [{"name": "b", "model": str(checkpoint), "input": "requests.jsonl",
                                          "chat_template_kwargs": {"enable_thinking": False},
                                          "output": {"path": "out/b", "format": "openai"}}])
    prepare_job(load_job_file(job_file).jobs[0])
    assert seen and all(kwargs == {"enable_thinking": False} for kwargs in seen)


def test_error_form_vllm_writes_every_line_in_the_output_as_vllm_run_batch_does(tmp_path, checkpoint):
    (tmp_path / "out" / "b").mkdir(parents=True)
    (tmp_path / "out" / "b" / ERRORS_NAME).write_text("stale\n")  # e.g. from an earlier run in OpenAI's form
    assert run(write_batch(tmp_path, checkpoint, error_form="vllm"), FakeEngine())["status"] == "done"
    lines = read_lines(tmp_path)
    assert [line["custom_id"] for line in lines] == ["c1", "t1", None, "c2", None, "t1", "e1", "t2"]
    assert not (tmp_path / "out" / "b" / ERRORS_NAME).exists()  # vLLM writes no error file
    for position, what in [(2, "invalid JSON"), (4, "custom_id: missing"), (5, "duplicate of an earlier line"),
                           (6, "'/v1/embeddings' is not supported")]:
        line = lines[position]
        assert line["id"].startswith("vllm-") and line["response"]["request_id"].startswith("vllm-batch-")
        assert line["response"]["status_code"] == 400 and line["response"]["body"] is None
        assert set(line["error"]) == {"error"}  # vLLM's ErrorResponse
        assert line["error"]["error"]["type"] == "BadRequestError" and line["error"]["error"]["code"] == 400
        assert what in line["error"]["error"]["message"], line
    for line in (lines[0], lines[1], lines[3], lines[7]):
        assert line["error"] is None and line["response"]["status_code"] == 200
        assert line["response"]["body"]["choices"]


def test_error_form_needs_format_openai():
    text = "jobs:\n  - name: b\n    model: demo\n    input: r.jsonl\n    output: {path: o, error_form: vllm}\n"
    with pytest.raises(JobError) as caught:
        parse_job_file(text, Path("/p/jobs.yaml"))
    assert "jobs.b.output.error_form" in str(caught.value) and "needs format: openai" in str(caught.value)
