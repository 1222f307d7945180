"""Re-exports `jobs.outdir.progress_time` for `run/progress.py`, which imports it from here."""
from batchinfer.jobs.outdir.progress_time import ETA_AFTER_FRACTION, ETA_AFTER_SECONDS, Heartbeat, eta_seconds, format_seconds  # noqa: F401
