"""The engine: requests in, planned and batched through the model, results streamed out.

`Engine.generate_units` takes work units (lists of requests), plans each unit as a whole
(sorted DFS order, branch points, ideal reuse), and runs continuous-batching steps, streaming
each (request, sample) the moment it finishes. The next unit joins as soon as the earlier ones
have no sequence left waiting for admission. `Engine.generate` is the same over consecutive
windows of `plan_window` requests.

`Engine` is the facade: building is `engine/build.py`, one step (schedule → run → postprocess)
`engine/step.py`, drawing, scoring and completing sequences `engine/postprocess.py`.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import fields, replace
from typing import Callable, Iterable, Iterator, Optional, Sequence as Seq

import torch

from batchinfer.engine.build import EngineBuilder, load_model
from batchinfer.engine.config import EngineConfig, dtype_name
from batchinfer.engine.overlap import DecodeOverlap
from batchinfer.engine.planner import PlanSummary, make_plan, plan_prompts
from batchinfer.engine.postprocess import Postprocessor
from batchinfer.engine.scheduler import Scheduler
from batchinfer.engine.step_cost import engine_step_cost
from batchinfer.engine.sequence import Detokenize, Sequence, StopRules
from batchinfer.engine.stats import EngineStats, StatsTally, process_peak_rss_bytes
from batchinfer.engine.step import EngineStep
from batchinfer.engine.types import Request, RequestOutput
from batchinfer.models.pipeline import PipelinedModel

_NO_UNIT = object()  # what the unit source gives when it is exhausted
# Process-wide maxima, not counters: `stats_since` keeps them as they are.
_PEAK_STATS = frozenset({"peak_memory_bytes", "peak_rss_bytes"})


def _windows(requests: Iterable[Request], size: Optional[int]) -> Iterator[list[Request]]:
    """`requests` in consecutive lists of `size` (the last may be shorter; None: one list)."""
    source = iter(requests)
    while batch := list(itertools.islice(source, size)):
        yield batch
        if size is None or len(batch) < size:
            return


class Engine:
    def __init__(self, model, config: EngineConfig, *, eos_token_ids: Seq[int] = (),
                 detokenize: Optional[Detokenize] = None, model_name: str = "",
                 load_weights: Optional[Callable[[], None]] = None) -> None:
        """`model` is a built `HybridModel` on config's device (see `from_pretrained`). With
        `load_weights` its parameters are only allocated: the engine calls it to fill them while
        the Triton kernels compile in worker processes (the trace needs only shapes)."""
        self.config = config
        self.model = model
        self.model_name = model_name
        self.device = config.resolved_device()
        # Seconds per startup phase, additive: load (the weight load's wall time, kernels
        # compiling meanwhile; from_pretrained adds the allocation), compile_and_capture (the
        # trace, the compile time left after the load, the graph capture).
        self.startup_seconds: dict[str, float] = {"load": 0.0, "compile_and_capture": 0.0}
        self.mixed_step = config.resolved_mixed_step()  # one forward per step over prefill and decode
        model_config = model.config
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        eos = tuple(eos_token_ids) or tuple(model_config.eos_token_ids)
        stop_rules = StopRules(frozenset(eos), self.max_model_len, detokenize)

        builder = EngineBuilder(model, config, self.max_model_len, self.mixed_step, self.startup_seconds)
        parts = builder.build(load_weights)
        self.pool_plan, self.cache, self.runner = parts.pool_plan, parts.cache, parts.runner
        self.precompile_report = parts.precompile_report
        self.tally = StatsTally()
        self.scheduler = Scheduler(
            self.cache, max_running=self.pool_plan.max_running,
            max_batch_tokens=builder.max_batch_tokens,
            track_interval=config.track_interval, wait_for_leaders=builder.cache_config.tracks, tally=self.tally,
            state_slots=self.pool_plan.state_slots, branch_state_capacity=self.pool_plan.cache_state_slots,
            max_model_len=self.max_model_len, decode_rows_in_budget=self.mixed_step,
            step_cost=engine_step_cost(model, builder.kv_shape.bytes_per_token, builder.state_shape.bytes_per_slot,
                                       config.row_tokens or min(self.max_model_len, 8192)) if self.mixed_step else None)
        self._windows = itertools.count()
        self.overlap = DecodeOverlap()  # the decode step whose tokens the host has not read yet
        self.post = Postprocessor(stop_rules, self.scheduler, self.tally)
        self._stats_origin: Optional[EngineStats] = None  # where `stats` counts from (None: the start)
        self.stepper = EngineStep(self.scheduler, self.runner, self.cache, self.post, self.overlap, self.tally,
                                  self.device, mixed_step=self.mixed_step, overlap_decode=config.overlap_decode,
                                  concurrent_prefill=config.concurrent_prefill)

    @classmethod
    def from_pretrained(cls, model: str, config: EngineConfig = EngineConfig(), seed: int = 0,
                        eos_token_ids: Seq[int] = (), detokenize: Optional[Detokenize] = None) -> "Engine":
        """A model checkpoint directory or a preset name (random weights drawn from `seed`).

        EOS: `eos_token_ids`, or when empty the model checkpoint config's `eos_token_id`."""
        loaded: dict[str, float] = {}
        built, fill = load_model(model, config, seed, loaded)
        engine = cls(built, config, eos_token_ids=eos_token_ids, detokenize=detokenize, model_name=str(model),
                     load_weights=fill)
        engine.startup_seconds["load"] += loaded["load"]
        return engine

    @property
    def stop_rules(self) -> StopRules:
        """EOS ids, length limit and detokenizer: the postprocessor's, which applies them."""
        return self.post.stop_rules

    @stop_rules.setter
    def stop_rules(self, rules: StopRules) -> None:
        self.post.stop_rules = rules

    # ---- planning --------------------------------------------------------------------------
    @staticmethod
    def plan(prompts: Seq[Seq[int]], n: int | Seq[int] = 1) -> PlanSummary:
        return plan_prompts(prompts, n)

    # ---- generation ------------------------------------------------------------------------
    def generate(self, requests: Iterable[Request]) -> Iterator[RequestOutput]:
        """Stream one output per (request, sample not skipped), in completion order. The
        requests are planned `plan_window` at a time (None: all together), each window run as
        a unit of `generate_units` (its `unit_index`)."""
        return self.generate_units(_windows(requests, self.config.plan_window))

    def generate_units(self, units: Iterable[Seq[Request]]) -> Iterator[RequestOutput]:
        """Run work units: each is planned as one whole (sorted DFS order, branch points, ideal
        reuse), whatever its size, and its outputs stream as samples finish. The next unit is
        pulled as soon as no sequence of the earlier ones waits for admission, so outputs of
        unit k interleave with those of unit k + 1; `RequestOutput.unit_index` says which
        unit (0-based, in pull order) a sample belongs to and `unit_done` marks the last output
        of its unit. A unit with nothing to generate (empty, every sample skipped) yields nothing."""
        source = iter(units)
        unit_ids = itertools.count()
        left: dict[int, int] = {}  # unit index → outputs still to stream
        exhausted = False
        started, completed = time.perf_counter(), False
        try:
            while True:
                if not exhausted and not self.scheduler.waiting:
                    unit = next(source, _NO_UNIT)
                    if unit is _NO_UNIT:
                        exhausted = True
                    else:
                        for failed in self._enqueue(list(unit), next(unit_ids), left):
                            yield self._complete(failed, left)
                        continue  # an empty unit pulls the next at once
                if not self.scheduler.has_work:
                    if exhausted:
                        completed = True
                        return
                    continue
                for seq in self._step():
                    yield self._complete(seq, left)
        finally:
            if not completed:  # closed early or failed: the next generate() must start clean
                self.stepper.abandon()
            self.tally.add(wall_seconds=time.perf_counter() - started)

    def _enqueue(self, requests: list[Request], unit_index: int, left: dict[int, int]) -> list[Sequence]:
        """Plan a unit and queue its samples; returns the samples rejected outright. Counts the
        unit's outputs to come in `left`."""
        window_id = next(self._windows)
        rejected, accepted, samples = [], [], []
        for request in requests:
            skipped = set(request.skip_samples)
            wanted = [s for s in range(1 if request.score_tokens else request.sampling.n) if s not in skipped]
            reason = self._reject_reason(request)
            if reason is not None:
                for s in wanted:
                    rejected.append(Sequence(request, s, priority=(window_id, -1), planned_reuse=0,
                                             branch_points=frozenset(), leader=None, unit_index=unit_index,
                                             finish_reason="error", error=reason))
            elif wanted:
                accepted.append(request)
                samples.append(wanted)
        # A scoring request is planned as its prompt alone: the k continuations of one prompt are
        # then k samples of it, sharing all but its last token (whose logits score their first).
        plan = make_plan([r.scored_prompt for r in accepted], [len(s) for s in samples])
        seqs: list[Sequence] = []
        for order, row in enumerate(plan.rows):
            seqs.append(Sequence(
                accepted[row.prompt_index], samples[row.prompt_index][row.sample_index], (window_id, order),
                planned_reuse=row.resume_depth, branch_points=frozenset(row.branch_points),
                leader=None if row.leader is None else seqs[row.leader], unit_index=unit_index))
        left[unit_index] = len(rejected) + len(seqs)
        self.scheduler.add(seqs)
        return rejected

    def _reject_reason(self, request: Request) -> Optional[str]:
        n = len(request.prompt_token_ids)
        if n == 0:
            return "empty prompt"
        if request.score_tokens:
            if not 0 < request.score_tokens < n:
                return f"a continuation of {request.score_tokens} tokens needs a prompt before it ({n} tokens in all)"
            if n > self.max_model_len:
                return f"prompt and continuation have {n} tokens; max_model_len is {self.max_model_len}"
        elif n >= self.max_model_len:
            return f"prompt has {n} tokens; max_model_len {self.max_model_len} leaves no room to generate"
        vocab = self.model.config.vocab_size
        if min(request.prompt_token_ids) < 0 or max(request.prompt_token_ids) >= vocab:
            return f"prompt has token ids outside the vocabulary [0, {vocab})"
        return None

    def _complete(self, seq: Sequence, left: dict[int, int]) -> RequestOutput:
        left[seq.unit_index] -= 1
        return self.post.complete(seq, unit_done=left[seq.unit_index] == 0)

    def _step(self) -> list[Sequence]:
        """One step (schedule → run → postprocess, `EngineStep.run`); the sequences it finished."""
        return self.stepper.run()

    # ---- reporting -------------------------------------------------------------------------
    @property
    def stats(self) -> EngineStats:
        """The counters since the engine was built, or since the last `restart_stats`."""
        if self._stats_origin is None:
            return self._stats_now()
        return self.stats_since(self._stats_origin, now=self._stats_now())

    def restart_stats(self) -> None:
        """Count from here: `stats` reports what comes after this call (an engine kept across
        jobs reports each job's own); the peaks stay process-wide."""
        self._stats_origin = self._stats_now()

    def stats_since(self, earlier: EngineStats, now: Optional[EngineStats] = None) -> EngineStats:
        """The counters of `now` (default: `stats`) since `earlier`, a `stats` taken before on
        the same count; the peaks stay process-wide."""
        now = self.stats if now is None else now
        return replace(now, **{f.name: getattr(now, f.name) - getattr(earlier, f.name)
                               for f in fields(now) if f.name not in _PEAK_STATS})

    def _stats_now(self) -> EngineStats:
        cache = self.cache.stats()
        rss = process_peak_rss_bytes()
        # On the CPU the model, pools and activations live in the process: its RSS is the real peak.
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else rss
        return self.tally.snapshot(states_tracked=cache.states_tracked, states_donated=cache.states_donated,
                                   states_evicted=cache.states_evicted, tracks_skipped=cache.tracks_skipped,
                                   peak_memory_bytes=peak, peak_rss_bytes=rss)

    def settings(self) -> dict:
        """The settings this engine runs with (resolved), for stats.json."""
        plan = self.pool_plan
        return {
            **self.config.to_dict(),
            "model": self.model_name,
            "device": str(self.device),
            "dtype": dtype_name(self.config.resolved_dtype()),
            "ckpt_dtype": dtype_name(self.config.resolved_ckpt_dtype()) if self.config.replayssm else None,
            "max_model_len": self.max_model_len,
            "max_batch_tokens": self.scheduler.max_batch_tokens,  # the config's, else the model's default
            "mixed_step": self.mixed_step,  # the config's, unless BATCHINFER_MIXED_STEP=0 turned it off
            "concurrent_prefill": self.stepper.side is not None,
            "max_running_effective": plan.max_running,
            "kv_slots": plan.kv_slots,
            "state_slots": plan.state_slots,
            "eos_token_ids": sorted(self.stop_rules.eos_token_ids),
            **({"pipeline": {"stages": [list(b) for b in self.model.split.bounds],
                             "predicted_balance": round(self.model.split.balance, 4),
                             # each stage's compute time so far: the pipeline's bubble is wall - busy
                             "stage_busy_seconds": [round(b, 6) for b in self.model.stage_busy_seconds()]}}
               if isinstance(self.model, PipelinedModel) else {}),
        }
