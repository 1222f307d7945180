"""`batchinfer plan`: what a job would reuse, from the tokenizer alone (no model loaded).

The global plan (`plan_job_globally`): every prompt of the job sorted by token ids and cut
into work units (jobs/global_plan/), with the global ideal, the units, and with `workers`
the predicted balance of the units over N workers. It writes nothing into the job's output
folder: it reuses a committed `_work/` plan made from the same input, prompt and model,
else plans into a temporary folder that is deleted afterwards.

The per-window plan (`plan_job`): prompts planned in the units `run_job(plan="window")` hands the
engine (windows of `window_rows` consecutive input rows, each planned alone), the comparison arm.
"""
from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.table import Table

from batchinfer.engine.planner import plan_prompts
from batchinfer.jobs.run.executors.balance import Balance, predict_balance
from batchinfer.jobs.global_plan import (GlobalPlanSummary, PlanningProgress, SortBudget, UnitConfig, WorkUnit, build_work_plan,
                              open_matching_plan, work_dir_for)
from batchinfer.jobs.global_plan.units import unit_size_quantiles
from batchinfer.jobs.inputs.files import iter_windows
from batchinfer.jobs.inputs.prompts import build_prompts
from batchinfer.jobs.inputs.prepared_job import PreparedJob
from batchinfer.jobs.run.runner import WINDOW_ROWS


@dataclass(frozen=True)
class JobPlan:
    job: str
    rows: int                      # input rows (after limit)
    samples: int                   # (row, sample) pairs that would run
    error_rows: int                # rows that cannot make a prompt
    prompt_tokens: int
    theoretical_max_cached_tokens: int
    shared_prefix_groups: int
    branch_points: int

    @property
    def hit_rate(self) -> float:
        return self.theoretical_max_cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def plan_job(job: PreparedJob, window_rows: int = WINDOW_ROWS) -> JobPlan:
    """Plan the job's prompts in the units of the window plan (`window_rows` input rows each, in input order)."""
    spec = job.spec
    totals = dict(rows=0, samples=0, error_rows=0, prompt_tokens=0, theoretical_max_cached_tokens=0,
                  shared_prefix_groups=0, branch_points=0)

    def add_plan(prompts: list[list[int]]) -> None:
        summary = plan_prompts(prompts, spec.sampling.n)
        totals["samples"] += summary.rows
        for key in ("prompt_tokens", "theoretical_max_cached_tokens", "shared_prefix_groups", "branch_points"):
            totals[key] += getattr(summary, key)

    pending: list[list[int]] = []
    unit = 0
    for window in iter_windows(job.inputs, window_rows, spec.limit):
        prompts = build_prompts(window.table, spec.prompt, job.tokenizer, spec.chat, spec.system, job.vocab_size,
                                id_column=spec.id_column, max_chars=job.max_prompt_chars)
        totals["rows"] += window.table.num_rows
        for row, ids in enumerate(prompts.token_ids, start=window.first_row):
            if row // window_rows != unit:  # a file's end may cut a read window short: units go by row index
                if pending:
                    add_plan(pending)
                pending, unit = [], row // window_rows
            if ids is None:
                totals["error_rows"] += 1
            else:
                pending.append(ids)
    if pending:
        add_plan(pending)
    return JobPlan(job=spec.name, **totals)


@dataclass(frozen=True)
class GlobalPlanReport:
    job: str
    summary: GlobalPlanSummary
    units: tuple[WorkUnit, ...]
    balance: Optional[Balance]       # with `workers`
    per_window: Optional[JobPlan]    # with `per_window`
    reused_work_dir: bool            # planned from the output's committed _work/ folder
    seconds: float


def plan_job_globally(job: PreparedJob, console: Optional[Console] = None, workers: Optional[int] = None,
                      per_window: bool = False, config: UnitConfig = UnitConfig(),
                      budget: SortBudget = SortBudget(), scratch_dir: Optional[Path] = None) -> GlobalPlanReport:
    """The job's global plan, writing nothing into its output folder (`scratch_dir`: where the
    temporary plan goes; the system's temporary folder when None)."""
    start = time.monotonic()
    plan = open_matching_plan(job, work_dir_for(job.spec.output.path), config)
    reused = plan is not None
    if plan is None:
        with tempfile.TemporaryDirectory(prefix="batchinfer-plan-", dir=scratch_dir) as folder:
            with PlanningProgress(console or Console(quiet=True), job.spec.name) as progress:
                plan = build_work_plan(job, Path(folder) / "_work", config, progress, budget)
    balance = predict_balance([unit.cost for unit in plan.units], workers) if workers else None
    window_plan = plan_job(job) if per_window else None
    return GlobalPlanReport(job=job.spec.name, summary=plan.summary, units=plan.units, balance=balance,
                            per_window=window_plan, reused_work_dir=reused, seconds=time.monotonic() - start)


def unit_config_with(config: UnitConfig, unit_rows: Optional[int]) -> UnitConfig:
    """`--unit-rows`: a fixed row limit per unit (and no automatic cost limit below it)."""
    if unit_rows is None:
        return config
    return replace(config, max_rows=unit_rows, min_rows=unit_rows)


def render_global_plan(console: Console, report: GlobalPlanReport) -> None:
    summary = report.summary
    table = Table(title=f"plan {report.job} (global)", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value", justify="right")
    table.add_row("rows", f"{summary.rows:,}")
    table.add_row("samples", f"{summary.samples:,}")
    table.add_row("rows without a prompt (errors)", f"{summary.error_rows:,}")
    table.add_row("prompt tokens", f"{summary.prompt_tokens:,}")
    table.add_row("ideal cached tokens", f"{summary.ideal_cached_tokens:,}")
    table.add_row("ideal cache hit rate", f"{summary.hit_rate:.1%}")
    if report.per_window is not None:
        window = report.per_window
        table.add_row(f"per-window ideal cached tokens ({WINDOW_ROWS:,} rows)",
                      f"{window.theoretical_max_cached_tokens:,}")
        table.add_row("per-window ideal cache hit rate", f"{window.hit_rate:.1%}")
    table.add_row("shared-prefix groups", f"{summary.shared_prefix_groups:,}")
    table.add_row("work units", f"{summary.units:,}")
    rows = unit_size_quantiles(report.units, "rows")
    costs = unit_size_quantiles(report.units, "cost")
    table.add_row("rows per unit (min / median / p90 / max)",
                  " / ".join(f"{rows[q]:,.0f}" for q in ("min", "median", "p90", "max")))
    table.add_row("est. cost per unit (min / median / p90 / max)",
                  " / ".join(f"{costs[q]:,.0f}" for q in ("min", "median", "p90", "max")))
    if report.units:
        largest = max(report.units, key=lambda unit: (unit.cost, -unit.unit_id))
        table.add_row("largest unit", f"#{largest.unit_id}: {largest.rows:,} rows, cost {largest.cost:,.0f}")
    table.add_row("cached tokens kept by the units", f"{summary.unit_ideal_cached_tokens:,} "
                                                      f"({summary.unit_hit_rate:.1%})")
    table.add_row("root tokens recomputed by split groups", f"{summary.recomputed_root_tokens:,}")
    table.add_row("est. total cost", f"{summary.total_cost:,.0f}")
    table.add_row("unit limits (cost / rows)", f"{summary.target_cost:,.0f} / {summary.max_unit_rows:,}")
    table.add_row("planned in", f"{report.seconds:.1f}s" + (" (reused _work/)" if report.reused_work_dir else ""))
    console.print(table)
    if report.balance is not None:
        render_balance(console, report.balance)


def render_balance(console: Console, balance: Balance) -> None:
    table = Table(title=f"predicted balance over {balance.workers} workers (largest unit first, to the least "
                        f"loaded)", title_justify="left")
    table.add_column("worker", justify="right")
    table.add_column("units", justify="right")
    table.add_column("est. cost", justify="right")
    table.add_column("of makespan", justify="right")
    for worker, (units, load) in enumerate(zip(balance.unit_counts, balance.loads)):
        share = load / balance.makespan if balance.makespan else 0.0
        table.add_row(str(worker), f"{units:,}", f"{load:,.0f}", f"{share:.1%}")
    console.print(table)
    console.print(f"predicted makespan {balance.makespan:,.0f} vs ideal {balance.ideal:,.0f} "
                  f"(max of total / {balance.workers} and the largest unit): {balance.overhead:+.1%}",
                  highlight=False, markup=False)
