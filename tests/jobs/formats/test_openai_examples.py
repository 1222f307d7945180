"""The example batch files of OpenAI's Batch API guide and vLLM's run-batch guide (tests/data/, as their
documentation writes them) run unchanged through `batchinfer run` on the random demo checkpoint, with the
documented behaviour: chat lines answered by the model that ran, each line's token budget honoured, and
the endpoints batchinfer does not serve (vLLM's embeddings and score examples) one error line each,
in OpenAI's error file or, with `error_form: vllm`, in vLLM's form."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.job_process import REPO_ROOT
from tests.random_demo_jobs import run_random_demo_jobs

pytestmark = pytest.mark.slow
DATA = REPO_ROOT / "tests" / "data"
FILES = {"openai_guide": "openai_batch_guide.jsonl", "vllm_example": "vllm_openai_example_batch.jsonl",
         "vllm_embeddings": "vllm_embeddings_batch.jsonl", "vllm_score": "vllm_score_batch.jsonl"}


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("examples")
    jobs = []
    for name, file in FILES.items():
        shutil.copyfile(DATA / file, folder / file)  # byte for byte
        for form in ("openai", "vllm"):
            # max_model_len bounds the random model's 1000-token answers (finish_reason length), not the file
            jobs.append({"name": f"{name}_{form}", "model": "demo", "input": file,
                         "engine": {"device": "cpu", "max_model_len": 80},
                         "output": {"path": f"out/{name}_{form}", "format": "openai", "error_form": form}})
    return run_random_demo_jobs(folder, tmp_path_factory.getbasetemp() / "demo-cache", jobs)


@pytest.mark.parametrize("name, budget_key", [("openai_guide", "max_tokens"), ("vllm_example", "max_completion_tokens")])
@pytest.mark.parametrize("form", ["openai", "vllm"])
def test_the_chat_examples_run_unchanged(out, name, budget_key, form):
    request = _lines(DATA / FILES[name])
    lines = _lines(out / f"{name}_{form}" / "_batch_output.jsonl")
    assert [line["custom_id"] for line in lines] == ["request-1", "request-2"]
    assert not (out / f"{name}_{form}" / "_batch_errors.jsonl").exists()
    for line in lines:
        assert line["error"] is None and line["response"]["status_code"] == 200
        assert line["id"].startswith("vllm-" if form == "vllm" else "batch_req_")
        body = line["response"]["body"]
        assert body["object"] == "chat.completion" and body["model"] == "demo"  # the model that ran
        choice = body["choices"][0]
        assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
        assert choice["finish_reason"] in ("stop", "length")
        usage = body["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] <= 80
    rows = pq.read_table(out / f"{name}_{form}").to_pylist()
    assert {row["max_tokens"] for row in rows} == {request[0]["body"][budget_key]}  # the line's budget reached the job
    assert rows[0]["prompt_token_ids"] != rows[1]["prompt_token_ids"]  # different system messages


@pytest.mark.parametrize("name", ["vllm_embeddings", "vllm_score"])
def test_endpoints_not_served_are_error_lines_in_either_form(out, name):
    assert _lines(out / f"{name}_openai" / "_batch_output.jsonl") == []
    errors = _lines(out / f"{name}_openai" / "_batch_errors.jsonl")
    assert [line["custom_id"] for line in errors] == ["request-1", "request-2"]
    for line in errors:
        assert line["response"]["status_code"] == 400 and line["error"] is None
        error = line["response"]["body"]["error"]
        assert error["type"] == "invalid_request_error" and "is not supported" in error["message"]
    vllm = _lines(out / f"{name}_vllm" / "_batch_output.jsonl")
    assert [line["custom_id"] for line in vllm] == ["request-1", "request-2"]
    for line in vllm:
        assert line["response"] == {"status_code": 400, "request_id": line["response"]["request_id"], "body": None}
        assert line["error"]["error"]["code"] == 400 and "is not supported" in line["error"]["error"]["message"]
