"""Which decoder layers each pipeline stage runs: a cost estimate per layer and a balanced split.

A layer's cost is the bytes its weights take (read once per step) plus a per-token FLOP term
(`tokens_per_step` tokens at `BYTES_PER_FLOP`, the H200's bandwidth over its bf16 throughput),
so GDN, attention, dense and MoE layers weigh what they move and compute: a MoE layer stores
every expert but computes with `num_experts_per_tok` of them. The embedding (a row gather) costs
nothing per token and sits on the first stage; the final norm and the LM head (a GEMM over the
vocabulary) on the last. `split_layers` cuts the layers into contiguous runs that minimise the
largest stage cost (a small dynamic programme), every stage at least one layer.

Pure functions of a `ModelConfig`: `batchinfer plan` and the engine use the same split.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from batchinfer.models.config import LINEAR_ATTENTION, ModelConfig

# H200: 4.8 TB/s over ~990 dense bf16 TFLOP/s: a FLOP costs what moving this many bytes costs.
BYTES_PER_FLOP = 4.8e12 / 990e12
DEFAULT_TOKENS_PER_STEP = 256  # a full decode step at the default max_running


@dataclass(frozen=True)
class LayerCost:
    weight_params: int   # parameters stored
    active_params: int   # parameters one token multiplies with (MoE: its top-k experts)


def _mixer_params(config: ModelConfig, layer_id: int) -> int:
    c, h = config, config.hidden_size
    if config.layer_types[layer_id] == LINEAR_ATTENTION:
        v_heads = c.linear_num_value_heads
        in_proj = h * (c.conv_dim + c.gdn_value_dim + 2 * v_heads)  # q|k|v, z, b|a
        return in_proj + c.conv_dim * c.linear_conv_kernel_dim + c.gdn_value_dim * h + 3 * v_heads
    q = h * c.num_attention_heads * c.head_dim * 2  # q and its output gate
    kv = 2 * h * c.num_kv_heads * c.head_dim
    return q + kv + c.num_attention_heads * c.head_dim * h + 2 * c.head_dim


def layer_cost(config: ModelConfig, layer_id: int) -> LayerCost:
    """Parameters of one decoder layer, stored and active per token (norms included)."""
    h = config.hidden_size
    mixer = _mixer_params(config, layer_id) + 2 * h
    if config.is_moe_layer(layer_id):
        expert = 3 * h * config.moe_intermediate_size
        shared = 3 * h * config.shared_expert_intermediate_size + h  # + its sigmoid gate
        router = h * config.num_experts
        stored = config.num_experts * expert + shared + router
        active = config.num_experts_per_tok * expert + shared + router
        return LayerCost(mixer + stored, mixer + active)
    dense = 3 * h * config.intermediate_size
    return LayerCost(mixer + dense, mixer + dense)


def cost_units(cost: LayerCost, weight_bytes_per_param: float, tokens_per_step: int) -> float:
    """Bytes-equivalent cost of one step through this part: weights read + 2 FLOPs per active
    parameter per token."""
    return cost.weight_params * weight_bytes_per_param + BYTES_PER_FLOP * 2 * cost.active_params * tokens_per_step


@dataclass(frozen=True)
class StageSplit:
    """Layer ranges per stage (`[start, end)`, contiguous, in order) and each stage's cost."""

    bounds: tuple[tuple[int, int], ...]
    costs: tuple[float, ...]
    weight_bytes: tuple[int, ...]   # each stage's weights (embedding / LM head included)

    @property
    def num_stages(self) -> int:
        return len(self.bounds)

    def layers(self, stage: int) -> range:
        return range(*self.bounds[stage])

    @property
    def balance(self) -> float:
        """Mean stage cost over the largest (1.0: perfectly even; the pipeline runs at the slowest)."""
        return sum(self.costs) / (len(self.costs) * max(self.costs)) if max(self.costs) > 0 else 1.0

    def describe(self) -> str:
        parts = [f"stage {s}: layers {a}-{b - 1} ({self.weight_bytes[s] / 2**30:.2f} GiB)"
                 for s, (a, b) in enumerate(self.bounds)]
        return "; ".join(parts) + f"; predicted balance {self.balance:.1%}"


def split_layers(config: ModelConfig, num_stages: int, *, weight_bytes_per_param: float = 2.0,
                 tokens_per_step: int = DEFAULT_TOKENS_PER_STEP) -> StageSplit:
    """Contiguous layer runs for `num_stages` stages minimising the largest stage cost (ties: the
    earliest cut). Raises ValueError when there are more stages than layers."""
    n = config.num_layers
    if not 1 <= num_stages <= n:
        raise ValueError(f"pipeline_stages must be between 1 and the model's {n} layers, got {num_stages}")
    layer_costs = [layer_cost(config, i) for i in range(n)]
    per_layer = [cost_units(c, weight_bytes_per_param, tokens_per_step) for c in layer_costs]
    vocab = config.vocab_size * config.hidden_size
    embed = vocab * weight_bytes_per_param
    head = cost_units(LayerCost(0 if config.tie_word_embeddings else vocab, vocab), weight_bytes_per_param,
                      tokens_per_step)
    prefix = [0.0]
    for c in per_layer:
        prefix.append(prefix[-1] + c)

    def run_cost(a: int, b: int) -> float:  # layers [a, b) plus the ends they carry
        return prefix[b] - prefix[a] + (embed if a == 0 else 0.0) + (head if b == n else 0.0)

    @lru_cache(maxsize=None)
    def best(start: int, stages: int) -> tuple[float, tuple[int, ...]]:
        """(largest stage cost, cut points) of layers [start, n) over `stages` stages."""
        if stages == 1:
            return run_cost(start, n), ()
        options = []
        for cut in range(start + 1, n - stages + 2):
            rest, cuts = best(cut, stages - 1)
            options.append((max(run_cost(start, cut), rest), (cut, *cuts)))
        return min(options, key=lambda o: o[0])

    _, cuts = best(0, num_stages)
    edges = (0, *cuts, n)
    bounds = tuple(zip(edges[:-1], edges[1:]))
    weights = []
    for a, b in bounds:
        params = sum(layer_costs[i].weight_params for i in range(a, b))
        params += (vocab if a == 0 else 0) + (vocab if b == n and (not config.tie_word_embeddings or a != 0) else 0)
        weights.append(int(params * weight_bytes_per_param))
    return StageSplit(bounds=bounds, costs=tuple(run_cost(a, b) for a, b in bounds), weight_bytes=tuple(weights))


def check_stages_fit(split: StageSplit, device_bytes: list[int], model_name: str = "the model") -> None:
    """Raise ValueError naming the model's size and the memory available when a stage's weights
    do not fit its device (`device_bytes[s]`: memory stage s may use)."""
    for s, (need, have) in enumerate(zip(split.weight_bytes, device_bytes)):
        if need > have:
            gib = 2 ** 30
            raise ValueError(
                f"{model_name} ({sum(split.weight_bytes) / gib:.1f} GiB of weights) does not fit "
                f"{split.num_stages} pipeline stages: stage {s} needs {need / gib:.1f} GiB, "
                f"{have / gib:.1f} GiB available on its device; use more stages or an FP8 checkpoint")
