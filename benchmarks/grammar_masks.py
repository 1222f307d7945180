"""Host cost of structured output's token masks: llguidance over a batch of sequences, per decode step.

    python -m benchmarks.grammar_masks --tokenizer /path/to/qwen3.5-checkpoint  # batch 64 / 256
    python -m benchmarks.grammar_masks --quick                                  # the demo tokenizer, CPU smoke

Each step fills the int32 bitmask [B, ceil(V/32)] of B matchers (`jobs.structured.fill_masks`,
llguidance's threads) and advances each by one random allowed token (as a random-weight model
under the mask would), for a JSON schema with nested objects, enums and arrays, and for a regex.
The mask fill is what the engine overlaps with the forward pass: compare its ms per step with the
decode step's (docs/BENCHMARKS.md) — the issue's budget is 5% of the step at batch 256.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from batchinfer.jobs.tasks.structured import allowed_tokens, compile_grammar, fill_masks, new_bitmask
from batchinfer.jobs.spec.task import GrammarSpec
from batchinfer.jobs.inputs.tokenizer import CheckpointTokenizer

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40},
    "label": {"enum": ["positive", "negative", "neutral"]},
    "entities": {"type": "array", "maxItems": 8, "items": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24}, "kind": {"enum": ["person", "place", "org"]},
        "score": {"type": "number"}}, "required": ["name", "kind"], "additionalProperties": False}},
    "year": {"type": "integer", "minimum": 1900, "maximum": 2100}},
    "required": ["title", "label", "entities"], "additionalProperties": False}
CONSTRAINTS = {"json_schema": GrammarSpec("json_schema", json.dumps(SCHEMA)),
               "regex": GrammarSpec("regex", r"[A-Z][a-z]{2,12}( [A-Z][a-z]{2,12}){0,3}, [0-9]{4}\.")}


def measure(grammar, vocab: int, batch: int, steps: int, rng: np.random.Generator) -> tuple[float, float, int]:
    """→ (ms per mask fill, ms per accept of the batch, steps measured)."""
    matchers = [grammar.matcher() for _ in range(batch)]
    bits = new_bitmask(batch, vocab)
    fill = accept = 0.0
    measured = 0
    for _ in range(steps):
        live = [m for m in matchers if not m.finished]
        if not live:
            break
        started = time.perf_counter()
        fill_masks(live, bits[:len(live)])
        fill += time.perf_counter() - started
        tokens = [int(rng.choice(allowed_tokens(bits[i], vocab))) for i in range(len(live))]
        started = time.perf_counter()
        for matcher, token in zip(live, tokens):
            matcher.accept(token)
        accept += time.perf_counter() - started
        measured += 1
    return 1e3 * fill / max(measured, 1), 1e3 * accept / max(measured, 1), measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, help="a checkpoint folder (tokenizer.json, configs)")
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="the demo tokenizer, batch 8, 16 steps")
    args = parser.parse_args()
    if args.quick or args.tokenizer is None:
        from batchinfer.demo import demo_checkpoint

        args.tokenizer = demo_checkpoint()
        if args.quick:
            args.batch, args.steps = [8], 16
    tokenizer = CheckpointTokenizer.from_checkpoint(args.tokenizer)
    config = json.loads((args.tokenizer / "config.json").read_text())
    vocab = int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size") or tokenizer.vocab_size)
    started = time.perf_counter()
    grammars = {name: compile_grammar(spec, tokenizer, vocab) for name, spec in CONSTRAINTS.items()}
    print(f"tokenizer {args.tokenizer.name}: vocab {vocab}, tokenizer + grammars built in "
          f"{time.perf_counter() - started:.2f} s")
    rng = np.random.default_rng(0)
    print(f"{'constraint':<12} {'batch':>6} {'steps':>6} {'fill ms/step':>13} {'accept ms/step':>15} {'us/seq':>8}")
    for name, grammar in grammars.items():
        for batch in args.batch:
            fill, accept, steps = measure(grammar, vocab, batch, args.steps, rng)
            print(f"{name:<12} {batch:>6} {steps:>6} {fill:>13.3f} {accept:>15.3f} {1e3 * fill / batch:>8.1f}")


if __name__ == "__main__":
    main()
