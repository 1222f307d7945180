"""Per-job statistics: `_stats.json` beside the outputs and a summary table at the end.

Engine counters (prefix reuse, state tracking, ReplaySSM flushes, memory) come from
`engine.stats`; the job adds rows, errors, its own wall time split into startup (`startup_seconds`:
load, compile_and_capture, plan) and `generation_seconds`, and derives rates over the generation time.
Samples and errors count what is on disk (in committed parts), whatever stopped the run.
Memory is reported twice, each labelled: the engine's own peak figure on its device
(`peak_memory_bytes`, `peak_memory_device`), and this process's peak resident set
(`process_peak_rss_bytes`, from getrusage), which on the CPU is the figure that matters.

Cached tokens, three figures, one a bound:
- `cached_tokens`: achieved, the prompt tokens this run's samples took from the prefix cache;
- `plan.global_ideal_cached_tokens` (the global plan, the default): the job's ideal, every prompt sorted by
  token ids, each reusing min(lcp with its predecessor, len - 1). No cache does better, so
  achieved <= global ideal always; the summary compares achieved with it;
- `planned_cached_tokens`: what the engine's planner expected of its planning units (work units,
  or windows), each planned alone. The prefix cache outlives a unit, so a root a split group
  was planned to recompute may still be cached: achieved may exceed it. A plan, not a bound.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from rich.console import Console
from rich.table import Table

from batchinfer.engine.stats import process_peak_rss_bytes
from batchinfer.jobs.outdir.atomic_files import write_atomically

ENGINE_COUNTERS = ("requests", "prompt_tokens", "cached_tokens", "theoretical_max_cached_tokens",
                   "discarded_kv_tokens", "states_tracked", "states_donated", "states_evicted",
                   "replayssm_flushes", "output_tokens", "recomputed_tokens", "preemptions", "prefill_seconds",
                   "decode_seconds", "peak_memory_bytes")
# The engine's "theoretical max" is its planner's figure for each planning unit alone, not a bound on
# the job (module docstring): `_stats.json` names it for what it is.
STATS_NAMES = {"theoretical_max_cached_tokens": "planned_cached_tokens"}

STARTUP_PHASES = ("load", "compile_and_capture", "plan")


@dataclass(frozen=True)
class JobCounters:
    """What the job itself counted during this run."""

    rows: int                # input rows in the job (after limit)
    samples_total: int       # rows x n
    samples_resumed: int     # found in finished parts, not run again
    samples_written: int     # committed to parts by this run (on disk)
    errors: int              # of those, finish_reason "error"
    wall_seconds: float
    startup_seconds: Optional[dict[str, float]] = None  # load, compile_and_capture, plan (what ran)
    generation_seconds: Optional[float] = None          # None: nothing was generated (e.g. all resumed)


def build_stats(job_name: str, counters: JobCounters, engine_stats: Any, settings: dict[str, Any],
                status: str, failure: Optional[str] = None, interrupted_by: Optional[str] = None) -> dict[str, Any]:
    engine = {STATS_NAMES.get(name, name): getattr(engine_stats, name, 0) if engine_stats is not None else 0
              for name in ENGINE_COUNTERS}
    # Rates over the generation time: startup (load, compile, plan) is a fixed cost reported apart.
    generating = counters.generation_seconds if counters.generation_seconds else counters.wall_seconds
    rate_seconds = max(generating, 1e-9)
    stats: dict[str, Any] = {
        "job": job_name,
        "status": status,
        "rows": counters.rows,
        "samples": counters.samples_total,
        "samples_resumed": counters.samples_resumed,
        "samples_written": counters.samples_written,
        **engine,
        "cache_hit_rate": engine["cached_tokens"] / engine["prompt_tokens"] if engine["prompt_tokens"] else 0.0,
        "planned_cache_hit_rate": (engine["planned_cached_tokens"] / engine["prompt_tokens"]
                                   if engine["prompt_tokens"] else 0.0),
        "errors": counters.errors,
        "wall_seconds": counters.wall_seconds,
        "startup_seconds": {name: counters.startup_seconds.get(name, 0.0) for name in STARTUP_PHASES}
        if counters.startup_seconds is not None else None,
        "generation_seconds": counters.generation_seconds,
        "prompt_tokens_per_second": engine["prompt_tokens"] / rate_seconds,
        # what the progress line's "prompt tok/s" shows: prompt tokens computed, not taken from the cache
        "computed_prompt_tokens_per_second": (engine["prompt_tokens"] - engine["cached_tokens"]) / rate_seconds,
        "output_tokens_per_second": engine["output_tokens"] / rate_seconds,
        # What peak_memory_bytes measures: the engine's device (None: no engine was loaded).
        "peak_memory_device": settings.get("device") if engine_stats is not None else None,
        "process_peak_rss_bytes": process_peak_rss_bytes(),
        "engine_settings": settings,
    }
    if failure is not None:
        stats["failure"] = failure
    if interrupted_by is not None:
        stats["interrupted_by"] = interrupted_by
    return stats


def write_stats(path: Path, stats: dict[str, Any]) -> None:
    text = json.dumps(stats, indent=2, default=str)
    write_atomically(path, lambda temp: temp.write_text(text, encoding="utf-8"))


def _count(value: float) -> str:
    return f"{int(value):,}"


def _eval_rows(evaluation: Optional[dict[str, Any]]) -> list[tuple[str, str]]:
    """The eval's accuracy ± its standard error sqrt(p(1-p)/n) (jobs/tasks/eval_metrics.py)."""
    if not evaluation:
        return []
    if evaluation.get("accuracy") is None:
        return [(f"accuracy ({evaluation['metric']})", "no judged samples")]
    return [(f"accuracy ({evaluation['metric']}) ± s.e.",
             f"{evaluation['accuracy']:.2%} ± {evaluation['stderr']:.2%} (n = {_count(evaluation['judged'])})")]


def _cached_rows(stats: dict[str, Any]) -> list[tuple[str, str]]:
    """Achieved against the global ideal (a bound) when the job was planned globally, else against the
    windows' plan (no bound: the cache outlives a window)."""
    plan = stats.get("plan") or {}
    planned = ("planned cached tokens (units alone)" if plan.get("mode") == "global" else
               "planned cached tokens (windows alone)", _count(stats["planned_cached_tokens"]))
    if plan.get("global_ideal_cached_tokens") is None:
        return [("cached tokens (achieved)", _count(stats["cached_tokens"])),
                ("cache hit rate (achieved)", f"{stats['cache_hit_rate']:.1%}"), planned]
    return [("cached tokens (achieved / global ideal)",
             f"{_count(stats['cached_tokens'])} / {_count(plan['global_ideal_cached_tokens'])}"),
            ("cache hit rate (achieved / global ideal)",
             f"{stats['cache_hit_rate']:.1%} / {plan['global_ideal_hit_rate']:.1%}"), planned]


def _prompt_rate_row(stats: dict[str, Any]) -> tuple[str, str]:
    """Prompt tok/s computed (the progress line's figure) beside all prompt tokens, cached ones included
    (a _stats.json written before the computed rate was recorded shows the latter alone)."""
    computed = stats.get("computed_prompt_tokens_per_second")
    if computed is None:
        return "prompt tok/s with cached (generation)", f"{stats['prompt_tokens_per_second']:,.1f}"
    return ("prompt tok/s: computed / with cached (generation)",
            f"{computed:,.1f} / {stats['prompt_tokens_per_second']:,.1f}")


def render_summary(console: Console, stats: dict[str, Any]) -> None:
    table = Table(title=f"job {stats['job']}: {stats['status']}", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value", justify="right")
    rows = [
        ("rows / samples", f"{_count(stats['rows'])} / {_count(stats['samples'])}"),
        ("written / resumed", f"{_count(stats['samples_written'])} / {_count(stats['samples_resumed'])}"),
        ("errors", _count(stats["errors"])),
        ("prompt tokens", _count(stats["prompt_tokens"])),
        *_cached_rows(stats),
        ("KV tokens discarded (no state)", _count(stats["discarded_kv_tokens"])),
        ("states tracked / donated / evicted",
         f"{_count(stats['states_tracked'])} / {_count(stats['states_donated'])} / {_count(stats['states_evicted'])}"),
        ("ReplaySSM flushes", _count(stats["replayssm_flushes"])),
        ("output tokens", _count(stats["output_tokens"])),
        _prompt_rate_row(stats),
        ("output tok/s (generation)", f"{stats['output_tokens_per_second']:,.1f}"),
        ("wall time", f"{stats['wall_seconds']:.1f} s"),
        ("startup: load / compile+capture / plan", " / ".join(
            f"{(stats.get('startup_seconds') or {}).get(name, 0.0):.1f}" for name in STARTUP_PHASES) + " s"),
        ("generation time", f"{stats['generation_seconds']:.1f} s" if stats.get("generation_seconds") is not None
         else "-"),
        (f"peak memory (engine, {stats['peak_memory_device']})" if stats.get("peak_memory_device")
         else "peak memory (no engine loaded)",
         f"{stats['peak_memory_bytes'] / 2**20:,.1f} MiB"),
        ("peak RSS (this process)", f"{stats.get('process_peak_rss_bytes', 0) / 2**20:,.1f} MiB"),
    ]
    rows.extend(_sampling_rows(stats.get("sampling")))
    rows.extend(_eval_rows(stats.get("eval")))
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    for example in (stats.get("eval") or {}).get("examples", []):  # what the model answered, in its words
        mark = {True: "right", False: "wrong", None: "not judged"}[example["correct"]]
        label = f"{example['id']}: " if example["id"] is not None else ""
        console.print(f"  {label}generated {example['generated_text']!r}, answer {example['answer']!r}: {mark}",
                      highlight=False, markup=False)


def _sampling_rows(sampling: Optional[dict[str, Any]]) -> list[tuple[str, str]]:
    """One row per source of the job's sampling values (the job, generation_config.json, defaults)."""
    if not sampling:
        return []
    by_source: dict[str, list[str]] = {}
    for name, source in sampling["sources"].items():
        by_source.setdefault(source, []).append(f"{name}={sampling['values'][name]}")
    rows = [(f"sampling ({source})", ", ".join(values)) for source, values in by_source.items()]
    if sampling.get("generation_config_ignored"):
        rows.append(("generation_config.json ignored", ", ".join(sampling["generation_config_ignored"])))
    return rows
