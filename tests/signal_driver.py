"""`batchinfer run jobs.yaml` in a process that sends itself a signal at a chosen point, for tests of
where a signal lands (a real signal, through the CLI's own handlers; only the moment is chosen here).

    python tests/signal_driver.py WHEN COUNT SIGNAL [run arguments...]

WHEN: `write` (the COUNT-th part written, before its fsync, record and rename), `renamed` (the
COUNT-th part renamed to its final name, before the run has counted it) or `planning` (as the
planning pass starts). The name of the part being committed goes to `signalled_part` in the folder.
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import batchinfer.jobs.outdir.part_store as part_store  # noqa: E402
import batchinfer.jobs.run.runner as runner  # noqa: E402


def main() -> None:
    when, count, signum = sys.argv[1], int(sys.argv[2]), signal.Signals[sys.argv[3]]
    seen = {"parts": 0}

    def at_commit(name: str) -> None:
        seen["parts"] += 1
        if seen["parts"] == count:
            Path("signalled_part").write_text(name)
            os.kill(os.getpid(), signum)

    if when == "write":
        write = part_store._write_table

        def write_then_signal(table, path: Path) -> None:
            write(table, path)
            at_commit(path.name[1:path.name.index(".parquet")] + ".parquet")  # the temporary's final name
        part_store._write_table = write_then_signal
    elif when == "renamed":
        commit, fsync_dir = part_store.commit_part, part_store.fsync_dir
        committing: list[str] = []

        def commit_noting_its_name(out_dir: Path, name: str, table):
            committing[:] = [name]
            return commit(out_dir, name, table)

        def fsync_dir_then_signal(folder) -> None:  # commit_part's step right after the part's rename
            fsync_dir(folder)
            at_commit(committing[0])
        part_store.fsync_dir = fsync_dir_then_signal
        for module in list(sys.modules.values()):  # the modules that imported it by name
            if getattr(module, "commit_part", None) is commit:
                module.commit_part = commit_noting_its_name
    elif when == "planning":
        plan_units = runner.plan_units

        def signal_then_plan(*args, **kwargs):
            os.kill(os.getpid(), signum)
            return plan_units(*args, **kwargs)
        runner.plan_units = signal_then_plan
    else:
        raise SystemExit(f"unknown point {when}")
    from batchinfer.cli import main as cli

    cli(["run", "jobs.yaml", *sys.argv[4:]], prog_name="batchinfer")


if __name__ == "__main__":
    main()
