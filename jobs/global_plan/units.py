"""Cutting the globally sorted rows into work units, and what each unit costs.

A unit is a contiguous range of the sorted order. Cutting before sorted row b loses
exactly that row's reuse, d_b = min(lcp_b, len_b - 1) tokens: the unit it starts
recomputes them (a shared root computed once more). So a cut between prefix groups is
free, and a group larger than a unit can only be cut inside, below its shared root. The
cut is a shortest path over boundaries (a dynamic program with a sliding-window minimum):
every unit at most `max_rows` rows and `target_cost` estimated cost, minimising the
recomputed tokens; among equally cheap unit starts the earliest wins (each unit as large as
its limits allow), which leaves as few units as the cheapest cut allows (the tests check both
against every partition of small inputs). That keeps every group that fits a unit
whole, packs small groups together, and splits a larger group only at its root's
children, as few times as possible.

Cost model, in units of one uncached prompt token: a unit costs its uncached prefill
tokens plus `decode_token_cost` per decode token (n x max_tokens per prompt row, an upper
bound). The default 1.25 is the ratio measured on the H200 for qwen3.5-27b in bf16:
about 9,600 uncached prompt tokens/s against 7,800 decode tokens/s at a full decode batch
(docs/BENCHMARKS.md, issue-5 table).
"""
from __future__ import annotations

import array
import tempfile
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

import numpy as np

from batchinfer.jobs.global_plan.sorted_rows import SpillTotals

DECODE_TOKEN_COST = 1.25


@dataclass(frozen=True)
class UnitConfig:
    max_rows: int = 4096                # rows a unit holds at most (the engine plans a unit as one window)
    target_cost: Optional[float] = None  # estimated cost a unit holds at most; None: from the job's total
    units_goal: int = 256               # automatic target: total cost / units_goal ...
    min_rows: int = 64                  # ... but at least the cost of min_rows average rows
    decode_token_cost: float = DECODE_TOKEN_COST

    def __post_init__(self) -> None:
        if self.max_rows < 1 or self.units_goal < 1 or self.min_rows < 1:
            raise ValueError("max_rows, units_goal and min_rows must be >= 1")
        if self.target_cost is not None and not self.target_cost > 0:
            raise ValueError("target_cost must be > 0")
        if not self.decode_token_cost >= 0:
            raise ValueError("decode_token_cost must be >= 0")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class WorkUnit:
    unit_id: int
    start: int                   # position of its first row in the sorted order
    rows: int                    # input rows, error rows included
    error_rows: int              # rows without a prompt (the runner records them as errors)
    samples: int                 # (row, sample) pairs for the engine: prompt rows x n
    prompt_tokens: int           # Σ over its samples
    ideal_cached_tokens: int     # make_plan over its own rows: what the engine reuses running it alone
    recomputed_root_tokens: int  # reuse its first row loses to the cut before it (0 between groups)
    decode_tokens: int           # samples x max_tokens (an upper bound)
    cost: float                  # uncached prompt tokens + decode_token_cost x decode_tokens

    @property
    def stop(self) -> int:
        return self.start + self.rows

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class GlobalPlanSummary:
    rows: int
    error_rows: int
    samples: int
    prompt_tokens: int               # Σ over samples
    ideal_cached_tokens: int         # the global ideal: Σ over all sorted prompts of min(lcp, len - 1)
    shared_prefix_groups: int        # as make_plan counts them over all prompts at once
    units: int
    unit_ideal_cached_tokens: int    # Σ over units = ideal_cached_tokens - recomputed_root_tokens
    recomputed_root_tokens: int      # reuse lost where a group was split between units
    decode_tokens: int
    total_cost: float
    target_cost: float               # the unit cost limit used
    max_unit_rows: int

    @property
    def hit_rate(self) -> float:
        return self.ideal_cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def unit_hit_rate(self) -> float:
        return self.unit_ideal_cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate, "unit_hit_rate": self.unit_hit_rate}


@dataclass(frozen=True)
class _RowQuantities:
    """Per-row quantities of one batch of the sorted profile (int64 arrays unless noted)."""

    prompt: np.ndarray        # bool: a prompt row (not an error row)
    tokens: np.ndarray        # prompt length
    reuse_first: np.ndarray   # d = min(lcp, len - 1): the first sample's reuse, and the cost of a cut before it
    reuse: np.ndarray         # d + (n - 1)(len - 1): every sample's reuse
    cost: np.ndarray          # float64: the row's estimated cost with its predecessor in the same unit


def _row_quantities(lcp: np.ndarray, tokens: np.ndarray, n: int, max_tokens: int,
                    decode_token_cost: float) -> _RowQuantities:
    prompt = tokens > 0
    reuse_first = np.where(prompt, np.clip(np.minimum(lcp, tokens - 1), 0, None), 0)
    reuse = reuse_first + (n - 1) * np.where(prompt, np.clip(tokens - 1, 0, None), 0)
    cost = (n * tokens - reuse) + decode_token_cost * np.where(prompt, n * max_tokens, 0)
    return _RowQuantities(prompt, tokens, reuse_first, reuse, cost.astype(np.float64))


def total_cost(totals: SpillTotals, n: int, max_tokens: int, decode_token_cost: float) -> float:
    uncached = n * totals.prompt_tokens - totals.ideal_cached_tokens(n)
    return float(uncached + decode_token_cost * n * max_tokens * totals.prompt_rows)


def resolve_target_cost(config: UnitConfig, totals: SpillTotals, n: int, max_tokens: int) -> float:
    """The unit cost limit: as configured, else enough units to balance over many workers."""
    if config.target_cost is not None:
        return float(config.target_cost)
    total = total_cost(totals, n, max_tokens, config.decode_token_cost)
    average_row = total / totals.rows if totals.rows else 1.0
    return max(total / config.units_goal, config.min_rows * average_row, 1e-9)


class _Predecessors:
    """The best unit start for every boundary, spilled to a scratch file in blocks (bounded memory)."""

    BLOCK = 1 << 20

    def __init__(self, scratch: Path) -> None:
        self._path = scratch / "predecessors.i64"
        self._file = open(self._path, "wb")
        self._block = array.array("q")

    def append(self, value: int) -> None:
        self._block.append(value)
        if len(self._block) == self.BLOCK:
            self._block.tofile(self._file)
            self._block = array.array("q")

    def backtrack(self, end: int) -> list[int]:
        """Unit starts of the best path to boundary `end`, ascending."""
        self._block.tofile(self._file)
        self._file.close()
        starts: list[int] = []
        cached_block, values = -1, np.empty(0, dtype=np.int64)
        boundary = end
        while boundary > 0:
            index = boundary - 1  # predecessors are logged for boundaries 1 .. end
            block = index // self.BLOCK
            if block != cached_block:
                values = np.fromfile(self._path, dtype=np.int64, count=self.BLOCK, offset=block * self.BLOCK * 8)
                cached_block = block
            boundary = int(values[index - block * self.BLOCK])
            starts.append(boundary)
        self._path.unlink()
        return starts[::-1]


def _cut_starts(profile: Iterable[tuple[np.ndarray, np.ndarray]], n: int, max_tokens: int, config: UnitConfig,
                target: float, scratch: Path) -> list[int]:
    """Unit starts (sorted positions) of the cheapest cut; see the module docstring."""
    predecessors = _Predecessors(scratch)
    window: deque[tuple[int, int]] = deque()     # (start a, path cost g(a)): g ascending, the earliest kept on ties
    prefix: deque[tuple[int, float]] = deque()   # (a, Σ cost of rows before a) for a not yet too far back
    path_cost = 0          # best cost of a cut ending at the current boundary, before its own cut
    spent = 0.0            # Σ cost of the rows seen
    row = 0
    max_rows = config.max_rows
    for lcp, tokens in profile:
        rows = _row_quantities(lcp, tokens, n, max_tokens, config.decode_token_cost)
        for cut_tokens, cost in zip(rows.reuse_first.tolist(), rows.cost.tolist()):
            # Boundary `row` (before this row) as a unit start: pay for the reuse the cut loses.
            candidate = path_cost + cut_tokens
            while window and window[-1][1] > candidate:
                window.pop()
            window.append((row, candidate))
            prefix.append((row, spent))
            spent += cost
            row += 1
            # Starts that cannot begin a unit ending at boundary `row`; the previous row always can.
            while prefix[0][0] < row - max_rows or (prefix[0][0] < row - 1 and spent - prefix[0][1] > target):
                prefix.popleft()
            while window[0][0] < prefix[0][0]:
                window.popleft()
            start, start_cost = window[0]
            path_cost = start_cost
            predecessors.append(start)
    return predecessors.backtrack(row)


def units_from_starts(profile: Iterable[tuple[np.ndarray, np.ndarray]], starts: list[int], rows: int, n: int,
                       max_tokens: int, decode_token_cost: float) -> tuple[list[WorkUnit], int]:
    """Each unit's counts from one streaming pass; also the global shared-prefix group count."""
    unit_starts = np.asarray(starts, dtype=np.int64)
    bounds = np.append(unit_starts, rows)
    names = ("rows", "error_rows", "prompt_rows", "tokens", "reuse")
    at_bounds = {name: np.zeros(len(bounds), dtype=np.int64) for name in names}
    first_reuse = np.zeros(len(starts), dtype=np.int64)
    carry = dict.fromkeys(names, 0)
    groups, previous_last_reuse, seen_prompt = 0, 0, False
    offset = 0
    for lcp, tokens in profile:
        quantities = _row_quantities(lcp, tokens, n, max_tokens, decode_token_cost)
        count = len(lcp)
        per_row = {"rows": np.ones(count, dtype=np.int64), "error_rows": (~quantities.prompt).astype(np.int64),
                   "prompt_rows": quantities.prompt.astype(np.int64), "tokens": quantities.tokens,
                   "reuse": quantities.reuse}
        # Σ before each bound that falls in (offset, offset + count]: the running sums there.
        inside = (bounds > offset) & (bounds <= offset + count)
        for name in names:
            cumulative = carry[name] + np.cumsum(per_row[name])
            at_bounds[name][inside] = cumulative[bounds[inside] - offset - 1]
            carry[name] = int(cumulative[-1])
        here = (unit_starts >= offset) & (unit_starts < offset + count)
        first_reuse[here] = quantities.reuse_first[unit_starts[here] - offset]
        # Groups as make_plan counts them: a reusing row after a non-reusing one, samples expanded.
        d = quantities.reuse_first[quantities.prompt]
        last = np.clip(quantities.tokens[quantities.prompt] - 1, 0, None) if n > 1 else d
        if len(d):
            before = np.concatenate([[previous_last_reuse], last[:-1]])
            starts_group = (d > 0) & (before == 0)
            if not seen_prompt:
                starts_group[0] = False
            groups += int(starts_group.sum())
            if n > 1:
                groups += int(((d == 0) & (last > 0)).sum())
            previous_last_reuse, seen_prompt = int(last[-1]), True
        offset += count
    units = []
    for unit_id, start in enumerate(starts):
        span = {name: int(at_bounds[name][unit_id + 1] - at_bounds[name][unit_id]) for name in names}
        recomputed = int(first_reuse[unit_id])
        ideal = span["reuse"] - recomputed
        samples = n * span["prompt_rows"]
        prompt_tokens = n * span["tokens"]
        decode = samples * max_tokens
        units.append(WorkUnit(unit_id=unit_id, start=start, rows=span["rows"], error_rows=span["error_rows"],
                              samples=samples, prompt_tokens=prompt_tokens, ideal_cached_tokens=ideal,
                              recomputed_root_tokens=recomputed, decode_tokens=decode,
                              cost=float(prompt_tokens - ideal + decode_token_cost * decode)))
    return units, groups


def cut_units(profile: Callable[[], Iterator[tuple[np.ndarray, np.ndarray]]], totals: SpillTotals, n: int,
              max_tokens: int, config: UnitConfig = UnitConfig(),
              scratch: Optional[Path] = None) -> tuple[tuple[WorkUnit, ...], GlobalPlanSummary]:
    """Units of the sorted rows whose (lcp, tokens) batches `profile()` yields (it is read twice).

    `scratch`: a folder for the cut's temporary file (a temporary folder when None).
    """
    target = resolve_target_cost(config, totals, n, max_tokens)
    with tempfile.TemporaryDirectory(dir=scratch, prefix=".cut-") as folder:
        starts = _cut_starts(profile(), n, max_tokens, config, target, Path(folder)) if totals.rows else []
    units, groups = units_from_starts(profile(), starts, totals.rows, n, max_tokens, config.decode_token_cost)
    summary = GlobalPlanSummary(
        rows=totals.rows, error_rows=totals.error_rows, samples=n * totals.prompt_rows,
        prompt_tokens=n * totals.prompt_tokens, ideal_cached_tokens=totals.ideal_cached_tokens(n),
        shared_prefix_groups=groups, units=len(units),
        unit_ideal_cached_tokens=sum(u.ideal_cached_tokens for u in units),
        recomputed_root_tokens=sum(u.recomputed_root_tokens for u in units),
        decode_tokens=sum(u.decode_tokens for u in units), total_cost=float(sum(u.cost for u in units)),
        target_cost=target, max_unit_rows=config.max_rows)
    return tuple(units), summary


def unit_size_quantiles(units: Iterable[WorkUnit], field: str = "rows") -> dict[str, float]:
    """min / median / p90 / max of a unit field (for reports)."""
    values = np.asarray([getattr(u, field) for u in units], dtype=np.float64)
    if not len(values):
        return {"min": 0.0, "median": 0.0, "p90": 0.0, "max": 0.0}
    q = np.quantile(values, [0.0, 0.5, 0.9, 1.0])
    return {"min": float(q[0]), "median": float(q[1]), "p90": float(q[2]), "max": float(q[3])}


__all__ = ["DECODE_TOKEN_COST", "GlobalPlanSummary", "UnitConfig", "WorkUnit", "cut_units", "resolve_target_cost",
           "total_cost", "unit_size_quantiles", "units_from_starts"]
