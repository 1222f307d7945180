"""Global plan against per-window planning, through `batchinfer run`'s own job machinery (GPU).

    python -m benchmarks.plan_arms                 # H200: qwen3.5-27b shapes, 8 layers, bf16
    python -m benchmarks.plan_arms --smoke         # CPU: tiny preset, a few hundred rows

A shuffled rag job much larger than one 4,096-row window: `--docs` documents of `--doc-tokens`
random token ids, each followed by `--questions` questions of `--question-tokens`, shuffled, so
that a window holds about two rows per document. The same rows run as two jobs that differ only
in `run_job(plan=...)` (`window`: units of 4,096 consecutive rows in input order, each planned alone;
`global`: the whole job sorted and cut into work units; both through the same unit path). Each arm gets a fresh engine on one loaded model (no
cache carried across arms), after a warm-up job that compiles the kernels. Printed: cached tokens
against the global ideal (Σ over the globally sorted prompts of min(lcp, len − 1), computed here
independently), prompt / output tokens per second over the job's wall time and over the engine's
own prefill + decode time, and how many rows generated identical tokens in both arms.
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from rich.console import Console

from batchinfer.demo import demo_checkpoint
from batchinfer.models.checkpoint_writer import write_random_checkpoint
from batchinfer.models.presets import PRESETS

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def make_checkpoint(folder: Path, preset: str, layers: int | None, dtype: torch.dtype) -> Path:
    """A random-weight checkpoint of the preset's shapes with the demo's tokenizer files (it only
    decodes here: ids outside its vocabulary decode to nothing)."""
    raw = dict(PRESETS[preset])
    if layers:
        raw["num_hidden_layers"] = layers
    write_random_checkpoint(folder, raw, seed=0, dtype=dtype)
    for name in TOKENIZER_FILES:
        shutil.copy(demo_checkpoint() / name, folder / name)
    return folder


def rag_rows(docs: int, questions: int, doc_tokens: int, question_tokens: int, vocab: int,
             seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(docs):
        doc = [rng.randrange(3, vocab) for _ in range(doc_tokens)]
        rows += [doc + [rng.randrange(3, vocab) for _ in range(question_tokens)] for _ in range(questions)]
    rng.shuffle(rows)
    return rows


def global_ideal(prompts: list[list[int]]) -> int:
    ordered = sorted(prompts)
    total = 0
    for before, row in zip(ordered, ordered[1:]):
        lcp = 0
        while lcp < min(len(before), len(row)) and before[lcp] == row[lcp]:
            lcp += 1
        total += min(lcp, len(row) - 1)
    return total


def write_job(folder: Path, name: str, data: Path, checkpoint: Path, args) -> Path:
    job = {"jobs": [{
        "name": name, "model": str(checkpoint), "input": str(data), "prompt": {"token_ids_column": "ids"},
        "sampling": {"max_tokens": args.output_tokens, "ignore_eos": True, "temperature": 0.0},
        "engine": {"device": args.device, "max_running": args.max_running},
        "output": {"path": str(folder / f"out-{name}")},
    }]}
    path = folder / f"{name}.yaml"
    path.write_text(json.dumps(job))  # JSON is YAML
    return path


def run_arm(job_file: Path, model, console: Console, plan: str = "global") -> tuple[dict, float, Path]:
    from batchinfer.engine import Engine, EngineConfig
    from batchinfer.jobs.run.prepare import prepare_job
    from batchinfer.jobs.run.runner import run_job
    from batchinfer.jobs.spec.job_file import engine_config_kwargs, load_job_file

    (spec,) = load_job_file(job_file).jobs
    job = prepare_job(spec, overwrite=True)

    def fresh_engine(job, window_rows):  # the loaded model, a new engine: no cache from another arm
        config = EngineConfig(**engine_config_kwargs(job.spec.engine), plan_window=window_rows)
        return Engine(model, config, eos_token_ids=job.tokenizer.eos_token_ids, detokenize=job.tokenizer.decode)

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    stats = run_job(job, console, overwrite=True, engine_factory=fresh_engine, plan=plan)
    wall = time.perf_counter() - start
    # The engine's pools (90% of the free memory) must go before the next arm sizes its own.
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        print(f"after {spec.name}: {free / 2**30:.1f} of {total / 2**30:.1f} GiB free", flush=True)
    return stats, wall, spec.output.path


def outputs_by_row(folder: Path) -> dict[int, list[int]]:
    table = pq.read_table(folder, columns=["row_index", "output_token_ids"])
    return dict(zip(table["row_index"].to_pylist(), table["output_token_ids"].to_pylist()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen3.5-27b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--docs", type=int, default=2000)
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--doc-tokens", type=int, default=512)
    parser.add_argument("--question-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--max-running", type=int, default=256)
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temp folder)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny preset, few rows")
    args = parser.parse_args()
    if args.smoke:
        args.preset, args.layers, args.docs, args.doc_tokens, args.question_tokens = "tiny", None, 40, 48, 8
        args.output_tokens, args.max_running = 4, 32
    args.device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    work = args.work or Path(tempfile.mkdtemp(prefix="plan_arms-"))
    work.mkdir(parents=True, exist_ok=True)
    console = Console()

    t0 = time.perf_counter()
    checkpoint = make_checkpoint(work / "ckpt", args.preset, args.layers, dtype)
    vocab = PRESETS[args.preset]["vocab_size"]
    prompts = rag_rows(args.docs, args.questions, args.doc_tokens, args.question_tokens, vocab, seed=1)
    warm = rag_rows(max(8, args.docs // 50), args.questions, args.doc_tokens, args.question_tokens, vocab, seed=2)
    for name, rows in (("rows", prompts), ("warm", warm)):
        pq.write_table(pa.table({"ids": pa.array(rows, pa.list_(pa.int32()))}), work / f"{name}.parquet")
    ideal = global_ideal(prompts)
    print(f"setup {time.perf_counter() - t0:.1f} s: {len(prompts)} rows, {sum(map(len, prompts)):,} prompt tokens, "
          f"global ideal {ideal:,} cached", flush=True)

    from batchinfer.models.loader import load_model
    model = load_model(str(checkpoint), dtype, args.device)
    run_arm(write_job(work, "warm", work / "warm.parquet", checkpoint, args), model, console)
    results = {}
    for arm in ("window", "global"):
        stats, wall, out = run_arm(write_job(work, arm, work / "rows.parquet", checkpoint, args), model, console, arm)
        engine_seconds = stats["prefill_seconds"] + stats["decode_seconds"]
        results[arm] = dict(
            wall_s=wall, engine_s=engine_seconds, prompt_tokens=stats["prompt_tokens"],
            cached=stats["cached_tokens"], planned=stats["planned_cached_tokens"],
            output_tokens=stats["output_tokens"], evicted=stats["states_evicted"],
            discarded_kv=stats["discarded_kv_tokens"], peak_gib=stats["peak_memory_bytes"] / 2**30,
            prompt_tps_wall=stats["prompt_tokens"] / wall, output_tps_wall=stats["output_tokens"] / wall,
            outputs=outputs_by_row(out))
    same = sum(results["window"]["outputs"][r] == tokens for r, tokens in results["global"]["outputs"].items())
    rows = len(results["global"]["outputs"])
    for result in results.values():
        del result["outputs"]
    summary = dict(rows=len(prompts), global_ideal=ideal, identical_rows=same, compared_rows=rows,
                   speedup_wall=results["window"]["wall_s"] / results["global"]["wall_s"],
                   arms=results, args={k: str(v) for k, v in vars(args).items()})
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    print(f"\n{'arm':<7} {'cached':>11} {'planned':>11} {'= ideal':>8} {'wall s':>7} {'engine s':>8} "
          f"{'prompt tok/s':>12} {'evicted':>8} {'peak GiB':>8}")
    for arm, r in results.items():
        print(f"{arm:<7} {r['cached']:>11,} {r['planned']:>11,} {str(r['cached'] == ideal):>8} {r['wall_s']:>7.1f} "
              f"{r['engine_s']:>8.1f} {r['prompt_tps_wall']:>12,.0f} {r['evicted']:>8,} {r['peak_gib']:>8.1f}")
    print(f"global over window (wall): {summary['speedup_wall']:.2f}x; identical generations: {same}/{rows} rows")


if __name__ == "__main__":
    main()
