"""Accuracy of a demo checkpoint on fresh held-out questions, through batchinfer's engine.

    python -m benchmarks.demo_model.evaluate CKPT --questions 1319 --device cpu --dtype float32
    python -m benchmarks.demo_model.evaluate CKPT --write-parquet rows.parquet   # rows for `batchinfer run`

Greedy decoding, prompts tokenized by the checkpoint's own tokenizer exactly as `batchinfer run`
does; a question is right when the generated text, stripped, starts with the value and the next
character (if any) is not a digit. Invalid: the text does not start with a 4-digit number.
"""
from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from batchinfer import demo_task

VALID_ANSWER = re.compile(r"\d{4}(?!\d)")


@dataclass(frozen=True)
class EvalResult:
    n: int
    correct: int
    invalid: int
    cache_hit_rate: float
    completions: dict  # question_id -> generated token ids (tuple)
    texts: dict        # question_id -> generated text

    @property
    def accuracy(self) -> float:
        return self.correct / self.n if self.n else 0.0

    @property
    def standard_error(self) -> float:
        p = self.accuracy
        return math.sqrt(p * (1 - p) / self.n) if self.n else 0.0

    @property
    def invalid_rate(self) -> float:
        return self.invalid / self.n if self.n else 0.0


def eval_rows(n_questions: int, questions_per_doc: int = 8, seed: int = 0) -> list[dict]:
    """At least n_questions held-out rows (documents of 10-80 facts), cut to exactly n_questions."""
    n_docs = -(-n_questions // questions_per_doc)
    return demo_task.held_out_rows(seed, n_docs, questions_per_doc)[:n_questions]


def is_invalid(text: str) -> bool:
    return VALID_ANSWER.match(text.strip()) is None


def evaluate(checkpoint: Path, rows: list[dict], engine_config, max_tokens: int = 8,
             ignore_eos: bool = False) -> EvalResult:
    """Run every row's prompt through a fresh engine; score against the row's `answer`.

    `ignore_eos` keeps decoding past the answer (the model goes on asking and answering its own
    questions), so that long decodes, e.g. ReplaySSM ring flushes, are exercised too."""
    from batchinfer.engine.engine import Engine
    from batchinfer.engine.types import Request, SamplingParams
    from batchinfer.jobs.inputs.tokenizer import CheckpointTokenizer

    tokenizer = CheckpointTokenizer.from_checkpoint(Path(checkpoint))
    prompts = tokenizer.encode_batch([demo_task.row_prompt(row) for row in rows])
    engine = Engine.from_pretrained(str(checkpoint), engine_config, eos_token_ids=tokenizer.eos_token_ids,
                                    detokenize=tokenizer.decode)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    requests = [Request(row["question_id"], tuple(ids), sampling, seed_key=i)
                for i, (row, ids) in enumerate(zip(rows, prompts))]
    completions, texts, errors = {}, {}, set()
    for output in engine.generate(requests):
        completions[output.request_id] = output.token_ids
        texts[output.request_id] = tokenizer.decode(output.token_ids)
        if output.finish_reason == "error":
            errors.add(output.request_id)
    assert len(completions) == len(rows), "every row answered exactly once"
    correct = sum(demo_task.is_correct(texts[r["question_id"]], r["answer"]) and r["question_id"] not in errors
                  for r in rows)
    invalid = sum(is_invalid(texts[r["question_id"]]) or r["question_id"] in errors for r in rows)
    return EvalResult(len(rows), correct, invalid, engine.stats.cache_hit_rate, completions, texts)


def write_parquet(rows: list[dict], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), str(path))


def main(argv: Optional[list[str]] = None) -> None:
    from batchinfer.engine.config import EngineConfig

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--questions", type=int, default=1319)
    p.add_argument("--questions-per-doc", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--write-parquet", type=Path, default=None, help="write the rows instead of evaluating")
    p.add_argument("--show", type=int, default=3, help="print this many wrong answers")
    args = p.parse_args(argv)
    rows = eval_rows(args.questions, args.questions_per_doc, args.seed)
    if args.write_parquet:
        write_parquet(rows, args.write_parquet)
        print(f"wrote {len(rows)} rows to {args.write_parquet}")
        return
    result = evaluate(args.checkpoint, rows, EngineConfig(device=args.device, dtype=args.dtype))
    wrong = [r for r in rows if not demo_task.is_correct(result.texts[r["question_id"]], r["answer"])]
    for row in wrong[:args.show]:
        print(f"wrong: {row['question']} expected {row['answer']} got {result.texts[row['question_id']]!r}")
    print(f"accuracy {result.accuracy:.4f} ± {result.standard_error:.4f} (SE) | invalid {result.invalid_rate:.4f} "
          f"| cache hit rate {result.cache_hit_rate:.3f} | n {result.n}")


if __name__ == "__main__":
    main()
