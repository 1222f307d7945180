"""The per-window plan as a unit cutter: units of `window_rows` consecutive rows, in input order.

No global sort and no reuse planned across windows: unit k holds input rows k x window_rows ..
(k + 1) x window_rows - 1, sorted by token ids within the unit (the order the engine plans a unit
in anyway), each row's lcp taken with the row before in the same unit only. So `sorted.parquet`
holds (window, key, row_index) order, its totals are the windows' own ideal, and the store, the
unit inputs, resume by unit and every executor treat these units as they treat the global plan's.
Memory holds one window's keys.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np

from batchinfer.jobs.global_plan.external_sort import SortedRow
from batchinfer.jobs.global_plan.keys import encode_key
from batchinfer.jobs.global_plan.sorted_rows import SpillTotals, row_group_rows_for, write_sorted_rows
from batchinfer.jobs.global_plan.spill import SPILL_WINDOW_ROWS, prompt_batches
from batchinfer.jobs.global_plan.unique_ids import IdHashes
from batchinfer.jobs.global_plan.units import GlobalPlanSummary, WorkUnit, units_from_starts
from batchinfer.jobs.inputs.prepared_job import PreparedJob


@dataclass(frozen=True)
class WindowCut:
    """Cut the job in input order into units of `window_rows` rows (the benchmarks' per-window arm)."""

    window_rows: int

    def __post_init__(self) -> None:
        if self.window_rows < 1:
            raise ValueError("window_rows must be >= 1")

    def fingerprint(self) -> dict[str, Any]:
        """What makes its sorted rows differ from the global plan's (and from another window size's)."""
        return {"mode": "window", "window_rows": self.window_rows}


def rows_by_window(job: PreparedJob, window_rows: int, on_rows: Callable[[int, int], None],
                   ids: Optional[IdHashes] = None, tokenise_rows: int = SPILL_WINDOW_ROWS) -> Iterator[SortedRow]:
    """Every row of the job as (key, row_index, error), window by window in input order, sorted by
    (key, row_index) within its window; `on_rows(rows, tokens)` per tokenised batch."""
    pending: list[SortedRow] = []
    window = 0
    for batch, prompts in prompt_batches(job, tokenise_rows):
        if ids is not None:
            ids.add(batch.table[job.spec.id_column])
        tokens = 0
        for offset, (token_ids, error) in enumerate(zip(prompts.token_ids, prompts.errors)):
            row = batch.first_row + offset
            if row // window_rows != window:
                yield from sorted(pending)
                pending, window = [], row // window_rows
            key = b"" if token_ids is None else encode_key(token_ids)
            tokens += len(key) // 4
            pending.append((key, row, error))
        on_rows(batch.table.num_rows, tokens)
    yield from sorted(pending)


def write_window_rows(job: PreparedJob, cut: WindowCut, path: Path, on_rows: Callable[[int, int], None],
                      ids: Optional[IdHashes] = None) -> SpillTotals:
    """`sorted.parquet` of the window plan at `path`; → its totals (the windows' own ideal)."""
    return write_sorted_rows(rows_by_window(job, cut.window_rows, on_rows, ids), path,
                             row_group_rows=row_group_rows_for(job.rows), restart_every=cut.window_rows)


def cut_windows(profile: Callable[[], Iterator[tuple[np.ndarray, np.ndarray]]], totals: SpillTotals, n: int,
                max_tokens: int, cut: WindowCut,
                decode_token_cost: float) -> tuple[tuple[WorkUnit, ...], GlobalPlanSummary]:
    """One unit per window of the rows `write_window_rows` wrote (nothing recomputed at a cut: no reuse
    was planned across it)."""
    starts = list(range(0, totals.rows, cut.window_rows))
    units, groups = units_from_starts(profile(), starts, totals.rows, n, max_tokens, decode_token_cost)
    ideal = sum(unit.ideal_cached_tokens for unit in units)
    summary = GlobalPlanSummary(
        rows=totals.rows, error_rows=totals.error_rows, samples=n * totals.prompt_rows,
        prompt_tokens=n * totals.prompt_tokens, ideal_cached_tokens=ideal, shared_prefix_groups=groups,
        units=len(units), unit_ideal_cached_tokens=ideal, recomputed_root_tokens=0,
        decode_tokens=sum(u.decode_tokens for u in units), total_cost=float(sum(u.cost for u in units)),
        target_cost=max((u.cost for u in units), default=0.0), max_unit_rows=cut.window_rows)
    return tuple(units), summary


__all__ = ["WindowCut", "cut_windows", "rows_by_window", "write_window_rows"]
