"""Decode overlap: at most one decode step whose tokens the host has not read yet.

With `config.overlap_decode` the engine launches decode step k + 1 before it reads step k's
tokens, so the GPU never waits for the host's bookkeeping: step k's tokens were drawn on the
device, are fed to step k + 1 straight from there (`decode_rows`), and reach the host through
a pinned copy (`host_copy.Download`) that is read only after the next launch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from batchinfer.engine.draws import Draw, DrawDownload
from batchinfer.engine.sequence import Sequence
from batchinfer.engine.types import TokenLogprob


@dataclass(frozen=True)
class InFlightDecode:
    """A decode step launched with its tokens drawn on the device, not yet read by the host."""
    seqs: list[Sequence]   # its rows, in order
    tokens: torch.Tensor   # [B] int64 on the device: what the next step feeds those still going
    download: DrawDownload  # the same tokens (and any logprobs) on their way to the host


class DecodeOverlap:
    """Owns the step in flight: `launch` leaves one there, `take` reads it back on the host."""

    def __init__(self) -> None:
        self.step: Optional[InFlightDecode] = None

    def launch(self, seqs: list[Sequence], draw: Draw) -> None:
        """Leave this step's draw (tokens [B] on the device) in flight; the previous one must be taken."""
        assert self.step is None, "take the step in flight before launching another"
        for seq in seqs:
            seq.token_in_flight()
        self.step = InFlightDecode(seqs, draw.tokens, DrawDownload(draw))

    def take(self) -> tuple[list[Sequence], list[int], Optional[list[Optional[TokenLogprob]]]]:
        """The step in flight read on the host (waits for its copy): its rows, their tokens and
        logprobs (`DrawDownload.read`); nothing when none is in flight."""
        step, self.step = self.step, None
        if step is None:
            return [], [], None
        for seq in step.seqs:
            seq.token_landed()
        return (step.seqs, *step.download.read())

    def clear(self) -> None:
        """Forget the step in flight (a generate call closed early: its sequences are dropped)."""
        self.step = None
