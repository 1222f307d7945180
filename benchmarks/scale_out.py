"""Scale-out of `batchinfer run` over N engines: wall time, throughput, reuse and balance per N.

    python -m benchmarks.scale_out                       # one GPU: workers 1 and 2 on it (half the memory each)
    python -m benchmarks.scale_out --spread --workers 1,2,4,8   # one engine per GPU (issue 20)
    python -m benchmarks.scale_out --smoke               # CPU, tiny preset: the same path in about a minute

Each run is a real `python -m batchinfer run jobs.yaml` process (planning pass, units, worker
processes for N > 1, parts, `_stats.json`) over the same shuffled job, so the runs can be compared
row by row. Model: the `--preset` (qwen3.5-27b) shapes with `--layers` layers and random weights,
written once as a checkpoint (config.json + safetensors, the demo's tokenizer) into the work folder:
a job names a checkpoint folder, not a preset. Prompts are random token ids (`prompt.token_ids_column`),
`ignore_eos`, so every sample generates exactly `--output-tokens`.

Workloads (the shapes of `engine_arms.py`, scaled by the largest N so that every engine gets at
least four full batches): rag (8·N documents of 2048 tokens × 32 questions of 128), fewshot (32·N
prefixes of 512 × 8 of 128), control (256·N prompts of 640 unique tokens).

Reported per run: job wall time (`_stats.json`: planning, model load and generation), prompt /
output tokens per second over it, output throughput per GPU relative to N = 1, cached tokens
against the global ideal, the slowest worker's load seconds (worker processes start and load in
parallel, inside the wall), the largest idle tail as a share of the wall (from the last unit a
worker finished to the job's last), each worker's load / busy seconds, peak memory per GPU
(nvidia-smi) and per engine (the engine's own figure). Checked across the N: the same (row, sample) set with the same
prompt, cached and completion token counts, and cached tokens = the plan's global ideal; the share
of samples with identical generated tokens is printed (bf16 kernels at other batch shapes may flip
a near-tie of random weights; the fp32 `--smoke` run must match exactly). Exit 1 when a check fails.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from benchmarks.bench_utils import print_table as print_rows
from benchmarks.engine_arms import Workload  # the same shuffled shared-prefix workloads

REPO_ROOT = Path(__file__).resolve().parents[1]


def workloads(engines: int, smoke: bool) -> dict[str, Workload]:
    if smoke:  # 64 rows per engine: one default-size unit (64 rows) each
        return {"rag": Workload("rag", 8 * engines, 8, 24, 6), "fewshot": Workload("fewshot", 16 * engines, 4, 12, 6),
                "control": Workload("control", 64 * engines, 1, 0, 18)}
    return {"rag": Workload("rag", 8 * engines, 32, 2048, 128),
            "fewshot": Workload("fewshot", 32 * engines, 8, 512, 128),
            "control": Workload("control", 256 * engines, 1, 0, 640)}


def write_checkpoint(folder: Path, preset: str, layers: Optional[int], dtype: str) -> tuple[Path, int]:
    """The preset's shapes with random weights as a checkpoint folder a job can name; → (folder, vocab)."""
    import torch

    from batchinfer.demo import write_demo_tokenizer_files
    from batchinfer.models.checkpoint_writer import write_random_checkpoint
    from batchinfer.models.presets import PRESETS

    config = dict(PRESETS[preset])
    if layers:
        config["num_hidden_layers"] = layers
    if not (folder / "model.safetensors").is_file():
        start = time.monotonic()
        write_random_checkpoint(folder, config, dtype=torch.bfloat16 if dtype == "bfloat16" else torch.float32)
        write_demo_tokenizer_files(folder)  # prompts are token ids: the tokenizer only decodes (unknown ids: nothing)
        print(f"checkpoint: {preset}, {config['num_hidden_layers']} layers, {dtype}, "
              f"{(folder / 'model.safetensors').stat().st_size / 2**30:.1f} GiB written in "
              f"{time.monotonic() - start:.0f} s", flush=True)
    return folder, int(config["vocab_size"])


class GpuMemorySampler:
    """Peak memory.used per GPU from nvidia-smi while a run goes on ({} without nvidia-smi)."""

    def __init__(self, interval_ms: int = 200) -> None:
        self.interval_ms = interval_ms
        self.peak_mib: dict[int, float] = {}
        self._process: Optional[subprocess.Popen] = None
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "GpuMemorySampler":
        if shutil.which("nvidia-smi"):
            self._process = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits",
                 "-lms", str(self.interval_ms)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self._thread = threading.Thread(target=self._read, daemon=True)
            self._thread.start()
        return self

    def _read(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            parts = [p.strip() for p in line.split(",")]
            try:
                index, used = int(parts[0]), float(parts[1])
            except (IndexError, ValueError):
                continue
            self.peak_mib[index] = max(self.peak_mib.get(index, 0.0), used)

    def __exit__(self, *exc: object) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait()
        if self._thread is not None:
            self._thread.join(timeout=5)


@dataclass(frozen=True)
class RunResult:
    workload: str
    workers: int
    gpus: int                  # GPUs the engines used (1 when they share one)
    wall_seconds: float        # the whole `batchinfer run` process
    stats: dict[str, Any]
    outputs: pa.Table
    gpu_peak_mib: dict[int, float]


def run_job(folder: Path, workload: str, checkpoint: Path, data: Path, workers: int, args: argparse.Namespace
            ) -> RunResult:
    """One `batchinfer run` of the workload with `workers` engines, in its own folder."""
    folder.mkdir(parents=True, exist_ok=True)
    device = "cpu" if args.smoke else "auto" if args.spread else "cuda:0"
    job = {"name": workload, "model": str(checkpoint), "input": str(data), "prompt": {"token_ids_column": "ids"},
           "sampling": {"max_tokens": args.output_tokens, "ignore_eos": True, "temperature": 0.0},
           "engine": {"device": device, "dtype": "float32" if args.smoke else "bfloat16",
                      "max_running": args.max_running, "memory_fraction": args.memory_fraction},
           "output": {"path": "out"}, "parallel": {"workers": workers}}
    (folder / "jobs.yaml").write_text(yaml.safe_dump({"jobs": [job]}, sort_keys=False))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    start = time.monotonic()
    with open(folder / "run.log", "w") as log, GpuMemorySampler() as memory:
        done = subprocess.run([sys.executable, "-m", "batchinfer", "run", "jobs.yaml", "--overwrite"], cwd=folder,
                              env=env, stdout=log, stderr=subprocess.STDOUT)
    wall = time.monotonic() - start
    if done.returncode != 0:
        tail = (folder / "run.log").read_text().splitlines()[-15:]
        raise RuntimeError(f"{workload} with {workers} workers exited {done.returncode}:\n" + "\n".join(tail))
    stats = json.loads((folder / "out" / "_stats.json").read_text())
    outputs = pq.read_table(folder / "out", columns=["row_index", "sample_index", "output_token_ids",
                                                    "prompt_tokens", "cached_tokens", "completion_tokens"])
    gpus = 1 if args.smoke or not args.spread else min(workers, max(len(memory.peak_mib), 1))
    return RunResult(workload, workers, gpus, wall, stats, outputs, dict(memory.peak_mib))


def by_sample(outputs: pa.Table) -> dict[tuple[int, int], tuple]:
    rows = outputs.to_pylist()
    return {(r["row_index"], r["sample_index"]): (tuple(r["output_token_ids"]), r["prompt_tokens"],
                                                  r["cached_tokens"], r["completion_tokens"]) for r in rows}


def compare(runs: list[RunResult], exact: bool) -> list[str]:
    """What differs between the runs of one workload (empty: nothing), and the reuse check."""
    problems = []
    base = by_sample(runs[0].outputs)
    for run in runs:
        plan = run.stats.get("plan", {})
        if run.stats["cached_tokens"] != plan.get("global_ideal_cached_tokens"):
            problems.append(f"{run.workload} N={run.workers}: cached {run.stats['cached_tokens']:,} != global ideal "
                            f"{plan.get('global_ideal_cached_tokens')}")
        if run is runs[0]:
            continue
        other = by_sample(run.outputs)
        if other.keys() != base.keys() or run.outputs.num_rows != len(other):
            problems.append(f"{run.workload} N={run.workers}: not the same (row, sample) set as N={runs[0].workers}")
            continue
        counts = [key for key in base if base[key][1:] != other[key][1:]]
        if counts:
            problems.append(f"{run.workload} N={run.workers}: {len(counts)} samples with other prompt / cached / "
                            f"completion token counts than N={runs[0].workers}, e.g. row {counts[0]}")
        same = sum(base[key][0] == other[key][0] for key in base)
        print(f"{run.workload} N={run.workers}: {same}/{len(base)} samples generate the same tokens as "
              f"N={runs[0].workers}", flush=True)
        if exact and same != len(base):
            problems.append(f"{run.workload} N={run.workers}: generations differ from N={runs[0].workers} (fp32)")
    return problems


def idle_tail_share(run: RunResult) -> float:
    workers = run.stats.get("executor", {}).get("per_worker", [])
    return max((w["idle_tail_seconds"] for w in workers), default=0.0) / max(run.stats["wall_seconds"], 1e-9)


def scale_line(run: RunResult, base: RunResult) -> str:
    """One table line: `run` against `base`, its workload's run with the fewest workers."""
    stats = run.stats
    per_gpu = stats["output_tokens_per_second"] / run.gpus
    relative = per_gpu / (base.stats["output_tokens_per_second"] / base.gpus)
    ideal = stats.get("plan", {}).get("global_ideal_cached_tokens", 0)
    gpu_peak = "/".join(f"{mib / 1024:.1f}" for _, mib in sorted(run.gpu_peak_mib.items())) or "-"
    workers = stats.get("executor", {}).get("per_worker", [])
    engine_peak = max((w.get("peak_memory_bytes", 0) for w in workers), default=stats.get("peak_memory_bytes", 0))
    load = f"{max(w['load_seconds'] for w in workers):.1f}" if workers else "-"  # N = 1 loads in the job's wall
    return (f"{run.workload:<9} {run.workers:>2} {run.gpus:>4} {stats['wall_seconds']:>8.1f} "
            f"{stats['prompt_tokens_per_second']:>13,.0f} {stats['output_tokens_per_second']:>13,.0f} "
            f"{relative:>14.3f} {stats['cached_tokens']:>11,} / {ideal:<9,} {load:>6} {idle_tail_share(run):>9.1%} "
            f"{gpu_peak:>14} {engine_peak / 2**30:>15.2f}")


def print_table(results: list[RunResult]) -> None:
    first = {r.workload: r for r in results if r.workers == min(x.workers for x in results if x.workload == r.workload)}
    header = (f"{'workload':<9} {'N':>2} {'GPUs':>4} {'wall s':>8} {'prompt tok/s':>13} {'output tok/s':>13} "
              f"{'per GPU vs N=1':>14} {'cached / ideal':>23} {'load s':>6} {'idle tail':>9} {'GPU peak GiB':>14} "
              f"{'engine peak GiB':>15}")
    print_rows(header, [scale_line(run, first[run.workload]) for run in results])
    print()
    for run in results:
        for w in run.stats.get("executor", {}).get("per_worker", []):
            print(f"{run.workload} N={run.workers} worker {w['worker']} ({w['device']}): {w['units']} units, "
                  f"{w['samples']} samples, load {w['load_seconds']:.1f} s, busy {w['busy_seconds']:.1f} s, "
                  f"idle tail {w['idle_tail_seconds']:.1f} s, restarts {w['restarts']}")


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,2", help="engine counts to run, e.g. 1,2,4,8")
    parser.add_argument("--workloads", default=None, help="rag,fewshot,control (default: all; --smoke: rag)")
    parser.add_argument("--spread", action="store_true", help="one engine per GPU (default: all on GPU 0)")
    parser.add_argument("--preset", default=None, help="model shapes (default qwen3.5-27b; --smoke: tiny)")
    parser.add_argument("--layers", type=int, default=None,
                        help="layers of the preset (default 8; --smoke: the preset's)")
    parser.add_argument("--output-tokens", type=int, default=None, help="per sample (default 64; --smoke: 4)")
    parser.add_argument("--max-running", type=int, default=None, help="engine.max_running (default 256; --smoke: 8)")
    parser.add_argument("--memory-fraction", type=float, default=0.9, help="of each GPU, split by engines sharing it")
    parser.add_argument("--folder", type=Path, default=None, help="work folder (default: a temporary one, deleted)")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny preset, fp32: generations must match exactly")
    args = parser.parse_args(argv)
    args.worker_counts = sorted({int(n) for n in args.workers.split(",")})
    args.workload_names = (args.workloads or ("rag" if args.smoke else "rag,fewshot,control")).split(",")
    args.preset = args.preset or ("tiny" if args.smoke else "qwen3.5-27b")
    args.layers = args.layers if args.layers is not None else (None if args.smoke else 8)
    args.output_tokens = args.output_tokens or (4 if args.smoke else 64)
    args.max_running = args.max_running or (8 if args.smoke else 256)
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    folder = args.folder or Path(tempfile.mkdtemp(prefix="batchinfer-scale-out-"))
    try:
        checkpoint, vocab = write_checkpoint(folder / "checkpoint", args.preset, args.layers,
                                             "float32" if args.smoke else "bfloat16")
        shapes = workloads(max(args.worker_counts), args.smoke)
        results: list[RunResult] = []
        problems: list[str] = []
        for name in args.workload_names:
            workload = shapes[name]
            data = folder / name / "data.parquet"
            data.parent.mkdir(parents=True, exist_ok=True)
            prompts = workload.prompts(vocab)
            pq.write_table(pa.table({"ids": pa.array(prompts, pa.list_(pa.int32()))}), data)
            print(f"{name}: {len(prompts):,} rows, {sum(map(len, prompts)):,} prompt tokens, "
                  f"{args.output_tokens} output tokens each", flush=True)
            runs = []
            for workers in args.worker_counts:
                run = run_job(folder / name / f"w{workers}", name, checkpoint, data, workers, args)
                print(f"{name} N={workers}: {run.wall_seconds:.1f} s", flush=True)
                runs.append(run)
            problems += compare(runs, exact=args.smoke)
            results += runs
        print()
        print_table(results)
        for problem in problems:
            print(f"CHECK FAILED: {problem}")
        return 1 if problems else 0
    finally:
        if args.folder is None:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
