"""What bucketing the units' input columns costs, beside the planning pass it follows (CPU, no model).

    python -m benchmarks.unit_inputs_scale [--documents 10000] [--questions 10] [--words 200]

The shape of `benchmarks/plan_scale.py text1m` scaled down (default 10,000 documents of ~200
words x 10 questions, shuffled, the demo tokenizer): in a child process, `build_work_plan`
(tokenise, sort, cut) and then `build_unit_inputs` (one streaming pass over the input into
buckets), each phase's wall time and the child's peak RSS after it; then the bytes on disk,
and what reading one unit's inputs costs against reading the whole input once.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, resource, sys, time
from pathlib import Path
import pyarrow.parquet as pq
from batchinfer.jobs.global_plan import build_work_plan, work_dir_for
from batchinfer.jobs.run.prepare import prepare_job
from batchinfer.jobs.spec.job_file import load_job_file
from batchinfer.jobs.global_plan.unit_inputs import build_unit_inputs, inputs_dir_for

def rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

job = prepare_job(load_job_file(Path(sys.argv[1])).jobs[0], overwrite=True)
work = work_dir_for(job.spec.output.path)
start = time.perf_counter()
plan = build_work_plan(job, work)
plan_seconds, plan_rss = time.perf_counter() - start, rss()
start = time.perf_counter()
inputs = build_unit_inputs(job, plan)
inputs_seconds, inputs_rss = time.perf_counter() - start, rss()
folder = inputs_dir_for(plan)
reads = []
for unit in list(plan.iter_units_by_cost())[:20]:
    start = time.perf_counter()
    table = inputs.read(unit.unit_id)
    reads.append((time.perf_counter() - start, table.num_rows))
start = time.perf_counter()
whole = sum(pq.read_table(path).num_rows for path in job.inputs.paths)
whole_seconds = time.perf_counter() - start
print(json.dumps({
    "rows": job.rows, "units": len(plan.units), "buckets": len(list(folder.glob("bucket-*.parquet"))),
    "plan_seconds": plan_seconds, "plan_peak_rss_bytes": plan_rss,
    "inputs_seconds": inputs_seconds, "inputs_peak_rss_bytes": inputs_rss,
    "input_bytes": sum(p.stat().st_size for p in job.inputs.paths),
    "bucket_bytes": sum(p.stat().st_size for p in folder.iterdir()),
    "unit_read_seconds_mean": sum(s for s, _ in reads) / len(reads), "unit_rows_mean": sum(r for _, r in reads) / len(reads),
    "whole_input_read_seconds": whole_seconds,
}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=10_000)
    parser.add_argument("--questions", type=int, default=10)
    parser.add_argument("--words", type=int, default=200)
    parser.add_argument("--folder", type=Path, default=None)
    args = parser.parse_args()
    from benchmarks.plan_scale import TEMPLATE, write_job, write_text_input
    from batchinfer.demo import demo_checkpoint

    demo_checkpoint()
    folder = args.folder or Path(tempfile.mkdtemp(prefix="unit-inputs-"))
    start = time.perf_counter()
    input_path = folder / "input.parquet"
    write_text_input(input_path, args.documents, args.questions, args.words)
    job_file = write_job(folder, input_path, {"template": TEMPLATE}, {"max_tokens": 32})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    child = subprocess.run([sys.executable, "-c", CHILD, str(job_file)], env=env, capture_output=True, text=True,
                           check=True)
    result = json.loads(child.stdout.strip().splitlines()[-1])
    result["inputs_over_plan"] = result["inputs_seconds"] / result["plan_seconds"]
    result["data_seconds"] = time.perf_counter() - start
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
