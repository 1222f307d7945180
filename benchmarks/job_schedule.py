"""A job's wall time from the H200's measured step costs, through the engine's own schedule (no GPU).

    python -m benchmarks.job_schedule       # each preset's measured 8k / 1k jobs, then 256 and 1,024 prompts
    python -m benchmarks.job_schedule --presets qwen3.5-35b-a3b-fp8 --prompts 384,1024 --step-tokens 32768,65536

The real `Engine` and `Scheduler` run the job on the CPU with a model that computes nothing: its
forwards are recorded (prompt tokens and chunks of each prefill forward; rows and KV positions
of each decode forward) and answered with random logits. The engine decides nothing by time in
its default two-forward step, so one recorded trace prices any step costs: the job's wall time
is the sum of its forwards' modelled times (`StepTimes`), prefill then decode each step, host
work hidden as it is on the H200 (decode overlapped with the host).

`StepTimes` per preset come from the H200 rows of docs/BENCHMARKS.md (`CALIBRATIONS`, each with
where its numbers come from): the decode forward's constants from the kernel profile and the
full-batch step, the prefill's per-token and per-step costs fitted to two measured jobs of one
tree. The table shows the measured jobs beside their predictions ("fitted": equal by
construction; "check": jobs the fit did not see) before the jobs asked for, which are
predictions until the H200 runs them.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch

from batchinfer.cache.shapes import shapes_from_model_config
from batchinfer.engine.config import EngineConfig
from batchinfer.engine.engine import Engine
from batchinfer.engine.types import Request, SamplingParams
from batchinfer.models.config import model_config_from_dict
from batchinfer.models.presets import PRESETS

# A model config whose tensors cost nothing: one attention and one GDN layer of minimal width (the
# schedule depends on token counts, pools and rows, not on the model's shapes). The vocabulary is
# Qwen3.5's, so random prompts share first tokens as rarely as in the measured jobs (shared
# prefixes are planned reuse, which changes the schedule); the logits are narrower.
_STUB_MODEL = dict(PRESETS["tiny"], vocab_size=248320, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
                   full_attention_interval=2, num_attention_heads=1, num_key_value_heads=1, head_dim=8,
                   linear_num_key_heads=1, linear_num_value_heads=1, linear_key_head_dim=4,
                   linear_value_head_dim=4, max_position_embeddings=1 << 20)


@dataclass(frozen=True)
class Forwards:
    """One step's forwards as the engine issued them (prefill first, then decode)."""
    prefill_tokens: int = 0   # new prompt tokens of the prefill forward (0: none ran)
    decode_rows: int = 0      # rows of the decode forward (0: none ran)
    decode_positions: int = 0  # KV positions those rows attend over, their new tokens included


@dataclass(frozen=True)
class StepTimes:
    """Milliseconds of one forward on the GPU, as a line in what it carries."""
    prefill_step_ms: float       # a prefill forward's cost beyond its tokens (launches, a MoE's expert reads)
    prefill_token_ms: float      # each prompt token (GEMMs, GDN, attention at the job's prompt length)
    decode_fixed_ms: float       # a decode forward's dense weights, LM head and launches
    decode_row_ms: float         # each row's state traffic (ReplaySSM, conv), sampling
    decode_position_ms: float    # each KV position a row attends over
    decode_experts_ms: float = 0.0  # a MoE's routed experts when every expert is read
    experts: int = 0             # routed experts a layer, and those each token picks: a decode forward
    top_k: int = 0               # reads the share its rows route to (uniform routing)

    def prefill_ms(self, f: Forwards) -> float:
        return self.prefill_step_ms + self.prefill_token_ms * f.prefill_tokens if f.prefill_tokens else 0.0

    def decode_ms(self, f: Forwards) -> float:
        if not f.decode_rows:
            return 0.0
        return (self.decode_fixed_ms + self.decode_experts_ms * self.experts_read(f.decode_rows)
                + self.decode_row_ms * f.decode_rows + self.decode_position_ms * f.decode_positions)

    def experts_read(self, rows: int) -> float:
        """The share of a layer's routed experts that `rows` tokens route to, on average."""
        return 1.0 - (1.0 - self.top_k / self.experts) ** rows if self.experts else 0.0


@dataclass(frozen=True)
class Trace:
    """What a job's run did, step by step."""
    prompts: int
    prompt_tokens: int
    output_tokens: int
    max_running: int
    step_tokens: int
    steps: tuple[Forwards, ...]

    @property
    def tokens(self) -> int:
        return self.prompts * (self.prompt_tokens + self.output_tokens)

    def seconds(self, times: StepTimes) -> float:
        return sum(times.prefill_ms(f) + times.decode_ms(f) for f in self.steps) / 1e3

    def tok_s(self, times: StepTimes) -> float:
        return self.tokens / self.seconds(times)

    def summary(self) -> dict[str, float]:
        decode = [f for f in self.steps if f.decode_rows]
        return dict(steps=len(self.steps), prefill_forwards=sum(1 for f in self.steps if f.prefill_tokens),
                    decode_forwards=len(decode),
                    mean_decode_rows=sum(f.decode_rows for f in decode) / max(len(decode), 1))


class _RecordingRunner:
    """Stands in for `ModelRunner`: records each forward's load, returns random fp32 logits."""

    def __init__(self, vocab: int = 64) -> None:
        self.vocab = vocab  # the logits' width: the drawn tokens do not matter
        self.generator = torch.Generator().manual_seed(0)
        self.steps: list[Forwards] = []
        self._prefill: Optional[Forwards] = None

    def _logits(self, rows: int) -> torch.Tensor:
        return torch.randn(rows, self.vocab, generator=self.generator)  # [rows, V]

    def prefill(self, chunks) -> torch.Tensor:
        self._flush()
        self._prefill = Forwards(prefill_tokens=sum(len(c.token_ids) for c in chunks))
        return self._logits(sum(c.num_logits for c in chunks))

    def decode(self, rows) -> torch.Tensor:
        base = self._prefill or Forwards()
        self._prefill = None
        self.steps.append(replace(base, decode_rows=len(rows.positions),
                                  decode_positions=sum(rows.positions) + len(rows.positions)))
        return self._logits(len(rows.positions))

    def mixed(self, chunks, rows) -> torch.Tensor:
        raise NotImplementedError("job_schedule prices the two-forward step only")

    def _flush(self) -> None:
        """A prefill forward with no decode forward after it is a step of its own."""
        if self._prefill is not None:
            self.steps.append(self._prefill)
            self._prefill = None

    def finish(self) -> tuple[Forwards, ...]:
        self._flush()
        return tuple(self.steps)


class _StubModel(torch.nn.Module):
    """The model the engine is built around: only its config matters (the runner is replaced)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def forward(self, batch, caches, logits_out=None):  # pragma: no cover - the recording runner answers
        raise AssertionError("the recording runner answers every forward")


def run_schedule(prompts: int, prompt_tokens: int, output_tokens: int, max_running: int, step_tokens: int,
                 seed: int = 0) -> Trace:
    """The engine's schedule of `prompts` unshared prompts (random tokens, ignore_eos), `max_running`
    rows at once, `step_tokens` prefill tokens a step, KV for every row at its full length."""
    config = model_config_from_dict(_STUB_MODEL)
    row = prompt_tokens + output_tokens
    engine = Engine(_StubModel(config), EngineConfig(
        device="cpu", dtype="fp32", max_running=max_running, max_batch_tokens=step_tokens, track_interval=8192,
        cuda_graphs=False, memory_budget_bytes=_pool_bytes(config, max_running, row)))
    runner = _RecordingRunner()
    engine.stepper.runner = runner
    generator = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=output_tokens, ignore_eos=True)
    requests = [Request(request_id=i, seed_key=i, sampling=params,
                        prompt_token_ids=tuple(torch.randint(config.vocab_size, (prompt_tokens,),
                                                             generator=generator).tolist()))
                for i in range(prompts)]
    outputs = sum(1 for _ in engine.generate(requests))
    stats = engine.stats
    # The H200's jobs had KV for every row: a preemption here would be a schedule they did not run.
    assert outputs == prompts and stats.preemptions == 0, (outputs, prompts, stats.preemptions)
    return Trace(prompts, prompt_tokens, output_tokens, max_running, step_tokens, runner.finish())


def _pool_bytes(config, rows: int, row_tokens: int) -> int:
    """A pool budget that holds `rows` rows of `row_tokens` KV positions and their states, with room."""
    kv, state = shapes_from_model_config(config, torch.float32, ring_len=16, ckpt_dtype=torch.float32,
                                         kv_dtype=torch.float32)
    return int(1.5 * rows * (row_tokens * kv.bytes_per_token + 3 * state.bytes_per_slot)) + (64 << 20)


@dataclass(frozen=True)
class Job:
    """A measured (or asked-for) 8k / 1k job: prompts, rows at once, prefill tokens a step."""
    prompts: int
    max_running: int
    step_tokens: int
    tok_s: float = 0.0  # measured total tok/s (0: not measured)
    prompt_tokens: int = 8192
    output_tokens: int = 1024

    def trace(self) -> Trace:
        return _traced(self.prompts, self.prompt_tokens, self.output_tokens, self.max_running, self.step_tokens)

    def seconds(self) -> float:
        return self.prompts * (self.prompt_tokens + self.output_tokens) / self.tok_s


_TRACES: dict[tuple, Trace] = {}


def _traced(*key) -> Trace:
    if key not in _TRACES:
        _TRACES[key] = run_schedule(*key)
    return _TRACES[key]


@dataclass(frozen=True)
class Calibration:
    """A setting's decode forward (measured per part: `decode`, its prefill constants unset) and two
    measured jobs of one tree that fix its prefill constants, or `prefill_of`: the calibration whose
    prefill constants it shares (a setting that changes only the decode forward, such as the KV
    dtype); `checks`: measured jobs no fit saw."""
    decode: StepTimes
    fit: tuple[Job, ...] = ()
    checks: tuple[Job, ...] = ()
    prefill_of: str = ""
    source: str = ""

    def __post_init__(self) -> None:
        if (len(self.fit) == 2) == bool(self.prefill_of):
            raise ValueError("a calibration fits its prefill constants to two jobs or takes them from prefill_of")

    @property
    def rows(self) -> int:
        """The rows the engine sized for the setting's measured default job."""
        return (self.fit or self.checks)[0].max_running

    def times(self) -> StepTimes:
        """The prefill constants solved from the two fitted jobs: each job's time is its decode
        forwards' modelled time plus (prefill forwards × step_ms + prompt tokens × token_ms)."""
        if self.prefill_of:
            shared = CALIBRATIONS[self.prefill_of].times()
            return replace(self.decode, prefill_step_ms=shared.prefill_step_ms, prefill_token_ms=shared.prefill_token_ms)
        rows = []
        for job in self.fit:
            trace = job.trace()
            forwards = sum(1 for f in trace.steps if f.prefill_tokens)
            tokens = sum(f.prefill_tokens for f in trace.steps)
            rows.append((forwards, tokens, 1e3 * (job.seconds() - trace.seconds(self.decode))))
        (n1, x1, r1), (n2, x2, r2) = rows
        det = n1 * x2 - n2 * x1
        if det == 0:
            raise ValueError("the two fitted jobs must differ in prefill forwards per prompt token")
        step_ms, token_ms = (r1 * x2 - r2 * x1) / det, (n1 * r2 - n2 * r1) / det
        return replace(self.decode, prefill_step_ms=step_ms, prefill_token_ms=token_ms)


# Decode constants. A KV position: the decode attention kernel alone at its measured rate
# (`bench_replay_attn`, per attention layer: 256 rows × 8,704 positions in 1.066 ms on the
# 35B-A3B's 2 KV heads, 96 × 8,704 in 0.799 ms on the 27B's 4). A row: the ReplaySSM step, flush
# and conv of the FP8 MoE's 8-layer decode profile (0.505 ms at 256 rows, × 5 layers' worth) plus
# sampling; the 27B's measured state floor (2.10 ms at 96 rows). A MoE's experts: the FP8 expert
# kernels of that profile (1.231 ms at 8 layers, × 5); bf16, that plus the full-batch steps'
# difference less the dense weights' (41.1 − 28.8 − 0.42 ms). Fixed: what is left of the measured
# full-batch step at its rows and mean context (~8,730 positions).
_FULL_CONTEXT = 8730


def _decode(full_batch_ms: float, rows: int, *, layers_attention: int, kv_ms_per_layer_position: float,
            row_ms: float, experts_ms: float = 0.0, experts: int = 0, top_k: int = 0) -> StepTimes:
    times = StepTimes(0.0, 0.0, 0.0, row_ms, layers_attention * kv_ms_per_layer_position, experts_ms, experts, top_k)
    rest = times.decode_ms(Forwards(decode_rows=rows, decode_positions=rows * _FULL_CONTEXT))
    return replace(times, decode_fixed_ms=full_batch_ms - rest)


_MOE = dict(layers_attention=10, kv_ms_per_layer_position=1.066 / (256 * 8704), row_ms=0.505 * 5 / 256 + 0.002,
            experts=256, top_k=8)
_DENSE = dict(layers_attention=16, kv_ms_per_layer_position=0.799 / (96 * 8704), row_ms=2.10 / 96)
_FP8_EXPERTS_MS = 1.231 * 5

CALIBRATIONS = {
    # The throughput table's rows: 41,292 at 32,768 tokens a step (384 rows sized, full batch 28.8 ms
    # at 256), 41,613 at 65,536 (376 rows). 8,192 tokens a step: 1 / 1.1675 of 32,768 (measured on an
    # earlier tree: the log's "MoE step size" entry).
    "qwen3.5-35b-a3b-fp8": Calibration(
        _decode(28.8, 256, experts_ms=_FP8_EXPERTS_MS, **_MOE),
        fit=(Job(256, 384, 32768, 41292), Job(256, 384, 8192, 41292 / 1.1675)),
        checks=(Job(256, 376, 65536, 41613),),
        source="BENCHMARKS 'Throughput against SGLang's published rows'; the log's 'MoE step size'"),
    # FP8 KV (`kv_cache_dtype: fp8_e4m3`): the FP8-pool attention kernel at 0.740 ms a layer (256 × 8,704
    # positions, 128-key tiles), full batch 25.3 ms at 256 rows, 656 rows sized; the prefill is the
    # default's. Measured at 1.092x the default job beside it (43,942 against 40,235, another call than
    # the default calibration's): here 1.092 × the default calibration's 41,292.
    "qwen3.5-35b-a3b-fp8/kv=fp8_e4m3": Calibration(
        _decode(25.3, 256, experts_ms=_FP8_EXPERTS_MS, **dict(_MOE, kv_ms_per_layer_position=0.740 / (256 * 8704))),
        checks=(Job(256, 656, 32768, 41292 * 43942 / 40235),), prefill_of="qwen3.5-35b-a3b-fp8",
        source="BENCHMARKS 'Throughput against SGLang's published rows', 'FP8 KV cache'"),
    # The throughput table's rows: 32,087 at 32,768 (264 rows, full batch 41.1 ms at 256), 27,582 at 8,192 (272),
    # 31,960 at 32,768 in another call (272), 28,556 at 65,536 (248 rows: eight prompts in a second wave).
    "qwen3.5-35b-a3b": Calibration(
        _decode(41.1, 256, experts_ms=_FP8_EXPERTS_MS + 41.1 - 28.8 - 0.42, **_MOE),
        fit=(Job(256, 264, 32768, 32087), Job(256, 272, 8192, 27582)),
        checks=(Job(256, 272, 32768, 31960), Job(256, 248, 65536, 28556)),
        source="BENCHMARKS 'Throughput against SGLang's published rows'"),
    # The throughput table's rows: 96 prompts, 8,924 at 32,768 (104 rows sized, full batch 32.6 ms at 96), 8,679 at 8,192.
    "qwen3.5-27b": Calibration(
        _decode(32.6, 96, **_DENSE),
        fit=(Job(96, 104, 32768, 8924), Job(96, 104, 8192, 8679)),
        source="BENCHMARKS 'Throughput against SGLang's published rows'"),
    # The throughput table's rows: 96 prompts, 11,531 at 32,768 (136 rows, full batch 29.4 ms at 96), 11,219 at 8,192 (128).
    "qwen3.5-27b-fp8": Calibration(
        _decode(29.4, 96, **_DENSE),
        fit=(Job(96, 136, 32768, 11531), Job(96, 128, 8192, 11219)),
        source="BENCHMARKS 'Throughput against SGLang's published rows'"),
}


def _row(preset: str, job: Job, times: StepTimes, kind: str) -> str:
    trace = job.trace()
    summary = trace.summary()
    predicted = trace.tok_s(times)
    measured = f"{job.tok_s:,.0f} | {predicted / job.tok_s:.3f}" if job.tok_s else "— | —"
    return (f"| {preset} | {kind} | {job.prompts:,} | {job.max_running} | {job.step_tokens:,} | "
            f"{summary['decode_forwards']:,} | {summary['mean_decode_rows']:.0f} | {trace.seconds(times):.1f} | "
            f"{predicted:,.0f} | {measured} |")


def main(argv: Optional[Sequence[str]] = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default=",".join(CALIBRATIONS))
    parser.add_argument("--prompts", default="256,1024", help="job sizes to predict (comma-separated)")
    parser.add_argument("--rows", type=int, default=0,
                        help="rows at once (0: what the engine sized for the preset's measured default job)")
    parser.add_argument("--step-tokens", default="32768", help="prefill tokens a step (comma-separated)")
    parser.add_argument("--no-check", action="store_true", help="skip the measured jobs (fitted and checked)")
    args = parser.parse_args(argv)
    lines = ["| model | job | prompts | rows at once | step tokens | decode forwards | mean decode rows | "
             "predicted s | predicted tok/s | measured tok/s | predicted / measured |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    constants = []
    for preset in args.presets.split(","):
        if preset not in CALIBRATIONS:
            raise SystemExit(f"--presets: no calibration for {preset!r} (have: {', '.join(CALIBRATIONS)})")
        calibration = CALIBRATIONS[preset]
        times = calibration.times()
        experts = f" + experts {times.decode_experts_ms:.2f} ms × the share read" if times.experts else ""
        constants.append(f"{preset}: prefill {times.prefill_step_ms:.1f} ms a forward + {times.prefill_token_ms * 1e3:.2f} "
                         f"µs a token; decode {times.decode_fixed_ms:.2f} ms{experts} + {times.decode_row_ms * 1e3:.1f} "
                         f"µs a row + {times.decode_position_ms * 1e6:.2f} ns a KV position")
        if not args.no_check:
            lines += [_row(preset, job, times, "fitted") for job in calibration.fit]
            lines += [_row(preset, job, times, "check") for job in calibration.checks]
        rows = args.rows or calibration.rows
        for prompts in (int(n) for n in args.prompts.split(",")):
            for step_tokens in (int(n) for n in args.step_tokens.split(",")):
                lines.append(_row(preset, Job(prompts, rows, step_tokens), times, "predicted"))
    text = "\n".join(constants + [""] + lines)
    print(text)
    return text


if __name__ == "__main__":
    main()
