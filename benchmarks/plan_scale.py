"""The global planning pass at scale (issues 18 and 19), on the CPU, no model loaded.

    python -m benchmarks.plan_scale text1m        # (a) `batchinfer plan` over 1,000,000 shuffled text rows
    python -m benchmarks.plan_scale tokens300k    # (b) per-window vs global ideal, 300,000 token-id rows
    python -m benchmarks.plan_scale makespan      # (c) predicted makespan at 2 / 4 / 8 workers
    python -m benchmarks.plan_scale all --folder /tmp/plan_scale

(a) 100,000 documents of ~200 words x 10 questions, shuffled, prompted by a template over
the two columns, with the demo model's tokenizer. `batchinfer plan` runs as a child process:
its peak RSS (ru_maxrss from wait4), its wall time, and the rate of its tokenising phase
against the tokenizers library's own `encode_batch` over the same prompt texts (a sample of
`--baseline-rows` rows, in the same batch size, measured before and after the child).
(b) 30,000 documents of 32 tokens x 10 questions of 8 tokens, shuffled, as token-id
prompts: `batchinfer plan --per-window` reports today's per-window ideal beside the global one.
(c) rag, fewshot and no-sharing token-id jobs of 100,000 rows, sorted and cut with the default
unit config (token ids straight into the sort: no tokenizer); each job's units balanced over
2 / 4 / 8 workers (largest first to the least loaded): predicted makespan against the ideal
(total / N, or the largest unit).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from batchinfer.demo import DEMO_CORPUS, demo_checkpoint

REPO_ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = "{document}\n\nQuestion: {question}\nAnswer:"
WORDS = sorted(set(re.findall(r"[A-Za-z]+", DEMO_CORPUS)))
ENCODE_BATCH_ROWS = 4096  # = jobs.global_plan.spill.SPILL_WINDOW_ROWS, so both encode in the same batches


def write_job(folder: Path, input_path: Path, prompt: dict, sampling: dict, name: str = "bench",
              limit: Optional[int] = None) -> Path:
    job = {"name": name, "model": "demo", "input": str(input_path), "prompt": prompt, "sampling": sampling,
           "output": str(folder / "out" / name), "limit": limit}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"jobs": [job]}, sort_keys=False))
    return path


# ---- (a) 1,000,000 shuffled text rows ---------------------------------------------------------------

def text_documents(documents: int, words: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    vocabulary = np.array(WORDS)
    lengths = rng.integers(words - 20, words + 21, documents)
    picks = rng.integers(0, len(vocabulary), int(lengths.sum()))
    documents_text, start = [], 0
    for length in lengths:
        documents_text.append(" ".join(vocabulary[picks[start:start + length]]))
        start += length
    return documents_text


def question(doc: int, q: int) -> str:
    word = WORDS[(doc * 31 + q * 7) % len(WORDS)]
    return f"What does the text say about {word.lower()} (question {q})?"


def write_text_input(path: Path, documents: int, questions: int, words: int, seed: int = 0) -> list[str]:
    """Shuffled (document, question) rows; returns the documents (for the baseline's texts)."""
    docs = text_documents(documents, words, seed)
    order = np.random.default_rng(seed + 1).permutation(documents * questions)
    schema = pa.schema([("document", pa.string()), ("question", pa.string())])
    path.parent.mkdir(parents=True, exist_ok=True)
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, len(order), 50_000):
            chunk = order[start:start + 50_000]
            writer.write_table(pa.table({"document": [docs[i // questions] for i in chunk],
                                         "question": [question(i // questions, i % questions) for i in chunk]},
                                        schema=schema), row_group_size=50_000)
    return docs


def baseline_encode_rate(texts: list[str]) -> tuple[float, float]:
    """tokenizers' own encode_batch over `texts` in the plan's batch size: (tokens per second,
    tokens per CPU second of this process, its Rust threads included)."""
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(str(demo_checkpoint() / "tokenizer.json"))
    tokens, start, cpu_start = 0, time.perf_counter(), _cpu_seconds(os.times(), children=False)
    for first in range(0, len(texts), ENCODE_BATCH_ROWS):
        tokens += sum(len(e.ids) for e in tokenizer.encode_batch(texts[first:first + ENCODE_BATCH_ROWS]))
    seconds, cpu = time.perf_counter() - start, _cpu_seconds(os.times(), children=False) - cpu_start
    return tokens / seconds, tokens / cpu


def _cpu_seconds(times: os.times_result, children: bool) -> float:
    return times.children_user + times.children_system if children else times.user + times.system


@dataclass(frozen=True)
class ChildRun:
    seconds: float
    cpu_seconds: float     # user + system, its threads included
    max_rss_bytes: int
    returncode: int
    output: str


def run_child(args: list[str], cwd: Path) -> ChildRun:
    """Run `python -m batchinfer ARGS`, with its own peak RSS (wait4's ru_maxrss, KiB on Linux)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
           "COLUMNS": "250"}  # wide enough that no table label wraps
    log = cwd / "child.log"
    start = time.monotonic()
    with open(log, "w") as handle:
        process = subprocess.Popen([sys.executable, "-m", "batchinfer", *args], cwd=cwd, env=env, stdout=handle,
                                   stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
    return ChildRun(seconds=time.monotonic() - start, cpu_seconds=usage.ru_utime + usage.ru_stime,
                    max_rss_bytes=usage.ru_maxrss * 1024,
                    returncode=process.returncode, output=log.read_text())


def table_value(output: str, label: str) -> str:
    match = re.search(rf"{re.escape(label)}\s*│\s*([^│]+?)\s*│", output)
    return match.group(1) if match else "?"


def phase_seconds(output: str, phase: str) -> float:
    match = re.search(rf"plan: {phase} done: ([\d,]+) rows in ([\d.]+)s", output)
    return float(match.group(2)) if match else float("nan")


def bench_text(folder: Path, documents: int, questions: int, words: int, baseline_rows: int) -> dict:
    input_path = folder / "text" / "input.parquet"
    docs = write_text_input(input_path, documents, questions, words)
    job_file = write_job(folder / "text", input_path, {"template": TEMPLATE}, {"max_tokens": 64})
    # The baseline's texts: the first rows of the (shuffled) input, through the same template.
    head = pq.ParquetFile(input_path).read_row_group(0).slice(0, baseline_rows)
    texts = [TEMPLATE.format(document=d, question=q) for d, q in
             zip(head["document"].to_pylist(), head["question"].to_pylist())]
    del docs
    before = baseline_encode_rate(texts)
    # The CPU time of starting `batchinfer plan` (imports, checks) on 10 of the same rows.
    startup = run_child(["plan", str(write_job(folder / "text", input_path, {"template": TEMPLATE},
                                              {"max_tokens": 64}, name="startup", limit=10))], folder / "text")
    child = run_child(["plan", str(job_file)], folder / "text")
    after = baseline_encode_rate(texts)
    if child.returncode != 0:
        raise SystemExit(f"batchinfer plan failed:\n{child.output[-3000:]}")
    prompt_tokens = int(table_value(child.output, "prompt tokens").replace(",", ""))
    tokenise = phase_seconds(child.output, "tokenise")
    baseline = (before[0] + after[0]) / 2
    return {
        "rows": documents * questions, "documents": documents, "questions": questions, "words": words,
        "prompt_tokens": prompt_tokens,
        "ideal_cached_tokens": table_value(child.output, "ideal cached tokens"),
        "ideal_hit_rate": table_value(child.output, "ideal cache hit rate"),
        "work_units": table_value(child.output, "work units"),
        "rows_per_unit": table_value(child.output, "rows per unit (min / median / p90 / max)"),
        "peak_rss_gib": child.max_rss_bytes / 2**30,
        "wall_seconds": child.seconds,
        "tokenise_seconds": tokenise, "sort_seconds": phase_seconds(child.output, "sort"),
        "plan_tokenise_tokens_per_s": prompt_tokens / tokenise,
        "encode_batch_tokens_per_s_before": before[0], "encode_batch_tokens_per_s_after": after[0],
        "baseline_rows": len(texts),
        "tokenise_rate_vs_encode_batch": prompt_tokens / tokenise / baseline,
        # Per CPU second, less sensitive to other load on a shared machine: the plan's CPU time
        # less its start-up's; it still holds the sort and the cut, so this ratio is a lower bound.
        "plan_cpu_seconds": child.cpu_seconds, "startup_cpu_seconds": startup.cpu_seconds,
        "plan_tokens_per_cpu_s": prompt_tokens / (child.cpu_seconds - startup.cpu_seconds),
        "encode_batch_tokens_per_cpu_s": (before[1] + after[1]) / 2,
        "per_cpu_second_ratio": prompt_tokens / (child.cpu_seconds - startup.cpu_seconds)
        / ((before[1] + after[1]) / 2),
        "key_bytes": prompt_tokens * 4,
    }


# ---- token-id jobs: (b) and (c) ---------------------------------------------------------------------

def write_token_input(path: Path, prompts: list[np.ndarray]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lengths = np.array([len(p) for p in prompts], dtype=np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    values = pa.array(np.concatenate(prompts).astype(np.int32)) if prompts else pa.array([], pa.int32())
    pq.write_table(pa.table({"ids": pa.ListArray.from_arrays(pa.array(offsets), values)}), path,
                   row_group_size=65_536)


def rag_prompts(rng: np.random.Generator, documents: int, questions: int, doc_tokens: int,
                question_tokens: int, vocab: int, header: Optional[np.ndarray] = None) -> list[np.ndarray]:
    prompts = []
    for _ in range(documents):
        doc = rng.integers(3, vocab, doc_tokens)
        if header is not None:
            doc = np.concatenate([header, doc])
        for _ in range(questions):
            prompts.append(np.concatenate([doc, rng.integers(3, vocab, question_tokens)]))
    order = rng.permutation(len(prompts))
    return [prompts[i] for i in order]


def bench_tokens300k(folder: Path) -> dict:
    rng = np.random.default_rng(18)
    prompts = rag_prompts(rng, 30_000, 10, 32, 8, 1024)
    input_path = folder / "tokens300k" / "input.parquet"
    write_token_input(input_path, prompts)
    job_file = write_job(folder / "tokens300k", input_path, {"token_ids_column": "ids"}, {"max_tokens": 16})
    child = run_child(["plan", str(job_file), "--per-window"], folder / "tokens300k")
    if child.returncode != 0:
        raise SystemExit(f"batchinfer plan failed:\n{child.output[-3000:]}")
    return {"rows": len(prompts),
            "global_ideal_cached_tokens": table_value(child.output, "ideal cached tokens"),
            "global_hit_rate": table_value(child.output, "ideal cache hit rate"),
            "per_window_ideal_cached_tokens": table_value(child.output, "per-window ideal cached tokens (4,096 rows)"),
            "per_window_hit_rate": table_value(child.output, "per-window ideal cache hit rate"),
            "work_units": table_value(child.output, "work units"),
            "recomputed_root_tokens": table_value(child.output, "root tokens recomputed by split groups"),
            "wall_seconds": child.seconds, "peak_rss_gib": child.max_rss_bytes / 2**30}


MAKESPAN_JOBS = {
    # name: (prompts from a seeded generator, n, max_tokens)
    "rag": (lambda rng: rag_prompts(rng, 10_000, 10, 512, 32, 1024), 1, 64),
    "fewshot": (lambda rng: rag_prompts(rng, 100_000, 1, 0, 64, 1024, header=rng.integers(3, 1024, 1024)), 4, 128),
    "no-sharing": (lambda rng: [rng.integers(3, 1024, int(n)) for n in rng.integers(64, 1024, 100_000)], 1, 128),
}


def plan_token_prompts(prompts: list[np.ndarray], n: int, max_tokens: int, folder: Path):
    """The global plan's sort and cut over ready token ids (no tokenizer): (units, summary)."""
    from batchinfer.jobs.global_plan import SortBudget, cut_units
    from batchinfer.jobs.global_plan.external_sort import RunWriter, merge_runs
    from batchinfer.jobs.global_plan.sorted_rows import iter_profile, write_sorted_rows

    budget = SortBudget()
    writer = RunWriter(folder / "runs", budget)
    for start in range(0, len(prompts), 4096):
        batch = prompts[start:start + 4096]
        writer.add_many(range(start, start + len(batch)), [p.astype(">u4").tobytes() for p in batch],
                        [None] * len(batch))
    sorted_path = folder / "sorted.parquet"
    totals = write_sorted_rows(merge_runs(writer.finish(), folder, budget), sorted_path)
    return cut_units(lambda: iter_profile(sorted_path), totals, n, max_tokens, scratch=folder)


def bench_makespan(folder: Path, workers: tuple[int, ...] = (2, 4, 8)) -> dict:
    from batchinfer.jobs.run.executors.balance import predict_balance
    from batchinfer.jobs.global_plan.units import unit_size_quantiles

    results = {}
    for name, (make, n, max_tokens) in MAKESPAN_JOBS.items():
        prompts = make(np.random.default_rng(19))
        start = time.monotonic()
        units, summary = plan_token_prompts(prompts, n, max_tokens, folder / "makespan" / name)
        seconds = time.monotonic() - start
        del prompts
        balances = {w: predict_balance([u.cost for u in units], w) for w in workers}
        results[name] = {
            "rows": summary.rows, "samples": summary.samples, "prompt_tokens": summary.prompt_tokens,
            "ideal_cached_tokens": summary.ideal_cached_tokens, "hit_rate": summary.hit_rate,
            "units": summary.units, "rows_per_unit": unit_size_quantiles(units, "rows"),
            "recomputed_root_tokens": summary.recomputed_root_tokens, "unit_hit_rate": summary.unit_hit_rate,
            "plan_seconds": seconds,
            "balance": {w: {"makespan": b.makespan, "ideal": b.ideal, "overhead": b.overhead,
                            "loads_min_max": [min(b.loads), max(b.loads)]} for w, b in balances.items()},
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("case", choices=["text1m", "tokens300k", "makespan", "all"])
    parser.add_argument("--folder", type=Path, default=Path("/tmp/batchinfer_plan_scale"))
    parser.add_argument("--documents", type=int, default=100_000)
    parser.add_argument("--questions", type=int, default=10)
    parser.add_argument("--words", type=int, default=200)
    parser.add_argument("--baseline-rows", type=int, default=40_960)
    parser.add_argument("--json", type=Path, default=None, help="Also write the results here.")
    args = parser.parse_args()
    args.folder.mkdir(parents=True, exist_ok=True)
    demo_checkpoint()
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{platform.node()}: {os.cpu_count()} "
                     f"CPUs, {platform.processor() or platform.machine()}", "command": " ".join(sys.argv)}
    if args.case in ("text1m", "all"):
        results["text1m"] = bench_text(args.folder, args.documents, args.questions, args.words, args.baseline_rows)
    if args.case in ("tokens300k", "all"):
        results["tokens300k"] = bench_tokens300k(args.folder)
    if args.case in ("makespan", "all"):
        results["makespan"] = bench_makespan(args.folder)
    text = json.dumps(results, indent=1, default=str)
    print(text)
    if args.json:
        args.json.write_text(text)


if __name__ == "__main__":
    main()
