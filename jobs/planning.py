"""`batchinfer plan`: what a job would reuse, from the tokenizer alone (no model loaded).

Prompts are planned in the same windows of requests `run` hands to the engine (on a fresh
run), so the ideal printed here is the run's ideal; reuse across windows through the prefix
cache comes on top.
"""
from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from batchinfer.engine.planner import plan_prompts
from jobs.inputs import iter_windows
from jobs.prompts import build_prompts
from jobs.prepare import PreparedJob
from jobs.runner import WINDOW_ROWS


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
    """Plan the job's prompts in the windows the engine will plan them in (`window_rows` requests)."""
    spec = job.spec
    totals = dict(rows=0, samples=0, error_rows=0, prompt_tokens=0, theoretical_max_cached_tokens=0,
                  shared_prefix_groups=0, branch_points=0)

    def add_plan(prompts: list[list[int]]) -> None:
        summary = plan_prompts(prompts, spec.sampling.n)
        totals["samples"] += summary.rows
        for key in ("prompt_tokens", "theoretical_max_cached_tokens", "shared_prefix_groups", "branch_points"):
            totals[key] += getattr(summary, key)

    pending: list[list[int]] = []
    for window in iter_windows(job.inputs, window_rows, spec.limit):
        prompts = build_prompts(window.table, spec.prompt, job.tokenizer, spec.chat, spec.system, job.vocab_size)
        good = [ids for ids in prompts.token_ids if ids is not None]
        totals["rows"] += window.table.num_rows
        totals["error_rows"] += window.table.num_rows - len(good)
        pending.extend(good)
        while len(pending) >= window_rows:
            add_plan(pending[:window_rows])
            pending = pending[window_rows:]
    if pending:
        add_plan(pending)
    return JobPlan(job=spec.name, **totals)


def render_plan(console: Console, plan: JobPlan) -> None:
    table = Table(title=f"plan {plan.job}", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value", justify="right")
    table.add_row("rows", f"{plan.rows:,}")
    table.add_row("samples", f"{plan.samples:,}")
    table.add_row("rows without a prompt (errors)", f"{plan.error_rows:,}")
    table.add_row("prompt tokens", f"{plan.prompt_tokens:,}")
    table.add_row("ideal cached tokens", f"{plan.theoretical_max_cached_tokens:,}")
    table.add_row("ideal cache hit rate", f"{plan.hit_rate:.1%}")
    table.add_row("shared-prefix groups", f"{plan.shared_prefix_groups:,}")
    table.add_row("planned branch points", f"{plan.branch_points:,}")
    console.print(table)
