"""The job file: YAML in, validated frozen specs out (keys, checks, sampling defaults, task and parallel settings, the model)."""
