"""Between rows and the engine: a row's request (its per-row seed key) and an output's result row.

Shared by the per-window runner and the unit runner, so both plan modes send the engine the
same requests and write the same results for the same rows.
"""
from __future__ import annotations

import zlib
from typing import Any, Optional

from batchinfer.engine.types import Request, RequestOutput, SamplingParams
from batchinfer.jobs.outdir.part_writer import SampleResult
from batchinfer.jobs.inputs.prepared_job import ReasoningSplit
from batchinfer.jobs.tasks.reasoning import split_reasoning
from batchinfer.jobs.inputs.tokenizer import CheckpointTokenizer
from batchinfer.jobs.tasks.scoring import ScoreRows


def seed_key(row_index: int, row_id: Any) -> int:
    """Per-row RNG key: the id column's value when given, so samples follow the row, not its position."""
    if row_id is None:
        return row_index
    if isinstance(row_id, int) and not isinstance(row_id, bool):
        return row_id & 0x7FFF_FFFF_FFFF_FFFF
    return zlib.crc32(repr(row_id).encode())


def cut_at_stop(text: str, stops: tuple[str, ...]) -> str:
    """Generated text ends before the first stop string (which the engine's tokens may include)."""
    cut = min((i for i in (text.find(stop) for stop in stops) if i >= 0), default=-1)
    return text if cut < 0 else text[:cut]


def row_request(row_index: int, token_ids: Any, sampling: SamplingParams, row_id: Any,
                done_samples: Optional[frozenset[int]] = None, grammar: Any = None) -> Request:
    return Request(request_id=row_index, prompt_token_ids=tuple(token_ids), sampling=sampling,
                   seed_key=seed_key(row_index, row_id), skip_samples=tuple(sorted(done_samples or ())),
                   grammar=grammar)


def error_result(row_index: int, sample: int, error: str) -> SampleResult:
    """A row without a prompt: recorded without reaching the engine."""
    return SampleResult(row_index, sample, "", (), 0, 0, 0, "error", error)


def output_result(output: RequestOutput, tokenizer: CheckpointTokenizer, stops: tuple[str, ...],
                  reasoning: ReasoningSplit = ReasoningSplit(), scores: Optional[ScoreRows] = None) -> Optional[SampleResult]:
    """A generation output's result row; a scoring output goes to `scores`, which gives its row's
    result with the row's last continuation (None before)."""
    if output.score is not None or isinstance(output.request_id, tuple):
        return scores.add(output)
    text = cut_at_stop(tokenizer.decode(output.token_ids), stops)
    reasoning_text, truncated = None, None
    if reasoning.enabled and output.finish_reason != "error":
        parts = split_reasoning(text, reasoning.starts_inside)
        text, reasoning_text, truncated = parts.answer, parts.reasoning, parts.truncated
    return SampleResult(
        row_index=int(output.request_id), sample_index=output.sample_index, generated_text=text,
        output_token_ids=tuple(output.token_ids), prompt_tokens=output.prompt_tokens,
        cached_tokens=output.cached_tokens, completion_tokens=output.completion_tokens,
        finish_reason=output.finish_reason, error=output.error,
        reasoning_text=reasoning_text, reasoning_truncated=truncated, logprobs=logprob_rows(output))


def logprob_rows(output: RequestOutput) -> Optional[list[dict]]:
    """The output's token logprobs as `logprobs` column rows (top_ids / top_logprobs null with k = 0)."""
    if output.logprobs is None:
        return None
    return [{"logprob": e.logprob, "top_ids": list(e.top_ids) or None, "top_logprobs": list(e.top_logprobs) or None}
            for e in output.logprobs]
