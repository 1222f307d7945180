"""Accuracy parity of the cache arms on the trained demo model (the seed's GSM8K table, here).

    python -m benchmarks.demo_parity --device cpu --dtype float32     # all arms token-identical (asserted)
    python -m benchmarks.demo_parity --device cuda --dtype bfloat16   # arms within two standard errors
    python -m benchmarks.demo_parity --quick --checkpoint CKPT        # CPU smoke: 16 questions

Questions: `--questions` (default 1,319) fresh held-out look-ups (batchinfer.demo_task, seed 0:
documents of 10-80 facts, 8 questions each, outside the training stream), greedy. Each row
decodes `--decode-tokens` tokens past EOS (the model goes on asking and answering its own
questions), so ReplaySSM rings of every length flush during decode. Scored: the first answer
(exact match by the issue's rule, with its standard error sqrt(p (1 - p) / n)), invalid rate
(the text does not start with a 4-digit number), cache hit rate; `follow-up` is the accuracy of
the model's own later questions that name a fact of the document (answers after the flushes).
Arms: ReplaySSM off + extra_buffer; ReplaySSM + no_buffer and + extra_buffer at ring lengths
8 / 16 / 32; prefix cache off (ReplaySSM + extra_buffer, L = 16); an FP8 KV pool (the same, its
tokens not asserted in fp32: it rounds the keys and values). `same tokens`: rows whose
generated tokens equal the first arm's. The table is printed last.
"""
from __future__ import annotations

import argparse
import re
import time
from dataclasses import dataclass
from pathlib import Path

from batchinfer.engine.config import EngineConfig
from benchmarks.demo_model.evaluate import EvalResult, eval_rows, evaluate

FOLLOW_UP = re.compile(r"Question: What is the (\w+) of (\w+)\?\nAnswer: ?(\d*)")
FACT_LINE = re.compile(r"The (\w+) of (\w+) is (\d+)\.")


@dataclass(frozen=True)
class Arm:
    name: str
    replayssm: bool
    state_cache: str
    ring_len: int = 16
    prefix_cache: bool = True
    kv_cache_dtype: str = "auto"  # fp8_e4m3 rounds the KV: not held to identical fp32 tokens

    def engine_config(self, device: str, dtype: str) -> EngineConfig:
        return EngineConfig(device=device, dtype=dtype, replayssm=self.replayssm, state_cache=self.state_cache,
                            ring_len=self.ring_len, prefix_cache=self.prefix_cache, kv_cache_dtype=self.kv_cache_dtype)


ARMS = (
    Arm("recurrent+extra_buffer", replayssm=False, state_cache="extra_buffer"),
    *(Arm(f"replay+no_buffer L{L}", True, "no_buffer", L) for L in (8, 16, 32)),
    *(Arm(f"replay+extra_buffer L{L}", True, "extra_buffer", L) for L in (8, 16, 32)),
    Arm("prefix cache off (replay L16)", True, "extra_buffer", 16, prefix_cache=False),
    Arm("fp8 KV (replay+extra_buffer L16)", True, "extra_buffer", 16, kv_cache_dtype="fp8_e4m3"),
)


def follow_up_score(rows: list[dict], result: EvalResult) -> tuple[int, int]:
    """(right, judged) over the generated follow-up questions that name a fact of their document."""
    right = judged = 0
    for row in rows:
        facts = {(a, n): v for a, n, v in FACT_LINE.findall(row["document"])}
        for attribute, name, value in FOLLOW_UP.findall(result.texts[row["question_id"]]):
            if (attribute, name) in facts and len(value) == 4:  # a complete answer inside the budget
                judged += 1
                right += value == facts[(attribute, name)]
    return right, judged


def main(argv=None) -> None:
    from batchinfer.demo import shipped_demo_checkpoint

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=None, help="default: the shipped demo checkpoint")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--questions", type=int, default=1319)
    p.add_argument("--decode-tokens", type=int, default=48)
    p.add_argument("--arms", default=None, help="comma-separated arm names (default: all)")
    p.add_argument("--quick", action="store_true", help="16 questions, 24 tokens (CPU smoke)")
    p.add_argument("--no-assert", action="store_true", help="report token differences in fp32 instead of failing")
    args = p.parse_args(argv)
    if args.quick:
        args.questions, args.decode_tokens = 16, 24
    checkpoint = args.checkpoint or shipped_demo_checkpoint()
    if checkpoint is None:
        raise SystemExit("error: --checkpoint: the trained demo is not in the package; pass its folder")
    arms = ARMS if args.arms is None else tuple(a for a in ARMS if a.name in args.arms.split(","))
    rows = eval_rows(args.questions)
    print(f"checkpoint {checkpoint} | {len(rows)} questions | device {args.device} {args.dtype} | "
          f"decode {args.decode_tokens} tokens past EOS", flush=True)

    results = []
    for arm in arms:
        start = time.monotonic()
        result = evaluate(checkpoint, rows, arm.engine_config(args.device, args.dtype),
                          max_tokens=args.decode_tokens, ignore_eos=True)
        seconds = time.monotonic() - start
        results.append((arm, result, seconds))
        same = sum(result.completions[q] == results[0][1].completions[q] for q in result.completions)
        print(f"{arm.name}: accuracy {result.accuracy:.4f} ± {result.standard_error:.4f} | same tokens "
              f"{same}/{result.n} | {seconds:.0f} s", flush=True)

    reference = results[0][1]
    print("\n| arm | accuracy ± SE | invalid | cache hit | follow-up (n) | same tokens | wall s |")
    print("|---|---|---|---|---|---|---|")
    for arm, result, seconds in results:
        right, judged = follow_up_score(rows, result)
        same = sum(result.completions[q] == reference.completions[q] for q in result.completions)
        follow = f"{right / judged:.4f} ({judged})" if judged else "- (0)"
        print(f"| {arm.name} | {result.accuracy:.4f} ± {result.standard_error:.4f} | {result.invalid_rate:.4f} "
              f"| {result.cache_hit_rate:.3f} | {follow} | {same}/{result.n} | {seconds:.0f} |")
    accuracies = [r.accuracy for _, r, _ in results]
    spread = max(accuracies) - min(accuracies)
    two_se = 2 * max(r.standard_error for _, r, _ in results)
    print(f"\naccuracy spread across arms {spread:.4f}; two standard errors {two_se:.4f}: "
          f"{'within' if spread <= two_se else 'OUTSIDE'}")
    if args.dtype in ("float32", "fp32") and not args.no_assert:
        differing = [arm.name for arm, r, _ in results
                     if arm.kv_cache_dtype == "auto" and r.completions != reference.completions]
        assert not differing, f"fp32 arms must be token-identical; differ from {results[0][0].name}: {differing}"
        print("fp32: all arms token-identical")


if __name__ == "__main__":
    main()
