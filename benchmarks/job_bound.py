"""The fastest a job of unshared prompts could run on one GPU, from its FLOPs and bytes alone.

    python -m benchmarks.job_bound                  # SGLang's published rows: 8,192 in / 1,024 out, one H200
    python -m benchmarks.job_bound --presets qwen3.5-27b --prompts 288 --kv-cache-dtype fp8_e4m3

No GPU needed: the model is built on the meta device (its weights' shapes and dtypes), the rows
that run at once come from the engine's own sizing (`cache.budget.size_max_running` on the pools
`EngineBuilder` would leave beside the weights on a device of `--device-gib`), and each part of
the job is timed at the ceilings this page's measurements reached (docs/BENCHMARKS.md, "Machine"):

- prefill, per prompt: every matrix once per token (a MoE token: its k routed experts and the
  shared one) at the bf16 or FP8 GEMM rate of its weight, causal attention (2·L²·heads·head_dim
  per attention layer) and the chunked GDN (H_v·(6·d_k·d_v + 2·64·(d_k + d_v)) per token and
  layer) at the bf16 rate, the LM head for one row; and never less than one read of the weights
  per step of `max_batch_tokens`;
- decode, per step of B rows at their mean context (prompt + half the output): the larger of its
  bytes at the copy bandwidth (every weight once, of a MoE's routed experts only those B rows
  route to on average; the KV of every context position; the GDN state as ReplaySSM moves it: its
  bf16 snapshot read, half the ring, conv state read and written) and its FLOPs at the GEMM rate.
  The job decodes in ceil(N / B) waves of `output` steps.

Two bounds: prefill then decode (the engine's two forwards a step, in turn), and overlapped
(the larger of the job's total compute time and its total byte time: prefill compute hiding the
decode's memory traffic entirely, which no schedule reaches fully). Each row names the targets of
the throughput issue (1.5× SGLang's published H200 rows) and where they fall against both.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch

from batchinfer.cache.budget import pool_budget
from batchinfer.cache.shapes import shapes_from_model_config
from batchinfer.engine.build import activation_reserve_bytes, default_step_tokens
from batchinfer.engine.config import EngineConfig, KV_CACHE_DTYPES
from batchinfer.models.config import ModelConfig, model_config_from_dict
from batchinfer.models.fp8_model import written_fp8_params
from batchinfer.models.presets import PRESETS, preset_config
from batchinfer.models.qwen3_hybrid import HybridModel

H200_GIB = 139.0  # what a process sees of one H200
GDN_CHUNK = 64    # the chunked GDN prefill's chunk length


@dataclass(frozen=True)
class Ceilings:
    """The rates a bound is taken at: the best this project measured on the H200."""
    hbm_tb_s: float = 4.28       # device-to-device copy, read + write
    bf16_tflop_s: float = 790.0  # cuBLAS bf16 GEMM, the top of 686-790
    fp8_tflop_s: float = 1304.0  # cuBLAS block-scaled FP8 GEMM at M = 8,192, the best shape

    def gemm_seconds(self, bf16_flops: float, fp8_flops: float) -> float:
        return bf16_flops / (self.bf16_tflop_s * 1e12) + fp8_flops / (self.fp8_tflop_s * 1e12)

    def byte_seconds(self, nbytes: float) -> float:
        return nbytes / (self.hbm_tb_s * 1e12)


@dataclass(frozen=True)
class ModelCosts:
    """A model's weights as the bounds count them: parameters multiplied per token (bf16 / FP8),
    bytes streamed per forward, the routed experts apart (per expert, summed over layers)."""
    config: ModelConfig
    dense_bf16_params: int      # matrices a token multiplies, LM head and gathered embedding excluded
    dense_fp8_params: int
    lm_head_params: int
    expert_params: int          # one routed expert, all layers
    expert_fp8: bool
    dense_bytes: int            # what every forward streams besides the routed experts
    expert_bytes: int           # one routed expert, all layers (scales included)
    total_bytes: int            # everything the device holds, the input embedding included

    @classmethod
    def of(cls, preset: str, layers: int | None = None) -> "ModelCosts":
        """`layers`: the preset cut to its first `layers` layers (as the benchmarks' `--layers`)."""
        raw = dict(PRESETS[preset], **({"num_hidden_layers": layers} if layers else {}))
        config = model_config_from_dict(raw) if layers else preset_config(preset)
        fp8 = written_fp8_params(config) if "quantization_config" in PRESETS[preset] else None
        model = HybridModel(config, torch.bfloat16, "meta", fp8)
        experts = max(config.num_experts, 1)
        counts = dict(bf16=0, fp8=0, expert=0, dense_bytes=0, expert_bytes=0, total=0, expert_fp8=False)
        for name, p in model.named_parameters():
            nbytes = p.numel() * p.element_size()
            counts["total"] += nbytes
            if name in ("embed", "lm_head"):
                continue
            if ".experts_" in name:
                counts["expert_bytes"] += nbytes // experts
                if p.dim() == 3:
                    counts["expert"] += p.numel() // experts
                    counts["expert_fp8"] = p.element_size() == 1
                continue
            counts["dense_bytes"] += nbytes
            if p.dim() == 2 and min(p.shape) > 16 and not name.endswith("scale_inv"):  # FP8 block scales: bytes only
                counts["fp8" if p.element_size() == 1 else "bf16"] += p.numel()
        lm_head = config.vocab_size * config.hidden_size
        head_bytes = lm_head * 2  # bf16 in every checkpoint (Qwen's FP8 ones keep it)
        return cls(config, counts["bf16"], counts["fp8"], lm_head, counts["expert"], counts["expert_fp8"],
                   counts["dense_bytes"] + head_bytes, counts["expert_bytes"], counts["total"])

    def token_gemm_flops(self) -> tuple[float, float]:
        """(bf16, FP8) GEMM FLOPs of one token through every layer, the LM head excluded."""
        c = self.config
        routed = 2.0 * (c.num_experts_per_tok or 0) * self.expert_params
        bf16, fp8 = 2.0 * self.dense_bf16_params, 2.0 * self.dense_fp8_params
        return (bf16, fp8 + routed) if self.expert_fp8 else (bf16 + routed, fp8)

    def gdn_flops_per_token(self) -> float:
        c = self.config
        d_k, d_v, h_v = c.linear_key_head_dim, c.linear_value_head_dim, c.linear_num_value_heads
        return len(c.gdn_layer_ids) * h_v * (6.0 * d_k * d_v + 2.0 * GDN_CHUNK * (d_k + d_v))

    def attention_flops(self, queries: float, context: float) -> float:
        """QKᵀ and PV for `queries` tokens over `context` positions each, every attention layer."""
        c = self.config
        return len(self.config.attn_layer_ids) * 4.0 * c.num_attention_heads * c.head_dim * queries * context

    def streamed_bytes(self, rows: float) -> float:
        """Weights one forward of `rows` tokens reads: all but the routed experts, and of those the
        experts the rows route to on average (uniform routing; all of them for a prefill step)."""
        c = self.config
        if not c.num_experts:
            return float(self.dense_bytes)
        routed = c.num_experts * (1.0 - (1.0 - c.num_experts_per_tok / c.num_experts) ** rows)
        return self.dense_bytes + routed * self.expert_bytes


@dataclass(frozen=True)
class JobBound:
    preset: str
    prompts: int
    prompt_tokens: int
    output_tokens: int
    kv_cache_dtype: str
    rows: int              # rows decoding at once (the engine's sizing, or the one asked)
    step_tokens: int       # prefill tokens a step
    prefill_s: float
    decode_s: float
    compute_s: float       # the whole job's FLOPs at the ceilings
    bytes_s: float         # the whole job's bytes at the copy bandwidth

    @property
    def tokens(self) -> int:
        return self.prompts * (self.prompt_tokens + self.output_tokens)

    @property
    def in_turn_tok_s(self) -> float:
        return self.tokens / (self.prefill_s + self.decode_s)

    @property
    def overlapped_tok_s(self) -> float:
        return self.tokens / max(self.compute_s, self.bytes_s)


def engine_rows(costs: ModelCosts, row_tokens: int, kv_cache_dtype: str, device_gib: float) -> tuple[int, int]:
    """(max_running, max_batch_tokens) as the engine would choose them on a device whose process
    sees `device_gib`, for rows of `row_tokens` KV positions (`EngineBuilder._step_tokens`)."""
    engine = EngineConfig(dtype="bf16", row_tokens=row_tokens, kv_cache_dtype=kv_cache_dtype)
    config, free = costs.config, int(device_gib * 2**30) - costs.total_bytes
    kv, state = shapes_from_model_config(config, torch.bfloat16, ring_len=engine.ring_len,
                                         ckpt_dtype=torch.bfloat16, kv_dtype=engine.resolved_kv_dtype())

    def pools(tokens: int) -> int:
        return pool_budget(free, engine.memory_fraction,
                           activation_reserve_bytes(config, engine, row_tokens + 16, tokens))
    tokens = default_step_tokens(engine, pools)
    return engine.resolved_max_running(config, (pools(tokens), kv.bytes_per_token, state.bytes_per_slot)), tokens


def job_bound(preset: str, prompts: int, prompt_tokens: int, output_tokens: int, *, kv_cache_dtype: str = "auto",
              rows: int | None = None, step_tokens: int | None = None, layers: int | None = None,
              ceilings: Ceilings = Ceilings(), device_gib: float = H200_GIB) -> JobBound:
    """`rows` / `step_tokens`: what ran (None: the engine's sizing); `layers`: a cut preset."""
    costs = ModelCosts.of(preset, layers)
    c = costs.config
    sized, sized_step = engine_rows(costs, prompt_tokens + output_tokens, kv_cache_dtype, device_gib)
    batch, step_tokens = min(prompts, rows or sized), step_tokens or sized_step
    bf16_tok, fp8_tok = costs.token_gemm_flops()
    head = 2.0 * costs.lm_head_params

    # Prefill: each prompt's FLOPs; each step reads the weights at least once.
    L = prompt_tokens
    prefill_bf16 = prompts * (L * (bf16_tok + costs.gdn_flops_per_token()) + costs.attention_flops(L, L) / 2 + head)
    prefill_fp8 = prompts * L * fp8_tok
    steps = math.ceil(prompts * L / step_tokens)
    prefill_compute = ceilings.gemm_seconds(prefill_bf16, prefill_fp8)
    prefill_bytes = steps * costs.streamed_bytes(step_tokens)
    prefill_s = max(prefill_compute, ceilings.byte_seconds(prefill_bytes))

    # Decode: waves of `batch` rows, `output_tokens` steps each, at the mean context.
    kv_item = (KV_CACHE_DTYPES[kv_cache_dtype] or torch.bfloat16).itemsize
    context = L + output_tokens / 2
    kv_bytes = 2 * len(c.attn_layer_ids) * c.num_kv_heads * c.head_dim * kv_item * context * batch
    heads = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
    ring_entry = c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
    conv = c.conv_dim * (c.linear_conv_kernel_dim - 1)
    ring_len = EngineConfig().ring_len
    state_bytes = len(c.gdn_layer_ids) * batch * 2 * (heads + ring_entry * (ring_len / 2 + 1) + 2 * conv)
    step_bytes = costs.streamed_bytes(batch) + kv_bytes + state_bytes
    step_bf16 = batch * (bf16_tok + head + 6.0 * len(c.gdn_layer_ids) * heads) + costs.attention_flops(batch, context)
    step_fp8 = batch * fp8_tok
    decode_steps = math.ceil(prompts / batch) * output_tokens
    decode_compute = decode_steps * ceilings.gemm_seconds(step_bf16, step_fp8)
    decode_bytes = decode_steps * step_bytes
    decode_s = max(decode_compute, ceilings.byte_seconds(decode_bytes))

    return JobBound(preset, prompts, prompt_tokens, output_tokens, kv_cache_dtype, batch, step_tokens, prefill_s,
                    decode_s, prefill_compute + decode_compute, ceilings.byte_seconds(prefill_bytes + decode_bytes))


# The throughput issue's targets: 1.5x SGLang's published H200 rows (random 8,192 in / 1,024 out).
TARGETS = {"qwen3.5-27b": 10600, "qwen3.5-27b-fp8": 14800, "qwen3.5-35b-a3b": 31500, "qwen3.5-35b-a3b-fp8": 45000}
# The prompts of the measured jobs (docs/BENCHMARKS.md, "Throughput against SGLang's published rows").
MEASURED_PROMPTS = {"qwen3.5-27b": 96, "qwen3.5-27b-fp8": 96, "qwen3.5-35b-a3b": 256, "qwen3.5-35b-a3b-fp8": 256}


def table(bounds: list[JobBound]) -> str:
    lines = ["| model | job | KV | rows at once | step tokens | prefill s | decode s | prefill then decode tok/s "
             "| overlapped tok/s | target | target / in turn | target / overlapped |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for b in bounds:
        target = TARGETS.get(b.preset)
        ratios = (f"{target:,} | {target / b.in_turn_tok_s:.2f} | {target / b.overlapped_tok_s:.2f}"
                  if target else "— | — | —")
        lines.append(f"| {b.preset} | {b.prompts} × {b.prompt_tokens:,} → {b.output_tokens:,} | {b.kv_cache_dtype} | "
                     f"{b.rows} | {b.step_tokens:,} | {b.prefill_s:.1f} | {b.decode_s:.1f} | "
                     f"{b.in_turn_tok_s:,.0f} | {b.overlapped_tok_s:,.0f} | {ratios} |")
    return "\n".join(lines)


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default=",".join(TARGETS))
    parser.add_argument("--prompts", default="measured",
                        help="prompts a job (comma-separated; 'measured': the measured jobs' 96 dense, 256 MoE)")
    parser.add_argument("--input", type=int, default=8192)
    parser.add_argument("--output", type=int, default=1024)
    parser.add_argument("--kv-cache-dtype", default="auto,fp8_e4m3", help="comma-separated: auto, fp8_e4m3")
    parser.add_argument("--rows", type=int, default=0, help="rows at once (0: the engine's sizing)")
    parser.add_argument("--device-gib", type=float, default=H200_GIB)
    args = parser.parse_args(argv)
    bounds = []
    for preset in args.presets.split(","):
        counts = [MEASURED_PROMPTS.get(preset, 256)] if args.prompts == "measured" else \
            [int(n) for n in args.prompts.split(",")]
        for prompts in counts:
            for kv in args.kv_cache_dtype.split(","):
                bounds.append(job_bound(preset, prompts, args.input, args.output, kv_cache_dtype=kv,
                                        rows=args.rows or None, device_gib=args.device_gib))
    text = table(bounds)
    print(text)
    return text


if __name__ == "__main__":
    main()
