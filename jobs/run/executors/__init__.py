"""Executors: run a job's work units on several engines, on this host or on a Ray cluster.

Importing this package never imports Ray; `executor_problem("ray")` says in one line when it is missing.

    recipe = WorkerRecipe("my.module:build_worker", job_file="jobs.yaml", job_name="rag")
    placements = local_placements(2, "cpu", cores=available_cores())
    report = LocalExecutor(recipe, placements).run([UnitSpec(0, cost=120.0, samples=40), ...])
"""
from batchinfer.jobs.run.executors.balance import Balance, predict_balance
from batchinfer.jobs.run.executors.contract import ProgressDelta, ProgressSink, RateLimitedSink, UnitResult, UnitWorker, WorkerRecipe
from batchinfer.jobs.run.executors.dispatch import ExecutionReport, RetryPolicy
from batchinfer.jobs.run.executors.local import LocalExecutor
from batchinfer.jobs.run.executors.placement import Placement, available_cores, local_placements, resolve_workers, visible_gpus
from batchinfer.jobs.run.executors.ray_executor import RayExecutor
from batchinfer.jobs.spec.executors import RAY_MISSING, executor_problem, ray_available
from batchinfer.jobs.run.executors.tally import ProgressSnapshot
from batchinfer.jobs.run.executors.unit_queue import UnitSpec

__all__ = ["Balance", "ExecutionReport", "LocalExecutor", "Placement", "ProgressDelta", "ProgressSink",
           "ProgressSnapshot", "RAY_MISSING", "RateLimitedSink", "RayExecutor", "RetryPolicy", "UnitResult",
           "UnitSpec", "UnitWorker", "WorkerRecipe", "available_cores", "executor_problem", "local_placements",
           "predict_balance", "ray_available", "resolve_workers", "visible_gpus"]
