"""Shared builders for the jobs/CLI tests: a tokenizer-only checkpoint, inputs, job files."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from batchinfer.demo import DEMO_CONFIG, write_demo_tokenizer_files

DOCUMENTS = [
    "The river town woke early and the baker opened the shutters.",
    "Linear attention keeps a fixed-size state for every sequence, decayed by a gate.",
    "Readers may borrow up to six books for three weeks from the library.",
]
QUESTIONS = ["What happens first?", "Who is named?", "How long?", "Why?", "What is kept?"]


def make_tokenizer_checkpoint(folder: Path) -> Path:
    """The demo's config and tokenizer with a placeholder weight file.

    Enough for everything up to the engine (which the runner tests replace with a fake).
    """
    folder.mkdir(parents=True, exist_ok=True)
    write_demo_tokenizer_files(folder)
    (folder / "config.json").write_text(json.dumps(DEMO_CONFIG))
    (folder / "model.safetensors").write_bytes(b"placeholder: never loaded by these tests")
    return folder


def rag_table(rows: int, null_rows: tuple[int, ...] = (), empty_rows: tuple[int, ...] = ()) -> pa.Table:
    """`rows` (document, question) rows, documents repeating in runs (shared prefixes)."""
    documents, questions, ids = [], [], []
    for row in range(rows):
        documents.append(None if row in null_rows else DOCUMENTS[(row // len(QUESTIONS)) % len(DOCUMENTS)])
        questions.append("" if row in empty_rows else QUESTIONS[row % len(QUESTIONS)] + f" #{row}")
        ids.append(f"q{row:04d}")
    return pa.table({"qid": ids, "document": documents, "question": questions,
                     "extra": pa.array([float(r) / 3 for r in range(rows)], type=pa.float64())})


def write_parquet(table: pa.Table, path: Path, row_group_size: Optional[int] = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def job_entry(**overrides: Any) -> dict:
    entry = {"name": "rag", "model": "ckpt", "input": "data/rag.parquet",
             "prompt": {"template": "{document}\n\nQuestion: {question}\nAnswer:"},
             "sampling": {"max_tokens": 6, "seed": 7},
             "output": {"path": "out/rag", "flush_rows": 4}}
    entry.update(overrides)
    return entry


def write_job_file(folder: Path, jobs: list[dict], defaults: Optional[dict] = None, name: str = "jobs.yaml") -> Path:
    document: dict[str, Any] = {"jobs": jobs}
    if defaults:
        document["defaults"] = defaults
    path = folder / name
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path
