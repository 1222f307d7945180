"""Plan, schedule, run and sample: the engine `jobs/` drives (see docs/MODULES.md)."""
from batchinfer.engine.config import EngineConfig
from batchinfer.engine.planner import PlanSummary, make_plan, plan_prompts
from batchinfer.engine.stats import EngineStats
from batchinfer.engine.types import Request, RequestOutput, SamplingParams


def __getattr__(name: str):
    # The Engine pulls in the model and the cache; planning alone (`batchinfer plan`) should not.
    if name == "Engine":
        from batchinfer.engine.engine import Engine

        return Engine
    raise AttributeError(name)


__all__ = ["Engine", "EngineConfig", "EngineStats", "PlanSummary", "Request", "RequestOutput",
           "SamplingParams", "make_plan", "plan_prompts"]
