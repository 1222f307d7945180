"""Byte-level digest of what `batchinfer run` writes, to compare two trees (a refactor must not change it).

    python benchmarks/parts_digest.py [WORK_DIR]     # prints one line per part and per job's stats

Runs a fixed set of small CPU jobs through the CLI (`python -m batchinfer run`, a subprocess each)
on a tiny random-weight checkpoint (the demo model's shape and tokenizer, fixed seed): generate,
n > 1 samples, eval, scoring, structured output, two local workers, output in input order, and a
run killed by SIGKILL then resumed. Prints the sha256 of every output part (by name) and the
`_stats.json` without timings. The killed run's part names depend on when the kill lands, so that
job prints one digest over its rows sorted by (row_index, sample_index) and the rows' count instead.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from batchinfer.demo import DEMO_CONFIG, write_demo_tokenizer_files  # noqa: E402
from batchinfer.models.checkpoint_writer import write_random_checkpoint  # noqa: E402

DOCUMENTS = ["The river town woke early and the baker opened the shutters.",
             "Linear attention keeps a fixed-size state for every sequence, decayed by a gate.",
             "Readers may borrow up to six books for three weeks from the library."]
QUESTIONS = ["What happens first?", "Who is named?", "How long?", "Why?", "What is kept?"]
TIMING_WORDS = ("seconds", "per_second", "wall", "elapsed", "startup", "peak_", "memory", "bytes", "_at",
                "time", "host", "pid", "threads")


def rows_table(rows: int) -> pa.Table:
    docs = [DOCUMENTS[(r // len(QUESTIONS)) % len(DOCUMENTS)] for r in range(rows)]
    questions = [QUESTIONS[r % len(QUESTIONS)] + f" #{r}" for r in range(rows)]
    return pa.table({"qid": [f"q{r:04d}" for r in range(rows)], "document": docs, "question": questions,
                     "answer": ["yes" if r % 2 else "the baker" for r in range(rows)],
                     "choices": [["yes", "no", "the baker"] for _ in range(rows)],
                     "answer_index": [r % 3 for r in range(rows)]})


BASE = {"model": "ckpt", "input": "data/rows.parquet",
        "prompt": {"template": "{document}\n\nQuestion: {question}\nAnswer:"},
        "sampling": {"max_tokens": 5, "seed": 7, "ignore_eos": True},
        "engine": {"device": "cpu", "max_running": 4}}


def job(name: str, **overrides: Any) -> dict:
    entry = json.loads(json.dumps(BASE))
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(entry.get(key), dict):
            entry[key].update(value)
        else:
            entry[key] = value
    entry["name"] = name
    entry.setdefault("output", {"path": f"out/{name}", "flush_rows": 4})
    return entry


JOBS = [
    job("generate"),
    job("samples", sampling={"n": 3, "temperature": 0.8, "top_p": 0.9}),
    job("eval", eval={"answer_column": "answer", "metric": "exact_match"}),
    job("score", task="score", score={"continuations_column": "choices"}, sampling={"max_tokens": 1},
        eval={"answer_column": "answer_index", "metric": "choice_accuracy"}),
    job("structured", sampling={"choice": ["yes", "no", "maybe"], "max_tokens": 4}),
    job("workers2", parallel={"workers": 2}, output={"path": "out/workers2", "flush_rows": 3}),
    job("ordered", output={"path": "out/ordered", "flush_rows": 3, "order": "input"}),
]
RESUMED = job("resumed", sampling={"max_tokens": 24}, output={"path": "out/resumed", "flush_rows": 2})


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def without_timings(value: Any, key: str = "") -> Any:
    if key == "per_worker":  # which worker took a unit is a race: the workers as a set, unnumbered
        return sorted((without_timings({k: v for k, v in w.items() if k != "worker"}) for w in value), key=json.dumps)
    if isinstance(value, dict):
        return {k: without_timings(v, k) for k, v in sorted(value.items())
                if not any(word in k for word in TIMING_WORDS)}
    if isinstance(value, list):
        return [without_timings(v) for v in value]
    return round(value, 9) if isinstance(value, float) else value


def run_cli(folder: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchinfer", "run", "jobs.yaml", *args], cwd=folder, env=env,
                          capture_output=True, text=True)


def print_job(out: Path, name: str, parts_by_name: bool = True) -> None:
    parts = sorted(out.glob("part-*.parquet"))
    if parts_by_name:
        for part in parts:
            print(f"{name} {part.name} {sha(part)}")
    else:
        table = pa.concat_tables(pq.read_table(p) for p in parts).sort_by(
            [("row_index", "ascending"), ("sample_index", "ascending")])
        table = table.drop_columns([c for c in ("cached_tokens",) if c in table.column_names])
        keys = list(zip(table["row_index"].to_pylist(), table["sample_index"].to_pylist()))
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
        print(f"{name} rows {table.num_rows} unique {len(set(keys))} "
              f"content {hashlib.sha256(str(table.to_pylist()).encode()).hexdigest()}")
    stats = json.loads((out / "_stats.json").read_text())
    if not parts_by_name:  # a resumed run's work counters depend on where the kill landed
        stats = {k: stats.get(k) for k in ("job", "status", "rows", "samples_total", "eval")}
    print(f"{name} stats {json.dumps(without_timings(stats), sort_keys=True)}")


def main() -> None:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="parts-digest-"))
    root.mkdir(parents=True, exist_ok=True)
    ckpt = root / "ckpt"
    if not (ckpt / "model.safetensors").exists():
        write_random_checkpoint(ckpt, DEMO_CONFIG, seed=3)
        write_demo_tokenizer_files(ckpt)
    data = root / "data"
    data.mkdir(exist_ok=True)
    pq.write_table(rows_table(23), data / "rows.parquet")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
           "BATCHINFER_CACHE_DIR": str(root / "cache"), "PYTHONUNBUFFERED": "1"}
    (root / "jobs.yaml").write_text(yaml.safe_dump({"jobs": JOBS + [RESUMED]}, sort_keys=False))
    for entry in JOBS:
        done = run_cli(root, env, "--job", entry["name"], "--overwrite")
        if done.returncode != 0:
            raise SystemExit(f"{entry['name']}: exit {done.returncode}\n{done.stderr[-3000:]}")
        print_job(root / "out" / entry["name"], entry["name"])
    out = root / "out" / "resumed"
    first = subprocess.Popen([sys.executable, "-m", "batchinfer", "run", "jobs.yaml", "--job", "resumed",
                              "--overwrite"], cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while first.poll() is None and time.monotonic() < deadline and not list(out.glob("part-*.parquet")):
        time.sleep(0.01)
    killed = first.poll() is None
    if killed:
        first.send_signal(signal.SIGKILL)
    first.wait()
    done = run_cli(root, env, "--job", "resumed")
    if done.returncode != 0:
        raise SystemExit(f"resumed: exit {done.returncode}\n{done.stderr[-3000:]}")
    print(f"resumed killed_mid_run {killed}", file=sys.stderr)
    print_job(out, "resumed", parts_by_name=False)


if __name__ == "__main__":
    main()
