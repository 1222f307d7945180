"""Host-side cost of one decode step: the real Engine around a model that costs nothing.

    python -m benchmarks.host_overhead  # batch 256, 64 output tokens
    python -m benchmarks.host_overhead --profile  # plus the top of cProfile

The stub model's forward returns random logits of the right shape at once, so every
millisecond measured is Python / torch-on-CPU work the engine does between GPU steps:
scheduling (admission, KV for decode tokens), building the batch (chunks, ForwardBatch,
progress bookkeeping) and sampling + stop checks. On a GPU host this work is serial with
the device, so it adds straight to the step time.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import time
from collections import defaultdict
from typing import Callable

import torch

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.engine import Engine
from batchinfer.engine.types import Request, SamplingParams
from batchinfer.models.presets import preset_config


class StubModel(torch.nn.Module):
    """Has the model's config; forward returns [N, vocab] random fp32 logits, nothing else."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self._generator = torch.Generator().manual_seed(0)

    def forward(self, batch, caches, logits_out=None) -> torch.Tensor:
        rows = batch.logits_indices.numel()
        logits = torch.randn(rows, self.config.vocab_size, generator=self._generator)  # [N, V]
        return logits if logits_out is None else logits_out.copy_(logits)


class PhaseTimer:
    """Wraps engine methods to bill wall time to phases, per step: "schedule", "sample_stop",
    "forward" (`forward_owner.forward_name`: the model here, the runner's decode in
    benchmarks/decode_profile.py) and "total", plus the step's "decode_batch" / "prefill_seqs" and
    "decode_context" (KV positions its decode rows attend over, the new tokens included).
    `sync` runs before and after each timed piece (a device sync on CUDA: GPU work is async) —
    which also stops decode overlap from hiding host work: use it for a breakdown, and a plain
    `sync` (no-op) timer for the time per step."""

    def __init__(self, engine: Engine, forward_owner=None, forward_name: str = "forward",
                 sync: Callable[[], None] = lambda: None) -> None:
        self.engine = engine
        self.sync = sync
        self.current: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(engine.post, "draw", "sample_stop")
        self._wrap(engine.post, "accept", "sample_stop")
        self._wrap(engine.model if forward_owner is None else forward_owner, forward_name, "forward")
        step = engine._step

        def timed_step():
            self.current = defaultdict(float)
            self.sync()
            start = time.perf_counter()
            done = step()
            self.sync()
            self.current["total"] = time.perf_counter() - start
            self.steps.append(dict(self.current))
            return done

        engine._step = timed_step
        plan_schedule = engine.scheduler.schedule

        def schedule_and_note():
            plan = plan_schedule()
            self.current["decode_batch"] = len(plan.decode)
            self.current["prefill_seqs"] = len(plan.prefill)
            self.current["decode_context"] = sum(seq.computed + 1 for seq in plan.decode)
            return plan

        engine.scheduler.schedule = schedule_and_note

    def _wrap(self, owner, name: str, phase: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            self.sync()
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.sync()
                self.current[phase] += time.perf_counter() - start

        setattr(owner, name, timed)

    def decode_report(self, min_batch: int) -> dict[str, float]:
        """Mean ms per decode-only step with at least `min_batch` sequences."""
        steps = [s for s in self.steps if not s.get("prefill_seqs") and s.get("decode_batch", 0) >= min_batch]
        if not steps:
            return {}
        mean = lambda key: 1e3 * sum(s.get(key, 0.0) for s in steps) / len(steps)  # noqa: E731
        total, schedule, sample_stop, forward = mean("total"), mean("schedule"), mean("sample_stop"), mean("forward")
        return {"steps": len(steps), "batch": sum(s["decode_batch"] for s in steps) / len(steps),
                "schedule_ms": schedule, "build_batch_ms": total - schedule - sample_stop - forward,
                "sample_stop_ms": sample_stop, "stub_forward_ms": forward, "host_ms": total - forward}


def make_requests(count: int, prompt_len: int, output_tokens: int, vocab: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=output_tokens, ignore_eos=True)
    return [Request(request_id=i, prompt_token_ids=tuple(rng.randrange(vocab) for _ in range(prompt_len)),
                    seed_key=i, sampling=params) for i in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256, help="requests, all decoding together")
    parser.add_argument("--prompt-len", type=int, default=33)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--preset", default="tiny", help="model config (only its shapes matter)")
    parser.add_argument("--budget-mb", type=float, default=400)
    parser.add_argument("--replayssm", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--profile", action="store_true", help="print the top of cProfile")
    parser.add_argument("--sort", default="cumulative", help="cProfile's order (cumulative, tottime, ...)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1: tiny ops pay no thread-pool wake-ups, as on a GPU host)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    config = preset_config(args.preset)
    engine = Engine(StubModel(config), EngineConfig(
        device="cpu", dtype="fp32", max_running=args.batch, cuda_graphs=False, replayssm=args.replayssm,
        memory_budget_bytes=int(args.budget_mb * 1e6)))
    timer = PhaseTimer(engine)
    requests = make_requests(args.batch, args.prompt_len, args.output_tokens, config.vocab_size, seed=0)
    profiler = cProfile.Profile() if args.profile else None
    start = time.perf_counter()
    if profiler:
        profiler.enable()
    outputs = list(engine.generate(requests))
    if profiler:
        profiler.disable()
    wall = time.perf_counter() - start
    assert len(outputs) == args.batch and all(o.completion_tokens == args.output_tokens for o in outputs)

    report = timer.decode_report(min_batch=args.batch)
    print(f"{args.batch} requests × {args.output_tokens} tokens, preset {args.preset}, "
          f"max_running {engine.settings()['max_running_effective']}: {wall:.2f} s wall")
    if not report:
        print(f"no decode-only step ran all {args.batch} sequences at once (the first finished before the last "
              f"was admitted): raise --output-tokens or lower --prompt-len")
    else:
        print(f"decode steps at batch {report['batch']:.0f} ({report['steps']} steps), ms per step:")
        for key in ("schedule_ms", "build_batch_ms", "sample_stop_ms", "host_ms", "stub_forward_ms"):
            print(f"  {key:<16} {report[key]:7.3f}")
    if profiler:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(args.sort).print_stats(30)
        print(text.getvalue())


if __name__ == "__main__":
    main()
