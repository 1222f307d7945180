"""Standard output and error that go quiet when their reader is gone, instead of failing the run.

    with quiet_when_closed():   # sys.stdout and sys.stderr wrapped while the run lasts
        ...

`batchinfer run ... | head -1` closes the pipe after one line, and a dropped ssh session leaves a
hung-up terminal: the next progress line then fails (EPIPE, EIO). Progress is not the job's output,
so the run carries on without it: on the first such error the stream's descriptor is pointed at
/dev/null (so nothing buffered fails again at exit, which Python would report with status 120) and
every later write is dropped.
"""
from __future__ import annotations

import errno
import os
import sys
from contextlib import contextmanager
from typing import Any, Iterator, TextIO

GONE_ERRNOS = (errno.EPIPE, errno.EIO)


class QuietStream:
    """A text stream that swallows the errors of a reader that is gone, then stays silent."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.gone = False

    def _went(self, exc: OSError) -> None:
        if exc.errno not in GONE_ERRNOS:
            raise exc
        self.gone = True
        try:  # later writes and the final flush at exit land in /dev/null
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, self._stream.fileno())
            finally:
                os.close(devnull)
        except (OSError, ValueError, AttributeError):  # no descriptor (a test's capture): dropping is enough
            pass

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                return self._stream.write(text)
            except OSError as exc:
                self._went(exc)
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                self._stream.flush()
            except OSError as exc:
                self._went(exc)

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, buffer...: the stream's own
        return getattr(self._stream, name)


@contextmanager
def quiet_when_closed() -> Iterator[None]:
    """sys.stdout and sys.stderr wrapped in `QuietStream` while inside (each at most once)."""
    saved = sys.stdout, sys.stderr
    if sys.stdout is not None and not isinstance(sys.stdout, QuietStream):
        sys.stdout = QuietStream(sys.stdout)  # type: ignore[assignment]
    if sys.stderr is not None and not isinstance(sys.stderr, QuietStream):
        sys.stderr = QuietStream(sys.stderr)  # type: ignore[assignment]
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
