"""The global planning pass: the whole job's prompts sorted by token ids, cut into work units.

    plan = build_work_plan(job, work_dir_for(job.spec.output.path))   # or open_work_plan(path) in a worker
    for unit in plan.iter_units_by_cost():          # largest estimated cost first
        rows = plan.read_unit(unit.unit_id)         # [UnitRow(row_index, token_ids | None, error | None)]

Modules, one job each: `spill` (tokenising pass into sorted runs), `external_sort` (runs and
their k-way merge in bounded memory), `sorted_rows` (the globally sorted rows on disk, with
each row's lcp), `units` (cutting them into units, costs), `windows` (the window plan's cutter:
units of consecutive rows in input order, no global sort), `store` (the work folder, its
atomic commit and reuse, `WorkPlan`), `progress`. The balance of units over N workers is the
executors' (`jobs.executors.balance`), so `plan --workers` predicts the order they dispatch in.
"""
from batchinfer.jobs.global_plan.external_sort import SortBudget
from batchinfer.jobs.global_plan.progress import NoProgress, PlanningProgress
from batchinfer.jobs.global_plan.sorted_rows import SpillTotals, UnitRow
from batchinfer.jobs.global_plan.store import (PlanNotFound, WorkPlan, build_work_plan, open_matching_plan, open_work_plan,
                                    remove_work_dir, work_dir_for)
from batchinfer.jobs.global_plan.units import DECODE_TOKEN_COST, GlobalPlanSummary, UnitConfig, WorkUnit, cut_units

__all__ = ["DECODE_TOKEN_COST", "GlobalPlanSummary", "NoProgress", "PlanNotFound", "PlanningProgress",
           "SortBudget", "SpillTotals", "UnitConfig", "UnitRow", "WorkPlan", "WorkUnit", "build_work_plan",
           "cut_units", "open_matching_plan", "open_work_plan", "remove_work_dir",
           "work_dir_for"]
