"""One (request, sample) pair as the engine runs it: tokens, progress, plan links, stop rules.

A `Sequence` changes only through its methods: the scheduler admits, advances, preempts and
releases it; postprocessing appends its tokens, gathers its logprobs, scores and grammar state,
and finishes it. The fields marked as memos are derived values kept beside it for the decode
hot path.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence as Seq

from batchinfer.engine.types import Request, RequestOutput, TokenLogprob

Detokenize = Callable[[Seq[int]], str]


@dataclass(eq=False)
class Sequence:
    request: Request
    sample_index: int
    priority: tuple[int, int]            # (planning window, DFS position): admission order
    planned_reuse: int                   # the planner's ideal reuse for this sample
    branch_points: frozenset[int]        # planned branch points (depths) this sequence's prefill leads
    leader: Optional["Sequence"]         # produces the state at `planned_reuse` (None: no reuse)
    unit_index: int = 0                  # the generate call's unit (plan window) this sample belongs to
    followers: dict[int, list["Sequence"]] = field(default_factory=dict, repr=False)  # branch point → who resumes there
    # Prompt, then sampled outputs: the sequence's one token list (its cache handle reads it by
    # reference). Tokens drawn by a decode step still in flight are not in it yet (`awaiting`).
    tokens: list[int] = field(default_factory=list)
    handle: object = None                # cache.SeqHandle while running, else None
    computed: int = 0                    # leading tokens whose KV and GDN state are in place
    high_water: int = 0                  # most tokens ever computed; survives preemption
    cached_tokens: Optional[int] = None  # prompt tokens reused at the first admission
    # Tokens drawn on the device by decode steps still in flight, behind `tokens` (engine
    # overlap: the next step is launched before the host reads this one's tokens).
    awaiting: int = 0
    # Memo: (previous row's handle, this handle, their tree_lens, shared KV positions): the decode
    # batch's `shared_with_prev` for this row, kept while neither side changes (decode_rows).
    shared_memo: Optional[tuple] = field(default=None, repr=False)
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    # Memos: per-sample constants the decode hot path reads every step (Postprocessor.draw, accept).
    stop_token_ids: Optional[frozenset[int]] = field(default=None, repr=False)  # set by StopRules
    sample_key: Optional[tuple[int, int]] = field(default=None, repr=False)     # sampler.identity_key
    prompt_len: int = field(init=False, default=0)
    # Gathered by postprocessing (engine/postprocess.py), read when the sequence completes.
    token_logprobs: list[TokenLogprob] = field(default_factory=list, repr=False)  # when sampling.logprobs is set
    # A scoring sequence's positions → (logprob of the next token, whether it is the argmax).
    scores: dict[int, tuple[float, bool]] = field(default_factory=dict, repr=False)
    matcher: object = field(default=None, repr=False)  # a constrained sequence's grammar matcher

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.request.prompt_token_ids)
        self.prompt_len = len(self.request.prompt_token_ids)

    @property
    def outputs(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def num_outputs(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def pending(self) -> int:
        """Tokens still to feed to the model (the last sampled token counts, on the host or not)."""
        return len(self.tokens) + self.awaiting - self.computed

    # ---- changes (the scheduler's) ----------------------------------------------------------
    def add_follower(self, follower: "Sequence") -> None:
        """`follower` plans to resume from this sequence's state at its `planned_reuse`."""
        self.followers.setdefault(follower.planned_reuse, []).append(follower)

    def admitted(self, handle) -> None:
        """Running on `handle` (a cache.SeqHandle): its first resume_len tokens are computed."""
        self.handle = handle
        self.computed = handle.resume_len
        if self.cached_tokens is None:
            self.cached_tokens = handle.resume_len
        self.high_water = max(self.high_water, self.computed)

    def advance(self, n: int) -> None:
        """`n` more tokens computed (KV and GDN state in place)."""
        self.computed += n
        self.high_water = max(self.high_water, self.computed)

    def released(self, recompute: bool = False) -> None:
        """Its cache handle is gone (finished, dropped); `recompute`: preempted, starts over."""
        self.handle = None
        if recompute:
            self.computed = 0

    def set_error(self, error: str) -> None:
        """Why it cannot run; the engine finishes it with reason "error"."""
        self.error = error

    # ---- changes (postprocessing's) -----------------------------------------------------------
    def append_token(self, token: int) -> None:
        self.tokens.append(token)

    def finish(self, reason: str) -> None:
        self.finish_reason = reason

    def token_in_flight(self) -> None:
        """A decode step drew its next token on the device; the host has not read it yet."""
        self.awaiting += 1

    def token_landed(self) -> None:
        """The host read a token that was in flight (it is appended next)."""
        self.awaiting -= 1

    def awaits_last_token(self, max_model_len: int) -> bool:
        """A token in flight will end this sequence by length: there is nothing more to feed."""
        if not self.awaiting:
            return False
        total = len(self.tokens) + self.awaiting
        return total - self.prompt_len >= self.request.sampling.max_tokens or total >= max_model_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def is_ready(self) -> bool:
        """The state this sequence plans to resume from exists (or never will: leader done)."""
        leader = self.leader
        return leader is None or leader.finished or leader.high_water >= self.planned_reuse

    def to_output(self, unit_done: bool = False) -> RequestOutput:
        return RequestOutput(
            request_id=self.request.request_id, sample_index=self.sample_index,
            token_ids=tuple(self.outputs), finish_reason=self.finish_reason,
            prompt_tokens=self.prompt_len, cached_tokens=self.cached_tokens or 0,
            completion_tokens=self.num_outputs, error=self.error,
            theoretical_max_cached_tokens=self.planned_reuse, unit_index=self.unit_index, unit_done=unit_done)


@dataclass(frozen=True)
class StopRules:
    """Engine-wide stopping inputs: EOS ids, the model's length limit, the detokenizer."""
    eos_token_ids: frozenset[int]
    max_model_len: int
    detokenize: Optional[Detokenize] = None

    def stop_ids(self, seq: Sequence) -> frozenset[int]:
        if seq.stop_token_ids is None:  # computed once per sequence: checked every step
            params = seq.request.sampling
            ids = frozenset(params.stop_token_ids)
            seq.stop_token_ids = ids if params.ignore_eos else ids | self.eos_token_ids
        return seq.stop_token_ids

    def finish_reason(self, seq: Sequence) -> Optional[str]:
        """After a token was appended: "stop", "length" or None (go on). The stop token stays
        in the output; a stop string ends generation at the token that completed it."""
        params = seq.request.sampling
        if seq.num_outputs > params.min_tokens:  # the newest token was drawn at index >= min_tokens
            if seq.tokens[-1] in self.stop_ids(seq) or self._hit_stop_string(seq):
                return "stop"
        if seq.num_outputs >= params.max_tokens or len(seq.tokens) >= self.max_model_len:
            return "length"
        return None

    def _hit_stop_string(self, seq: Sequence) -> bool:
        stops = seq.request.sampling.stop
        if not stops or self.detokenize is None:
            return False
        # A stop string can span tokens; a window of a few more tokens than its characters covers it.
        window = max(len(s) for s in stops) + 8
        text = self.detokenize(seq.outputs[-window:])
        return any(s in text for s in stops)
