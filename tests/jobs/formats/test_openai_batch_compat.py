"""OpenAI / vLLM batch files as real users have them: each field OpenAI's Batch API or vLLM's
run-batch accepts runs, is ignored, or refuses its line naming the field."""
from __future__ import annotations

import json

import pyarrow.parquet as pq
import yaml

from batchinfer.jobs.formats.openai_batch import _render, parse_line, system_fingerprint
from batchinfer.jobs.spec.checkpoint import checkpoint_fingerprint
from tests.fake_engine import FakeEngine
from tests.jobs.formats.test_openai_batch import checkpoint, chat, completion, read_errors, read_lines, run, write_batch  # noqa: F401

OPENAI_EXAMPLE = ('{"custom_id": "request-1", "method": "POST", "url": "/v1/chat/completions", "body": '
                  '{"model": "gpt-3.5-turbo-0125", "messages": [{"role": "system", "content": "You are a helpful '
                  'assistant."},{"role": "user", "content": "Hello world!"}],"max_tokens": 1000}}')
LINES = [
    OPENAI_EXAMPLE,
    chat("json", "Give JSON.", response_format={"type": "json_object"}),
    chat("pen0", "q", frequency_penalty=0, presence_penalty=0.0, logit_bias={}),
    chat("pen1", "q", presence_penalty=0.5),
    chat("bias0", "q", logit_bias={"12": 0}),
    chat("bias1", "q", logit_bias={"12": 5}),
    chat("kw", "q", chat_template_kwargs={"enable_thinking": False}),
    completion("vllm", "Once", min_tokens=2, max_tokens=4, ignore_eos=True, stop_token_ids=[3, 4],
               include_stop_str_in_output=False),
    completion("stopstr", "Once", include_stop_str_in_output=True),
    completion("one", ["Once upon a time"], max_tokens=3),
    completion("ids", [5, 6, 7], max_tokens=3),
    completion("many", ["a", "b"]),
    chat("quiet", "q", user="u1", metadata={"k": "v"}, store=True, parallel_tool_calls=False, stream=False,
         service_tier="auto", logprobs=False, n=1),
]


def test_a_realistic_batch_file_runs_each_field_as_documented(tmp_path, checkpoint):
    engine = FakeEngine()
    assert run(write_batch(tmp_path, checkpoint, LINES), engine)["status"] == "done"
    lines = {line["custom_id"]: line for line in read_lines(tmp_path) + read_errors(tmp_path)}
    refused = {"pen1": "presence_penalty", "bias1": "logit_bias", "stopstr": "include_stop_str_in_output",
               "many": "prompt"}
    assert [line["custom_id"] for line in read_errors(tmp_path)] == list(refused)
    for custom_id, line in lines.items():
        if custom_id in refused:
            assert line["error"] is None and line["response"]["status_code"] == 400, line
            error = line["response"]["body"]["error"]
            assert error["param"] == refused[custom_id] and error["type"] == "invalid_request_error"
            assert refused[custom_id] in error["message"]
        else:
            assert line["error"] is None and line["response"]["status_code"] == 200, line
    body = lines["request-1"]["response"]["body"]
    assert body["model"] == checkpoint.name  # the model that ran, not the request's gpt-3.5-turbo-0125
    assert body["system_fingerprint"] == system_fingerprint(checkpoint_fingerprint(checkpoint))
    assert body["system_fingerprint"].startswith("fp_batchinfer_")
    sent = {req.prompt_token_ids: req for call in engine.calls for req in call}
    parts = pq.read_table(tmp_path / "out" / "b").to_pylist()
    ids = {row["custom_id"]: tuple(row["prompt_token_ids"]) for row in parts if row["prompt_token_ids"]}
    vllm = sent[ids["vllm"]].sampling
    assert (vllm.min_tokens, vllm.max_tokens, vllm.ignore_eos, vllm.stop_token_ids) == (2, 4, True, (3, 4))
    assert ids["ids"] == (5, 6, 7)  # token ids are the prompt
    assert ids["one"] == ids["vllm"][:0] + ids["one"] and ids["one"] != ids["vllm"]
    schema = {row["custom_id"]: row["response_schema"] for row in parts}
    assert json.loads(schema["json"]) == {"type": "object"}
    assert "kw" in ids


def test_a_lines_chat_template_kwargs_merge_over_the_jobs():
    class Recorder:
        has_chat_template = True

        def render_messages(self, messages, kwargs):
            self.kwargs = kwargs
            return "x"

    tokenizer = Recorder()
    _render(parse_line(chat("kw", "q", chat_template_kwargs={"enable_thinking": False})), tokenizer,
            {"enable_thinking": True, "other": 1})
    assert tokenizer.kwargs == {"enable_thinking": False, "other": 1}


def test_a_prompt_list_of_one_string_is_that_string(tmp_path, checkpoint):
    run(write_batch(tmp_path, checkpoint, [completion("a", "Once upon a time"), completion("b", ["Once upon a time"])]),
        FakeEngine())
    parts = pq.read_table(tmp_path / "out" / "b").to_pylist()
    assert parts[0]["prompt_token_ids"] == parts[1]["prompt_token_ids"]


def test_reasoning_content_in_the_message_when_the_job_splits_reasoning(tmp_path, checkpoint):
    job_file = write_batch(tmp_path, checkpoint, [chat("r", "q")])
    document = yaml.safe_load(job_file.read_text())
    document["jobs"][0]["reasoning"] = "split"
    job_file.write_text(yaml.safe_dump(document))
    run(job_file, FakeEngine())
    message = read_lines(tmp_path)[0]["response"]["body"]["choices"][0]["message"]
    assert "reasoning_content" in message
