"""What one step drew on the device, and its way to the host.

`Draw` holds a step's tokens and, for the rows that ask (`sampling.logprobs`), their packed
logprobs (`sampler.token_logprobs`). `DrawDownload` starts both copies at once, so a step kept
in flight (overlap) brings its logprobs back with its tokens and no extra sync.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from batchinfer.engine.host_copy import Download
from batchinfer.engine.sampler import unpack_logprobs
from batchinfer.engine.types import TokenLogprob


@dataclass(frozen=True)
class Draw:
    tokens: torch.Tensor                       # [N] int64 on the device
    logprobs: Optional[torch.Tensor] = None    # [R, 1 + 2k] fp32 on the device (token_logprobs), None: no row asks
    logprob_rows: tuple[int, ...] = ()         # [R] which of the N rows, on the host
    logprob_ks: tuple[int, ...] = ()           # [R] each such row's k


HostDraw = tuple[list[int], Optional[list[Optional[TokenLogprob]]]]


def _on_host(draw: Draw, tokens: list[int], logprobs: Optional[torch.Tensor]) -> HostDraw:
    """The tokens, and per row its TokenLogprob (None where the row did not ask; the whole
    list None when no row did)."""
    if logprobs is None:
        return tokens, None
    per_row: list[Optional[TokenLogprob]] = [None] * len(tokens)
    for row, entry in zip(draw.logprob_rows, unpack_logprobs(logprobs, draw.logprob_ks)):
        per_row[row] = entry
    return tokens, per_row


def read_now(draw: Draw) -> HostDraw:
    """A draw read at once (a step not kept in flight): waits for the device."""
    return _on_host(draw, draw.tokens.tolist(), None if draw.logprobs is None else draw.logprobs.cpu())


class DrawDownload:
    """A draw's tensors on their way to the host; `read` waits for them only."""

    def __init__(self, draw: Draw) -> None:
        self.draw = draw
        self._logprobs = None if draw.logprobs is None else Download(draw.logprobs)
        self._tokens = Download(draw.tokens)

    def read(self) -> HostDraw:
        return _on_host(self.draw, self._tokens.tolist(), None if self._logprobs is None else self._logprobs.tensor())
