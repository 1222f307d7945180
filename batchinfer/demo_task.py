"""The demo model's task: documents and look-up questions in a fixed format, from a seed.

A document is 10-80 lines `The {attribute} of {Name} is {value}.`; a prompt is
`{document}\nQuestion: What is the {attribute} of {Name}?\nAnswer:` and the right completion
is ` {value}` then a newline or EOS. Names may repeat within a document with different
attributes (each (attribute, Name) pair once), so a question needs both to be matched.
Training (benchmarks/demo_model), the example data and the parity table all draw from here.
"""
from __future__ import annotations

import random
import string
from dataclasses import dataclass

ATTRIBUTES = ("code", "room", "badge", "locker", "seat", "gate", "pin", "ticket", "order", "batch", "serial",
              "lot", "unit", "slot", "track", "desk")
MIN_FACTS, MAX_FACTS = 10, 80
# Held-out streams start far from the training stream's seeds, so no document is shared.
HELD_OUT_SEED_OFFSET = 10**9


@dataclass(frozen=True)
class Fact:
    attribute: str
    name: str
    value: int


def random_name(rng: random.Random) -> str:
    letters = rng.choices(string.ascii_lowercase, k=rng.randint(5, 8))
    return "".join(letters).capitalize()


def make_document(rng: random.Random, n_facts: int) -> list[Fact]:
    """n_facts facts with distinct (attribute, Name) pairs; between n/3 and n distinct names."""
    n_names = rng.randint(max(1, -(-n_facts // 3)), n_facts)
    names: list[str] = []
    while len(names) < n_names:
        name = random_name(rng)
        if name not in names:
            names.append(name)
    facts: list[Fact] = []
    used: set[tuple[str, str]] = set()
    # Every name gets at least one fact; the rest pick names at random.
    order = names + [rng.choice(names) for _ in range(n_facts - n_names)]
    for name in order:
        free = [a for a in ATTRIBUTES if (a, name) not in used]
        if not free:  # this name has all 16 attributes already: give the fact to a fresh name
            name = random_name(rng)
            free = list(ATTRIBUTES)
        attribute = rng.choice(free)
        used.add((attribute, name))
        facts.append(Fact(attribute, name, rng.randint(1000, 9999)))
    rng.shuffle(facts)
    return facts


def document_text(facts: list[Fact]) -> str:
    return "\n".join(f"The {f.attribute} of {f.name} is {f.value}." for f in facts)


def question_text(fact: Fact) -> str:
    return f"Question: What is the {fact.attribute} of {fact.name}?"


def prompt_text(facts: list[Fact], fact: Fact) -> str:
    return f"{document_text(facts)}\n{question_text(fact)}\nAnswer:"


def answer_text(fact: Fact) -> str:
    return f" {fact.value}"


def is_correct(generated: str, value: int | str) -> bool:
    """The issue's rule: the stripped text starts with the value and no digit follows it."""
    text, expected = generated.strip(), str(value)
    return text.startswith(expected) and not text[len(expected):len(expected) + 1].isdigit()


# A job's prompt template over held_out_rows' columns: the same text as prompt_text.
ROW_TEMPLATE = "{document}\nQuestion: {question}\nAnswer:"


def held_out_rows(seed: int, n_docs: int, questions_per_doc: int, min_facts: int = MIN_FACTS,
                  max_facts: int = MAX_FACTS) -> list[dict]:
    """Rows {doc_id, document, question_id, question, answer} of fresh documents (uniform fact
    counts); `question` is `What is the {attribute} of {Name}?`, `answer` the value as text."""
    rng = random.Random(HELD_OUT_SEED_OFFSET + seed)
    rows = []
    for d in range(n_docs):
        facts = make_document(rng, rng.randint(min_facts, max_facts))
        document = document_text(facts)
        for q, fact in enumerate(rng.sample(facts, min(questions_per_doc, len(facts)))):
            rows.append({"doc_id": f"d{d}", "document": document, "question_id": f"d{d}-q{q}",
                         "question": f"What is the {fact.attribute} of {fact.name}?", "answer": str(fact.value)})
    return rows


def row_prompt(row: dict) -> str:
    return ROW_TEMPLATE.format(**row)
