"""Soak: one engine cycles rag, fewshot and no-sharing jobs of the trained demo model for a fixed
time, then answers the held-out questions as accurately as before.

    python -m benchmarks.soak --device cuda --dtype bfloat16 --seconds 240 --ring-lens 8,32
    python -m benchmarks.soak --quick                                  # CPU smoke, a few rounds

A stale ReplaySSM ring cursor, a branch state reused after its slot was given away or a leaked
slot fails silently and cumulatively: answers drift wrong and the hit rate falls away from its
ideal as rounds go by. So each round is scored (accuracy of the first answer, achieved against
the round's ideal cached tokens, error rows) and the first and second halves of the soak are
compared per job kind; the same engine then answers a fixed held-out set it answered before the
soak. Rows decode `--decode-tokens` past EOS (the model goes on asking and answering its own
questions), so rings of every length fold during decode. Fresh documents every round (seeded by
the round), so a round reuses only its own prefixes. The table is printed last.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

from batchinfer import demo_task

KINDS = ("rag", "fewshot", "no_sharing")


@dataclass(frozen=True)
class RoundResult:
    kind: str
    rows: int
    correct: int
    errors: int
    cached_tokens: int
    ideal_cached_tokens: int


def round_rows(kind: str, seed: int, size: int) -> list[dict]:
    """Rows {question_id, prompt, answer} of one round of `kind` (about `size` rows)."""
    if kind == "rag":  # a few documents, many questions each: the document is the shared prefix
        rows = demo_task.held_out_rows(seed, n_docs=max(1, size // 16), questions_per_doc=16)
        return [{"question_id": r["question_id"], "prompt": demo_task.row_prompt(r), "answer": r["answer"]}
                for r in rows]
    if kind == "fewshot":  # one document and four answered questions shared, then the row's question
        rows = demo_task.held_out_rows(seed, n_docs=1, questions_per_doc=size + 4, min_facts=size + 8,
                                       max_facts=size + 8)
        shots = "".join(f"\nQuestion: {r['question']}\nAnswer: {r['answer']}" for r in rows[:4])
        return [{"question_id": r["question_id"], "prompt": f"{r['document']}{shots}\nQuestion: {r['question']}\nAnswer:",
                 "answer": r["answer"]} for r in rows[4:]]
    if kind == "no_sharing":  # every row its own document
        rows = demo_task.held_out_rows(seed, n_docs=size, questions_per_doc=1)
        return [{"question_id": r["question_id"], "prompt": demo_task.row_prompt(r), "answer": r["answer"]}
                for r in rows]
    raise ValueError(kind)


def run_round(engine, tokenizer, kind: str, rows: list[dict], decode_tokens: int) -> tuple[RoundResult, dict]:
    from batchinfer.engine.types import Request, SamplingParams

    sampling = SamplingParams(max_tokens=decode_tokens, temperature=0.0, ignore_eos=True)
    prompts = tokenizer.encode_batch([row["prompt"] for row in rows])
    requests = [Request(row["question_id"], tuple(ids), sampling, seed_key=i) for i, (row, ids) in enumerate(zip(rows, prompts))]
    before = engine.stats
    texts, errors = {}, 0
    for output in engine.generate(requests):
        texts[output.request_id] = tokenizer.decode(output.token_ids)
        errors += output.finish_reason == "error"
    after = engine.stats
    assert len(texts) == len(rows), f"{kind}: {len(texts)} outputs for {len(rows)} rows"
    correct = sum(demo_task.is_correct(texts[row["question_id"]], row["answer"]) for row in rows)
    return RoundResult(kind, len(rows), correct, errors, after.cached_tokens - before.cached_tokens,
                       after.theoretical_max_cached_tokens - before.theoretical_max_cached_tokens), texts


def held_out_accuracy(engine, tokenizer, rows: list[dict], decode_tokens: int) -> tuple[float, dict]:
    result, texts = run_round(engine, tokenizer, "held_out", rows, decode_tokens)
    return result.correct / result.rows, texts


def halves_summary(results: list[RoundResult]) -> dict:
    half = max(1, len(results) // 2)
    def acc(part):
        rows = sum(r.rows for r in part)
        return sum(r.correct for r in part) / rows if rows else float("nan")
    def reuse(part):  # achieved over ideal, summed over the rounds
        ideal = sum(r.ideal_cached_tokens for r in part)
        return sum(r.cached_tokens for r in part) / ideal if ideal else float("nan")
    first, second = results[:half], results[half:] or results[:half]
    return {"rounds": len(results), "acc_first": acc(first), "acc_second": acc(second),
            "reuse_first": reuse(first), "reuse_second": reuse(second),
            "reuse_min": min((r.cached_tokens / r.ideal_cached_tokens for r in results if r.ideal_cached_tokens),
                             default=float("nan")),
            "errors": sum(r.errors for r in results)}


def soak_one(checkpoint: Path, ring_len: int, args) -> tuple[list[dict], dict]:
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.engine import Engine
    from batchinfer.jobs.inputs.tokenizer import CheckpointTokenizer

    tokenizer = CheckpointTokenizer.from_checkpoint(checkpoint)
    config = EngineConfig(device=args.device, dtype=args.dtype, replayssm=True, state_cache="extra_buffer",
                          ring_len=ring_len)
    engine = Engine.from_pretrained(str(checkpoint), config, eos_token_ids=tokenizer.eos_token_ids,
                                    detokenize=tokenizer.decode)
    held_out = [{"question_id": r["question_id"], "prompt": demo_task.row_prompt(r), "answer": r["answer"]}
                for r in demo_task.held_out_rows(10_000, n_docs=args.held_out // 8, questions_per_doc=8)]
    acc_before, texts_before = held_out_accuracy(engine, tokenizer, held_out, args.decode_tokens)
    results: dict[str, list[RoundResult]] = {kind: [] for kind in KINDS}
    start, round_index = time.monotonic(), 0
    while time.monotonic() - start < args.seconds or round_index < len(KINDS):
        kind = KINDS[round_index % len(KINDS)]
        result, _ = run_round(engine, tokenizer, kind, round_rows(kind, 1 + round_index, args.round_rows),
                              args.decode_tokens)
        results[kind].append(result)
        round_index += 1
        if round_index % 30 == 0:
            print(f"ring {ring_len}: {round_index} rounds, {time.monotonic() - start:.0f} s", flush=True)
    acc_after, texts_after = held_out_accuracy(engine, tokenizer, held_out, args.decode_tokens)
    same = sum(texts_before[q] == texts_after[q] for q in texts_before)
    rows = [{"ring": ring_len, "kind": kind, **halves_summary(rs)} for kind, rs in results.items()]
    return rows, {"ring": ring_len, "rounds": round_index, "seconds": time.monotonic() - start,
                  "acc_before": acc_before, "acc_after": acc_after, "same_texts": same, "held_out": len(held_out)}


def main(argv=None) -> int:
    from batchinfer.demo import shipped_demo_checkpoint

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=None, help="default: the shipped demo checkpoint")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seconds", type=float, default=240.0, help="soak time per ring length")
    p.add_argument("--ring-lens", default="8,32")
    p.add_argument("--round-rows", type=int, default=64)
    p.add_argument("--decode-tokens", type=int, default=40)
    p.add_argument("--held-out", type=int, default=256)
    p.add_argument("--quick", action="store_true", help="CPU smoke: 6 rounds of 16 rows, 12 tokens")
    args = p.parse_args(argv)
    if args.quick:
        args.seconds, args.round_rows, args.decode_tokens, args.held_out = 0.0, 16, 12, 32
    checkpoint = args.checkpoint or shipped_demo_checkpoint()
    if checkpoint is None:
        raise SystemExit("error: --checkpoint: the trained demo is not in the package; pass its folder")
    table, totals = [], []
    for ring_len in (int(x) for x in args.ring_lens.split(",")):
        rows, total = soak_one(Path(checkpoint), ring_len, args)
        table += rows
        totals.append(total)
    print("\n| ring | kind | rounds | accuracy 1st / 2nd half | achieved/ideal 1st / 2nd half (min round) | error rows |")
    print("|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['ring']} | {r['kind']} | {r['rounds']} | {r['acc_first']:.4f} / {r['acc_second']:.4f} | "
              f"{r['reuse_first']:.4f} / {r['reuse_second']:.4f} ({r['reuse_min']:.4f}) | {r['errors']} |")
    print("\n| ring | rounds | soak s | held-out accuracy before / after | same texts |")
    print("|---|---|---|---|---|")
    for t in totals:
        print(f"| {t['ring']} | {t['rounds']} | {t['seconds']:.0f} | {t['acc_before']:.4f} / {t['acc_after']:.4f} "
              f"| {t['same_texts']}/{t['held_out']} |")
    failed = [f"ring {t['ring']}: held-out accuracy {t['acc_before']:.4f} -> {t['acc_after']:.4f}"
              for t in totals if t["acc_after"] < t["acc_before"] - 0.01]
    failed += [f"ring {r['ring']} {r['kind']}: {r['errors']} error rows" for r in table if r["errors"]]
    failed += [f"ring {r['ring']} {r['kind']}: reuse fell {r['reuse_first']:.4f} -> {r['reuse_second']:.4f}"
               for r in table if r["reuse_second"] < r["reuse_first"] - 0.01]
    print("\nsoak: " + ("; ".join(failed) if failed else "no error rows, no drift in accuracy or reuse"))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
