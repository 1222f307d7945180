"""An engine built in a background thread while the job plans, sized by the plan.

Building an engine (allocating the model, reading the weights, tracing and compiling kernels,
capturing graphs) and planning a job (tokenising and sorting every prompt) need nothing of each
other until the first unit runs, except one figure: how many KV positions a running row will
hold, which sizes `max_running` (`EngineConfig.row_tokens`). So:

- `EngineBuild.start(factory)` runs `factory()` (the runner's engine factory) in a thread and
  returns at once; the caller plans meanwhile, then `post_row_tokens(n)` (None: no figure) and
  `result()` joins, re-raising the build's exception in the caller as if it had built there.
- Inside that thread `build_engine` (what the job's factory calls) allocates the model and reads
  the weights at once, and only then waits for the posted figure before the engine sizes its
  pools, traces, compiles and captures: the Triton trace intercepts every launch in the process,
  so nothing else may launch kernels while it runs (a weight load may: FP8 dequantisation).
  Outside an `EngineBuild` it is `Engine.from_pretrained`, unchanged.
"""
from __future__ import annotations

import contextvars
import math
import threading
from dataclasses import replace
from typing import Callable, Generic, Optional, TypeVar

E = TypeVar("E")
_NOT_POSTED = object()


class _Posted:
    """One value handed from the planning thread to the build, once."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._value: object = _NOT_POSTED

    def post(self, value: Optional[int]) -> None:
        if not self._event.is_set():
            self._value = value
            self._event.set()

    def wait(self) -> Optional[int]:
        self._event.wait()
        return self._value  # type: ignore[return-value]


_row_tokens: contextvars.ContextVar[Optional[_Posted]] = contextvars.ContextVar("engine_build_row_tokens",
                                                                                default=None)


def awaited_row_tokens() -> Optional[int]:
    """In an `EngineBuild`'s thread: the posted row figure, waited for; elsewhere None at once."""
    posted = _row_tokens.get()
    return None if posted is None else posted.wait()


def expected_row_tokens(prompt_tokens: int, cached_tokens: int, decode_tokens: int, samples: int) -> Optional[int]:
    """KV positions a running sample holds at its end, on average: its share of the prompt tokens
    no other sample shares (`cached_tokens`: the plan's ideal reuse) and of the output tokens."""
    if samples <= 0:
        return None
    return max(1, math.ceil((prompt_tokens - cached_tokens + decode_tokens) / samples))


class EngineBuild(Generic[E]):
    """`factory()` running in a daemon thread (the caller's context: its startup-phase listeners
    see the build's phases)."""

    def __init__(self, factory: Callable[[], E]) -> None:
        self._posted = _Posted()
        self._value: Optional[E] = None
        self._error: Optional[BaseException] = None
        context = contextvars.copy_context()
        context.run(_row_tokens.set, self._posted)
        self._thread = threading.Thread(target=context.run, args=(self._run, factory), name="engine-build",
                                        daemon=True)

    @classmethod
    def start(cls, factory: Callable[[], E]) -> "EngineBuild[E]":
        build = cls(factory)
        build._thread.start()
        return build

    def _run(self, factory: Callable[[], E]) -> None:
        try:
            self._value = factory()
        except BaseException as err:  # handed to the caller by result()
            self._error = err

    def post_row_tokens(self, row_tokens: Optional[int]) -> None:
        """The job's figure for `EngineConfig.row_tokens` (None: size by the defaults); only the first counts."""
        self._posted.post(row_tokens)

    def result(self) -> E:
        """The engine, once built (no figure posted by now: the defaults); the build's exception otherwise."""
        self._posted.post(None)
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


def build_engine(checkpoint: str, config, **kwargs):
    """`Engine.from_pretrained(checkpoint, config, **kwargs)`; inside an `EngineBuild`, a checkpoint
    folder's weights are read before the posted row figure is awaited, and that figure sizes the pools."""
    from batchinfer.engine.engine import Engine

    if _row_tokens.get() is None:
        return Engine.from_pretrained(checkpoint, config, **kwargs)
    import torch

    from batchinfer.engine.startup import phase
    from batchinfer.models.loader import empty_model, load_weights
    from batchinfer.models.presets import PRESETS

    if checkpoint in PRESETS or config.pipeline_stages > 1:  # drawn / loaded stage by stage inside the engine
        return Engine.from_pretrained(checkpoint, _sized(config), **kwargs)
    loaded: dict[str, float] = {}
    device = config.resolved_device()
    with phase("allocating the model", loaded, "load"):
        model = empty_model(checkpoint, config.resolved_dtype(), device)
    with phase("loading weights", loaded, "load"):
        load_weights(model, checkpoint)
        if device.type == "cuda":
            torch.cuda.synchronize()  # the copies to the device are part of the load
    engine = Engine(model, _sized(config), model_name=checkpoint, **kwargs)
    engine.startup_seconds["load"] += loaded["load"]
    return engine


def _sized(config):
    """`config` with the posted row figure, unless it sets `max_running` or a figure itself."""
    if config.max_running is not None or config.row_tokens is not None:
        return config
    return replace(config, row_tokens=awaited_row_tokens())
