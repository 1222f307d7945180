"""Bad input through the CLI: exit 2, one line naming file and key/column, no traceback, nothing written."""
from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from tests.cli_utils import invoke_cli
from tests.jobs_fixtures import job_entry, make_tokenizer_checkpoint, rag_table, write_job_file, write_parquet


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tokenizer_checkpoint(tmp_path_factory.mktemp("ckpt"))


def snapshot(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


def run_cli(folder: Path, *args: str):
    """Run in `folder` (so displayed paths are relative) and check the one-line error contract."""
    before = snapshot(folder)
    result = invoke_cli(folder, *args)
    assert result.exit_code == 2, (result.output, result.stderr, result.exception)
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    assert snapshot(folder) == before  # nothing written
    return lines[0]


def setup_job(folder: Path, checkpoint: Path, **overrides) -> None:
    write_parquet(rag_table(7), folder / "data" / "rag.parquet")
    write_job_file(folder, [job_entry(model=str(checkpoint), **overrides)])


def test_missing_job_file(tmp_path):
    assert run_cli(tmp_path, "run", "nope.yaml") == "error: nope.yaml: (file): no such job file"


def test_malformed_yaml(tmp_path):
    (tmp_path / "jobs.yaml").write_text("jobs:\n  - name: a\n   model: [\n")
    assert run_cli(tmp_path, "run", "jobs.yaml").startswith("error: jobs.yaml: line ")


def test_unknown_key_with_suggestion(tmp_path, checkpoint):
    setup_job(tmp_path, checkpoint, sampling={"max_tokns": 4})
    assert run_cli(tmp_path, "run", "jobs.yaml") == \
        "error: jobs.yaml: jobs.rag.sampling.max_tokns: unknown key (did you mean 'max_tokens'?)"


def test_invalid_value(tmp_path, checkpoint):
    setup_job(tmp_path, checkpoint, sampling={"temperature": -1})
    assert run_cli(tmp_path, "run", "jobs.yaml") == \
        "error: jobs.yaml: jobs.rag.sampling.temperature: must be >= 0.0, got -1"


def test_missing_input_file(tmp_path, checkpoint):
    setup_job(tmp_path, checkpoint, input="data/missing.parquet")
    assert run_cli(tmp_path, "run", "jobs.yaml") == \
        "error: jobs.yaml: jobs.rag.input: no such file or folder: data/missing.parquet"


def test_glob_matching_nothing(tmp_path, checkpoint):
    setup_job(tmp_path, checkpoint, input="data/*.nothing")
    assert run_cli(tmp_path, "run", "jobs.yaml") == "error: jobs.yaml: jobs.rag.input: no files match: data/*.nothing"


def test_non_parquet_input(tmp_path, checkpoint):
    # CSV, JSON Lines and Arrow are input kinds of their own (tests/jobs/inputs/test_input_kinds.py); a file of no
    # known kind is read as Parquet and refused as one
    setup_job(tmp_path, checkpoint, input="data/rows.txt")
    (tmp_path / "data" / "rows.txt").write_text("document,question\na,b\n")
    line = run_cli(tmp_path, "run", "jobs.yaml")
    assert line.startswith("error: jobs.yaml: jobs.rag.input: data/rows.txt: not a readable Parquet file"), line


@pytest.mark.parametrize("overrides, where, column", [
    ({"prompt": {"template": "{document} {questoin}"}}, "jobs.rag.prompt.template", "questoin"),
    ({"prompt": {"column": "text"}}, "jobs.rag.prompt.column", "text"),
    ({"prompt": {"token_ids_column": "ids"}}, "jobs.rag.prompt.token_ids_column", "ids"),
    ({"id_column": "uid"}, "jobs.rag.id_column", "uid"),
])
def test_missing_column(tmp_path, checkpoint, overrides, where, column):
    setup_job(tmp_path, checkpoint, **overrides)
    line = run_cli(tmp_path, "run", "jobs.yaml")
    assert line.startswith(f"error: jobs.yaml: {where}: column {column!r} is not in the input"), line


def test_prompt_column_of_the_wrong_type(tmp_path, checkpoint):
    setup_job(tmp_path, checkpoint, prompt={"column": "extra"})
    assert run_cli(tmp_path, "run", "jobs.yaml") == \
        "error: jobs.yaml: jobs.rag.prompt.column: column 'extra' must be text, got double"


def test_missing_checkpoint(tmp_path):
    setup_job(tmp_path, tmp_path / "no-model")
    assert run_cli(tmp_path, "run", "jobs.yaml") == \
        "error: jobs.yaml: jobs.rag.model: no such checkpoint folder: no-model"


def test_unsupported_checkpoint(tmp_path, checkpoint):
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    setup_job(tmp_path, llama)
    line = run_cli(tmp_path, "run", "jobs.yaml")
    assert line.startswith("error: jobs.yaml: jobs.rag.model: unsupported architecture 'LlamaForCausalLM'"), line


def test_checkpoint_without_tokenizer(tmp_path, checkpoint):
    partial = tmp_path / "partial"
    partial.mkdir()
    for name in ("config.json", "model.safetensors"):
        (partial / name).write_bytes((checkpoint / name).read_bytes())
    setup_job(tmp_path, partial)
    assert run_cli(tmp_path, "run", "jobs.yaml") == "error: jobs.yaml: jobs.rag.model: partial has no tokenizer.json"


def test_a_bad_later_job_stops_the_whole_file_before_anything_runs(tmp_path, checkpoint):
    write_parquet(rag_table(7), tmp_path / "data" / "rag.parquet")
    write_job_file(tmp_path, [job_entry(model=str(checkpoint)),
                              job_entry(name="second", model=str(checkpoint), output="out/second",
                                        prompt={"column": "nope"})])
    line = run_cli(tmp_path, "run", "jobs.yaml")
    assert line.startswith("error: jobs.yaml: jobs.second.prompt.column: column 'nope'"), line


def test_unknown_job_name_and_plan_share_the_checks(tmp_path, checkpoint):
    setup_job(tmp_path, checkpoint)
    assert run_cli(tmp_path, "run", "jobs.yaml", "--job", "rga") == \
        "error: jobs.yaml: --job rga: no such job (did you mean 'rag'?)"
    setup_job(tmp_path, checkpoint, input="data/missing.parquet")
    assert run_cli(tmp_path, "plan", "jobs.yaml").startswith("error: jobs.yaml: jobs.rag.input: no such file")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA to make the model load fail")
def test_a_model_that_cannot_load_is_a_runtime_failure_with_exit_1(tmp_path, checkpoint):
    setup_job(tmp_path, checkpoint, engine={"device": "cuda"})
    result = invoke_cli(tmp_path, "run", "jobs.yaml")
    assert result.exit_code == 1, (result.output, result.exception)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: job rag: cannot load the model: "), result.stderr
    assert not (tmp_path / "out").exists()


def test_a_key_given_twice_is_one_line_naming_its_line(tmp_path, checkpoint):
    setup_job(tmp_path, checkpoint)
    job_file = tmp_path / "jobs.yaml"
    text = job_file.read_text().replace("  sampling:\n", "  sampling:\n    seed: 1\n", 1)
    assert text.count("seed:") == 2
    job_file.write_text(text)
    first, second = [i + 1 for i, row in enumerate(text.splitlines()) if row.strip().startswith("seed:")]
    assert run_cli(tmp_path, "run", "jobs.yaml") == \
        f"error: jobs.yaml: line {second}: duplicate key 'seed' (first on line {first})"


@pytest.mark.parametrize("key, value, what", [
    ("temperature", float("nan"), "must be a finite number, got nan"),
    ("repetition_penalty", float("inf"), "must be a finite number, got inf"),
    ("seed", 2**64, "must be an integer in [0, 2**64), got 18446744073709551616"),
    ("min_tokens", 7, "must be <= max_tokens (6), got 7"),
])
def test_sampling_numbers_out_of_range_exit_2(tmp_path, checkpoint, key, value, what):
    setup_job(tmp_path, checkpoint, sampling={"max_tokens": 6, key: value})
    assert run_cli(tmp_path, "run", "jobs.yaml") == f"error: jobs.yaml: jobs.rag.sampling.{key}: {what}"


@pytest.mark.parametrize("value, what", [
    (1, "must be >= 2, got 1"),
    (4097, "must be <= the model's max_position_embeddings (4096), got 4097"),
])
def test_max_model_len_out_of_range_exits_2_naming_the_key(tmp_path, checkpoint, value, what):
    setup_job(tmp_path, checkpoint, engine={"max_model_len": value})
    assert run_cli(tmp_path, "run", "jobs.yaml") == f"error: jobs.yaml: jobs.rag.engine.max_model_len: {what}"


@pytest.mark.parametrize("engine", [{"plan": "window"}, {"state_cache": "no_buffer"}, {"plan": "global"}])
def test_a_benchmark_arm_in_a_job_file_exits_2_naming_the_key(tmp_path, checkpoint, engine):
    setup_job(tmp_path, checkpoint, engine=engine)
    (key,) = engine
    assert run_cli(tmp_path, "run", "jobs.yaml") == \
        f"error: jobs.yaml: jobs.rag.engine.{key}: is a benchmark's comparison arm, not a job key; remove it"


def test_a_template_column_of_a_type_polars_cannot_format_exits_2(tmp_path, checkpoint):
    table = rag_table(7)
    write_parquet(table.append_column("wait", pa.array([datetime.timedelta(seconds=s) for s in range(7)])),
                  tmp_path / "data" / "rag.parquet")
    write_job_file(tmp_path, [job_entry(model=str(checkpoint), prompt={"template": "{document} after {wait}"})])
    assert run_cli(tmp_path, "run", "jobs.yaml") == ("error: jobs.yaml: jobs.rag.prompt.template: column 'wait' has "
                                                     "type duration[us], which a template cannot format")


@pytest.mark.parametrize("overwrite", [False, True])
def test_an_output_path_that_is_an_existing_file_exits_2(tmp_path, checkpoint, overwrite):
    setup_job(tmp_path, checkpoint)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "rag").write_text("not a folder")
    args = ["run", "jobs.yaml"] + (["--overwrite"] if overwrite else [])
    assert run_cli(tmp_path, *args) == "error: jobs.yaml: jobs.rag.output: out/rag exists and is not a folder"
    assert (tmp_path / "out" / "rag").read_text() == "not a folder"


@pytest.mark.parametrize("command", ["run", "plan"])
def test_an_output_below_a_file_exits_2(tmp_path, checkpoint, command):
    setup_job(tmp_path, checkpoint, output="blocker/deeper/rag")
    (tmp_path / "blocker").write_text("a file where a folder should be")
    assert run_cli(tmp_path, command, "jobs.yaml") == \
        "error: jobs.yaml: jobs.rag.output: blocker is not a folder, so blocker/deeper/rag cannot be made"


def test_an_output_on_a_read_only_file_system_exits_2_before_the_model_loads(tmp_path, checkpoint, monkeypatch):
    import errno
    import tempfile

    setup_job(tmp_path, checkpoint)
    probed = []

    def read_only(*args, dir=None, **kwargs):
        probed.append(Path(dir))
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    assert run_cli(tmp_path, "run", "jobs.yaml") == \
        "error: jobs.yaml: jobs.rag.output: cannot write in .: Read-only file system"
    assert probed == [tmp_path]  # the nearest folder that exists: out/ is not made


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a 0o555 folder")
def test_an_output_in_a_folder_without_write_permission_exits_2(tmp_path, checkpoint):
    setup_job(tmp_path, checkpoint)
    (tmp_path / "out").mkdir(mode=0o555)
    try:
        assert run_cli(tmp_path, "run", "jobs.yaml") == \
            "error: jobs.yaml: jobs.rag.output: cannot write in out: Permission denied"
    finally:
        (tmp_path / "out").chmod(0o755)


def test_an_input_folder_without_parquet_files_says_so(tmp_path, checkpoint):
    setup_job(tmp_path, checkpoint, input="empty")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.csv").write_text("a,b\n")
    assert run_cli(tmp_path, "run", "jobs.yaml") == \
        "error: jobs.yaml: jobs.rag.input: folder has no .parquet files: empty"
