"""Scoring jobs (task: score) between rows and the engine: one scoring request per (row,
continuation), and the row's result once all its continuations are back.

Each continuation's tokens are tokens(prompt + continuation) minus the prompt's tokens when the
prompt's tokens are a prefix of the joint tokenisation (the continuation is scored as the model
would read it after the prompt: " Paris" after "Capital:" may merge differently alone); when they
are not (a merge across the boundary), the continuation is tokenised alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from batchinfer.engine.types import Request, RequestOutput, SamplingParams
from batchinfer.jobs.outdir.part_writer import SampleResult
from batchinfer.jobs.inputs.tokenizer import CheckpointTokenizer

_SCORE_SAMPLING = SamplingParams(max_tokens=1)  # unused by scoring requests (they generate nothing)


def continuations_of(value: Any) -> Optional[list[str]]:
    """A continuations cell (a list of strings or one string) as a list; None for a null cell."""
    if value is None:
        return None
    return [value] if isinstance(value, str) else list(value)


def continuation_token_ids(tokenizer: CheckpointTokenizer, prompt_ids: Sequence[int],
                           continuations: Sequence[str]) -> list[list[int]]:
    """Each continuation's tokens after the prompt (see the module docstring)."""
    prompt = list(prompt_ids)
    prompt_text = tokenizer.tokenizer.decode(prompt, skip_special_tokens=False)
    joint = tokenizer.encode_batch([prompt_text + c for c in continuations], add_special_tokens=False)
    alone = None
    result = []
    for j, ids in enumerate(joint):
        if ids[:len(prompt)] == prompt and len(ids) > len(prompt):
            result.append(ids[len(prompt):])
        else:
            if alone is None:
                alone = tokenizer.encode_batch(list(continuations), add_special_tokens=False)
            result.append(alone[j])
    return result


def score_requests(row_index: int, prompt_ids: Sequence[int], continuation_ids: list[list[int]],
                   seed_key: int) -> list[Request]:
    """One scoring request per continuation; request_id (row, continuation index)."""
    return [Request(request_id=(row_index, j), prompt_token_ids=tuple(prompt_ids) + tuple(ids),
                    sampling=_SCORE_SAMPLING, seed_key=seed_key, score_tokens=len(ids))
            for j, ids in enumerate(continuation_ids)]


def row_score_requests(tokenizer: CheckpointTokenizer, row_index: int, prompt_ids: Sequence[int], cell: Any,
                       seed_key: int) -> tuple[list[Request], Optional[str]]:
    """A row's scoring requests from its continuations cell, or why it cannot be scored (its
    output row says so)."""
    continuations = continuations_of(cell)
    if not continuations:
        return [], "no continuations to score"
    ids = continuation_token_ids(tokenizer, prompt_ids, continuations)
    empty = [j for j, c in enumerate(ids) if not c]
    if empty:
        return [], f"continuation {empty[0]} has no tokens"
    return score_requests(row_index, prompt_ids, ids, seed_key), None


@dataclass
class ScoreRows:
    """Collects a row's scoring outputs; `add` gives the row's result with its last one."""

    _open: dict[int, tuple[int, dict[int, RequestOutput]]] = field(default_factory=dict)

    def expect(self, row_index: int, count: int) -> None:
        self._open[row_index] = (count, {})

    def add(self, output: RequestOutput) -> Optional[SampleResult]:
        row, j = output.request_id
        count, got = self._open[row]
        got[j] = output
        if len(got) < count:
            return None
        del self._open[row]
        outputs = [got[k] for k in range(count)]
        failed = next((o for o in outputs if o.finish_reason == "error"), None)
        # The row's token counts are its requests' (prompt + continuation, each), as the engine counts
        # them: cached <= prompt per row, and rows, progress and _stats.json add up to the same rate.
        prompt = sum(o.prompt_tokens for o in outputs)
        cached = sum(o.cached_tokens for o in outputs)
        if failed is not None:
            return SampleResult(row, 0, "", (), prompt, cached, 0, "error", failed.error)
        return SampleResult(
            row_index=row, sample_index=0, generated_text="", output_token_ids=(),
            prompt_tokens=prompt, cached_tokens=cached, completion_tokens=0,
            finish_reason="stop", continuation_logprobs=[o.score.logprob for o in outputs],
            continuation_tokens=[o.score.tokens for o in outputs], continuation_greedy=[o.score.greedy for o in outputs])
