"""Startup phases (loading weights, compiling kernels, capturing graphs, planning): timed, and
announced to whoever listens (the job's progress display); and what start-up says about sizing.

A phase adds its seconds under a key of a caller's dict (`Engine.startup_seconds`: `load`,
`compile_and_capture`); listeners get `(label, None)` when it starts and `(label, seconds)` when
it ends. Listening is per thread of control (a context variable), so concurrent engines in one
process do not see each other's phases.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator, Optional

PhaseListener = Callable[[str, Optional[float]], None]
_listeners: ContextVar[tuple[PhaseListener, ...]] = ContextVar("startup_phase_listeners", default=())


@contextmanager
def listening(listener: PhaseListener) -> Iterator[None]:
    """Announce the phases started inside this block to `listener`."""
    token = _listeners.set(_listeners.get() + (listener,))
    try:
        yield
    finally:
        _listeners.reset(token)


@contextmanager
def phase(label: str, seconds: Optional[dict[str, float]] = None, key: Optional[str] = None,
          clock: Callable[[], float] = time.monotonic) -> Iterator[None]:
    """Time the block as `label`; its seconds are added to `seconds[key]` (when given)."""
    for listener in _listeners.get():
        listener(label, None)
    start = clock()
    try:
        yield
    finally:
        elapsed = clock() - start
        if seconds is not None and key is not None:
            seconds[key] = seconds.get(key, 0.0) + elapsed
        for listener in _listeners.get():
            listener(label, elapsed)


def max_running_shortfall(fits: int, max_running: Optional[int], requested: int, device_type: str) -> bool:
    """Whether to warn that the memory budget fits `fits` < `requested` running rows: only when the
    job set `max_running`. The default asks for what suits the model and sizes itself to the memory
    (on the CPU a fixed modest pool; a MoE model's 1,024 rarely fits beside long rows): the
    effective number is in the stats (`max_running_effective`)."""
    return fits < requested and max_running is not None
