"""A scoring job's progress hit rate is the `_stats.json` one: a score row's token counts are its
requests' (prompt + each continuation), as the engine counts them. The row used to count its prompt
once but the cached tokens of every continuation, and progress showed "hit 398.2%" beside 96.4%."""
from __future__ import annotations

import re
from io import StringIO

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from batchinfer.jobs.run.prepare import prepare_job
from batchinfer.jobs.run.runner import run_job
from batchinfer.jobs.spec.job_file import load_job_file
from tests.engine_utils import demo_engine_fp32
from tests.jobs_fixtures import job_entry, make_tokenizer_checkpoint, write_job_file, write_parquet

CHOICES = [["Paris", "Lyon", "Nice", "Lille"], ["red", "blue"], ["yes", "no", "maybe"], ["a", "b", "c", "d"]] * 3


@pytest.mark.parametrize("plan", ["global", "window"])
def test_a_score_jobs_progress_shows_the_hit_rate_of_its_stats(tmp_path, plan):
    checkpoint = make_tokenizer_checkpoint(tmp_path / "ckpt")
    rows = len(CHOICES)
    document = "The river town woke early and the baker opened the shutters. " * 4
    table = pa.table({"question": [f"{document}Question {r % 4}: pick one." for r in range(rows)],
                      "choices": CHOICES})
    write_parquet(table, tmp_path / "data" / "rag.parquet")
    entry = job_entry(model=str(checkpoint), prompt={"template": "{question} Answer:"}, task="score",
                      score={"continuations_column": "choices"})
    job = prepare_job(load_job_file(write_job_file(tmp_path, [entry])).jobs[0])
    console = Console(file=StringIO(), width=200)  # not a terminal: plain progress lines
    stats = run_job(job, console, engine_factory=lambda _j, _w: demo_engine_fp32(), window_rows=4, plan=plan)
    assert stats["status"] == "done" and stats["cache_hit_rate"] > 0.5
    lines = [line for line in console.file.getvalue().splitlines() if f"{rows}/{rows} samples" in line]
    assert lines, console.file.getvalue()
    shown = float(re.search(r"hit ([\d.]+)%", lines[-1]).group(1))
    assert shown == pytest.approx(100 * stats["cache_hit_rate"], abs=0.05)
    out = pq.read_table(tmp_path / "out" / "rag")
    assert sum(out["prompt_tokens"].to_pylist()) == stats["prompt_tokens"]
    assert sum(out["cached_tokens"].to_pylist()) == stats["cached_tokens"]
    assert all(cached <= prompt for cached, prompt in zip(out["cached_tokens"].to_pylist(),
                                                          out["prompt_tokens"].to_pylist()))
