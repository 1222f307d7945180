"""Fit the mixed step's cost model (batchinfer/engine/step_cost.py) from timed forward steps.

    python -m benchmarks.step_cost                                      # qwen3.5-27b, all 64 layers, bf16, one GPU
    python -m benchmarks.step_cost --preset qwen3.5-35b-a3b --context 9216 --rows 64,128,256,512
    python -m benchmarks.step_cost --preset tiny --device cpu --tokens 64,128 --rows 4,8 --context 64 --reps 1
    python -m benchmarks.step_cost --layers 16 --concurrent                # also: the two forwards at once

Times, through the engine's own `ModelRunner` on its pools (random weights at the preset's shapes):
decode-only steps at `--rows` rows of `--context` positions each (CUDA graphs where the engine
captures them), prefill-only steps of one fresh `--tokens`-token chunk, and mixed steps (a chunk
of each size beside `--mixed-rows` decode rows). Rows read distinct KV slots and state slots of the
pools (garbage values: only the bytes and FLOPs matter). Each figure is the median of `--reps`
after a warm-up (CUDA events). Prints the fitted constants (`step_cost.fit`), the line to put in
`BATCHINFER_STEP_COST`, and a table of every step measured against the model's prediction, with
the prompt tokens the model would carry beside each decode batch size.

`--concurrent` adds, for each chunk size beside `--mixed-rows` decode rows, the two forwards in
turn against the same two at once (`EngineConfig.concurrent_prefill`: the decode forward on the
caller's stream, the prefill on a second one), and how much of the shorter one the overlap hid:
(in turn − at once) / min(prefill, decode); then two variants of "at once" for the engine to pick
from: the prefill issued first, and the decode on a high-priority stream (its pending blocks
dispatched ahead of the prefill's as SMs free up). The chunk and the rows share pool slots here (garbage
values: only the time counts), which the engine never lets two forwards of one step do.
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.engine import Engine
from batchinfer.engine.model_runner import DecodeRows, SequenceChunk
from batchinfer.engine.side_stream import SideStream
from batchinfer.engine.step_cost import StepCost, fit
from benchmarks.engine_arms import build_model


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def timed(step: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median ms of `step` over `reps` runs after one warm-up."""
    step()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            step()
            times.append(1e3 * (time.perf_counter() - began))
    return statistics.median(times)


class Steps:
    """Prefill, decode and mixed steps of an engine's runner on its pools' slots."""

    def __init__(self, engine: Engine, context: int) -> None:
        self.engine, self.context = engine, context
        self.kv_slots = engine.pool_plan.kv_slots
        self.state_slots = engine.pool_plan.state_slots

    def chunk(self, tokens: int) -> SequenceChunk:
        return SequenceChunk(token_ids=[1] * tokens, start=0, state_slot=self.state_slots - 1,
                             context_kv=torch.arange(tokens, dtype=torch.int64) % self.kv_slots, wants_logits=True)

    def rows(self, count: int) -> DecodeRows:
        ctx = self.context
        kv = (torch.arange(count * ctx, dtype=torch.int64) % self.kv_slots)  # each row its own slots, wrapping
        return DecodeRows(token_ids=[1] * count, positions=[ctx - 1] * count,
                          state_slots=[i % (self.state_slots - 1) for i in range(count)], kv_indices=kv,
                          shared_with_prev=[0] * count)

    def in_turn(self, tokens: int, rows: int, concurrent: bool, decode_first: bool = True,
                urgent_decode: bool = False) -> Callable[[], object]:
        """A decode forward of `rows`, then (`concurrent`: at the same time, on a side stream) a
        prefill forward of one `tokens`-token chunk, as `EngineStep._concurrent` runs them;
        `decode_first=False` issues the prefill first (its kernels then queue ahead of the decode's);
        `urgent_decode`: the decode on a high-priority stream, the prefill on the caller's."""
        runner, chunks, batch = self.engine.runner, [self.chunk(tokens)], self.rows(rows)
        if urgent_decode:
            urgent = SideStream(self.engine.device, priority=-1)

            def urgent_step():
                with urgent.launch():
                    decoded = runner.decode(batch)
                prefilled = runner.prefill(chunks)  # on the caller's stream, beside the decode
                return prefilled, urgent.join(decoded)
            return urgent_step
        side = SideStream(self.engine.device) if concurrent else None

        def prefill():
            if side is None:
                return runner.prefill(chunks)
            with side.launch():
                logits = runner.prefill(chunks)
            return logits

        def step():
            if decode_first:
                runner.decode(batch)
                logits = prefill()
            else:
                logits = prefill()
                runner.decode(batch)
            return logits if side is None else side.join(logits)
        return step

    def run(self, tokens: int, rows: int) -> Callable[[], object]:
        runner = self.engine.runner
        if rows == 0:
            chunks = [self.chunk(tokens)]
            return lambda: runner.prefill(chunks)
        batch = self.rows(rows)
        if tokens == 0:
            return lambda: runner.decode(batch)
        chunks = [self.chunk(tokens)]
        return lambda: runner.mixed(chunks, batch)


def measure(args: argparse.Namespace) -> tuple[list[tuple[int, int, float]], StepCost, list["OverlapSample"]]:
    config = EngineConfig(device=args.device, max_running=max(_ints(args.rows) + [args.mixed_rows]),
                          max_batch_tokens=max(_ints(args.tokens)), max_model_len=max(args.context, max(_ints(args.tokens))) + 1,
                          memory_budget_bytes=args.pool_gib * 2**30 if args.pool_gib else None)
    model, _ = build_model(args.preset, args.layers or None, config.resolved_device().type, seed=0)
    engine = Engine(model, config, model_name=args.preset)
    steps = Steps(engine, args.context)
    device = engine.device
    samples = []
    with torch.inference_mode():
        for rows in _ints(args.rows):
            samples.append((0, rows, timed(steps.run(0, rows), device, args.reps)))
        for tokens in _ints(args.tokens):
            samples.append((tokens, 0, timed(steps.run(tokens, 0), device, args.reps)))
        for tokens in _ints(args.tokens):
            samples.append((tokens, args.mixed_rows, timed(steps.run(tokens, args.mixed_rows), device, args.reps)))
    concurrent = []
    if args.concurrent:
        rows = args.mixed_rows
        with torch.inference_mode():
            decode_ms = timed(steps.run(0, rows), device, args.reps)
            for tokens in _ints(args.tokens):
                prefill_ms = timed(steps.run(tokens, 0), device, args.reps)
                turn_ms = timed(steps.in_turn(tokens, rows, False), device, args.reps)
                once_ms = timed(steps.in_turn(tokens, rows, True), device, args.reps)
                prefill_first_ms = timed(steps.in_turn(tokens, rows, True, decode_first=False), device, args.reps)
                urgent_ms = timed(steps.in_turn(tokens, rows, True, urgent_decode=True), device, args.reps)
                concurrent.append(OverlapSample(tokens, rows, prefill_ms, decode_ms, turn_ms, once_ms,
                                                prefill_first_ms, urgent_ms))
    return samples, fit(samples), concurrent


@dataclass(frozen=True)
class OverlapSample:
    """One chunk size beside one decode batch: each forward alone, in turn, and at once (ms)."""
    tokens: int
    rows: int
    prefill_ms: float
    decode_ms: float
    in_turn_ms: float
    at_once_ms: float               # the decode forward issued first, as the engine does
    prefill_first_ms: float = 0.0   # at once, the prefill issued first
    urgent_decode_ms: float = 0.0   # at once, the decode on a high-priority stream

    @property
    def hidden(self) -> float:
        """The share of the shorter forward the overlap hid (0: none, 1: all of it)."""
        return (self.in_turn_ms - self.at_once_ms) / min(self.prefill_ms, self.decode_ms)


def overlap_report(samples: list[OverlapSample]) -> str:
    lines = ["| prompt tokens | decode rows | prefill ms | decode ms | in turn ms | at once ms | at once / in turn "
             "| shorter one hidden | at once, prefill issued first ms | at once, urgent decode ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {s.tokens} | {s.rows} | {s.prefill_ms:.3f} | {s.decode_ms:.3f} | {s.in_turn_ms:.3f} | "
              f"{s.at_once_ms:.3f} | {s.at_once_ms / s.in_turn_ms:.3f} | {s.hidden:.2f} | {s.prefill_first_ms:.3f} | "
              f"{s.urgent_decode_ms:.3f} |"
              for s in samples]
    return "\n".join(lines)


def report(samples: list[tuple[int, int, float]], cost: StepCost, rows: list[int], most: int) -> str:
    lines = [f"fitted: weight_ms={cost.weight_ms:.3f} row_ms={cost.row_ms:.4f} token_ms={cost.token_ms:.5f} "
             f"prefill_overhead_ms={cost.prefill_overhead_ms:.3f}",
             f"BATCHINFER_STEP_COST={cost.weight_ms:.4g},{cost.row_ms:.4g},{cost.token_ms:.4g},"
             f"{cost.prefill_overhead_ms:.4g}",
             "", "| prompt tokens | decode rows | measured ms | model ms | model / measured |", "|---|---|---|---|---|"]
    for tokens, count, ms in samples:
        predicted = cost.step_ms(tokens, count)
        lines.append(f"| {tokens} | {count} | {ms:.3f} | {predicted:.3f} | {predicted / ms:.2f} |")
    lines += ["", "| decode rows | prompt tokens the model puts beside them |", "|---|---|"]
    lines += [f"| {r} | {cost.prefill_budget(r, most - r)} |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3.5-27b")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--tokens", default="256,512,1024,2048,4096,8192", help="prompt tokens of the prefill steps")
    parser.add_argument("--rows", default="16,32,64,96,128,256", help="rows of the decode-only steps")
    parser.add_argument("--mixed-rows", type=int, default=96, help="decode rows beside each prefill chunk")
    parser.add_argument("--context", type=int, default=9216, help="KV positions each decode row reads")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--pool-gib", type=float, default=0.0, help="pool budget (0: the engine's own)")
    parser.add_argument("--concurrent", action="store_true",
                        help="also time each chunk beside --mixed-rows decode rows in turn and at once")
    parser.add_argument("--layers", type=int, default=0, help="0: the preset's (16: as docs/BENCHMARKS.md's 16-layer rows)")
    args = parser.parse_args(argv)
    samples, cost, overlap = measure(args)
    text = report(samples, cost, _ints(args.rows) + [args.mixed_rows], max(_ints(args.tokens)))
    if overlap:
        text += "\n\n" + overlap_report(overlap)
    print(text)
    return text


if __name__ == "__main__":
    main()
