"""A step's model inputs from the scheduler's plan, and what each of its logits rows is for.

A prefill chunk is a `SequenceChunk` (`sequence_chunk`). A prefill forward, or a mixed one
(prefill chunks, then decode rows), returns logits rows in batch order: `num_logits` per chunk,
then one per decode row. `LogitsRows` says which rows draw a token (chunks that end their
sequence's tokens, then every decode row) and which score a continuation.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from batchinfer.engine.model_runner import SequenceChunk
from batchinfer.engine.sequence import Sequence


def sequence_chunk(seq: Sequence, n: int) -> SequenceChunk:
    """`seq`'s next `n` tokens as a prefill chunk; logits where it ends the sequence's tokens
    (a token is drawn there) or, for a scoring sequence, at each continuation position it holds."""
    start, end = seq.computed, seq.computed + n
    score_logits = 0
    if seq.request.score_tokens:  # logits from the position before the continuation on
        score_logits = max(0, end - max(start, len(seq.tokens) - seq.request.score_tokens - 1))
    return SequenceChunk(token_ids=seq.tokens[start:end], start=start, state_slot=seq.handle.working_slot,
                         context_kv=seq.handle.kv_indices[:end],
                         wants_logits=end == len(seq.tokens) and not seq.request.score_tokens,
                         score_logits=score_logits)


@dataclass(frozen=True)
class LogitsRows:
    sampled: list[Sequence] = field(default_factory=list)  # sequences drawing a token, in row order
    sample_rows: list[int] = field(default_factory=list)   # their logits rows
    scored: list[tuple[Sequence, SequenceChunk, int]] = field(default_factory=list)  # (seq, chunk, its first row)


def logits_rows(items: list[tuple[Sequence, int]], chunks: list[SequenceChunk],
                decode: list[Sequence] = ()) -> LogitsRows:
    """The logits rows of a step over prefill `items` (as `chunks`) followed by `decode` rows."""
    rows = LogitsRows()
    row = 0
    for (seq, _), chunk in zip(items, chunks):
        if chunk.wants_logits:
            rows.sampled.append(seq)
            rows.sample_rows.append(row)
        elif chunk.score_logits:
            rows.scored.append((seq, chunk, row))
        row += chunk.num_logits
    rows.sampled.extend(decode)
    rows.sample_rows.extend(range(row, row + len(decode)))
    return rows
