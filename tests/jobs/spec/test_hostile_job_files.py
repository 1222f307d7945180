"""Hostile job files: alias bombs, recursive aliases, deep nesting, names and values that pass a
`$`-anchored regex with a trailing newline. Each is one located `JobError`, never a traceback
or gigabytes of memory."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from batchinfer.jobs.errors import JobError
from batchinfer.jobs.outdir.part_store import is_part_name
from batchinfer.jobs.spec.job_file import parse_job_file
from batchinfer.jobs.spec.checks import device_name
from batchinfer.jobs.spec.yaml_loader import load_yaml
from tests.jobs_fixtures import make_tokenizer_checkpoint, write_parquet

JOB_FILE = Path("/project/jobs.yaml")
JOB = """jobs:
  - name: {name}
    model: m
    input: i.parquet
    prompt: {{column: text}}
    chat: true
"""
BILLION_LAUGHS = """\
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
"""


def test_a_billion_laughs_under_chat_template_kwargs_is_a_one_line_error():
    bomb = "".join("      " + line + "\n" for line in BILLION_LAUGHS.splitlines())
    text = JOB.format(name="rag") + "    chat_template_kwargs:\n" + bomb
    with pytest.raises(JobError) as caught:
        parse_job_file(text, JOB_FILE)
    assert caught.value.file == str(JOB_FILE) and caught.value.where.startswith("line ")
    assert "aliases expand to more than" in caught.value.what


def test_the_job_file_of_a_billion_laughs_fails_fast_and_small_in_a_real_process(tmp_path):
    checkpoint = make_tokenizer_checkpoint(tmp_path / "ckpt")
    write_parquet(pa.table({"text": ["hello"]}), tmp_path / "data.parquet")
    bomb = "".join("      " + line + "\n" for line in BILLION_LAUGHS.splitlines())
    job_file = tmp_path / "jobs.yaml"
    job_file.write_text(JOB.format(name="rag").replace("model: m", f"model: {checkpoint}")
                        .replace("input: i.parquet", "input: data.parquet") + "    chat_template_kwargs:\n" + bomb)
    # 4 GiB of address space: the expanded document (~8 GB) cannot be built under it
    limit = "import resource; resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30)); "
    code = limit + "import sys; from batchinfer.cli import main; sys.argv = ['batchinfer', 'plan', sys.argv[1]]; main()"
    done = subprocess.run([sys.executable, "-c", code, str(job_file)], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[3])
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.count("\n") == 1 and "aliases expand to more than" in done.stderr
    assert "Traceback" not in done.stderr


def test_merge_keys_and_small_aliases_still_load():
    text = "base: &b {x: 1, y: [1, 2]}\njob: {<<: *b, y: 3}\nother: *b\n"
    assert load_yaml(text) == {"base": {"x": 1, "y": [1, 2]}, "job": {"x": 1, "y": 3}, "other": {"x": 1, "y": [1, 2]}}


@pytest.mark.parametrize("text, what", [
    ("a: &a [*a]\n", "recursive alias"),
    ("a: &a {b: *a}\n", "recursive alias"),
    ("jobs: " + "[" * 5000 + "]" * 5000 + "\n", "nested more than"),
])
def test_recursive_aliases_and_deep_nesting_are_located_errors(text, what):
    with pytest.raises(JobError) as caught:
        parse_job_file(text, JOB_FILE)
    assert what in caught.value.what


def test_a_job_name_with_a_trailing_newline_is_refused():
    text = JOB.format(name='"ab\\n"')
    with pytest.raises(JobError) as caught:
        parse_job_file(text, JOB_FILE)
    assert caught.value.where == "jobs[0].name" and "'ab\\n'" in caught.value.what
    assert parse_job_file(JOB.format(name="ab"), JOB_FILE).jobs[0].name == "ab"


@pytest.mark.parametrize("device", ["cuda:0\n", "cpu\n", "cuda:\u0661"])  # \u0661: ARABIC-INDIC DIGIT ONE
def test_a_device_with_a_newline_or_a_non_ascii_digit_is_refused(device):
    with pytest.raises(ValueError):
        device_name(device)


@pytest.mark.parametrize("name", ["part-00001.parquet\n", "part-u000001-002.parquet\n", "part-\u0661.parquet"])
def test_part_names_are_matched_whole_and_in_ascii_digits(name):
    assert not is_part_name(name)
    assert is_part_name("part-00001.parquet") and is_part_name("part-u000001-002.parquet")
