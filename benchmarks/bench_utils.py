"""What the benchmark scripts share: `time_ms` (a callable's time, do_bench on CUDA) and
`print_table` (a header, a rule under it, one line per row)."""
from __future__ import annotations

import time
from typing import Callable, Iterable


def time_ms(fn: Callable[[], object], device: str, *, warmup: int = 10, rep: int = 50, cpu_calls: int = 1) -> float:
    """Milliseconds per call of fn(): on CUDA triton.testing.do_bench (`warmup` / `rep` in ms of
    calls, L2 flushed between them); elsewhere the mean wall time of `cpu_calls` calls after one
    untimed call (a smoke run's number, not a measurement)."""
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=warmup, rep=rep)
    fn()
    start = time.perf_counter()
    for _ in range(cpu_calls):
        fn()
    return 1e3 * (time.perf_counter() - start) / cpu_calls


def print_table(header: str, lines: Iterable[str]) -> None:
    """`header`, a rule as wide, then each line (formatted by the caller to the header's columns)."""
    print(header)
    print("-" * len(header))
    for line in lines:
        print(line)
