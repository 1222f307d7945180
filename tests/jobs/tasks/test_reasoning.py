"""Reasoning blocks split off the answer: with and without the opening and closing tags, and in a job's columns."""
from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console

import tests.fake_engine as fake_engine
from batchinfer.jobs.run.prepare import prepare_job
from batchinfer.jobs.tasks.reasoning import ReasoningParts, ReasoningSplit, split_reasoning
from batchinfer.jobs.run.runner import run_job
from batchinfer.jobs.spec.job_file import load_job_file
from tests.fake_engine import FakeEngine
from tests.jobs_fixtures import job_entry, make_tokenizer_checkpoint, rag_table, write_job_file, write_parquet
from tests.jobs.inputs.test_chat_template import make_thinking_checkpoint


@pytest.mark.parametrize("text, starts_inside, parts", [
    # the prompt opened the block (Qwen3.5 with thinking on): no opening tag in the output
    ("Paris is in France.\n</think>\n\nParis.", True, ReasoningParts("Paris.", "Paris is in France.", False)),
    ("Still counting the", True, ReasoningParts("", "Still counting the", True)),
    # the model opens the block itself
    ("<think>\nHmm.\n</think>\n\nYes.", False, ReasoningParts("Yes.", "Hmm.", False)),
    ("\n<think>\nHmm, so", False, ReasoningParts("", "Hmm, so", True)),
    # a closing tag alone: the (pre-rendered) prompt opened the block
    ("Hmm.\n</think>\n\nYes.", False, ReasoningParts("Yes.", "Hmm.", False)),
    # no tags and no open block (enable_thinking false): all answer
    ("Just the answer.", False, ReasoningParts("Just the answer.", None, False)),
    # an empty block (what Qwen3.5 writes with thinking off)
    ("\n\n</think>\n\nA.", True, ReasoningParts("A.", "", False)),
    # the answer keeps a later tag-like text as it is
    ("r\n</think>\n\nuse </think> literally", True, ReasoningParts("use </think> literally", "r", False)),
])
def test_split_with_and_without_the_opening_and_closing_tags(text, starts_inside, parts):
    assert split_reasoning(text, starts_inside) == parts


@pytest.fixture(scope="module")
def thinking_checkpoint(tmp_path_factory) -> Path:
    return make_thinking_checkpoint(tmp_path_factory.mktemp("thinking"))


@pytest.fixture(scope="module")
def plain_checkpoint(tmp_path_factory) -> Path:
    return make_tokenizer_checkpoint(tmp_path_factory.mktemp("plain"))  # its template has no thinking tags


def _prepared(folder: Path, checkpoint: Path, **entry):
    write_parquet(rag_table(3), folder / "data" / "rag.parquet")
    return prepare_job(load_job_file(write_job_file(folder, [job_entry(model=str(checkpoint), **entry)])).jobs[0])


@pytest.mark.parametrize("use_thinking, entry, expected", [
    (True, {"chat": True}, ReasoningSplit(enabled=True, starts_inside=True)),
    (True, {"chat": True, "chat_template_kwargs": {"enable_thinking": False}}, ReasoningSplit(True, False)),
    (True, {"chat": True, "reasoning": "raw"}, ReasoningSplit(enabled=False)),
    (True, {}, ReasoningSplit(enabled=False)),                      # no chat: auto leaves the text alone
    (False, {"chat": True}, ReasoningSplit(enabled=False)),         # a template without thinking tags
    (False, {"reasoning": "split", "prompt": {"template": "{question}<think>\n"}}, ReasoningSplit(True, True)),
    (False, {"reasoning": "split", "prompt": {"column": "question"}}, ReasoningSplit(True, False)),
])
def test_the_default_splits_chat_jobs_whose_template_has_thinking_tags(tmp_path, thinking_checkpoint,
                                                                       plain_checkpoint, use_thinking, entry, expected):
    job = _prepared(tmp_path, thinking_checkpoint if use_thinking else plain_checkpoint, **entry)
    assert job.reasoning == expected


SCRIPTS = {0: ("The capital of France is Paris.\n</think>\n\nParis.", True),
           1: ("Counting the letters one by one", False),     # the budget runs out inside the reasoning
           2: ("<think>\nOpened by the model.\n</think>\n\nDone.", True)}


@pytest.fixture
def scripted_engine(monkeypatch, thinking_checkpoint):
    """A FakeEngine whose row r generates SCRIPTS[r] (then EOS where it finishes)."""
    from batchinfer.jobs.inputs.tokenizer import CheckpointTokenizer
    tokenizer = CheckpointTokenizer.from_checkpoint(thinking_checkpoint)

    def scripted(request, sample, vocab_size, eos_token_ids):
        text, finishes = SCRIPTS[request.request_id]
        return tuple(tokenizer.encode_batch([text], add_special_tokens=False)[0]) + ((2,) if finishes else ())
    monkeypatch.setattr(fake_engine, "fake_tokens", scripted)
    return FakeEngine


def _run(folder: Path, checkpoint: Path, engine_class, plan: str = "global", **entry) -> list[dict]:
    job = _prepared(folder, checkpoint, sampling={"max_tokens": 64}, **entry)
    engine = engine_class()
    run_job(job, Console(quiet=True), engine_factory=lambda _job, _rows: engine, plan=plan)
    parts = sorted((folder / "out" / "rag").glob("part-*.parquet"))
    table = pa.concat_tables(pq.read_table(p) for p in parts).sort_by("row_index")
    return table.select(["generated_text", "reasoning_text", "reasoning_truncated", "finish_reason"]).to_pylist()


@pytest.mark.parametrize("plan", ["global", "window"])
def test_a_thinking_chat_job_writes_reasoning_and_answer_in_their_columns(tmp_path, thinking_checkpoint,
                                                                          scripted_engine, plan):
    rows = _run(tmp_path, thinking_checkpoint, scripted_engine, chat=True, plan=plan)
    assert rows == [
        {"generated_text": "Paris.", "reasoning_text": "The capital of France is Paris.",
         "reasoning_truncated": False, "finish_reason": "stop"},
        {"generated_text": "", "reasoning_text": "Counting the letters one by one",
         "reasoning_truncated": True, "finish_reason": "length"},
        {"generated_text": "Done.", "reasoning_text": "Opened by the model.",
         "reasoning_truncated": False, "finish_reason": "stop"},
    ]


def test_raw_keeps_the_decoded_text_as_it_is(tmp_path, thinking_checkpoint, scripted_engine):
    rows = _run(tmp_path, thinking_checkpoint, scripted_engine, chat=True, reasoning="raw")
    assert [row["generated_text"] for row in rows] == [text for text, _ in SCRIPTS.values()]
    assert {(row["reasoning_text"], row["reasoning_truncated"]) for row in rows} == {(None, None)}


def test_with_thinking_off_text_without_tags_is_all_answer(tmp_path, thinking_checkpoint, scripted_engine):
    rows = _run(tmp_path, thinking_checkpoint, scripted_engine, chat=True,
                chat_template_kwargs={"enable_thinking": False})
    assert rows[1] == {"generated_text": "Counting the letters one by one", "reasoning_text": None,
                       "reasoning_truncated": False, "finish_reason": "length"}
    assert rows[0]["generated_text"] == "Paris."  # a closing tag still ends a reasoning block
