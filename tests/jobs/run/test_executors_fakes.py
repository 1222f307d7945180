"""A fake UnitWorker for the executor tests (this module holds no tests itself).

The fake reads its settings from a JSON "job file": each unit's row count, and which units
misbehave. A unit's rows are committed in chunks under names fixed by the unit
(`unit-UUUUU-CCC.parquet`), chunks already committed are skipped, and every attempt is logged
(one appended line per attempt) so tests can count how often each unit ran.
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any, Generator, Iterator, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from batchinfer.jobs.run.executors.contract import ProgressDelta, ProgressSink, UnitResult, WorkerRecipe

FACTORY = "tests.jobs.run.test_executors_fakes:build_fake_worker"


def write_fake_job(folder: Path, unit_rows: dict[int, int], **settings: Any) -> WorkerRecipe:
    """Settings: sleep (s per chunk), chunk_rows, kill_once (units; SIGKILL on their 2nd chunk, first
    attempt only), always_kill (units), raise_in (units; raise RuntimeError), fail_open (bool),
    cuda (bool: hold a CUDA tensor under the recipe's memory fraction and compute with it per chunk),
    streaming (bool: `run_units` holds two units at once, their chunks taking turns, as an engine
    overlaps the end of one unit with the start of the next), open_barrier (N: open returns once N
    workers have opened, so a slow start cannot leave one worker every unit)."""
    config = {"out": str(folder / "out"), "log": str(folder / "attempts.log"), "markers": str(folder),
              "units": {str(unit): rows for unit, rows in unit_rows.items()}, **settings}
    folder.mkdir(parents=True, exist_ok=True)
    job_file = folder / "fake-job.json"
    job_file.write_text(json.dumps(config))
    return WorkerRecipe(factory=FACTORY, job_file=str(job_file), job_name="fake")


def read_attempts(folder: Path) -> list[tuple[int, int]]:
    """(worker index, unit id) per attempt, in the order they started."""
    log = folder / "attempts.log"
    if not log.exists():
        return []
    return [(int(w), int(u)) for w, u, _ in (line.split() for line in log.read_text().splitlines())]


def opened_workers(folder: Path) -> list[dict[str, Any]]:
    """What each worker process saw when it opened: index, device, recipe overrides, environment."""
    return [json.loads(path.read_text()) for path in sorted(folder.glob("opened-*.json"))]


def committed_rows(folder: Path) -> list[tuple[int, int]]:
    """(unit id, row) of every committed output row."""
    out = folder / "out"
    if not out.exists() or not any(out.glob("unit-*.parquet")):
        return []
    table = pq.read_table(out)
    return list(zip(table["unit_id"].to_pylist(), table["row"].to_pylist()))


class FakeUnitWorker:
    def __init__(self, recipe: WorkerRecipe) -> None:
        self.config = json.loads(Path(recipe.job_file).read_text())
        self.overrides = dict(recipe.overrides)
        self.out = Path(self.config["out"])
        self.worker_index = -1
        self.progress: Optional[ProgressSink] = None

    def open(self, worker_index: int, device: str, progress: ProgressSink) -> None:
        if self.config.get("fail_open"):
            raise RuntimeError(f"cannot load the fake model on {device}")
        self.worker_index, self.device, self.progress = worker_index, device, progress
        seen = {"worker": worker_index, "device": device, "overrides": self.overrides,
                "env": {name: os.environ.get(name) for name in ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")}}
        if self.config.get("cuda"):
            import torch

            torch.cuda.set_per_process_memory_fraction(self.overrides.get("engine.memory_fraction", 0.9))
            self.block = torch.ones(1024, 1024, device=device)
            seen["cuda_device_count"] = torch.cuda.device_count()
        Path(self.config["markers"], f"opened-{worker_index}-{os.getpid()}.json").write_text(json.dumps(seen))
        deadline = time.monotonic() + 60
        while len(list(Path(self.config["markers"]).glob("opened-*.json"))) < self.config.get("open_barrier", 0):
            assert time.monotonic() < deadline, "the other workers never opened"
            time.sleep(0.01)

    def _first_time(self, unit_id: int) -> bool:
        try:  # O_EXCL: exactly one attempt over all processes creates it
            os.close(os.open(os.path.join(self.config["markers"], f"killed-{unit_id}"), os.O_CREAT | os.O_EXCL))
            return True
        except FileExistsError:
            return False

    def run_unit(self, unit_id: int) -> UnitResult:
        steps = self._unit_steps(unit_id)
        while True:
            try:
                next(steps)
            except StopIteration as finished:
                return finished.value

    def _streaming_run_units(self, unit_ids: Iterator[int]) -> Iterator[UnitResult]:
        active: list[Generator[None, None, UnitResult]] = []
        source, exhausted = iter(unit_ids), False
        while True:
            if not exhausted and len(active) < 2:   # room for one more: pull it (may wait for the parent)
                unit_id = next(source, None)
                if unit_id is None:
                    exhausted = True
                else:
                    active.append(self._unit_steps(unit_id))
                continue
            if not active:
                return
            steps = active.pop(0)
            try:
                next(steps)               # one chunk of the oldest unit, then the other's turn
                active.append(steps)
            except StopIteration as finished:
                yield finished.value

    def __getattr__(self, name: str) -> Any:
        # `run_units` exists only for streaming fakes: the executors look it up to choose the mode.
        if name == "run_units" and self.__dict__.get("config", {}).get("streaming"):
            return self._streaming_run_units
        raise AttributeError(name)

    def _unit_steps(self, unit_id: int) -> Generator[None, None, UnitResult]:
        """Runs the unit one chunk per step; returns its result."""
        with open(self.config["log"], "a") as log:  # one short O_APPEND write per attempt
            log.write(f"{self.worker_index} {unit_id} {os.getpid()}\n")
        if unit_id in self.config.get("raise_in", []):
            raise RuntimeError(f"fake failure in unit {unit_id}")
        rows = self.config["units"][str(unit_id)]
        chunk_rows = self.config.get("chunk_rows", 2)
        written = skipped = 0
        parts = []
        for chunk, first in enumerate(range(0, rows, chunk_rows)):
            name = f"unit-{unit_id:05d}-{chunk:03d}.parquet"
            parts.append(name)
            count = min(chunk_rows, rows - first)
            if (self.out / name).exists():
                skipped += count
                continue
            if chunk == 1 and (unit_id in self.config.get("always_kill", [])
                               or (unit_id in self.config.get("kill_once", []) and self._first_time(unit_id))):
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(self.config.get("sleep", 0.0))
            if self.config.get("cuda"):
                assert float((self.block @ self.block)[0, 0]) == 1024.0
            table = pa.table({"unit_id": pa.array([unit_id] * count, pa.int64()),
                              "row": pa.array(range(first, first + count), pa.int64()),
                              "text": [f"u{unit_id}r{row}" for row in range(first, first + count)]})
            self.out.mkdir(parents=True, exist_ok=True)
            pq.write_table(table, self.out / f".{name}.tmp")
            os.replace(self.out / f".{name}.tmp", self.out / name)  # whole or absent, as the real worker's parts
            written += count
            self.progress.report(unit_id, ProgressDelta(samples=count, prompt_tokens=10 * count,
                                                        cached_tokens=4 * count, output_tokens=3 * count))
            yield
        return UnitResult(unit_id=unit_id, samples_written=written, samples_skipped=skipped,
                          prompt_tokens=10 * written, cached_tokens=4 * written, output_tokens=3 * written,
                          parts=tuple(parts),
                          counters={"states_evicted": 1, "peak_memory_bytes": 100 + unit_id})

    def close(self) -> None:
        pass


def build_fake_worker(recipe: WorkerRecipe) -> FakeUnitWorker:
    return FakeUnitWorker(recipe)
