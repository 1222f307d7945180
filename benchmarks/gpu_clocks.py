"""SM clock and power samples from nvidia-smi while a block of code runs.

On the H200 the decode step's GEMMs are compute-bound and the board runs at its power cap
(throttle reason 0x4), so the SM clock sets the step time: two runs of the same code differ by a
few percent per step (docs/BENCHMARKS.md, "Benchmark method: warm-up, clocks, full-batch
medians"). Benchmarks that compare runs record the clock next to the time.
"""
from __future__ import annotations

import shutil
import statistics
import subprocess
from typing import Optional

_QUERY = "--query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active"


class ClockSampler:
    """Context manager: nvidia-smi samples every `interval_ms` while the block runs. Without
    nvidia-smi (or with `enabled=False`, e.g. on the CPU) it samples nothing and reports NaN."""

    def __init__(self, enabled: bool = True, interval_ms: int = 100) -> None:
        self.enabled = enabled and shutil.which("nvidia-smi") is not None
        self.interval_ms = interval_ms
        self.samples: list[tuple[float, float, str]] = []  # (SM MHz, W, throttle reasons)
        self._proc: Optional[subprocess.Popen] = None

    def __enter__(self) -> "ClockSampler":
        if self.enabled:
            self._proc = subprocess.Popen(["nvidia-smi", _QUERY, "--format=csv,noheader,nounits",
                                           "-lms", str(self.interval_ms)], stdout=subprocess.PIPE, text=True)
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        self.samples = parse_samples(self._proc.communicate()[0])

    @property
    def mean_mhz(self) -> float:
        return statistics.fmean(s[0] for s in self.samples) if self.samples else float("nan")

    @property
    def mean_watts(self) -> float:
        return statistics.fmean(s[1] for s in self.samples) if self.samples else float("nan")

    def summary(self, count: int = 4) -> str:
        """A few samples from the middle on: "MHz, W, reasons | ..."."""
        picked = self.samples[len(self.samples) // 3::max(1, len(self.samples) // count)][:count]
        return " | ".join(f"{mhz:.0f} MHz, {watts:.1f} W, {reasons}" for mhz, watts, reasons in picked)


def parse_samples(text: str) -> list[tuple[float, float, str]]:
    """nvidia-smi's "MHz, W, reasons" lines (csv, noheader, nounits); lines that do not parse —
    one cut by the terminate, "[N/A]" power — are skipped."""
    samples = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            samples.append((float(parts[0]), float(parts[1]), parts[2]))
        except (IndexError, ValueError):
            continue
    return samples
