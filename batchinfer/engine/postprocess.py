"""Postprocessing: a step's logits → drawn tokens → progress, and a finished sequence → its output.

`Postprocessor.draw` samples each row on the device (grammar masks and logprobs included),
`score` records a scoring sequence's continuation logprobs, `accept` appends drawn tokens and
finishes the sequences that stop, and `complete` turns a finished sequence into its
`RequestOutput`. What each sequence gathers on the way (logprobs, scores, grammar matcher)
lives on its `Sequence`.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

import numpy as np
import torch

from batchinfer.engine.draws import Draw
from batchinfer.engine.host_copy import upload, upload_packed
from batchinfer.engine.model_runner import SequenceChunk
from batchinfer.engine.sampler import SamplingTensors, apply_token_bitmask, identity_key, sample, token_logprobs
from batchinfer.engine.scheduler import Scheduler
from batchinfer.engine.sequence import Sequence, StopRules
from batchinfer.engine.stats import StatsTally
from batchinfer.engine.types import ContinuationScore, RequestOutput, TokenLogprob


def draws_from_host_tokens(seqs: list[Sequence]) -> bool:
    """Whether drawing this step needs each row's earlier tokens on the host: a grammar (its
    next mask follows the last token) or a repetition penalty (the tokens seen)."""
    return any(s.request.grammar is not None or s.request.sampling.repetition_penalty != 1.0 for s in seqs)


def continuation_score(seq: Sequence) -> ContinuationScore:
    """A scoring sequence's continuation: summed logprob, length, all greedy."""
    end = seq.prompt_len - 1  # position q's logits score token q + 1
    scored = [seq.scores[q] for q in range(end - seq.request.score_tokens, end)]
    return ContinuationScore(math.fsum(lp for lp, _ in scored), len(scored), all(g for _, g in scored))


class Postprocessor:
    def __init__(self, stop_rules: StopRules, scheduler: Scheduler, tally: StatsTally) -> None:
        self.stop_rules = stop_rules
        self.scheduler = scheduler  # releases the cache of each sequence finished here
        self.tally = tally

    # ---- logits → tokens -------------------------------------------------------------------
    def draw(self, seqs: list[Sequence], logits: torch.Tensor) -> Draw:
        """Each sequence's next token from its logits ([N, V]), drawn on the device: [N] int64
        (no host sync), with the logprobs of the rows that ask (nothing computed when none does)."""
        params = [seq.request.sampling for seq in seqs]
        for seq in seqs:
            if seq.sample_key is None:
                seq.sample_key = identity_key(seq.request.sampling, seq.request.seed_key, seq.sample_index)
        # Index of the token drawn now among the outputs (tokens still in flight count).
        num_outputs = [len(seq.tokens) + seq.awaiting - seq.prompt_len for seq in seqs]
        penalised = any(p.repetition_penalty != 1.0 for p in params)
        banned = [(i, t) for i, (seq, p, n) in enumerate(zip(seqs, params, num_outputs)) if n < p.min_tokens
                  for t in sorted(self.stop_rules.stop_ids(seq))]
        tensors = SamplingTensors.from_columns(
            params, [seq.sample_key for seq in seqs], num_outputs,
            seen_token_ids=[seq.tokens if p.repetition_penalty != 1.0 else () for seq, p in zip(seqs, params)]
            if penalised else None, banned=banned, device=logits.device)
        asking = [i for i, p in enumerate(params) if p.logprobs is not None]
        constrained = [i for i, seq in enumerate(seqs) if seq.request.grammar is not None]
        raw = logits
        if constrained:
            logits = self._constrain([seqs[i] for i in constrained], constrained, logits, keep_raw=bool(asking))
        tokens = sample(logits, tensors)
        if not asking:
            return Draw(tokens)
        ks = tuple(params[i].logprobs for i in asking)
        rows = upload(torch.tensor(asking, dtype=torch.int64), logits.device)  # [R]
        return Draw(tokens, token_logprobs(raw, tokens, rows, max(ks)), tuple(asking), ks)

    @staticmethod
    def _constrain(seqs: list[Sequence], rows: list[int], logits: torch.Tensor, keep_raw: bool) -> torch.Tensor:
        """`logits` with each constrained row's disallowed tokens at -inf: the masks are filled on
        the host (on CUDA while the forward pass still runs: nothing here waits for it), uploaded
        as int32 bitmasks and unpacked on the device. A copy when the raw logits are still needed."""
        live, matchers = [], []
        for i, seq in enumerate(seqs):
            if seq.finished:  # stopped while this step was launched: its row is dropped, its matcher done
                continue
            if seq.matcher is None:
                seq.matcher = seq.request.grammar.matcher()
            live.append(i)
            matchers.append(seq.matcher)
        bitmask = np.full((len(seqs), (logits.shape[1] + 31) // 32), -1, dtype=np.int32)  # [R, W]; -1: all allowed
        if matchers:
            filled = np.zeros((len(matchers), bitmask.shape[1]), dtype=np.int32)
            seqs[live[0]].request.grammar.fill_masks(matchers, filled)
            bitmask[live] = filled
        device = logits.device
        with torch.inference_mode():  # the runner's logits are inference tensors: edited in place here
            masked = logits.clone() if keep_raw else logits
            every_row = len(rows) == logits.shape[0]  # rows are distinct and sorted: then 0..N-1
            apply_token_bitmask(masked, None if every_row else upload(torch.tensor(rows, dtype=torch.int64), device),
                                upload(torch.from_numpy(bitmask), device))
        return masked

    def score(self, scored: list[tuple[Sequence, SequenceChunk, int]], logits: torch.Tensor) -> list[Sequence]:
        """Record each scored position's next-token logprob and greedy match (raw fp32 log_softmax);
        a scoring sequence whose tokens are all computed is finished (it generates nothing)."""
        rows, targets, points = [], [], []
        for seq, chunk, first_row in scored:
            end = chunk.start + len(chunk.token_ids)
            for j, q in enumerate(range(end - chunk.score_logits, end)):
                if q + 1 < len(seq.tokens):  # the last position scores nothing
                    rows.append(first_row + j)
                    targets.append(seq.tokens[q + 1])
                    points.append((seq, q))
        if rows:
            row_ids, target_ids = upload_packed([torch.tensor(rows, dtype=torch.int64),
                                                 torch.tensor(targets, dtype=torch.int64)], logits.device)
            picked = logits[row_ids].float()                                        # [P, V]
            logprob = picked.log_softmax(dim=1).gather(1, target_ids[:, None])[:, 0]  # [P]
            greedy = picked.argmax(dim=1) == target_ids                              # [P]
            values = torch.stack([logprob, greedy.float()], dim=1).tolist()
            for (seq, q), (lp, g) in zip(points, values):
                seq.scores[q] = (lp, g > 0.5)  # a recompute overwrites: each once
        done = []
        for seq, _, _ in scored:
            if seq.computed == len(seq.tokens) and not seq.finished:
                self._finish(seq, "stop", done)
        return done

    # ---- tokens → progress -----------------------------------------------------------------
    def accept(self, seqs: list[Sequence], tokens: list[int],
               logprobs: Optional[list[Optional[TokenLogprob]]] = None) -> list[Sequence]:
        """Append each sequence's drawn token (and its logprobs, where asked) and finish those
        that stop (the scheduler releases their cache). A row whose sequence already finished
        (it was fed once more while its stop token was in flight) is dropped."""
        done = []
        stop_rules, max_len = self.stop_rules, self.stop_rules.max_model_len
        for i, (seq, token) in enumerate(zip(seqs, tokens)):
            if seq.finished:
                continue
            seq.append_token(token)
            if logprobs is not None and logprobs[i] is not None:
                seq.token_logprobs.append(logprobs[i])
            if seq.request.grammar is not None and not seq.matcher.accept(token):
                # The mask allowed nothing (e.g. min_tokens banned the only allowed EOS).
                seq.set_error(f"token {token} is not allowed by the grammar")
                self._finish(seq, "error", done)
                continue
            p = seq.request.sampling
            outputs = len(seq.tokens) - seq.prompt_len
            # The common case decided here: a plain token, no stop strings, far from any limit.
            if (outputs <= p.min_tokens or token not in stop_rules.stop_ids(seq)) and not p.stop \
                    and outputs < p.max_tokens and len(seq.tokens) < max_len:
                continue
            reason = stop_rules.finish_reason(seq)
            if reason is not None:
                self._finish(seq, reason, done)
        return done

    def _finish(self, seq: Sequence, reason: str, done: list[Sequence]) -> None:
        seq.finish(reason)
        self.scheduler.finish(seq)
        done.append(seq)

    # ---- a finished sequence → its output --------------------------------------------------
    def complete(self, seq: Sequence, unit_done: bool) -> RequestOutput:
        """The output of a finished sequence (its score or logprobs where asked), counted."""
        if seq.finish_reason == "error":
            self.tally.add(requests=1)
        else:
            cached = seq.cached_tokens or 0
            self.tally.add(requests=1, prompt_tokens=seq.prompt_len, cached_tokens=cached,
                           theoretical_max_cached_tokens=seq.planned_reuse, output_tokens=seq.num_outputs,
                           planned_reuse_lost_tokens=max(0, seq.planned_reuse - cached))
        output = seq.to_output(unit_done=unit_done)
        if seq.finish_reason != "error":
            if seq.request.score_tokens:
                output = replace(output, score=continuation_score(seq))
            elif seq.request.sampling.logprobs is not None:
                output = replace(output, logprobs=tuple(seq.token_logprobs))
        # Handed over: a finished sequence may live on as a follower's leader, holding nothing more.
        seq.token_logprobs, seq.scores, seq.matcher = [], {}, None
        return output
