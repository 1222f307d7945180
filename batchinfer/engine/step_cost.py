"""How long a forward step takes, and how many prompt tokens a mixed step should carry.

A step reads the weights once and each decode row's KV and state (memory), and multiplies every
token through the weights (compute); the two overlap, so a step costs the larger, plus a fixed
overhead when it carries prompt chunks (their attention / GDN prefill launches):

    step_ms(P, d) = prefill_overhead_ms·[P > 0] + max(weight_ms + row_ms·d, token_ms·(P + d))

Below the ridge (token_ms·(P + d) < weight_ms + row_ms·d) prompt tokens ride in a decode step
for free; past it each costs token_ms, as in a prefill step. `prefill_budget` picks the prompt
tokens of a mixed step that cost the least time per token beside the decode rows, so every
running row keeps decoding while prefill work remains. The constants are fitted on the GPU by
`benchmarks/step_cost.py` (`BATCHINFER_STEP_COST=weight_ms,row_ms,token_ms,prefill_overhead_ms`
sets them); otherwise `from_model` estimates them from the model's bytes and FLOPs at the
device's peak rates.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence

ENV = "BATCHINFER_STEP_COST"
CHUNK_GRANULE = 256  # prompt tokens per step come in these steps: few distinct shapes to compile
NEAR_BEST = 0.05  # per-token costs this close count as equal (the larger step wins)
# One H200 (SXM): HBM bytes/s and dense bf16 FLOP/s at the rates kernels reach (~85% / ~70% of peak).
HBM_BYTES_PER_S = 4.8e12 * 0.85
BF16_FLOPS = 989e12 * 0.7
# A step with prompt chunks pays its prefill launches over its compute: 7.4 ms for the 16-layer
# 27B on the H200 (the fit of docs/BENCHMARKS.md, "The mixed step's cost model"), per layer.
PREFILL_OVERHEAD_MS_PER_LAYER = 7.4 / 16


@dataclass(frozen=True)
class StepCost:
    weight_ms: float             # a step's weight read (and launch floor): the decode-only intercept
    row_ms: float                # each decode row's KV and state traffic
    token_ms: float              # each token's compute (prefill tokens and decode rows alike)
    prefill_overhead_ms: float = 0.0  # a step with prompt chunks, over its tokens' compute

    def __post_init__(self) -> None:
        if min(self.weight_ms, self.row_ms, self.token_ms, self.prefill_overhead_ms) < 0 or self.token_ms <= 0:
            raise ValueError(f"step cost constants must be >= 0 (token_ms > 0): {self}")

    def step_ms(self, prefill_tokens: int, decode_rows: int) -> float:
        memory = self.weight_ms + self.row_ms * decode_rows
        compute = self.token_ms * (prefill_tokens + decode_rows)
        return (self.prefill_overhead_ms if prefill_tokens else 0.0) + max(memory, compute)

    def prefill_budget(self, decode_rows: int, most: int, granule: int = CHUNK_GRANULE) -> int:
        """Prompt tokens for a step beside `decode_rows` decode rows, at most `most`: the largest
        multiple of `granule` whose extra time over the decode-only step per prompt token is within
        NEAR_BEST of the least (fewer, larger steps where the model sees no real difference: each
        step also pays host work the model leaves out); `most` itself without decode rows."""
        if decode_rows <= 0 or most <= granule:
            return max(0, most)
        base = self.step_ms(0, decode_rows)
        sizes = [*range(granule, most, granule), most]
        costs = [(self.step_ms(tokens, decode_rows) - base) / tokens for tokens in sizes]
        least = min(costs)
        return max(t for t, c in zip(sizes, costs) if c <= least * (1 + NEAR_BEST) + 1e-12)

    @classmethod
    def parse(cls, text: str) -> "StepCost":
        """`weight_ms,row_ms,token_ms[,prefill_overhead_ms]` (what benchmarks/step_cost.py prints)."""
        try:
            values = [float(v) for v in text.split(",")]
            return cls(*values)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{ENV} must be weight_ms,row_ms,token_ms[,prefill_overhead_ms], not {text!r}: "
                             f"{err}") from None

    @classmethod
    def from_model(cls, weight_bytes: int, active_params: int, row_bytes: int, layers: int = 0,
                   bytes_per_s: float = HBM_BYTES_PER_S, flops: float = BF16_FLOPS) -> "StepCost":
        """From the bytes a step reads (`weight_bytes`; `row_bytes` per decode row: its KV at the
        expected context and its state), the FLOPs per token (2 × `active_params`) and the prefill
        launches of `layers` layers. Without that overhead a MoE model (all experts' bytes, few
        active parameters) chose 768–2,560-token chunks, 3–10× the steps (docs/BENCHMARKS.md)."""
        return cls(weight_ms=1e3 * weight_bytes / bytes_per_s, row_ms=1e3 * row_bytes / bytes_per_s,
                   token_ms=1e3 * 2 * active_params / flops,
                   prefill_overhead_ms=PREFILL_OVERHEAD_MS_PER_LAYER * layers)


def active_params(model) -> int:
    """Parameters one token multiplies through: a MoE layer's routed experts count top_k of them."""
    config = model.config
    experts = getattr(config, "num_experts", 0) or 0
    top_k = getattr(config, "num_experts_per_tok", 0) or 0
    total = routed = 0
    for name, param in model.named_parameters():
        total += param.numel()
        if experts and ".experts." in name and "shared" not in name:
            routed += param.numel()
    return int(total - routed + (routed * top_k / experts if experts else 0))


def engine_step_cost(model, kv_bytes_per_token: int, state_bytes_per_slot: int,
                     context_tokens: int) -> Optional[StepCost]:
    """The mixed step's cost model: BATCHINFER_STEP_COST when set, else estimated from the model on
    a GPU (None on the CPU, where the constant `max_batch_tokens` stays)."""
    text = os.environ.get(ENV, "").strip()
    if text:
        return StepCost.parse(text)
    param = next(iter(model.parameters()), None)
    if param is None or param.device.type != "cuda":
        return None
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # A decode row reads its KV and its state and writes the state back.
    row_bytes = kv_bytes_per_token * context_tokens + 2 * state_bytes_per_slot
    return StepCost.from_model(weight_bytes, active_params(model), row_bytes, layers=model.config.num_hidden_layers)


def fit(samples: Sequence[tuple[int, int, float]]) -> StepCost:
    """Constants from measured steps (prompt tokens, decode rows, ms): decode-only steps give the
    weight read and the per-row cost (a line), the two largest prefill-only steps the per-token
    compute (their slope), and the smallest prefill-only step's excess over the model the overhead
    (launch-bound there: on the H200 a 256-token step of the 16-layer 27B took 12.7 ms where its
    weights and compute take 5.3; the larger steps hide it under their compute)."""
    decode = sorted((d, ms) for p, d, ms in samples if p == 0 and d > 0)
    prefill = sorted((p, ms) for p, d, ms in samples if d == 0 and p > 0)
    if len(decode) < 2 or len(prefill) < 2:
        raise ValueError("fit needs at least two decode-only and two prefill-only steps")
    row_ms, weight_ms = _line(decode)
    (p1, t1), (p2, t2) = prefill[-2:]
    token_ms = max((t2 - t1) / (p2 - p1), 1e-9)
    p0, ms0 = prefill[0]
    excess = ms0 - max(weight_ms, token_ms * p0)
    return StepCost(max(weight_ms, 0.0), max(row_ms, 0.0), token_ms, max(excess, 0.0))


def _line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares slope and intercept."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return slope, my - slope * mx
