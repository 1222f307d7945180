"""The work folder: a global plan on disk, committed atomically, reused while its inputs are unchanged.

Layout of `<output>/_work/`:

    plan.json               the commit record, written last (temp, fsync, rename): the spill's
                            fingerprint digest and totals, the unit config, the units file in use
    sorted.parquet          every row in global token order (sorted_rows.py)
    units-<digest>.parquet  the units cut for one unit config and sampling (units.py)
    .build/                 runs and scratch of a build in progress

Nothing is trusted without a plan.json that names it, and no file whose bytes differ from the
checksum plan.json records for it (size and sha256, as parts have): a damaged file, e.g. torn by
a kill -9 or a disk fault, is rebuilt, with a one-line note, and the finished parts are kept.
A build whose spill fingerprint (input files, prompt spec, model, rows) differs deletes
plan.json first, so a kill -9 at any later point leaves no record a rerun could trust; a rerun
removes what a killed build left.
Workers open a committed plan read-only from the folder's path (`open_work_plan`).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import pyarrow as pa
import pyarrow.parquet as pq

from batchinfer.jobs.global_plan.external_sort import RunWriter, SortBudget, merge_runs
from batchinfer.jobs.global_plan.progress import NoProgress, PlanningProgress
from batchinfer.jobs.global_plan.sorted_rows import (SortedRowsReader, SpillTotals, UnitRow, iter_profile, row_group_rows_for,
                                         write_sorted_rows)
from batchinfer.jobs.global_plan.spill import SPILL_WINDOW_ROWS, spill_prompts
from batchinfer.jobs.global_plan.unique_ids import IdHashes, check_unique_ids, checks_ids
from batchinfer.jobs.global_plan.units import GlobalPlanSummary, UnitConfig, WorkUnit, cut_units
from batchinfer.jobs.global_plan.windows import WindowCut, cut_windows, write_window_rows
from batchinfer.jobs.outdir.atomic_files import checksum_problem, file_checksum
from batchinfer.jobs.errors import display_path
from batchinfer.jobs.outdir.part_writer import TEMP_SUFFIX, write_atomically
from batchinfer.jobs.inputs.prepared_job import PreparedJob
from batchinfer.jobs.outdir.resume import fingerprint_digest

WORK_DIR_NAME = "_work"
MANIFEST_NAME = "plan.json"
SORTED_NAME = "sorted.parquet"
BUILD_NAME = ".build"
FORMAT = 2  # bump when the files' layout or meaning changes: older work folders are rebuilt (2: checksums)

Progress = Union[PlanningProgress, NoProgress]
Warn = Callable[[str], None]


def _no_warning(message: str) -> None:
    pass


class PlanNotFound(Exception):
    """The folder holds no committed plan."""


def work_dir_for(out_dir: Path) -> Path:
    return Path(out_dir) / WORK_DIR_NAME


def spill_fingerprint(job: PreparedJob, windows: Optional[WindowCut] = None) -> dict[str, Any]:
    """What the sorted rows depend on: not sampling, not the engine (the id column makes rows with an
    id that is not UTF-8 errors); a window plan's rows also on its windows."""
    fingerprint = job.fingerprint
    spill = {"format": FORMAT, "model": fingerprint["model"], "prompt": fingerprint["prompt"],
             "id_column": job.spec.id_column, "input": fingerprint["input"], "rows": job.rows}
    return spill if windows is None else {**spill, "cut": windows.fingerprint()}


def _units_digest(spill_digest: str, config: UnitConfig, n: int, max_tokens: int) -> str:
    return fingerprint_digest({"spill": spill_digest, "config": config.to_dict(), "n": n, "max_tokens": max_tokens})


@dataclass(frozen=True)
class WorkPlan:
    """A global plan: its units and a reader of each unit's rows (in plan order)."""

    work_dir: Path
    summary: GlobalPlanSummary
    units: tuple[WorkUnit, ...]
    spill: SpillTotals
    reused_spill: bool = False   # the sorted rows came from an earlier run's work folder
    units_digest: str = ""       # identifies the units (the spill, unit config and sampling they were cut for)
    _rows: SortedRowsReader = field(default=None, repr=False, compare=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self._rows is None:
            object.__setattr__(self, "_rows", SortedRowsReader(self.work_dir / SORTED_NAME))

    def unit(self, unit_id: int) -> WorkUnit:
        return self.units[unit_id]

    def read_unit(self, unit_id: int) -> list[UnitRow]:
        """The unit's rows in plan order: (row_index, token_ids, None) or (row_index, None, error)."""
        unit = self.units[unit_id]
        return self._rows.read(unit.start, unit.rows)

    def iter_units_by_cost(self) -> Iterator[WorkUnit]:
        """Largest estimated cost first (ties by unit id): the order an executor hands units out."""
        return iter(sorted(self.units, key=lambda unit: (-unit.cost, unit.unit_id)))


def _read_manifest(work_dir: Path) -> Optional[dict[str, Any]]:
    try:
        manifest = json.loads((work_dir / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") == FORMAT else None


def _intact(work_dir: Path, manifest: dict[str, Any], name: str, warn: Warn) -> bool:
    """Whether `name` matches the checksum plan.json records for it; a note when it does not."""
    files = manifest.get("files")
    problem = checksum_problem(work_dir / name, files.get(name) if isinstance(files, dict) else None)
    if problem is not None:
        warn(f"{display_path(work_dir / name)}: damaged ({problem}); planning again (finished parts are kept)")
    return problem is None


def _committed_spill(work_dir: Path, manifest: Optional[dict[str, Any]], digest: str,
                     warn: Warn = _no_warning) -> Optional[SpillTotals]:
    """The committed spill's totals when it was made from the same input, prompt and model, and is intact."""
    if manifest is None or manifest.get("spill_sha256") != digest:
        return None
    try:
        totals = SpillTotals(**manifest["spill"])
    except (TypeError, KeyError):
        return None
    return totals if _intact(work_dir, manifest, SORTED_NAME, warn) else None


def _fsync_dir(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _forget(work_dir: Path) -> None:
    """Withdraw the commit record first, then delete the files it named."""
    manifest = work_dir / MANIFEST_NAME
    if manifest.exists():
        manifest.unlink()
        _fsync_dir(work_dir)
    for path in work_dir.iterdir():
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


def remove_work_dir(work_dir: Path) -> None:
    """Delete a work folder (e.g. when its job completes), commit record first."""
    if work_dir.is_dir():
        _forget(work_dir)
        work_dir.rmdir()


def _build_sorted_rows(job: PreparedJob, work_dir: Path, build: Path, budget: SortBudget, progress: Progress,
                       window_rows: int) -> SpillTotals:
    runs = RunWriter(build / "runs", budget)
    progress.phase("tokenise", job.rows)
    ids = IdHashes(build / "ids") if checks_ids(job) else None
    counts = spill_prompts(job, runs, on_rows=progress.advance, window_rows=window_rows, ids=ids)
    if ids is not None:
        check_unique_ids(job, ids)
    run_paths = runs.finish()
    progress.phase("sort", counts.rows)
    (build / "merge").mkdir(parents=True, exist_ok=True)
    written: list[SpillTotals] = []
    write_atomically(work_dir / SORTED_NAME, lambda temp: written.append(write_sorted_rows(
        merge_runs(run_paths, build / "merge", budget), temp, on_rows=progress.advance,
        row_group_rows=row_group_rows_for(counts.rows))))
    totals = written[0]
    if (totals.rows, totals.error_rows, totals.prompt_tokens) != (counts.rows, counts.error_rows,
                                                                  counts.prompt_tokens):
        raise RuntimeError(f"the sort lost rows: {counts} spilled, {totals} sorted")
    return totals


def _build_window_rows(job: PreparedJob, work_dir: Path, build: Path, windows: WindowCut,
                       progress: Progress) -> SpillTotals:
    progress.phase("tokenise", job.rows)
    ids = IdHashes(build / "ids") if checks_ids(job) else None
    written: list[SpillTotals] = []
    write_atomically(work_dir / SORTED_NAME, lambda temp: written.append(
        write_window_rows(job, windows, temp, progress.advance, ids)))
    if ids is not None:
        check_unique_ids(job, ids)
    return written[0]


def _write_units(units: tuple[WorkUnit, ...], path: Path) -> None:
    columns = {name: [getattr(unit, name) for unit in units] for name in WorkUnit.__dataclass_fields__}
    pq.write_table(pa.table(columns, schema=_UNITS_SCHEMA), path)


def _read_units(path: Path) -> tuple[WorkUnit, ...]:
    return tuple(WorkUnit(**row) for row in pq.read_table(path).to_pylist())


_UNITS_SCHEMA = pa.schema([(name, pa.float64() if name == "cost" else pa.int64())
                           for name in WorkUnit.__dataclass_fields__])


def _summary(manifest: dict[str, Any]) -> GlobalPlanSummary:
    fields = GlobalPlanSummary.__dataclass_fields__
    return GlobalPlanSummary(**{name: value for name, value in manifest["summary"].items() if name in fields})


def build_work_plan(job: PreparedJob, work_dir: Path, config: UnitConfig = UnitConfig(),
                    progress: Optional[Progress] = None, budget: SortBudget = SortBudget(),
                    window_rows: int = SPILL_WINDOW_ROWS, warn: Warn = _no_warning,
                    windows: Optional[WindowCut] = None) -> WorkPlan:
    """The job's global plan in `work_dir`: reused when committed from the same input, prompt and
    model (units recut if the unit config or sampling changed), else built from scratch
    (`window_rows` input rows tokenised at a time); a damaged file is rebuilt, said through `warn`.
    `windows`: cut in input order instead (`windows.py`), no global sort; `config` then goes unused."""
    progress = progress or NoProgress()
    work_dir.mkdir(parents=True, exist_ok=True)
    sampling = job.spec.sampling
    digest = fingerprint_digest(spill_fingerprint(job, windows))
    manifest = _read_manifest(work_dir)
    totals = _committed_spill(work_dir, manifest, digest, warn)
    build = work_dir / BUILD_NAME
    for leftover in work_dir.glob(f".*{TEMP_SUFFIX}"):  # what a killed build left (.build goes at the end)
        leftover.unlink()
    reused = totals is not None
    if totals is None:
        _forget(work_dir)
        manifest = None
        build.mkdir()
        totals = _build_sorted_rows(job, work_dir, build, budget, progress, window_rows) if windows is None else \
            _build_window_rows(job, work_dir, build, windows, progress)
    units_digest = _units_digest(digest, config, sampling.n, sampling.max_tokens)
    units_name = f"units-{units_digest[:16]}.parquet"
    if manifest is not None and manifest.get("units_sha256") == units_digest and \
            _intact(work_dir, manifest, units_name, warn):
        units, summary = _read_units(work_dir / units_name), _summary(manifest)
    else:
        sorted_checksum = manifest["files"][SORTED_NAME] if manifest is not None else \
            file_checksum(work_dir / SORTED_NAME)  # reused: verified above; else just written
        build.mkdir(exist_ok=True)
        profile = lambda: iter_profile(work_dir / SORTED_NAME)  # noqa: E731
        units, summary = cut_units(profile, totals, sampling.n, sampling.max_tokens, config, scratch=build) \
            if windows is None else cut_windows(profile, totals, sampling.n, sampling.max_tokens, windows,
                                                config.decode_token_cost)
        write_atomically(work_dir / units_name, lambda temp: _write_units(units, temp))
        files = {SORTED_NAME: sorted_checksum, units_name: file_checksum(work_dir / units_name)}
        record = {"format": FORMAT, "spill_sha256": digest, "spill_fingerprint": spill_fingerprint(job, windows),
                  "files": files,
                  "spill": totals.to_dict(), "units_sha256": units_digest, "units_file": units_name,
                  "unit_config": config.to_dict(), "sampling": {"n": sampling.n, "max_tokens": sampling.max_tokens},
                  "summary": summary.to_dict()}
        write_atomically(work_dir / MANIFEST_NAME, lambda temp: temp.write_text(
            json.dumps(record, indent=1, sort_keys=True, default=str), encoding="utf-8"))
        _fsync_dir(work_dir)
        for stale in work_dir.glob("units-*.parquet"):
            if stale.name != units_name:
                stale.unlink()
    shutil.rmtree(build, ignore_errors=True)
    return WorkPlan(work_dir=work_dir, summary=summary, units=units, spill=totals, reused_spill=reused,
                    units_digest=units_digest)


def open_work_plan(work_dir: Path) -> WorkPlan:
    """The committed plan of `work_dir`, as a worker process opens it (no fingerprint check: its
    parent built or validated the plan). Raises PlanNotFound without one."""
    work_dir = Path(work_dir)
    manifest = _read_manifest(work_dir)
    if manifest is None:
        raise PlanNotFound(f"{work_dir} holds no committed plan")
    units_path = work_dir / manifest["units_file"]
    if not units_path.is_file() or not (work_dir / SORTED_NAME).is_file():
        raise PlanNotFound(f"{work_dir}: {MANIFEST_NAME} names files that are missing")
    return WorkPlan(work_dir=work_dir, summary=_summary(manifest), units=_read_units(units_path),
                    spill=SpillTotals(**manifest["spill"]), reused_spill=True,
                    units_digest=str(manifest.get("units_sha256", "")))


def open_matching_plan(job: PreparedJob, work_dir: Path, config: UnitConfig = UnitConfig(),
                       warn: Warn = _no_warning) -> Optional[WorkPlan]:
    """The plan of a committed work folder made from the job's input, prompt and model, writing
    nothing there (units cut in memory when the config or sampling differ); None without an intact one."""
    manifest = _read_manifest(work_dir)
    digest = fingerprint_digest(spill_fingerprint(job))
    totals = _committed_spill(work_dir, manifest, digest, warn)
    if manifest is None or totals is None:
        return None
    sampling = job.spec.sampling
    units_path = work_dir / manifest.get("units_file", "")
    units_digest = _units_digest(digest, config, sampling.n, sampling.max_tokens)
    if manifest.get("units_sha256") == units_digest and _intact(work_dir, manifest, units_path.name, warn):
        units, summary = _read_units(units_path), _summary(manifest)
    else:
        with tempfile.TemporaryDirectory(prefix="batchinfer-cut-") as scratch:
            units, summary = cut_units(lambda: iter_profile(work_dir / SORTED_NAME), totals, sampling.n,
                                       sampling.max_tokens, config, scratch=Path(scratch))
    return WorkPlan(work_dir=work_dir, summary=summary, units=units, spill=totals, reused_spill=True,
                    units_digest=units_digest)
