"""Running a job: preparation, the plan's units, the engine loop, executors, progress, warmup."""
