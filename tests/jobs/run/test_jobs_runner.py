"""The runner against a fake engine: outputs, row errors, n > 1, resume, manifest, stats."""
from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from batchinfer.jobs.errors import JobError, JobRuntimeError
from batchinfer.jobs.outdir.part_writer import RESULT_COLUMNS
from batchinfer.engine.planner import plan_prompts
from batchinfer.jobs.run.planning import plan_job
from batchinfer.jobs.run.prepare import prepare_job
from batchinfer.jobs.run.engine_io import cut_at_stop as _cut_at_stop
from batchinfer.jobs.run.runner import run_job
from batchinfer.jobs.spec.job_file import load_job_file
from tests.fake_engine import FakeEngine, fake_tokens
from tests.jobs_fixtures import job_entry, make_tokenizer_checkpoint, rag_table, write_job_file, write_parquet

ROWS = 13  # odd, and not a multiple of the window (5) or the flush size (4)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tokenizer_checkpoint(tmp_path_factory.mktemp("ckpt"))


def make_job(folder: Path, checkpoint: Path, table: pa.Table = None, **overrides):
    write_parquet(rag_table(ROWS) if table is None else table, folder / "data" / "rag.parquet", row_group_size=4)
    return write_job_file(folder, [job_entry(model=str(checkpoint), **overrides)])


def run(job_file: Path, engine: FakeEngine, overwrite: bool = False, window_rows: int = 5,
        console: Console = None, plan: str = "global") -> dict:
    job = prepare_job(load_job_file(job_file).jobs[0], overwrite=overwrite)
    return run_job(job, console or Console(quiet=True), overwrite=overwrite,
                   engine_factory=lambda _job, _window_rows: engine, window_rows=window_rows, plan=plan)


def read_output(folder: Path) -> pa.Table:
    parts = sorted(str(p) for p in (folder / "out" / "rag").glob("part-*.parquet"))
    return pa.concat_tables(pq.read_table(p) for p in parts).sort_by(
        [("row_index", "ascending"), ("sample_index", "ascending")])


def part_hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (folder / "out" / "rag").glob("part-*")}


def test_outputs_hold_every_row_and_sample_once_beside_its_input_columns(tmp_path, checkpoint):
    job_file = make_job(tmp_path, checkpoint, sampling={"max_tokens": 6, "n": 3, "seed": 7})
    engine = FakeEngine()
    terminal = Console(file=io.StringIO(), force_terminal=True, width=120)
    stats = run(job_file, engine, console=terminal)
    shown = terminal.file.getvalue()
    assert f"{ROWS * 3}/{ROWS * 3}" in shown and "tok/s" in shown and "job rag: done" in shown
    out = read_output(tmp_path)
    table = rag_table(ROWS)
    assert out.column_names == table.column_names + list(RESULT_COLUMNS)
    assert out.num_rows == ROWS * 3
    assert list(zip(out["row_index"].to_pylist(), out["sample_index"].to_pylist())) == \
        [(r, s) for r in range(ROWS) for s in range(3)]
    for name in table.column_names:  # every input value sits beside its own row's results
        assert out[name].to_pylist() == [v for v in table[name].to_pylist() for _ in range(3)]
    requests = {r.request_id: r for call in engine.calls for r in call}
    assert sorted(requests) == list(range(ROWS))
    for row in out.to_pylist():
        tokens = fake_tokens(requests[row["row_index"]], row["sample_index"], 1024, (2,))
        assert tuple(row["output_token_ids"]) == tokens
        assert row["completion_tokens"] == len(tokens)
        assert row["finish_reason"] == ("stop" if tokens[-1] == 2 else "length")
        assert row["prompt_tokens"] == len(requests[row["row_index"]].prompt_token_ids)
        assert row["error"] is None
    parts = sorted((tmp_path / "out" / "rag").glob("part-*.parquet"))
    assert len(parts) >= ROWS * 3 // 4 and all(pq.read_metadata(p).num_rows <= 4 for p in parts)
    assert stats["rows"] == ROWS and stats["samples"] == ROWS * 3 and stats["samples_written"] == ROWS * 3
    on_disk = json.loads((tmp_path / "out" / "rag" / "_stats.json").read_text())
    assert on_disk["job"] == "rag" and on_disk["status"] == "done" and on_disk["errors"] == 0
    assert on_disk["prompt_tokens"] == engine.stats.prompt_tokens > 0
    assert on_disk["cache_hit_rate"] == pytest.approx(engine.stats.cached_tokens / engine.stats.prompt_tokens)
    for key in ("requests", "cached_tokens", "planned_cached_tokens", "discarded_kv_tokens",
                "states_tracked", "states_donated", "replayssm_flushes", "output_tokens", "wall_seconds",
                "prompt_tokens_per_second", "output_tokens_per_second", "peak_memory_bytes", "engine_settings"):
        assert key in on_disk, key
    # the progress line's prompt rate counts the computed prompt tokens; the summary shows it beside all of them
    generation = on_disk["generation_seconds"]
    assert on_disk["computed_prompt_tokens_per_second"] == pytest.approx(
        (engine.stats.prompt_tokens - engine.stats.cached_tokens) / generation)
    assert on_disk["prompt_tokens_per_second"] == pytest.approx(engine.stats.prompt_tokens / generation)
    assert on_disk["computed_prompt_tokens_per_second"] < on_disk["prompt_tokens_per_second"]  # rag: cache hits


def test_bad_rows_are_recorded_as_errors_and_the_rest_completes(tmp_path, checkpoint):
    table = rag_table(ROWS, null_rows=(2,))
    long_question = table["question"].to_pylist()
    long_question[9] = "very long " * 40
    table = table.set_column(2, "question", pa.array(long_question))
    job_file = make_job(tmp_path, checkpoint, table=table, prompt={"template": "{document}{question}"},
                        sampling={"max_tokens": 5, "n": 2})
    run(job_file, FakeEngine(max_model_len=60))
    out = read_output(tmp_path)
    assert out.num_rows == ROWS * 2
    by_row = {(r["row_index"], r["sample_index"]): r for r in out.to_pylist()}
    for sample in range(2):
        assert by_row[(2, sample)]["finish_reason"] == "error"
        assert by_row[(2, sample)]["error"] == "template column 'document' is null"
        assert by_row[(9, sample)]["finish_reason"] == "error" and "max_model_len" in by_row[(9, sample)]["error"]
    good = [r for key, r in by_row.items() if key[0] not in (2, 9)]
    assert good and all(r["error"] is None and r["completion_tokens"] > 0 for r in good)
    stats = json.loads((tmp_path / "out" / "rag" / "_stats.json").read_text())
    assert stats["errors"] == 4


def test_resume_after_a_crash_runs_only_the_rest_and_never_rewrites_a_part(tmp_path, checkpoint):
    reference_dir = tmp_path / "reference"
    reference_dir.mkdir()
    run(make_job(reference_dir, checkpoint, sampling={"max_tokens": 6, "n": 2}), FakeEngine())
    reference = read_output(reference_dir)

    job_file = make_job(tmp_path, checkpoint, sampling={"max_tokens": 6, "n": 2})
    with pytest.raises(JobRuntimeError, match="out of memory"):
        run(job_file, FakeEngine(fail_after=11))
    crashed = read_output(tmp_path)
    assert 0 < crashed.num_rows < ROWS * 2
    stats = json.loads((tmp_path / "out" / "rag" / "_stats.json").read_text())
    assert stats["status"] == "failed" and "out of memory" in stats["failure"]
    before = part_hashes(tmp_path)
    leftover = tmp_path / "out" / "rag" / ".part-00099.parquet.tmp"
    leftover.write_bytes(b"half a part from a killed run")

    engine = FakeEngine()
    stats = run(job_file, engine)
    assert not leftover.exists()
    after = part_hashes(tmp_path)
    assert {name: after[name] for name in before} == before  # finished parts untouched
    # Exactly once, with the results of an uninterrupted run (cache hits differ: a new engine).
    assert read_output(tmp_path).drop_columns(["cached_tokens"]).equals(reference.drop_columns(["cached_tokens"]))
    done = {(r, s) for r, s in zip(crashed["row_index"].to_pylist(), crashed["sample_index"].to_pylist())}
    asked = {(req.request_id, s) for call in engine.calls for req in call for s in range(2)
             if s not in req.skip_samples}
    assert asked.isdisjoint(done) and len(asked) == ROWS * 2 - len(done)
    assert stats["samples_resumed"] == len(done) and stats["samples_written"] == len(asked)

    stats_file = tmp_path / "out" / "rag" / "_stats.json"
    stats_text = stats_file.read_text()
    loaded = []
    job = prepare_job(load_job_file(job_file).jobs[0])
    run_job(job, Console(quiet=True), engine_factory=lambda *_: loaded.append(1) or FakeEngine())
    # Everything done: no model is loaded, nothing is added, the last run's stats stay.
    assert loaded == [] and part_hashes(tmp_path) == after and stats_file.read_text() == stats_text


def test_changed_settings_are_refused_until_overwrite(tmp_path, checkpoint):
    job_file = make_job(tmp_path, checkpoint)
    run(job_file, FakeEngine())
    user_file = tmp_path / "out" / "rag" / "NOTES.txt"
    user_file.write_text("mine")
    job_file = write_job_file(tmp_path, [job_entry(model=str(checkpoint), sampling={"max_tokens": 9, "seed": 7})])
    before = part_hashes(tmp_path)
    with pytest.raises(JobError, match=r"jobs\.rag\.output: .*\(sampling changed\); use --overwrite"):
        run(job_file, FakeEngine())
    assert part_hashes(tmp_path) == before
    run(job_file, FakeEngine(), overwrite=True)
    out = read_output(tmp_path)
    assert out.num_rows == ROWS and max(out["completion_tokens"].to_pylist()) <= 9
    assert user_file.read_text() == "mine"  # overwrite deletes only what the tool wrote


def test_input_changes_are_refused_but_a_larger_limit_resumes(tmp_path, checkpoint):
    job_file = make_job(tmp_path, checkpoint, limit=6)
    run(job_file, FakeEngine())
    assert read_output(tmp_path)["row_index"].to_pylist() == list(range(6))
    job_file = write_job_file(tmp_path, [job_entry(model=str(checkpoint), limit=11)])
    engine = FakeEngine()
    run(job_file, engine)
    assert read_output(tmp_path)["row_index"].to_pylist() == list(range(11))
    assert sorted(r.request_id for call in engine.calls for r in call) == list(range(6, 11))
    write_parquet(rag_table(ROWS + 1), tmp_path / "data" / "rag.parquet")
    with pytest.raises(JobError, match=r"\(input changed\)"):
        run(job_file, FakeEngine())


def test_id_column_keys_the_seed_so_samples_follow_the_row(tmp_path, checkpoint):
    """The same rows in reversed order: each row keeps its seed key and its samples."""
    keys, samples = {}, {}
    for name, order in (("forward", list(range(ROWS))), ("reversed", list(range(ROWS))[::-1])):
        table = rag_table(ROWS).take(order)
        job_file = make_job(tmp_path / name, checkpoint, table=table, id_column="qid", sampling={"n": 2, "seed": 7})
        engine = FakeEngine()
        run(job_file, engine)
        qids = table["qid"].to_pylist()
        keys[name] = {qids[r.request_id]: r.seed_key for call in engine.calls for r in call}
        out = read_output(tmp_path / name)
        samples[name] = {(q, s): tuple(t) for q, s, t in zip(out["qid"].to_pylist(), out["sample_index"].to_pylist(),
                                                            out["output_token_ids"].to_pylist())}
    assert len(set(keys["forward"].values())) == ROWS and keys["forward"] == keys["reversed"]
    assert len(samples["forward"]) == ROWS * 2 and samples["forward"] == samples["reversed"]


def test_stop_strings_cut_the_text_at_the_first_stop():
    assert _cut_at_stop("abc END def STOP", ("STOP", "END")) == "abc "
    assert _cut_at_stop("abc", ("x",)) == "abc" and _cut_at_stop("abc", ()) == "abc"


def test_plan_sums_the_planner_over_the_window_units_the_engine_gets(tmp_path, checkpoint):
    job_file = make_job(tmp_path, checkpoint, table=rag_table(ROWS, null_rows=(1, 6)), sampling={"n": 2})
    job = prepare_job(load_job_file(job_file).jobs[0])
    plan = plan_job(job, window_rows=4)
    assert not (tmp_path / "out").exists()  # planning writes nothing
    engine = FakeEngine()
    run(job_file, engine, window_rows=4, plan="window")
    # One engine call a unit (largest cost first): rows 0-3, 4-7, 8-11, 12 (rows 1 and 6 have no prompt).
    assert sorted(len(call) for call in engine.calls) == [1, 3, 3, 4]
    windows = [plan_prompts([list(r.prompt_token_ids) for r in call], 2) for call in engine.calls]
    assert (plan.rows, plan.error_rows, plan.samples) == (ROWS, 2, (ROWS - 2) * 2)
    assert plan.prompt_tokens == sum(w.prompt_tokens for w in windows) == engine.stats.prompt_tokens
    assert plan.theoretical_max_cached_tokens == sum(w.theoretical_max_cached_tokens for w in windows) > 0
    assert plan.shared_prefix_groups == sum(w.shared_prefix_groups for w in windows)


def test_a_part_that_lost_its_footer_is_redone_not_a_crash(tmp_path, checkpoint, capsys):
    job_file = make_job(tmp_path, checkpoint)
    run(job_file, FakeEngine())
    reference = read_output(tmp_path)
    part = sorted((tmp_path / "out" / "rag").glob("part-*.parquet"))[1]
    lost = pq.read_metadata(part).num_rows
    part.write_bytes(part.read_bytes()[:50])  # a part that lost its footer
    engine = FakeEngine()
    stats = run(job_file, engine)
    warning = capsys.readouterr().err.splitlines()
    assert len(warning) == 1 and f"{part.name}: damaged" in warning[0] and "redone" in warning[0]
    assert read_output(tmp_path).drop_columns(["cached_tokens"]).equals(reference.drop_columns(["cached_tokens"]))
    assert stats["samples_written"] == lost == sum(len(call) for call in engine.calls)
