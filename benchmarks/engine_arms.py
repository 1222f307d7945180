"""Engine arms on shared-prefix workloads (GPU): what planned reuse and ReplaySSM buy.

    python -m benchmarks.engine_arms --quick  # < 5 min on one H200
    python -m benchmarks.engine_arms --layers 16 --hf  # deeper, plus transformers' generate
    python -m benchmarks.engine_arms --preset qwen3.5-35b-a3b --hf  # the MoE workhorse, all 40 layers

Model: the qwen3.5-27b preset (or `--preset`, e.g. qwen3.5-35b-a3b) in bf16 with random weights
(`--layers N` keeps the 3:1 GDN/attention pattern with fewer layers). Workloads (random token ids, ignore_eos, so every
sample generates exactly `--output-tokens`):

    rag       8 groups × 32 prompts: a 2048-token document shared per group + 128 unique tokens
    fewshot   32 groups × 8 prompts: a 512-token few-shot prefix per group + 128 unique tokens
    control   256 prompts of 640 unique tokens (nothing to share)

Decode columns: ms per decode step (wall, as the engine runs: steps overlapped; the mean over
all decode steps), its byte roofline (weights — of an MoE stack only the experts the batch is
expected to route to, E·(1 − (1 − k/E)^B) — + every sequence's KV + GDN state, at copy bandwidth), the same with KV that neighbouring rows share counted once ("once": what the
shared-prefix attention reads), and the FLOP floor; then the median decode-only step at the
full batch and the mean SM clock while the arm ran (nvidia-smi; the step time follows it);
with `--floor` (default on CUDA) that step's measured floor (benchmarks/decode_floor.py: its GEMMs
timed alone + every other kernel's bytes at measured copy bandwidth) and the step over it.

Arms: `recurrent+extra_buffer` (ReplaySSM off), `replay+no_buffer`, `replay+extra_buffer`;
`--hf` adds transformers' generate (same shapes, its own random weights; batches of
`--hf-batch`, no prefix reuse) after the engine arms, once the engine's memory is freed.
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from dataclasses import dataclass

import torch

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.engine import Engine
from batchinfer.engine.types import Request, SamplingParams
from batchinfer.models.config import model_config_from_dict
from batchinfer.models.layers.fp8_linear import Fp8Weight
from batchinfer.models.presets import PRESETS, random_model, random_preset_fp8
from batchinfer.models.quantization import parse_quantization
from benchmarks import bench_utils
from benchmarks.decode_floor import floor_columns, print_floor, record_decode_rows, shared_meter
from benchmarks.gpu_clocks import ClockSampler
from benchmarks.host_overhead import PhaseTimer

DEFAULT_PRESET = "qwen3.5-27b"
ARMS = {
    "recurrent+extra_buffer": dict(replayssm=False, state_cache="extra_buffer"),
    "replay+no_buffer": dict(replayssm=True, state_cache="no_buffer"),
    "replay+extra_buffer": dict(replayssm=True, state_cache="extra_buffer"),
}


@dataclass(frozen=True)
class Workload:
    name: str
    groups: int
    per_group: int
    prefix_len: int
    suffix_len: int

    def prompts(self, vocab: int, seed: int = 0) -> list[list[int]]:
        rng = random.Random(seed)
        out = []
        for _ in range(self.groups):
            prefix = [rng.randrange(vocab) for _ in range(self.prefix_len)]
            out += [prefix + [rng.randrange(vocab) for _ in range(self.suffix_len)] for _ in range(self.per_group)]
        rng.shuffle(out)  # the planner, not the input order, must find the sharing
        return out


def workloads(quick: bool) -> list[Workload]:
    scale = 2 if quick else 1  # --quick halves the groups
    return [Workload("rag", 8 // scale, 32, 2048, 128),
            Workload("fewshot", 32 // scale, 8, 512, 128),
            Workload("control", 256 // scale, 1, 0, 640)]


def build_model(preset: str, layers: int | None, device: str, seed: int = 0):
    raw = dict(PRESETS[preset])
    if layers:
        raw["num_hidden_layers"] = layers
    config = model_config_from_dict(raw)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if parse_quantization(raw) is not None:  # an FP8 preset: FP8 projections on CUDA, dequantized elsewhere
        return random_preset_fp8(config, dtype, device, seed=seed), raw
    return random_model(config, dtype, device, seed=seed), raw


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


COPY_BANDWIDTH = 4.28e12  # B/s, device-to-device copy measured on the H200 (shared/device/README.md)
MATMUL_RATE = 686e12  # FLOP/s, bf16 matrix product at 8192³ measured on the H200 (shared/device/README.md)


def expected_unique_experts(num_experts: int, top_k: int, batch: float) -> float:
    """Experts a batch of `batch` tokens routes to, on average, if each token's k distinct experts
    are uniform: each expert is missed by a token with probability 1 − k/E."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def _expert_stacks(model, scales: bool = True) -> list:
    """The routed experts' stacked tensors [E, ...] (MoE layers only): a bf16 stack, or an FP8
    stack's e4m3 weight (`experts_gate_up.weight`) and, with `scales`, its block scales."""
    return [p for name, p in model.named_parameters()
            if ".experts_" in name and (scales or not name.endswith("scale_inv"))]


def decode_flops(model, batch: float, context: float) -> float:
    """Fewest FLOPs of one decode step: every matrix weight once per sequence (2-D parameters
    but the gathered input embedding), each sequence's k routed experts (MoE), attention over the
    `context` tokens (summed over the batch), and the GDN state update and read-out."""
    c = model.config
    matrices = sum(p.numel() for p in model.parameters() if p.dim() == 2 and min(p.shape) > 16)
    if model.lm_head is not None:
        matrices -= model.embed.numel()
    routed = sum(p[0].numel() for p in _expert_stacks(model, scales=False)) * (c.num_experts_per_tok or 0)  # k a token
    attention = len(c.attn_layer_ids) * 4 * c.num_attention_heads * c.head_dim * context
    heads = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
    return 2 * batch * (matrices + routed) + attention + len(c.gdn_layer_ids) * 6 * heads * batch


def decode_bytes(model, replay: bool, batch: float, context: float, ring_len: int = 16, kv_itemsize: int = 2) -> float:
    """Fewest bytes one decode step must move: every weight once (embedding: only the batch's
    rows; MoE: of each expert stack only the experts the batch routes to, expected under uniform
    routing), the KV of every context token of every attention layer, and the GDN state
    (ReplaySSM: a bf16 checkpoint read plus the live half of the ring on average; recurrent: fp32
    read + write)."""
    c = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:  # untied: the input embedding is gathered, not streamed
        weights -= model.embed.numel() * model.embed.element_size()
    stacks = _expert_stacks(model)
    if stacks:  # a decode batch reads the experts it routes to, not all E
        routed = expected_unique_experts(c.num_experts, c.num_experts_per_tok, batch)
        weights -= sum(p[0].numel() * p.element_size() * (c.num_experts - routed) for p in stacks)
    kv = len(c.attn_layer_ids) * 2 * c.num_kv_heads * c.head_dim * kv_itemsize * context  # K and V (bf16: 2 B)
    heads = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
    if replay:
        ring = (c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim) * 2
        per_seq = heads * 2 + ring * ring_len / 2
    else:
        per_seq = heads * 4 * 2
    return weights + kv + len(c.gdn_layer_ids) * per_seq * batch


def run_arm(model, arm: str, prompts: list[list[int]], output_tokens: int, args,
            engine_overrides: dict | None = None) -> dict:
    """`engine_overrides`: EngineConfig fields set on top of the arm's (e.g. track_interval)."""
    fields = dict(device=args.device, cuda_graphs=not args.no_graphs, max_running=args.max_running,
                  max_batch_tokens=args.max_batch_tokens, memory_budget_bytes=args.budget_bytes)
    config = EngineConfig(**{**fields, **ARMS[arm], **(engine_overrides or {})})
    engine = Engine(model, config, model_name=args.preset)
    # temperature > 0: random weights give near-flat logits, so greedy rows tend to draw the same
    # token, and a MoE model's decode then routes the whole batch to few experts (optimistic)
    params = SamplingParams(max_tokens=output_tokens, ignore_eos=True, temperature=getattr(args, "temperature", 0.0))
    # Warm-up on unrelated tokens shaped like the workload (its first prompts' lengths, a pair
    # sharing a prefix): Triton compiles the prefill shapes here, not in the timed run — else
    # whichever arm runs first pays for it (docs/BENCHMARKS.md, "Benchmark method: warm-up,
    # clocks, full-batch medians") — and nothing the timed run could reuse lands in the cache.
    rng = random.Random(12345)
    vocab = model.config.vocab_size
    shaped = [[rng.randrange(vocab) for _ in range(len(p))] for p in prompts[:4]]
    shaped[1][:len(shaped[1]) // 2] = shaped[0][:len(shaped[1]) // 2]
    warm = [Request(f"warm{i}", tuple(p), SamplingParams(max_tokens=4, ignore_eos=True)) for i, p in enumerate(shaped)]
    for _ in engine.generate(warm):
        pass
    requests = [Request(i, tuple(p), params, seed_key=i) for i, p in enumerate(prompts)]
    rows_log = record_decode_rows(engine.runner) if getattr(args, "floor", False) else None
    before = engine.stats
    _sync(args.device)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    timer = PhaseTimer(engine, engine.runner, "decode")  # no sync: each step's wall time as it runs
    with ClockSampler(enabled=args.device == "cuda") as clocks:
        start = time.perf_counter()
        count = sum(1 for _ in engine.generate(requests))
        _sync(args.device)
        wall = time.perf_counter() - start
    stats = engine.stats
    replay = ARMS[arm]["replayssm"]
    kv_itemsize = 1 if config.kv_cache_dtype == "fp8_e4m3" else 2

    def roofline_ms(batch: float, context: float) -> float:  # a decode step's bytes at copy bandwidth
        return 1e3 * decode_bytes(model, replay, batch, context, kv_itemsize=kv_itemsize) / COPY_BANDWIDTH

    prompt = stats.prompt_tokens - before.prompt_tokens
    cached = stats.cached_tokens - before.cached_tokens
    ideal = stats.theoretical_max_cached_tokens - before.theoretical_max_cached_tokens
    output = stats.output_tokens - before.output_tokens
    result = dict(arm=arm, samples=count, hit=cached / prompt, ideal_hit=ideal / prompt,
                  prompt_tps=prompt / wall, output_tps=output / wall, wall_s=wall,
                  peak_gib=engine.stats.peak_memory_bytes / 2**30,
                  max_running=engine.pool_plan.max_running, preemptions=stats.preemptions - before.preemptions,
                  flushes=stats.replayssm_flushes - before.replayssm_flushes,
                  discarded_kv=stats.discarded_kv_tokens - before.discarded_kv_tokens,
                  sm_mhz=clocks.mean_mhz, power_w=clocks.mean_watts,
                  **full_batch_steps(timer, roofline_ms))
    steps = stats.decode_steps - before.decode_steps
    if steps:
        batch = (stats.decode_seq_steps - before.decode_seq_steps) / steps
        context = (stats.decode_context_tokens - before.decode_context_tokens) / steps
        shared = (stats.decode_shared_kv_tokens - before.decode_shared_kv_tokens) / steps
        result.update(decode_ms=1e3 * (stats.decode_seconds - before.decode_seconds) / steps, decode_batch=batch,
                      roofline_ms=roofline_ms(batch, context),
                      # KV that neighbouring rows share counted once (what the shared-prefix kernel reads)
                      roofline_once_ms=roofline_ms(batch, context - shared),
                      flop_floor_ms=1e3 * decode_flops(model, batch, context) / MATMUL_RATE)
    # The timer wraps the engine's methods and holds it: both go before the memory is released,
    # else the next arm's engine sizes its pools with this one's still allocated (then a tenth of
    # the requests fit, and it runs out of memory).
    del engine, timer
    _free(args.device)
    if rows_log is not None:  # measured with the pools freed: the lm_head GEMM's operands alone are GBs
        fp8 = any(isinstance(m, Fp8Weight) for m in model.modules())
        result.update(floor_columns(shared_meter(args.device, fp8), model, rows_log, result.get("full_batch_median_ms"),
                                    replay=replay, ring_len=config.ring_len, ckpt_dtype=config.resolved_ckpt_dtype()))
    return result


def full_batch_steps(timer: PhaseTimer, roofline_ms) -> dict:
    """Median wall ms of the decode-only steps at the run's largest decode batch: a figure that
    prefill interleaving, the batch's ramp and tail, and the one step in L that flushes every
    ring (lock-step admission) do not move, unlike the mean over all decode steps. Beside it the
    byte roofline of those steps, `roofline_ms(batch, context)` at their median context: the
    mean step's roofline is at the mean batch and context, which these steps are not."""
    decode_only = [s for s in timer.steps if not s.get("prefill_seqs") and s.get("decode_batch")]
    if not decode_only:
        return {}
    full = max(s["decode_batch"] for s in decode_only)
    picked = [s for s in decode_only if s["decode_batch"] == full]
    median_ms = 1e3 * statistics.median(s["total"] for s in picked)
    roofline = roofline_ms(full, statistics.median(s["decode_context"] for s in picked))
    return dict(full_batch=full, full_batch_steps=len(picked), full_batch_median_ms=median_ms,
                full_batch_roofline_ms=roofline, full_batch_x_roofline=median_ms / roofline)


def run_hf(raw_config: dict, prompts: list[list[int]], output_tokens: int, batch: int) -> dict:
    import transformers as tf

    text = {k: v for k, v in raw_config.items() if k not in ("architectures", "model_type")}
    moe = raw_config["model_type"].startswith("qwen3_5_moe")
    model_class, config_class = ((tf.Qwen3_5MoeForCausalLM, tf.Qwen3_5MoeTextConfig) if moe
                                 else (tf.Qwen3_5ForCausalLM, tf.Qwen3_5TextConfig))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # build in bf16: an fp32 27B model plus its bf16 copy would not fit
    try:
        with torch.device("cuda"):
            model = model_class(config_class(**text)).eval()
    finally:
        torch.set_default_dtype(previous)
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = prompts[i:i + batch]
        width = max(len(p) for p in group)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in group], device="cuda")
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device="cuda")
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_tokens,
                       min_new_tokens=output_tokens, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    prompt = sum(len(p) for p in prompts)
    result = dict(arm="transformers.generate", decode_ms=float("nan"), decode_batch=float(batch), roofline_ms=float("nan"), samples=len(prompts), hit=0.0, ideal_hit=float("nan"),
                  prompt_tps=prompt / wall, output_tps=len(prompts) * output_tokens / wall, wall_s=wall,
                  peak_gib=torch.cuda.max_memory_allocated() / 2**30, max_running=batch, preemptions=0,
                  flushes=0, discarded_kv=0)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return result


HEADER = (f"{'workload':<9} {'arm':<24} {'hit%':>6} {'ideal%':>7} {'prompt tok/s':>13} {'out tok/s':>10} "
          f"{'wall s':>8} {'peak GiB':>9} {'running':>8} {'preempt':>8} {'dec ms/step':>11} {'roofline ms':>11} "
          f"{'once ms':>8} {'flop ms':>8} {'dec batch':>9} {'full-batch med ms':>17} {'(x roofline)':>12} {'SM MHz':>7} {'floor ms':>8} {'(x floor)':>9}")


def row_line(r: dict) -> str:
    return (f"{r['workload']:<9} {r['arm']:<24} {100 * r['hit']:6.1f} {100 * r['ideal_hit']:7.1f} "
            f"{r['prompt_tps']:13,.0f} {r['output_tps']:10,.0f} {r['wall_s']:8.1f} {r['peak_gib']:9.1f} "
            f"{r['max_running']:8d} {r['preemptions']:8d} {r.get('decode_ms', float('nan')):11.2f} "
            f"{r.get('roofline_ms', float('nan')):11.2f} {r.get('roofline_once_ms', float('nan')):8.2f} "
            f"{r.get('flop_floor_ms', float('nan')):8.2f} "
            f"{r.get('decode_batch', float('nan')):9.1f} "
            f"{r.get('full_batch_median_ms', float('nan')):17.2f} {r.get('full_batch_x_roofline', float('nan')):11.2f}x "
            f"{r.get('sm_mhz', float('nan')):7.0f} {r.get('floor_ms', float('nan')):8.2f} "
            f"{r.get('step_x_floor', float('nan')):8.2f}x")


def print_table(rows: list[dict]) -> None:
    bench_utils.print_table(HEADER, map(row_line, rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="8 layers, half the groups, 32 output tokens")
    parser.add_argument("--layers", type=int, default=None, help="model depth (multiple of 4; default 64)")
    parser.add_argument("--output-tokens", type=int, default=None, help="default 64 (32 with --quick)")
    parser.add_argument("--workloads", default="rag,fewshot,control")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--max-running", type=int, default=256)
    parser.add_argument("--max-batch-tokens", type=int, default=8192)
    parser.add_argument("--no-graphs", action="store_true", help="decode without CUDA graphs")
    parser.add_argument("--hf", action="store_true", help="add transformers' generate as a baseline")
    parser.add_argument("--hf-batch", type=int, default=32)
    parser.add_argument("--hf-prompts", type=int, default=64,
                        help="transformers runs this many prompts of each workload (rates are per second)")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--preset", default=DEFAULT_PRESET, help="e.g. tiny, for a CPU smoke run")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--budget-bytes", type=int, default=None, help="pool budget (default: free memory)")
    parser.add_argument("--floor", action=argparse.BooleanOptionalAction, default=None,
                        help="the full-batch step's measured floor (benchmarks/decode_floor.py); default: on CUDA")
    args = parser.parse_args()
    args.floor = args.device == "cuda" if args.floor is None else args.floor
    layers = args.layers or (8 if args.quick else None)
    output_tokens = args.output_tokens or (32 if args.quick else 64)

    model, raw = build_model(args.preset, layers, args.device)
    vocab = model.config.vocab_size
    chosen = [w for w in workloads(args.quick) if w.name in args.workloads.split(",")]
    rows = []
    for workload in chosen:
        prompts = workload.prompts(vocab)
        for arm in args.arms.split(","):
            rows.append({"workload": workload.name, **run_arm(model, arm, prompts, output_tokens, args)})
            print_table(rows[-1:])
            if "floor" in rows[-1]:
                print_floor(rows[-1]["floor"])
    del model
    _free(args.device)
    if args.hf:
        for workload in chosen:
            rows.append({"workload": workload.name,
                         **run_hf(raw, workload.prompts(vocab)[:args.hf_prompts], output_tokens, args.hf_batch)})
    print()
    print(f"{args.preset}, {layers or raw['num_hidden_layers']} layers, {output_tokens} output tokens")
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
