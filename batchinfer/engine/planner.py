"""Offline prefix planning: sort a window of prompts, find branch points, compute the ideal reuse.

Lexicographic order of token ids is a depth-first walk of the prompt trie, so in sorted order
the predecessor of a prompt shares the longest prefix with it of all earlier prompts. Row i may
therefore reuse

    resume_depth[i] = min(lcp(sorted[i-1], sorted[i]), len[i] - 1)

tokens (at least one token is always computed: it produces the logits of the first output
token), and the ideal reuse of the window is Σ resume_depth. It is reachable: the *leader* of
row i — the earliest row sharing its first resume_depth[i] tokens — ends a prefill chunk at
exactly that depth and donates its state there; row i starts once that state exists.

Samples (`n > 1`): a prompt with n samples is planned as n identical rows. Sample 0 is
prefilled in full; each further sample resumes at `len - 1` from the state sample 0 leaves
there (its KV for the whole prompt but the last token is shared) and recomputes only the last
prompt token, which gives it its own logits row. So an n-sample prompt of length P ideally
reuses (n - 1)(P - 1) tokens on top of what its first sample reuses.
"""
from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass
from typing import Optional, Sequence, Union


@dataclass(frozen=True)
class PlannedRow:
    prompt_index: int              # index into the planned prompts
    sample_index: int              # 0..n-1 within that prompt
    resume_depth: int              # prompt tokens this row ideally reuses
    leader: Optional[int]          # DFS position of the row whose prefill produces that state
    branch_points: tuple[int, ...]  # branch depths this row leads: end a chunk there, track the state


@dataclass(frozen=True)
class PlanSummary:
    rows: int                      # (prompt, sample) pairs
    prompts: int
    prompt_tokens: int             # Σ over rows (a prompt with n samples counts n times)
    theoretical_max_cached_tokens: int
    shared_prefix_groups: int      # maximal runs of sorted rows that each reuse their predecessor's prefix
    branch_points: int             # planned branch points (states tracked for followers)

    @property
    def hit_rate(self) -> float:
        return self.theoretical_max_cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate}


@dataclass(frozen=True)
class Plan:
    rows: tuple[PlannedRow, ...]   # in DFS (sorted) order
    summary: PlanSummary


def _common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    limit = min(len(a), len(b))
    i = 0
    while i < limit and a[i] == b[i]:
        i += 1
    return i


def _samples_per_prompt(n: Union[int, Sequence[int]], count: int) -> list[int]:
    per_prompt = [n] * count if isinstance(n, int) else list(n)
    if len(per_prompt) != count or any(k < 0 for k in per_prompt):
        raise ValueError("n must be an int >= 0 or one count >= 0 per prompt")
    return per_prompt


def make_plan(prompts: Sequence[Sequence[int]], n: Union[int, Sequence[int]] = 1) -> Plan:
    """Plan `prompts` (token id sequences); `n` is the samples per prompt (int or one per prompt)."""
    per_prompt = _samples_per_prompt(n, len(prompts))
    keys = [(tuple(prompts[p]), p, s) for p in range(len(prompts)) for s in range(per_prompt[p])]
    keys.sort()  # token ids first: DFS order of the trie; ties by (prompt, sample) keep it stable

    resume: list[int] = []
    leaders: list[Optional[int]] = []
    lcp_stack: list[int] = []    # strictly increasing neighbour LCPs of ...
    index_stack: list[int] = []  # ... these rows: candidates for "last row whose LCP < x"
    for i, (tokens, _, _) in enumerate(keys):
        lcp = _common_prefix_length(keys[i - 1][0], tokens) if i else 0
        depth = max(0, min(lcp, len(tokens) - 1))
        while lcp_stack and lcp_stack[-1] >= lcp:
            lcp_stack.pop()
            index_stack.pop()
        lcp_stack.append(lcp)
        index_stack.append(i)
        leader = None
        if depth > 0:
            # The leader is the last row m <= i whose LCP with its predecessor is < depth: rows
            # m..i all share the first `depth` tokens and m-1 does not. Some row on the stack is it.
            leader = index_stack[bisect.bisect_left(lcp_stack, depth) - 1]
        resume.append(depth)
        leaders.append(leader)

    points: list[set[int]] = [set() for _ in keys]  # each row's branch points
    for depth, leader in zip(resume, leaders):
        if leader is not None:
            points[leader].add(depth)

    rows = tuple(
        PlannedRow(prompt_index=p, sample_index=s, resume_depth=resume[i], leader=leaders[i],
                   branch_points=tuple(sorted(points[i])))
        for i, (_, p, s) in enumerate(keys))
    # A group starts where a reusing row follows a non-reusing one (row 0 never reuses).
    groups = sum(1 for i in range(1, len(rows)) if resume[i] > 0 and resume[i - 1] == 0)
    summary = PlanSummary(
        rows=len(rows), prompts=len(prompts),
        prompt_tokens=sum(len(prompts[p]) * k for p, k in enumerate(per_prompt)),
        theoretical_max_cached_tokens=sum(resume),
        shared_prefix_groups=groups,
        branch_points=sum(len(c) for c in points))
    return Plan(rows=rows, summary=summary)


def plan_prompts(prompts: Sequence[Sequence[int]], n: Union[int, Sequence[int]] = 1) -> PlanSummary:
    """The plan's summary only: what `batchinfer plan` prints, no model needed."""
    return make_plan(prompts, n).summary
