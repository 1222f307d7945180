"""Accuracy of the demo job's answers: `python examples/demo_accuracy.py` after `batchinfer run examples/demo.yaml`.

A row is right when its generated text, stripped, starts with the row's `answer` and no digit
follows (batchinfer.demo_task.is_correct). Reads the parts under examples/out/rag.
"""
from __future__ import annotations

import math
from pathlib import Path

import pyarrow.parquet as pq

from batchinfer.demo_task import is_correct


def main() -> None:
    parts = sorted((Path(__file__).resolve().parent / "out" / "rag").glob("part-*.parquet"))
    rows = [row for part in parts for row in pq.read_table(part, columns=["generated_text", "answer"]).to_pylist()]
    if not rows:
        raise SystemExit("error: examples/out/rag: no parts; run `batchinfer run examples/demo.yaml` first")
    right = sum(is_correct(row["generated_text"] or "", row["answer"]) for row in rows)
    p = right / len(rows)
    print(f"accuracy {p:.3f} ± {math.sqrt(p * (1 - p) / len(rows)):.3f} (SE) on {len(rows)} questions")


if __name__ == "__main__":
    main()
