"""The per-window plan as a unit cutter: units of consecutive rows in input order, planned alone."""
from __future__ import annotations

import random

from batchinfer.engine.planner import plan_prompts
from batchinfer.jobs.global_plan import UnitConfig, build_work_plan, open_work_plan
from batchinfer.jobs.global_plan.windows import WindowCut
from tests.jobs.global_plan.test_global_plan import checkpoint, job_prompts, make_job, prepared, rag_rows  # noqa: F401

WINDOW = 7


def shuffled_rows() -> list[dict]:
    rows = rag_rows(6, 5)
    random.Random(1).shuffle(rows)
    rows[3]["document"] = None  # a row without a prompt
    return rows


def test_window_units_are_consecutive_rows_in_input_order_each_planned_alone(tmp_path, checkpoint):  # noqa: F811
    rows = shuffled_rows()
    job = prepared(make_job(tmp_path, checkpoint, rows))
    plan = build_work_plan(job, tmp_path / "_work", windows=WindowCut(WINDOW))
    prompts = job_prompts(job)
    starts = list(range(0, len(rows), WINDOW))
    assert [(u.start, u.rows) for u in plan.units] == [(s, min(WINDOW, len(rows) - s)) for s in starts]
    n = job.spec.sampling.n
    for unit, start in zip(plan.units, starts):
        unit_rows = plan.read_unit(unit.unit_id)
        assert sorted(r.row_index for r in unit_rows) == list(range(start, start + unit.rows))  # the window's rows
        ids = [r.token_ids for r in unit_rows if r.token_ids is not None]
        assert ids == sorted(ids)  # within a unit in token order, as the engine plans it
        assert ids == [p for p in sorted(p for p in prompts[start:start + unit.rows] if p is not None)]
        expected = plan_prompts(ids, n).theoretical_max_cached_tokens
        assert unit.ideal_cached_tokens == expected and unit.recomputed_root_tokens == 0  # no reuse across windows
    assert plan.summary.ideal_cached_tokens == plan.summary.unit_ideal_cached_tokens == \
        sum(u.ideal_cached_tokens for u in plan.units) > 0
    assert plan.summary.error_rows == 1 and plan.units[0].error_rows == 1
    assert [u.unit_id for u in open_work_plan(tmp_path / "_work").units] == [u.unit_id for u in plan.units]


def test_a_window_plan_and_a_global_plan_never_reuse_each_others_work_folder(tmp_path, checkpoint):  # noqa: F811
    job = prepared(make_job(tmp_path, checkpoint, shuffled_rows()))
    folder = tmp_path / "_work"
    windows = build_work_plan(job, folder, windows=WindowCut(WINDOW))
    assert build_work_plan(job, folder, windows=WindowCut(WINDOW)).reused_spill  # the same cut: reused
    assert not build_work_plan(job, folder, windows=WindowCut(WINDOW + 1)).reused_spill
    whole = build_work_plan(job, folder, UnitConfig(max_rows=1000, target_cost=1e12))
    assert not whole.reused_spill and len(whole.units) == 1 and len(windows.units) > 1
    assert whole.summary.ideal_cached_tokens > windows.summary.ideal_cached_tokens  # sorted across windows
    assert not build_work_plan(job, folder, windows=WindowCut(WINDOW)).reused_spill
