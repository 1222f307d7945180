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
