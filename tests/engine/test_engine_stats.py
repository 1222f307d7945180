"""Engine statistics: peak memory figures that say what they measure."""
from __future__ import annotations

import resource

from batchinfer.engine.stats import EngineStats, process_peak_rss_bytes
from batchinfer.engine.types import SamplingParams
from tests.engine_utils import make_engine, requests_for, run, tiny_model


def test_cpu_peak_memory_is_the_process_peak_rss():
    engine = make_engine(tiny_model())
    run(engine, requests_for([[1, 2, 3, 4, 5]] * 2, SamplingParams(max_tokens=3)))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    stats = engine.stats
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert before <= stats.peak_rss_bytes <= after == process_peak_rss_bytes()
    assert stats.peak_memory_bytes == stats.peak_rss_bytes > 100 * 2**20  # torch alone takes more than 100 MiB
    assert {"peak_memory_bytes", "peak_rss_bytes"} <= set(stats.to_dict())
    assert EngineStats().peak_rss_bytes == 0


def test_stats_count_from_a_restart_and_since_an_earlier_snapshot():
    """An engine kept across jobs (the `LLM` API) reports each job's own counters."""
    engine = make_engine(tiny_model())
    run(engine, requests_for([[1, 2, 3, 4, 5]] * 2, SamplingParams(max_tokens=3, ignore_eos=True)))
    before = engine.stats
    second = requests_for([[6, 7, 8, 9]] * 3, SamplingParams(max_tokens=4, ignore_eos=True))
    run(engine, second)
    since = engine.stats_since(before)
    assert (since.requests, since.prompt_tokens, since.output_tokens) == (3, 12, 12)
    assert since.peak_rss_bytes == engine.stats.peak_rss_bytes > 0  # a peak is process-wide, not a difference
    engine.restart_stats()
    assert (engine.stats.requests, engine.stats.output_tokens) == (0, 0)
    run(engine, second)
    assert (engine.stats.requests, engine.stats.prompt_tokens, engine.stats.output_tokens) == (3, 12, 12)
