"""Planned against achieved reuse on a shuffled rag job, per-window planning against one unit.

    python -m benchmarks.unit_reuse --arm window   # units of 4,096 consecutive rows, in input order
    python -m benchmarks.unit_reuse --arm unit     # the whole job as one work unit

The demo model (`model: demo`, fp32 on the CPU, its default 256 MiB pool budget) over 1,000 documents of 120
pseudo-words × 10 questions each, shuffled, built and tokenised here and fed through the engine API
(`generate_units`, as the job runner feeds it). Prints one JSON object: the engine's reuse counters, the
global ideal (the plan of all rows at once) and the wall time.
"""
from __future__ import annotations

import argparse
import json
import random
import time

from batchinfer.demo import demo_checkpoint
from batchinfer.engine import Engine, EngineConfig
from batchinfer.engine.planner import plan_prompts
from batchinfer.engine.types import Request, SamplingParams
from batchinfer.jobs.inputs.tokenizer import CheckpointTokenizer

_SYLLABLES = ("ka", "lo", "mi", "ru", "sen", "tav", "qui", "ber", "dol", "fex", "gan", "hup", "zor", "wim", "ne", "po")
_COUNTERS = ("prompt_tokens", "cached_tokens", "theoretical_max_cached_tokens", "planned_reuse_lost_tokens",
             "branch_states_over_capacity", "discarded_kv_tokens", "states_evicted", "tracks_skipped",
             "preemptions", "output_tokens", "prefill_seconds", "decode_seconds")


def rag_texts(docs: int, questions: int, words: int, rng: random.Random) -> list[str]:
    """Grouped by document: a document of `words` pseudo-words, then each of its questions."""
    vocab = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randrange(1, 4))) for _ in range(5000)]
    texts = []
    for _ in range(docs):
        doc = " ".join(rng.choice(vocab) for _ in range(words)).capitalize() + "."
        for _ in range(questions):
            question = " ".join(rng.choice(vocab) for _ in range(rng.randrange(4, 10))).capitalize() + "?"
            texts.append(f"{doc}\n\nQuestion: {question}")
    return texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arm", choices=("window", "unit"), default="unit")
    parser.add_argument("--docs", type=int, default=1000)
    parser.add_argument("--questions", type=int, default=10)
    parser.add_argument("--words", type=int, default=120)
    parser.add_argument("--window", type=int, default=4096, help="rows per unit (--arm window)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--grouped", action="store_true", help="keep the rows grouped by document")
    args = parser.parse_args()

    checkpoint = demo_checkpoint()
    tokenizer = CheckpointTokenizer.from_checkpoint(checkpoint)
    rng = random.Random(0)
    ids = tokenizer.encode_batch(rag_texts(args.docs, args.questions, args.words, rng))
    order = list(range(len(ids)))
    if not args.grouped:
        rng.shuffle(order)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    requests = [Request(request_id=i, prompt_token_ids=tuple(ids[i]), sampling=params, seed_key=i) for i in order]

    # The window plan's units (jobs/global_plan/windows.py): consecutive rows, each unit planned alone.
    size = args.window if args.arm == "window" else len(requests)
    units = [requests[start:start + size] for start in range(0, len(requests), size)]
    engine = Engine.from_pretrained(str(checkpoint), EngineConfig(), eos_token_ids=tokenizer.eos_token_ids)
    started = time.perf_counter()
    for _ in engine.generate_units(units):
        pass
    wall = time.perf_counter() - started
    stats = engine.stats.to_dict()
    ideal = plan_prompts([r.prompt_token_ids for r in requests]).theoretical_max_cached_tokens
    print(json.dumps({"arm": args.arm, "rows": len(requests), **{k: stats[k] for k in _COUNTERS},
                      "cache_hit_rate": round(stats["cache_hit_rate"], 4),
                      "ideal_hit_rate": round(stats["ideal_hit_rate"], 4),
                      "global_ideal": ideal, "wall_seconds": round(wall, 1)}, indent=1))


if __name__ == "__main__":
    main()
