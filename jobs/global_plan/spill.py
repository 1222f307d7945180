"""The tokenising pass: every input row to (row_index, prompt key or error), into sorted runs.

Windows of input rows are turned into prompts by `jobs.prompts.build_prompts` (the
tokenizer's batch encoder, multi-threaded in Rust) one window ahead on a helper thread,
while this thread turns the previous window's token ids into sort keys and hands them to
the external sort's run writer. Rows without a prompt keep their error (and the empty key)
so the runner can record them as error rows.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from batchinfer.jobs.global_plan.external_sort import RunWriter
from batchinfer.jobs.global_plan.keys import encode_key
from batchinfer.jobs.global_plan.unique_ids import IdHashes
from batchinfer.jobs.inputs.files import RowWindow, iter_windows
from batchinfer.jobs.inputs.prepared_job import PreparedJob
from batchinfer.jobs.inputs.prompts import PromptBatch, build_prompts

SPILL_WINDOW_ROWS = 4096  # rows tokenised per batch-encode call


@dataclass(frozen=True)
class SpillCounts:
    rows: int
    error_rows: int
    prompt_tokens: int  # Σ prompt lengths, one sample each


def prompt_batches(job: PreparedJob, window_rows: int) -> Iterator[tuple[RowWindow, PromptBatch]]:
    """Windows with their prompts; the next window is tokenised while the caller handles this one."""
    spec = job.spec

    def tokenise(window: RowWindow) -> PromptBatch:
        return build_prompts(window.table, spec.prompt, job.tokenizer, spec.chat, spec.system, job.vocab_size,
                             id_column=spec.id_column, max_chars=job.max_prompt_chars)

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="plan-tokenise") as pool:
        windows = iter_windows(job.inputs, window_rows, spec.limit)
        ahead = None
        for window in windows:
            submitted = (window, pool.submit(tokenise, window))
            if ahead is not None:
                yield ahead[0], ahead[1].result()
            ahead = submitted
        if ahead is not None:
            yield ahead[0], ahead[1].result()


def spill_prompts(job: PreparedJob, runs: RunWriter, on_rows: Optional[Callable[[int, int], None]] = None,
                  window_rows: int = SPILL_WINDOW_ROWS, ids: Optional[IdHashes] = None) -> SpillCounts:
    """Tokenise every row of the job (within `limit`) into `runs`; `on_rows(rows, tokens)` per window;
    each window's `id_column` into `ids` (the uniqueness check, in the same read of the input)."""
    rows = error_rows = prompt_tokens = 0
    for window, prompts in prompt_batches(job, window_rows):
        if ids is not None:
            ids.add(window.table[job.spec.id_column])
        keys = [b"" if ids is None else encode_key(ids) for ids in prompts.token_ids]
        count = window.table.num_rows
        runs.add_many(range(window.first_row, window.first_row + count), keys, prompts.errors)
        tokens = sum(map(len, keys)) // 4
        rows += count
        error_rows += sum(error is not None for error in prompts.errors)
        prompt_tokens += tokens
        if on_rows is not None:
            on_rows(count, tokens)
    return SpillCounts(rows=rows, error_rows=error_rows, prompt_tokens=prompt_tokens)
