"""The planned run: plan, resume by unit, run the units.

`plan_units` is the planning pass (prompts tokenised and sorted into `_work/`, units cut, each unit's input
columns bucketed), with progress; a rerun reuses it while the input, prompt and model are unchanged. With a
`WindowCut` (`run_job(plan="window")`, a benchmark's arm) the units are windows of consecutive rows in input
order instead (`global_plan/windows.py`); the rest is the same. `prepare_units` retires unit parts of an
earlier plan that this one would rewrite and records what was done at the run's start (`unit_parts`); an
executor then runs the unfinished units (`job_executor`: `in_process` through one engine here, or
`parallel_run` on workers).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
from rich.console import Console

from batchinfer.engine.engine_build import expected_row_tokens
from batchinfer.jobs.global_plan import GlobalPlanSummary, PlanningProgress, SortBudget, UnitConfig, WorkPlan, build_work_plan
from batchinfer.jobs.inputs.prepared_job import PreparedJob
from batchinfer.jobs.outdir.resume import ResumeState
from batchinfer.jobs.global_plan.windows import WindowCut
from batchinfer.jobs.global_plan.unit_inputs import ROW_UNITS_NAME, UnitInputs, build_unit_inputs, inputs_dir_for
from batchinfer.jobs.outdir.unit_parts import retire_foreign_unit_parts, write_done_index


@dataclass(frozen=True)
class PlannedUnits:
    plan: WorkPlan
    inputs: UnitInputs
    seconds: float
    windows: Optional[WindowCut] = None  # None: the global plan


def plan_row_tokens(summary: GlobalPlanSummary) -> Optional[int]:
    """The plan's row figure for `EngineConfig.row_tokens`: KV positions a running sample holds, on average."""
    return expected_row_tokens(summary.prompt_tokens, summary.ideal_cached_tokens, summary.decode_tokens,
                               summary.samples)


def plan_units(job: PreparedJob, work_dir: Path, console: Console, config: UnitConfig = UnitConfig(),
               budget: SortBudget = SortBudget(), warn: Callable[[str], None] = lambda message: None,
               windows: Optional[WindowCut] = None) -> PlannedUnits:
    """The planning pass, shown as it goes (rows tokenised and sorted, inputs bucketed, ETA); `warn`: a
    damaged `_work/` file being rebuilt; `windows`: cut in input order, not sorted."""
    start = time.monotonic()
    with PlanningProgress(console, job.spec.name) as progress:
        plan = build_work_plan(job, work_dir, config, progress, budget, warn=warn, windows=windows)
        inputs = UnitInputs.open(plan, verify=True, warn=warn)
        if inputs is None:
            progress.phase("inputs", job.rows)
            inputs = build_unit_inputs(job, plan, on_rows=progress.advance)
    summary = plan.summary
    reused = " (reused _work/)" if plan.reused_spill else ""
    if windows is not None:  # no global sort: no global figure to show
        console.print(f"[{job.spec.name}] plan: {summary.units:,} windows of {windows.window_rows:,} rows in input "
                      f"order, {summary.unit_ideal_cached_tokens:,} cached tokens planned" + reused,
                      highlight=False, markup=False)
        return PlannedUnits(plan, inputs, time.monotonic() - start, windows)
    console.print(f"[{job.spec.name}] plan: {summary.units:,} units, global ideal {summary.ideal_cached_tokens:,} "
                  f"cached tokens ({summary.hit_rate:.1%}), {summary.recomputed_root_tokens:,} root tokens "
                  f"recomputed by split groups" + reused,
                  highlight=False, markup=False)
    return PlannedUnits(plan, inputs, time.monotonic() - start)


def row_units(planned: PlannedUnits) -> np.ndarray:
    """The unit of every input row (memory-mapped)."""
    return np.load(inputs_dir_for(planned.plan) / ROW_UNITS_NAME, mmap_mode="r")


def prepare_units(job: PreparedJob, planned: PlannedUnits, out_dir: Path, resume: ResumeState) -> list[int]:
    """Before any unit runs (holding the folder's lock): retire unit parts of another plan that this one
    would rewrite, record what is done by unit; → the unfinished units, largest estimated cost first."""
    spec = job.spec
    retire_foreign_unit_parts(out_dir, planned.plan, resume.parts, resume.done, spec.sampling.n,
                              spec.output.flush_rows, resume.next_part)
    units_of_rows = row_units(planned)
    write_done_index(planned.plan.work_dir, units_of_rows, resume.done)
    n = spec.sampling.n
    done_per_unit = np.zeros(len(planned.plan.units), dtype=np.int64)
    rows = np.fromiter((row for row in resume.done if row < len(units_of_rows)), dtype=np.int64)
    if len(rows):
        counts = np.fromiter((len(resume.done[row]) for row in rows), dtype=np.int64)
        np.add.at(done_per_unit, units_of_rows[rows], counts)
    return [unit.unit_id for unit in planned.plan.iter_units_by_cost()
            if done_per_unit[unit.unit_id] < unit.rows * n]


def plan_stats(planned: PlannedUnits) -> dict[str, Any]:
    """The plan's numbers for `_stats.json`, beside the achieved cached tokens."""
    summary = planned.plan.summary
    if planned.windows is not None:  # the windows' own plan: no global ideal was computed
        return {"mode": "window", "window_rows": planned.windows.window_rows, "units": summary.units,
                "prompt_tokens": summary.prompt_tokens, "unit_ideal_cached_tokens": summary.unit_ideal_cached_tokens,
                "shared_prefix_groups": summary.shared_prefix_groups, "reused_work_dir": planned.plan.reused_spill,
                "planning_seconds": planned.seconds}
    return {"mode": "global", "units": summary.units, "prompt_tokens": summary.prompt_tokens,
            "global_ideal_cached_tokens": summary.ideal_cached_tokens, "global_ideal_hit_rate": summary.hit_rate,
            "unit_ideal_cached_tokens": summary.unit_ideal_cached_tokens,
            "recomputed_root_tokens": summary.recomputed_root_tokens, "shared_prefix_groups":
                summary.shared_prefix_groups, "reused_work_dir": planned.plan.reused_spill,
            "planning_seconds": planned.seconds}
