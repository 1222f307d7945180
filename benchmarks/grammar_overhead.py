"""Decode step cost of structured output and logprobs: the same batch without, with a JSON schema, with logprobs k=5.

    python -m benchmarks.grammar_overhead                   # H200: qwen3.5-27b shapes, 8 layers, bf16, batch 256
    python -m benchmarks.grammar_overhead --tokenizer DIR   # the grammar over a real checkpoint's tokenizer
    python -m benchmarks.grammar_overhead --quick           # CPU smoke: the tiny preset, batch 8

Model: random weights (`benchmarks.engine_arms.build_model`), prompts of random token ids, seeded
sampling at temperature 1 in every arm, so the arms differ only in what they add:

    none        plain decode (one-step overlap on, as the engine runs)
    json        every row under a JSON schema (nested objects, enums, arrays, strings with maxLength):
                the previous step read and the masks filled on the host while the forward runs,
                applied on the device
    json_unbounded  the same schema without maxLength on its strings
    logprobs5   every row asks logprobs k=5 (computed on the device, downloaded with the tokens)

Each arm runs `--reps` times, interleaved (none, json, logprobs5, none, ...) to cancel drift; a
rep's number is the median wall time of its decode-only steps at exactly `--batch` rows (no
syncs: with overlap the wall time per step is the GPU's); the arm's number is the median over
reps. Targets (issue 23): json ≤ 5% over none, logprobs5 ≤ 3%.

Without `--tokenizer` the grammar runs over a synthetic byte-level vocabulary of the model's size
(random words, JSON punctuation, every byte): llguidance's mask cost follows the token trie, so
this approximates a real 248k vocabulary; with a real checkpoint's tokenizer the number is exact.
Inside a string with maxLength the cost is the walk over the tokens that can leave the string:
7.7% of this vocabulary's tokens hold a quote or a backslash (its random words draw from an
alphabet with both), likely more than a real BPE vocabulary, so that arm is a pessimistic case.
`json@N` runs the json arm with an N-thread mask pool (`BATCHINFER_GRAMMAR_THREADS`);
`logprobs5@fused` / `logprobs5@torch` the logprobs arm on the one-pass kernel / the torch ops.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import statistics
from pathlib import Path

import torch

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.engine import Engine
from batchinfer.engine.sampler import fused_logprobs_enabled, fused_sampler_enabled
from batchinfer.engine.types import Request, SamplingParams
from batchinfer.jobs.tasks.structured import mask_threads, set_mask_threads
from benchmarks.engine_arms import build_model
from benchmarks.host_overhead import PhaseTimer

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 200},
    "label": {"enum": ["positive", "negative", "neutral"]},
    "entities": {"type": "array", "minItems": 64, "items": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24}, "kind": {"enum": ["person", "place", "org"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["name", "kind", "score"], "additionalProperties": False}}},
    "required": ["title", "label", "entities"], "additionalProperties": False}
TARGETS = {"json": 5.0, "json_unbounded": 5.0, "logprobs5": 3.0}


def unbounded_schema() -> dict:
    """SCHEMA without its strings' maxLength: llguidance's slicer then covers string contents
    (a bounded repetition defeats it, and each mask inside such a string costs ~30x more)."""
    schema = json.loads(json.dumps(SCHEMA))
    schema["properties"]["title"].pop("maxLength")
    schema["properties"]["entities"]["items"]["properties"]["name"].pop("maxLength")
    return schema


def synthetic_tokenizer_json(vocab_size: int, seed: int = 0) -> tuple[str, int]:
    """A byte-level BPE tokenizer JSON of `vocab_size` tokens (every byte, JSON punctuation,
    random words) and its EOS id (the last token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    def byte_chars() -> list[str]:  # GPT-2's byte → printable character map
        keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
            list(range(ord("®"), ord("ÿ") + 1))
        chars, extra = {}, 0
        for b in range(256):
            if b in keep:
                chars[b] = chr(b)
            else:
                chars[b] = chr(256 + extra)
                extra += 1
        return [chars[b] for b in range(256)]

    to_chars = byte_chars()
    rng = random.Random(seed)
    tokens = list(to_chars)
    seen = set(tokens)
    for piece in ['{"', '":', '",', '"}', '["', '"]', '":"', '},', '},{"', ' ', ', ', ': ', 'true', 'false']:
        text = "".join(to_chars[b] for b in piece.encode())
        if text not in seen:
            seen.add(text)
            tokens.append(text)
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.,'\"{}[]:"
    while len(tokens) < vocab_size - 1:
        word = ("Ġ" if rng.random() < 0.4 else "") + "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 9)))
        text = "".join(to_chars[b] for b in word.replace("Ġ", " ").encode())
        if text not in seen:
            seen.add(text)
            tokens.append(text)
    vocab = {text: i for i, text in enumerate(tokens[:vocab_size - 1])}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|im_end|>"])
    return tokenizer.to_str(), tokenizer.token_to_id("<|im_end|>")


def compiled_schema(vocab_size: int, tokenizer_dir: Path | None, schema: dict = SCHEMA):
    import llguidance

    from batchinfer.jobs.tasks.structured import compile_source, grammar_source, grammar_tokenizer

    source = grammar_source("json_schema", json.dumps(schema))
    if tokenizer_dir is not None:
        from batchinfer.jobs.inputs.tokenizer import CheckpointTokenizer

        return compile_source(source, grammar_tokenizer(CheckpointTokenizer.from_checkpoint(tokenizer_dir), vocab_size))
    text, eos = synthetic_tokenizer_json(vocab_size)
    return compile_source(source, llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=[eos]))


def arm_requests(arm: str, batch: int, prompt_len: int, output_tokens: int, vocab: int, grammar, tag: str):
    rng = random.Random(1)
    constrained = arm.startswith("json")
    params = SamplingParams(max_tokens=output_tokens, temperature=1.0, seed=5, ignore_eos=not constrained,
                            logprobs=5 if arm == "logprobs5" else None)
    return [Request(f"{tag}{i}", tuple(rng.randrange(vocab) for _ in range(prompt_len)), params, seed_key=i,
                    grammar=grammar[arm] if constrained else None)
            for i in range(batch)]


def run_arm(engine: Engine, timer: PhaseTimer, requests, batch: int) -> tuple[float, int, int]:
    """(median ms per decode-only step at `batch` rows, steps measured, rows that stopped early)."""
    timer.steps.clear()
    outputs = list(engine.generate(requests))
    steps = [s["total"] for s in timer.steps if not s.get("prefill_seqs") and s.get("decode_batch") == batch]
    stopped = [o for o in outputs if o.completion_tokens < requests[0].sampling.max_tokens]
    if stopped:  # with minItems 64 nothing may stop before 64 tokens: say how they stopped
        reasons = collections.Counter((o.finish_reason, (o.error or "")[:120]) for o in stopped)
        print(f"  stopped early: {dict(reasons)}; first: {stopped[0].completion_tokens} tokens "
              f"{list(stopped[0].token_ids)[-8:]}", flush=True)
    return (1e3 * statistics.median(steps) if steps else float("nan")), len(steps), len(stopped)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3.5-27b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tokenizer", type=Path, default=None, help="a checkpoint folder (tokenizer.json, configs)")
    parser.add_argument("--arms", default="none,json,json_unbounded,logprobs5",
                        help="comma list; json@N: the json arm with an N-thread mask pool; "
                             "logprobs5@fused / logprobs5@torch: that logprobs path")
    parser.add_argument("--quick", action="store_true", help="CPU smoke: tiny preset, batch 8, 12 tokens, 1 rep")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    if args.quick:
        args.preset, args.layers, args.batch, args.prompt_len, args.output_tokens, args.reps = \
            "tiny", None, 8, 16, 12, 1
    model, _ = build_model(args.preset, args.layers, device)
    vocab = model.config.vocab_size
    grammar = {"json": compiled_schema(vocab, args.tokenizer),
               "json_unbounded": compiled_schema(vocab, args.tokenizer, unbounded_schema())}
    cuda = device == "cuda"
    engine = Engine(model, EngineConfig(device=device, max_running=args.batch, cuda_graphs=cuda,
                                        **({} if cuda else {"memory_budget_bytes": 64 << 20})),
                    model_name=args.preset)
    if engine.pool_plan.max_running < args.batch:
        raise SystemExit(f"the memory budget fits {engine.pool_plan.max_running} running requests, not {args.batch}")
    timer = PhaseTimer(engine, engine.runner, "decode")  # no syncs: wall time per step as the engine runs
    arms = tuple(args.arms.split(","))
    if "none" not in arms:
        raise SystemExit("--arms must include none (the baseline)")

    logprobs_env = os.environ.get("BATCHINFER_FUSED_LOGPROBS")  # None: the engine's default

    def start(arm: str) -> str:
        """Set up the arm's variant and return its kind: json@N → an N-thread mask pool;
        logprobs5@fused / @torch → that logprobs path; no suffix: the defaults of this process."""
        kind, _, variant = arm.partition("@")
        set_mask_threads(int(variant) if variant.isdigit() else mask_threads())
        chosen = {"fused": "1", "torch": "0"}.get(variant, logprobs_env)
        if chosen is None:
            os.environ.pop("BATCHINFER_FUSED_LOGPROBS", None)
        else:
            os.environ["BATCHINFER_FUSED_LOGPROBS"] = chosen
        return kind

    for arm in arms:  # warm-up: compile, capture, llguidance's first masks
        run_arm(engine, timer, arm_requests(start(arm), min(args.batch, 8), args.prompt_len, 4, vocab, grammar,
                                            f"w{arm}"), min(args.batch, 8))
    results: dict[str, list[float]] = {arm: [] for arm in arms}
    notes: dict[str, str] = {}
    for rep in range(args.reps):
        for arm in arms:
            # Fresh prompts each rep (a new tag, new ids): nothing is served from the prefix cache twice.
            requests = arm_requests(start(arm), args.batch, args.prompt_len, args.output_tokens, vocab, grammar,
                                    f"r{rep}{arm}")
            requests = [Request(r.request_id, tuple((t + 7919 * rep) % vocab for t in r.prompt_token_ids), r.sampling,
                                r.seed_key, grammar=r.grammar) for r in requests]
            ms, steps, early = run_arm(engine, timer, requests, args.batch)
            results[arm].append(ms)
            print(f"rep {rep} {arm:10s} {ms:8.3f} ms/step over {steps} steps"
                  + (f" ({early} rows stopped early)" if early else ""), flush=True)
            if early:
                notes[arm] = f"{early} rows stopped before {args.output_tokens} tokens"
    start("none")  # the process's own settings again, for the header below
    base = statistics.median(results["none"])
    layers = args.layers or "all"
    print(f"\n{args.preset}, {layers} layers, {'bf16' if cuda else 'fp32'}, {device}, batch {args.batch}, "
          f"prompt {args.prompt_len}, {args.output_tokens} tokens, {args.reps} reps; grammar vocabulary: "
          f"{args.tokenizer or 'synthetic'}; fused sampler {'on' if fused_sampler_enabled() else 'off'}, "
          f"fused logprobs {'on' if fused_logprobs_enabled() else 'off'} (unless an arm says)")
    print(f"{'arm':16s} {'ms/step':>9s} {'overhead':>9s} {'target':>7s}")
    for arm in arms:
        ms = statistics.median(results[arm])
        overhead = 100.0 * (ms / base - 1.0)
        kind = arm.partition("@")[0]
        target = f"≤{TARGETS[kind]:.0f}%" if kind in TARGETS else ""
        print(f"{arm:16s} {ms:9.3f} {overhead:+8.1f}% {target:>7s}" + (f"  ({notes[arm]})" if arm in notes else ""))


if __name__ == "__main__":
    main()
