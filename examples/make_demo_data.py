"""Write examples/rag_demo.parquet: a few documents x several questions each (RAG-style).

Every question about a document repeats the document in its prompt, so the prompts share
long prefixes: the job's cache hit rate shows that reuse. Deterministic: rerunning this
script rewrites the same rows.

    python examples/make_demo_data.py
"""
from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

DOCUMENTS = {
    "harbour": "The river town woke early. Fishermen pulled their boats onto the gravel, and the baker "
               "opened the shutters while the first light touched the bell tower. Children ran along the "
               "harbour wall, counting gulls and shouting the names of ships they hoped to sail one day.",
    "deltanet": "Linear attention keeps a fixed-size state for every sequence. A gated delta rule decays the "
                "state, removes the old value stored under a key, and writes the new one. Hybrid models mix "
                "such layers with a few full attention layers, which keep a cache of keys and values.",
    "library": "The library catalogue lists books by author, title, subject and year. Readers may borrow up "
               "to six books for three weeks; journals and rare maps must stay in the reading room. Late "
               "returns cost ten cents a day.",
    "leaves": "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. Chlorophyll "
              "absorbs red and blue light and reflects green, which is why leaves look green. In autumn "
              "the chlorophyll breaks down and yellow pigments become visible.",
    "railway": "The mountain railway climbs twelve hundred metres in forty minutes. Its carriages are pushed "
               "by a small locomotive that grips a toothed rack between the rails. In winter the line closes "
               "above the middle station.",
    "council": "The committee met on Thursday to discuss the budget, the new playground, and the repair of "
               "the old bridge. After a long debate, members agreed to ask three firms for quotes and to vote "
               "again in March.",
}
QUESTIONS = [
    "What is this text about?",
    "Summarise it in one sentence.",
    "Which numbers does it mention?",
    "Who or what acts first?",
    "What happens in winter or at the end?",
    "Name one place in the text.",
    "What would you ask next?",
    "Give the text a title.",
]


def demo_table() -> pa.Table:
    rows = [(doc_id, document, f"{doc_id}-{q}", question)
            for doc_id, document in DOCUMENTS.items() for q, question in enumerate(QUESTIONS)]
    doc_ids, documents, question_ids, questions = map(list, zip(*rows))
    return pa.table({"question_id": question_ids, "doc_id": doc_ids, "document": documents,
                     "question": questions})


def main() -> None:
    path = Path(__file__).resolve().parent / "rag_demo.parquet"
    pq.write_table(demo_table(), path)
    print(f"wrote {path} ({demo_table().num_rows} rows)")


if __name__ == "__main__":
    main()
