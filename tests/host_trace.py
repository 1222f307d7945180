"""The precompile trace on a machine without a GPU: a stand-in triton driver that reports an
sm_90 device, so `JITFunction.run` binds and specialises a launch's (CPU tensor) arguments as
it would on the H200 and `precompile.trace_specialisations` records what would compile. Only
in a process with TRITON_INTERPRET=0 (real JITFunctions); nothing is launched."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

SM90 = ("cuda", 90, 32)


class HostDriver:
    """What `JITFunction.run` asks of the driver before the compile hook (which skips)."""

    def __init__(self, target: tuple = SM90) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget(*target)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0

    def get_current_target(self):
        return self.target


@contextmanager
def host_driver(target: tuple = SM90) -> Iterator[None]:
    from triton.runtime.driver import driver

    previous = driver._active
    driver.set_active(HostDriver(target))
    try:
        yield
    finally:
        driver._active = previous


def traced(run: Callable[[], None], target: tuple = SM90) -> list:
    """`precompile.trace_specialisations(run)` under the stand-in driver."""
    from batchinfer.engine.precompile import trace_specialisations

    with host_driver(target):
        return trace_specialisations(run)
