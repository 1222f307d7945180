"""Checks for job-file values, shared by every section of jobs/spec/job_file.py.

Value checkers return the cleaned value or raise ValueError(what is wrong); `Checker` turns
that into a `JobError` located at a key path, and rejects unknown keys with a "did you mean".
"""
from __future__ import annotations

import difflib
import math
import re
from pathlib import Path
from typing import Any, Callable, Optional

from batchinfer.jobs.errors import JobError


def boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"must be true or false, got {value!r}")
    return value


INT64_MAX = (1 << 63) - 1  # every integer setting ends up in an int64 somewhere (tensors, Parquet)
SEED_LIMIT = 1 << 64       # the sampler hashes the seed as two 32-bit words: wider seeds would alias


def integer(low: Optional[int] = None, optional: bool = False, high: int = INT64_MAX) -> Callable[[Any], Optional[int]]:
    def check(value: Any) -> Optional[int]:
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"must be an integer, got {value!r}")
        if low is not None and value < low:
            raise ValueError(f"must be >= {low}, got {value}")
        if value > high:
            raise ValueError(f"must be <= {high}, got {value}")
        return value
    return check


def seed(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < SEED_LIMIT:
        raise ValueError(f"must be an integer in [0, 2**64), got {value!r}")
    return value


def number(low: float, high: Optional[float] = None, low_open: bool = False) -> Callable[[Any], float]:
    """A finite float in [low, high] ((low, high] with low_open); no upper bound when high is None."""
    def check(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"must be a number, got {value!r}")
        if not math.isfinite(value):  # NaN passes every comparison below, and inf means nothing here
            raise ValueError(f"must be a finite number, got {value}")
        if value < low or (low_open and value == low) or (high is not None and value > high):
            if high is None:
                raise ValueError(f"must be {'>' if low_open else '>='} {float(low)}, got {value}")
            raise ValueError(f"must be in {'(' if low_open else '['}{float(low)}, {float(high)}], got {value}")
        return float(value)
    return check


def text(optional: bool = False) -> Callable[[Any], Optional[str]]:
    def check(value: Any) -> Optional[str]:
        if value is None and optional:
            return None
        if not isinstance(value, str) or not value:
            raise ValueError(f"must be a non-empty string, got {value!r}")
        return value
    return check


def choice(*options: str) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        if value not in options:
            raise ValueError(f"must be one of {', '.join(options)}; got {value!r}")
        return value
    return check


def device_name(value: Any) -> str:
    if not isinstance(value, str) or not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", value):
        raise ValueError(f"must be auto, cpu, cuda or cuda:N; got {value!r}")
    return value


def stop_strings(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise ValueError(f"must be a list of non-empty strings, got {value!r}")
    return tuple(value)


def did_you_mean(word: str, options: Any) -> str:
    close = difflib.get_close_matches(str(word), list(options), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


class Checker:
    """Carries the job file path so every helper can raise a located error."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, where: str, what: str) -> JobError:
        return JobError(self.path, where, what)

    def mapping(self, value: Any, where: str, allowed: Any) -> dict:
        if not isinstance(value, dict):
            raise self.fail(where, f"must be a mapping, got {type(value).__name__}")
        for key in value:
            if key not in allowed:
                raise self.fail(f"{where}.{key}", f"unknown key{did_you_mean(key, allowed)}")
        return value

    def section(self, value: Any, where: str, keys: dict[str, Callable[[Any], Any]]) -> dict:
        checked = {}
        for key, item in self.mapping(value, where, keys).items():
            try:
                checked[key] = keys[key](item)
            except ValueError as exc:
                raise self.fail(f"{where}.{key}", str(exc)) from None
        return checked
