"""A job checked and opened for running (`PreparedJob`), as `jobs/run/prepare.py` builds it.

It sits under the planning pass and the unit inputs, which read a job's inputs through it; the
checks that build it (`prepare.prepare_job`) stay in `run/`, since they reach every layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from batchinfer.jobs.inputs.files import InputFiles
from batchinfer.jobs.inputs.tokenizer import CheckpointTokenizer
from batchinfer.jobs.spec.job_file import JobSpec
from batchinfer.jobs.spec.sampling_defaults import ResolvedSampling


@dataclass(frozen=True)
class ReasoningSplit:
    """How a job's generated text is split (enabled False: it is not)."""

    enabled: bool = False
    starts_inside: bool = False  # the prompt ends inside an open reasoning block


@dataclass(frozen=True)
class PreparedJob:
    spec: JobSpec
    checkpoint: Path
    vocab_size: int
    tokenizer: CheckpointTokenizer
    inputs: InputFiles
    fingerprint: dict[str, Any]
    sampling: Optional[ResolvedSampling] = None  # spec.sampling is its params; this adds where each came from
    reasoning: ReasoningSplit = ReasoningSplit()
    max_prompt_chars: Optional[int] = None  # longer prompt text is refused untokenised (prompts.prompt_char_limit)

    @property
    def rows(self) -> int:
        limit = self.spec.limit
        return self.inputs.num_rows if limit is None else min(limit, self.inputs.num_rows)
