"""Job files in, Parquet out: specs, inputs, prompts, outputs, resume and statistics.

Usable from Python without the CLI:

    from batchinfer.jobs.spec import load_job_file
    from batchinfer.jobs.prepare import prepare_job
    from batchinfer.jobs.runner import run_job

    for spec in load_job_file(Path("jobs.yaml")).jobs:
        run_job(prepare_job(spec), Console())
"""
