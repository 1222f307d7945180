"""FP8 checkpoints on the GPU (H200): parity with the dequantized model, bf16 vs FP8 speed, the 80B.

    python -m benchmarks.fp8_parity --parts parity,speed     # 27B shapes, 8 layers (< 10 min)
    python -m benchmarks.fp8_parity --parts next80b          # qwen3-next-80b-a3b-fp8, 48 layers
    python -m benchmarks.fp8_parity --quick                  # CPU smoke run (tiny aligned shapes)

parity: the qwen3.5-27b-fp8 preset (random weights quantized on the device; `--layers`, default
  8) against the same weights dequantized to bf16 (`fp8_model.dequantized_model`), so the only
  difference is the GEMM path (FP8 activations × FP8 weights vs bf16 cuBLAS). A packed prefill
  of lengths 1, 63, 300, 1000: the max logit error relative to the max |logit|, the mean cosine
  of the logit rows and the fraction of equal argmaxes. Tolerance: relative error ≤ 0.10 and
  cosine ≥ 0.99 (e4m3 keeps 3 mantissa bits: ~3% per activation element, averaged down by
  the GEMMs; random weights give near-flat logits, so argmax agreement is reported, not gated).
speed: the 27B shapes in bf16 and FP8, through the engine (`benchmarks.engine_arms.run_arm`,
  replay+extra_buffer): prefill tokens/s of 32 × 8,192-token prompts (1 output token, nothing
  shared) and the batch-256 decode step (256 × 640-token prompts, 64 output tokens: the
  full-batch median step); hit and ideal hit beside them.
next80b: the qwen3-next-80b-a3b-fp8 preset at 48 layers (~80 GB) through the engine on the
  engine_arms --quick workloads (rag, fewshot, control), 32 output tokens. Routed experts are
  stored FP8 and dequantized per layer call for the grouped bf16 GEMM (no grouped FP8 kernel).
Short table last.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchinfer.models import model_config_from_dict, random_model  # noqa: E402
from batchinfer.models.fp8_model import dequantized_model, random_fp8_model  # noqa: E402
from batchinfer.models.presets import PRESETS  # noqa: E402
from benchmarks.engine_arms import Workload, _free, run_arm, workloads  # noqa: E402
from tests.model_utils import PackedDriver  # noqa: E402

ARM = "replay+extra_buffer"
REL_TOL, COS_TOL = 0.10, 0.99
# CPU smoke shapes: every fused part a whole 128-row block, as in the real models.
TINY_ALIGNED = {**PRESETS["tiny"], "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2,
                "num_key_value_heads": 1, "head_dim": 128, "linear_num_key_heads": 1, "linear_num_value_heads": 2,
                "linear_key_head_dim": 128, "linear_value_head_dim": 64}


def preset_dict(name: str, layers: int | None, quick: bool) -> dict:
    raw = dict(TINY_ALIGNED if quick else PRESETS[name])
    if layers:
        raw["num_hidden_layers"] = layers
    return raw


def parity(args) -> list[dict]:
    config = model_config_from_dict(preset_dict("qwen3.5-27b-fp8", args.layers, args.quick))
    dtype = torch.bfloat16
    fp8 = random_fp8_model(config, dtype, args.device, seed=0)
    plain = dequantized_model(fp8, dtype)
    lengths = [1, 63, 300] if args.quick else [1, 63, 300, 1000]
    g = torch.Generator().manual_seed(0)
    prompts = {i: torch.randint(0, config.vocab_size, (n,), generator=g).tolist() for i, n in enumerate(lengths)}

    def logits(model):
        driver = PackedDriver(model, num_state_slots=len(lengths) + 1, num_kv_slots=sum(lengths) + 16)
        for i in prompts:
            driver.add(i, i)
        out = driver.prefill(prompts, all_logits=True)
        return torch.cat([out[i] for i in prompts])  # [Σ lengths, vocab] fp32

    a, b = logits(fp8), logits(plain)
    rel = ((a - b).abs().max() / b.abs().max()).item()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1).mean().item()
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    ok = rel <= REL_TOL and cos >= COS_TOL
    del fp8, plain
    _free(args.device)
    return [dict(part="parity", what=f"fp8 vs dequantized bf16, {config.num_layers} layers",
                 value=f"rel {rel:.3f} (<= {REL_TOL}), cos {cos:.4f} (>= {COS_TOL}), argmax {100 * agree:.0f}%",
                 verdict="PASS" if ok else "FAIL")]


def _engine_args(args, preset: str) -> argparse.Namespace:
    return argparse.Namespace(device=args.device, no_graphs=args.device != "cuda", max_running=256,
                              max_batch_tokens=8192, budget_bytes=None, preset=preset)


def speed(args) -> list[dict]:
    raw = preset_dict("qwen3.5-27b", args.layers, args.quick)
    config = model_config_from_dict(raw)
    prefill = Workload("prefill8k", 4 if args.quick else 32, 1, 0, 256 if args.quick else 8192)
    decode = Workload("control", 8 if args.quick else 256, 1, 0, 64 if args.quick else 640)
    rows, measured = [], {}
    for kind in ("bf16", "fp8"):
        dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
        start = time.perf_counter()
        model = (random_model(config, dtype, args.device, seed=0) if kind == "bf16"
                 else random_fp8_model(config, dtype, args.device, seed=0))
        built = time.perf_counter() - start
        engine_args = _engine_args(args, f"qwen3.5-27b{'-fp8' if kind == 'fp8' else ''}")
        p = run_arm(model, ARM, prefill.prompts(config.vocab_size), 1, engine_args)
        d = run_arm(model, ARM, decode.prompts(config.vocab_size), 8 if args.quick else 64, engine_args)
        step = d.get("full_batch_median_ms", float("nan"))
        measured[kind] = (p["prompt_tps"], step)
        weights = sum(t.numel() * t.element_size() for t in model.parameters()) / 2**30
        rows.append(dict(part="speed", what=f"{kind}: {config.num_layers} layers, weights {weights:.1f} GiB, "
                         f"built {built:.0f} s",
                         value=f"prefill {p['prompt_tps']:,.0f} tok/s (hit {p['hit']:.2f}/{p['ideal_hit']:.2f}); "
                               f"decode b{d.get('full_batch', 0):.0f} {step:.2f} ms/step "
                               f"(hit {d['hit']:.2f}/{d['ideal_hit']:.2f})", verdict=""))
        del model
        _free(args.device)
    (p16, s16), (p8, s8) = measured["bf16"], measured["fp8"]
    rows.append(dict(part="speed", what="fp8 / bf16", value=f"prefill {p8 / p16:.2f}x (target 1.6x), "
                     f"decode step {s16 / s8:.2f}x faster (target 1.4x)",
                     verdict="PASS" if p8 / p16 >= 1.6 and s16 / s8 >= 1.4 else "short"))
    return rows


def next80b(args) -> list[dict]:
    raw = preset_dict("qwen3-next-80b-a3b-fp8", 4 if args.quick else args.layers80, False)
    if args.quick:  # tiny aligned MoE stand-in on the CPU
        raw = {**TINY_ALIGNED, "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
               "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
               "shared_expert_intermediate_size": 128}
    config = model_config_from_dict(raw)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    start = time.perf_counter()
    model = random_fp8_model(config, dtype, args.device, seed=0)
    built = time.perf_counter() - start
    weights = sum(t.numel() * t.element_size() for t in model.parameters()) / 2**30
    rows = []
    for workload in workloads(quick=True):
        if args.quick:
            workload = Workload(workload.name, 2, 2, 16, 8)
        engine_args = _engine_args(args, "qwen3-next-80b-a3b-fp8")
        if args.device == "cuda":  # activations and the per-layer dequantized experts (~3.5 GB) live outside the pools
            engine_args.budget_bytes = torch.cuda.mem_get_info()[0] - args.headroom_gib * 2**30
        r = run_arm(model, ARM, workload.prompts(config.vocab_size), 8 if args.quick else 32, engine_args)
        rows.append(dict(part="next80b", what=f"{workload.name}: {config.num_layers} layers, {weights:.1f} GiB weights, "
                         f"built {built:.0f} s, peak {r['peak_gib']:.1f} GiB",
                         value=f"{r['samples']} samples, prompt {r['prompt_tps']:,.0f} tok/s, out "
                               f"{r['output_tps']:,.0f} tok/s, decode {r.get('decode_ms', float('nan')):.1f} ms/step "
                               f"(b{r.get('decode_batch', 0):.0f}), hit {r['hit']:.2f}/{r['ideal_hit']:.2f}",
                         verdict="ran"))
    del model
    _free(args.device)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="parity,speed")
    parser.add_argument("--layers", type=int, default=8, help="27B depth for parity / speed (multiple of 4)")
    parser.add_argument("--layers80", type=int, default=48, help="80B depth")
    parser.add_argument("--headroom-gib", type=int, default=20, help="80B: GPU memory left outside the cache pools")
    parser.add_argument("--quick", action="store_true", help="CPU smoke run, tiny shapes")
    args = parser.parse_args()
    args.device = "cpu" if args.quick else "cuda"
    parts = {"parity": parity, "speed": speed, "next80b": next80b}
    rows = []
    for name in args.parts.split(","):
        rows += parts[name](args)
        for r in rows[-1:]:
            print(f"[{r['part']}] {r['what']}: {r['value']} {r['verdict']}", flush=True)
    print()
    print(f"{'part':8} {'what':58} {'result':90} verdict")
    for r in rows:
        print(f"{r['part']:8} {r['what'][:58]:58} {r['value'][:90]:90} {r['verdict']}")


if __name__ == "__main__":
    main()
