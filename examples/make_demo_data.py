"""Write examples/rag_demo.parquet: 6 documents x 8 look-up questions, with the answers.

Each document is 10-80 lines `The {attribute} of {Name} is {value}.` and each question
`What is the {attribute} of {Name}?` (batchinfer.demo_task, the task the shipped demo model
was trained on; these documents are outside its training stream). Every question about a
document repeats the document in its prompt, so the prompts share long prefixes: the job's
cache hit rate shows that reuse. Deterministic: rerunning this script rewrites the same rows.

    python examples/make_demo_data.py
"""
from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchinfer.demo_task import held_out_rows

EXAMPLE_SEED = 1  # the parity table's questions use seed 0: the example's documents differ


def demo_table() -> pa.Table:
    rows = held_out_rows(EXAMPLE_SEED, n_docs=6, questions_per_doc=8)
    columns = ("question_id", "doc_id", "document", "question", "answer")
    return pa.table({name: [row[name] for row in rows] for name in columns})


def main() -> None:
    path = Path(__file__).resolve().parent / "rag_demo.parquet"
    table = demo_table()
    pq.write_table(table, path)
    print(f"wrote {path} ({table.num_rows} rows)")


if __name__ == "__main__":
    main()
