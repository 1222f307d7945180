"""Job-file YAML: YAML 1.2 core-schema scalars, and a key given twice is a located error."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from batchinfer.jobs.errors import JobError
from batchinfer.jobs.spec.job_file import parse_job_file
from batchinfer.jobs.spec.yaml_loader import DuplicateKeyError, load_yaml

JOB_FILE = Path("/project/jobs.yaml")


@pytest.mark.parametrize("text, value", [
    ("1e-9", 1e-9), ("1e5", 1e5), (".5", 0.5), ("-.5", -0.5), ("+1.5E+2", 150.0), ("1.", 1.0), ("2.5", 2.5),
    (".inf", math.inf), ("-.Inf", -math.inf), ("7", 7), ("-3", -3), ("010", 10), ("0o17", 15), ("0x1F", 31),
    ("true", True), ("FALSE", False), ("null", None), ("~", None), ("", None),
    # YAML 1.1 reads these as booleans, base-60 numbers, dates or a broken "value" tag; 1.2 as text.
    ("yes", "yes"), ("off", "off"), ("1:20", "1:20"), ("2024-01-02", "2024-01-02"), ("1_000", "1_000"),
    ("=", "="), ("'1e5'", "1e5"), ("0b101", "0b101"),
])
def test_scalars_follow_the_yaml_1_2_core_schema(text, value):
    loaded = load_yaml(f"key: {text}\n")["key"]
    assert loaded == value and type(loaded) is type(value)


def test_nan_loads_as_a_float_nan():
    assert math.isnan(load_yaml("a: .nan")["a"])


def test_merge_keys_still_work_and_may_be_overridden():
    assert load_yaml("base: &b {x: 1, y: 2}\njob: {<<: *b, y: 3}\n")["job"] == {"x": 1, "y": 3}


def test_the_stock_safe_loader_is_unchanged():
    assert yaml.safe_load("a: 1e5\nb: yes\n") == {"a": "1e5", "b": True}  # only job files read YAML 1.2


@pytest.mark.parametrize("text, line, key, first", [
    ("a: 1\nb: 2\na: 3\n", 3, "a", 1),
    ("top:\n  inner: {c: 1, c: 2}\n", 2, "c", 2),
    ("- {x: 1}\n- x: 1\n  y: 2\n  x: 1\n", 4, "x", 2),
])
def test_a_key_given_twice_in_any_mapping_is_an_error_at_its_second_line(text, line, key, first):
    with pytest.raises(DuplicateKeyError) as caught:
        load_yaml(text)
    assert caught.value.problem_mark.line + 1 == line
    assert caught.value.problem == f"duplicate key {key!r} (first on line {first})"


def test_explicit_number_tags_on_text_are_yaml_errors_not_tracebacks():
    with pytest.raises(yaml.YAMLError):
        load_yaml("a: !!int zz\n")
    with pytest.raises(yaml.YAMLError):
        load_yaml("a: !!float zz\n")


JOB = """jobs:
  - name: rag
    model: m
    input: i.parquet
    prompt: {column: text}
    sampling:
      temperature: 0.7
      max_tokens: 8
      temperature: 0.2
"""


def test_a_duplicate_key_in_a_job_file_is_one_line_naming_line_and_key():
    with pytest.raises(JobError) as caught:
        parse_job_file(JOB, JOB_FILE)
    assert str(caught.value) == f"{JOB_FILE}: line 9: duplicate key 'temperature' (first on line 7)"


def test_exponent_and_leading_dot_numbers_are_accepted_as_settings():
    text = JOB.replace("      temperature: 0.2\n", "      min_p: 1e-9\n").replace("0.7", ".5") \
        + "    engine: {memory_fraction: 5e-1}\n"
    job = parse_job_file(text, JOB_FILE).jobs[0]
    assert (job.sampling.temperature, job.sampling.min_p, job.engine.memory_fraction) == (0.5, 1e-9, 0.5)
