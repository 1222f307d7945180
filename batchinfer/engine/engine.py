"""The engine: requests in, planned and batched through the model, results streamed out.

`Engine.generate_units` takes work units (lists of requests), plans each unit as a whole
(sorted DFS order, branch points, ideal reuse), and runs continuous-batching steps, streaming
each (request, sample) the moment it finishes. The next unit joins as soon as the earlier ones
have no sequence left waiting for admission. `Engine.generate` is the same over consecutive
windows of `plan_window` requests.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import math
import time
from dataclasses import replace
from typing import Callable, Iterable, Iterator, Optional, Sequence as Seq

import numpy as np
import torch

from batchinfer.engine.activations import decode_graph_bytes, step_activation_bytes
from batchinfer.engine.config import EngineConfig, dtype_name
from batchinfer.engine.cuda_graphs import DecodeGraphs, bucket_sizes
from batchinfer.engine.decode_rows import decode_rows
from batchinfer.engine.draws import Draw, read_now
from batchinfer.engine.host_copy import upload, upload_packed
from batchinfer.engine.model_runner import DecodeRows, ModelRunner, SequenceChunk
from batchinfer.engine.overlap import DecodeOverlap
from batchinfer.engine.pipeline_pools import build_pipeline_pools, plan_pipeline_pools
from batchinfer.engine.planner import PlanSummary, make_plan, plan_prompts
from batchinfer.engine.sampler import SamplingTensors, apply_token_bitmask, identity_key, sample, token_logprobs
from batchinfer.engine.scheduler import Scheduler
from batchinfer.engine.step_cost import engine_step_cost
from batchinfer.engine.sequence import Detokenize, Sequence, StopRules
from batchinfer.engine.startup import max_running_shortfall, phase
from batchinfer.engine.step_batch import logits_rows, sequence_chunk
from batchinfer.engine.stats import EngineStats, StatsTally, process_peak_rss_bytes
from batchinfer.engine.types import ContinuationScore, Request, RequestOutput, TokenLogprob
from batchinfer.models.forward_batch import ModelCaches
from batchinfer.models.pipeline import PipelinedModel, StagedCaches
from batchinfer.cache.budget import build_pools, memory_budget, plan_pools
from batchinfer.cache.shapes import shapes_from_model_config
from batchinfer.cache.state_cache import CacheConfig, StateCache

log = logging.getLogger(__name__)
_CPU_DEFAULT_BUDGET_BYTES = 256 << 20  # no free-memory query on the CPU: a modest fixed pool
_GRAPH_CTX_CAP = 32768  # context slots per row in the decode graphs' buffer; longer steps run eagerly
# Reserved over the activation estimate for the caching allocator's rounding and fragmentation.
ACTIVATION_MARGIN = 1.25


def activation_reserve_bytes(model_config, config: EngineConfig, max_model_len: int) -> int:
    """Memory the pools must leave free on CUDA: the largest eager step plus the decode graphs,
    with ACTIVATION_MARGIN for the allocator. The fraction alone left 10% of the free memory,
    less than one prefill step needs on a nearly full device (docs/BENCHMARKS.md, "Memory budget:
    the activation reserve")."""
    dtype = config.resolved_dtype()
    reserve = step_activation_bytes(model_config, dtype, config.max_batch_tokens, config.resolved_max_running(model_config))
    if config.cuda_graphs:
        reserve += decode_graph_bytes(model_config, dtype, bucket_sizes(config.resolved_max_running(model_config)),
                                      min(max_model_len, _GRAPH_CTX_CAP))
    return int(reserve * ACTIVATION_MARGIN)


_NO_UNIT = object()  # what the unit source gives when it is exhausted


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
        self.stop_rules = StopRules(frozenset(eos), self.max_model_len, detokenize)

        cache_config = CacheConfig(mode=config.state_cache, prefix_cache=config.prefix_cache)
        ring_len = config.ring_len if config.replayssm else 0
        kv_shape, state_shape = shapes_from_model_config(
            model_config, config.resolved_dtype(), ring_len=ring_len, ckpt_dtype=config.resolved_ckpt_dtype())
        # One working slot per running request, plus plan_pools' shared pool of cached states
        # that tracking borrows from (a tracked state goes to the tree at once) and eviction
        # refills: tree states are never pinned by running requests, only during admission.
        pipelined = isinstance(model, PipelinedModel)
        if pipelined:  # each stage priced against its own device (engine/pipeline_pools.py)
            requested = config.resolved_max_running(model.config)
            self.pool_plan = plan_pipeline_pools(
                model, kv_shape, state_shape, max_running=requested, cpu_budget=_CPU_DEFAULT_BUDGET_BYTES,
                fraction=config.memory_fraction, budget_bytes=config.memory_budget_bytes,
                reserve_bytes=activation_reserve_bytes(model.config, config, self.max_model_len))
        else:
            budget = self._budget_bytes()
            requested = config.resolved_max_running(model.config, (budget, kv_shape.bytes_per_token, state_shape.bytes_per_slot))
            self.pool_plan = plan_pools(kv_shape, state_shape, budget, max_running=requested)
        if max_running_shortfall(self.pool_plan.max_running, config.max_running, requested, self.device.type):
            log.warning("memory budget fits %d concurrent requests, not max_running=%d (%.0f MiB per state slot)",
                        self.pool_plan.max_running, requested, self.pool_plan.bytes_per_state_slot / 2**20)
        kv_pool, state_pool = (build_pipeline_pools(model, self.pool_plan, kv_shape, state_shape) if pipelined
                               else build_pools(self.pool_plan, kv_shape, state_shape, self.device))
        self.cache = StateCache(kv_pool, state_pool, cache_config)
        caches = (StagedCaches if pipelined else ModelCaches).from_pools(kv_pool, state_pool)
        # Before the graphs, which would compile the kernels one by one at their first launch.
        self.precompile_report = self._load_and_compile(caches, kv_pool, state_pool, load_weights)
        self.runner = ModelRunner(model, caches, self.device, replay=config.replayssm,
                                  decode_graphs=self._decode_graphs(caches, kv_pool, state_pool))
        self.tally = StatsTally()
        self.scheduler = Scheduler(
            self.cache, max_running=self.pool_plan.max_running, max_batch_tokens=config.max_batch_tokens,
            track_interval=config.track_interval, wait_for_leaders=cache_config.tracks, tally=self.tally,
            state_slots=self.pool_plan.state_slots, branch_state_capacity=self.pool_plan.cache_state_slots,
            max_model_len=self.max_model_len, decode_rows_in_budget=self.mixed_step,
            step_cost=engine_step_cost(model, kv_shape.bytes_per_token, state_shape.bytes_per_slot,
                                       config.row_tokens or min(self.max_model_len, 8192)) if self.mixed_step else None)
        self._windows = itertools.count()
        self.overlap = DecodeOverlap()  # the decode step whose tokens the host has not read yet
        self.token_logprobs: dict[Sequence, list[TokenLogprob]] = {}  # sequences with sampling.logprobs set
        # Scoring sequences: position → (logprob of the next token, whether it is the argmax).
        self.scores: dict[Sequence, dict[int, tuple[float, bool]]] = {}
        self.matchers: dict[Sequence, object] = {}  # constrained sequences: their grammar matcher

    @classmethod
    def from_pretrained(cls, model: str, config: EngineConfig = EngineConfig(), seed: int = 0,
                        eos_token_ids: Seq[int] = (), detokenize: Optional[Detokenize] = None) -> "Engine":
        """A checkpoint directory or a preset name (random weights drawn from `seed`).

        EOS: `eos_token_ids`, or when empty the checkpoint config's `eos_token_id`."""
        from batchinfer.models.loader import empty_model, load_weights
        from batchinfer.models.presets import PRESETS, build_model

        loaded: dict[str, float] = {}
        device = config.resolved_device()
        if config.pipeline_stages > 1:  # each stage allocated on its device, filled with its tensors only
            from batchinfer.models.pipeline_build import pipelined_model

            with phase("allocating the model", loaded, "load"):
                built, fill = pipelined_model(str(model), config.resolved_dtype(), device, config.pipeline_stages,
                                              seed=seed)
        elif str(model) in PRESETS:  # random weights: drawn before the engine (nothing to overlap)
            with phase("loading weights", loaded, "load"):
                built = build_model(model, config.resolved_dtype(), device, seed=seed)
                if device.type == "cuda":
                    torch.cuda.synchronize()
            fill = None
        else:  # the weights load inside the engine, while its kernels compile
            with phase("allocating the model", loaded, "load"):  # on CUDA also the device's initialisation
                built = empty_model(model, config.resolved_dtype(), device)

            def fill() -> None:
                load_weights(built, model)
                if device.type == "cuda":
                    torch.cuda.synchronize()  # the copies to the device are part of the load

        engine = cls(built, config, eos_token_ids=eos_token_ids, detokenize=detokenize, model_name=str(model),
                     load_weights=fill)
        engine.startup_seconds["load"] += loaded["load"]
        return engine

    def _load_and_compile(self, caches, kv_pool, state_pool, load_weights: Optional[Callable[[], None]]):
        """Trace the steps' Triton kernels and start compiling them in worker processes (CUDA
        only), load the weights meanwhile (`load_weights`, when given), then wait for the
        compiles and load them into this process. → the PrecompileReport (None: no precompile)."""
        # One CPU is left to the weight load that runs beside the compiles.
        pending = self._start_precompile(caches, kv_pool, state_pool, spare_cpus=int(load_weights is not None))
        try:
            if load_weights is not None:
                compiling = pending is not None and pending.compiling
                label = f"loading weights (and compiling {pending.missing} kernels in parallel)" if compiling \
                    else "loading weights"
                with phase(label, self.startup_seconds, "load"):
                    load_weights()
        except BaseException:
            if pending is not None:
                pending.cancel()
            raise
        if pending is None:
            return None
        with phase("compiling kernels", self.startup_seconds, "compile_and_capture"):
            return pending.finish()

    def _start_precompile(self, caches, kv_pool, state_pool, spare_cpus: int = 0):
        """The trace of every Triton kernel the steps will launch, their compiles submitted to
        worker processes (CUDA only; None otherwise or when turned off); `spare_cpus` are left
        to the caller's work meanwhile."""
        if self.device.type != "cuda" or isinstance(self.model, PipelinedModel):  # stages compile at first launch
            return None
        from batchinfer.engine.precompile import StepShapes, engine_trace, start_precompile

        shapes = StepShapes(decode_buckets=bucket_sizes(self.pool_plan.max_running),
                            graph_ctx_cap=min(self.max_model_len, _GRAPH_CTX_CAP), decode_hint=True,
                            max_batch_tokens=self.config.max_batch_tokens, max_running=self.pool_plan.max_running,
                            max_model_len=self.max_model_len, replay=self.config.replayssm,
                            mixed_step=self.mixed_step)
        with phase("tracing kernels", self.startup_seconds, "compile_and_capture"):
            return start_precompile(engine_trace(self.model, caches, shapes, state_pool.pad_slot, kv_pool.pad_slot,
                                                 self.device), spare_cpus=spare_cpus)

    def _decode_graphs(self, caches, kv_pool, state_pool) -> Optional[DecodeGraphs]:
        if not (self.config.cuda_graphs and self.device.type == "cuda") or isinstance(self.model, PipelinedModel):
            return None
        graphs = DecodeGraphs(self.model, caches, self.device, replay=self.config.replayssm,
                              max_batch=self.pool_plan.max_running, pad_state_slot=state_pool.pad_slot,
                              pad_kv_slot=kv_pool.pad_slot, ctx_cap=min(self.max_model_len, _GRAPH_CTX_CAP))
        try:
            with phase("capturing CUDA graphs", self.startup_seconds, "compile_and_capture"):
                graphs.capture_all()
        except Exception as err:  # e.g. an op that syncs with the host (MoE routing): run eagerly
            log.warning("decode CUDA graphs disabled, capture failed: %s", err)
            return None
        return graphs

    def _budget_bytes(self) -> int:
        if self.config.memory_budget_bytes is not None:
            return self.config.memory_budget_bytes
        if self.device.type == "cuda":
            reserve = activation_reserve_bytes(self.model.config, self.config, self.max_model_len)
            return memory_budget(self.device, self.config.memory_fraction, reserve_bytes=reserve)
        return memory_budget(self.device, self.config.memory_fraction, cpu_total_bytes=_CPU_DEFAULT_BUDGET_BYTES)

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
                self.overlap.clear()
                self.token_logprobs.clear()
                self.scores.clear()
                self.matchers.clear()
                self.scheduler.abandon()
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
                                             checkpoints=frozenset(), leader=None, unit_index=unit_index,
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
                planned_reuse=row.resume_depth, checkpoints=frozenset(row.checkpoints),
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
        if seq.finish_reason == "error":
            self.tally.add(requests=1)
        else:
            cached = seq.cached_tokens or 0
            self.tally.add(requests=1, prompt_tokens=seq.prompt_len, cached_tokens=cached,
                           theoretical_max_cached_tokens=seq.planned_reuse, output_tokens=seq.num_outputs,
                           planned_reuse_lost_tokens=max(0, seq.planned_reuse - cached))
        left[seq.unit_index] -= 1
        output = seq.to_output(unit_done=left[seq.unit_index] == 0)
        logprobs = self.token_logprobs.pop(seq, ())
        points = self.scores.pop(seq, {})
        self.matchers.pop(seq, None)
        if seq.finish_reason == "error":
            return output
        if seq.request.score_tokens:
            return replace(output, score=self._continuation_score(seq, points))
        if seq.request.sampling.logprobs is not None:
            output = replace(output, logprobs=tuple(logprobs))
        return output

    @staticmethod
    def _continuation_score(seq: Sequence, points: dict[int, tuple[float, bool]]) -> ContinuationScore:
        end = seq.prompt_len - 1  # position q's logits score token q + 1
        scored = [points[q] for q in range(end - seq.request.score_tokens, end)]
        return ContinuationScore(math.fsum(lp for lp, _ in scored), len(scored), all(g for _, g in scored))

    # ---- one step: schedule, run, postprocess ----------------------------------------------
    def _step(self) -> list[Sequence]:
        """One step; returns the sequences it finished. The scheduler plans it, the model runs
        one forward over the prefill chunks and the decode rows (`_mixed`; a step with only one
        kind, or without mixed_step: a prefill forward, then a decode forward), and `_postprocess`
        turns drawn tokens into progress."""
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        done = []
        if plan.needs_host_tokens:  # decode slots ran short: preempting needs every token read
            done += self._postprocess(*self.overlap.take())
            self.scheduler.schedule_rest(plan)
        done += self._fail(plan.failed)
        if self.mixed_step and plan.prefill and plan.decode:
            done += self._mixed(plan.prefill, plan.decode)
            # No device sync: with steps in flight the step's wall time is the GPU's.
            self.tally.add(mixed_seconds=time.perf_counter() - started)
            return done
        prefill_seconds = 0.0
        if plan.prefill:
            with self._timed("prefill_seconds") as timing:  # syncs: a decode step in flight finishes too
                done += self._prefill(plan.prefill)
            prefill_seconds = timing["seconds"]
        if plan.decode:
            done += self._decode(plan.decode)
            # With steps in flight the host waits on the previous step here, so wall time per
            # step is the GPU's time per step (a device sync would stop the overlap).
            self.tally.add(decode_seconds=time.perf_counter() - started - prefill_seconds)
        else:
            done += self._postprocess(*self.overlap.take())
        return done

    @staticmethod
    def _fail(seqs: list[Sequence]) -> list[Sequence]:
        for seq in seqs:
            seq.finish("error")
        return seqs

    # ---- run -------------------------------------------------------------------------------
    def _prefill(self, items: list[tuple[Sequence, int]]) -> list[Sequence]:
        """Run one prefill forward over (sequence, new tokens) chunks; sample where a chunk ends
        its sequence's tokens, score where a chunk holds a scoring sequence's continuation."""
        chunks = [sequence_chunk(seq, n) for seq, n in items]
        logits = self.runner.prefill(chunks)  # [N, V]: num_logits rows per chunk
        self.scheduler.advance(items)
        rows = logits_rows(items, chunks)
        done = self._score(rows.scored, logits) if rows.scored else []
        if rows.sampled:
            if rows.scored:
                logits = logits[upload(torch.tensor(rows.sample_rows, dtype=torch.int64), logits.device)]
            done += self._postprocess(rows.sampled, *read_now(self._draw(rows.sampled, logits)))
        return done

    def _mixed(self, items: list[tuple[Sequence, int]], decode: list[Sequence]) -> list[Sequence]:
        """One forward over the prefill chunks, then the decode rows (each a one-token segment).
        The chunks that end their sequence's tokens draw beside the decode rows, and the step
        stays in flight as a decode step does (`_launch_draw`)."""
        decode = sorted(decode, key=lambda seq: seq.priority)  # plan (DFS) order: sharers adjacent
        chunks = [sequence_chunk(seq, n) for seq, n in items]
        rows = decode_rows(decode, self.overlap.step)
        logits = self.runner.mixed(chunks, rows)  # [N_prefill + B, V]
        self._count_decode(decode, rows, mixed=True)
        self.scheduler.advance(items + [(seq, 1) for seq in decode])
        step = logits_rows(items, chunks, decode)
        done = self._score(step.scored, logits) if step.scored else []
        if step.scored and step.sampled:
            logits = logits[upload(torch.tensor(step.sample_rows, dtype=torch.int64), logits.device)]
        return done + self._launch_draw(step.sampled, logits)

    def _score(self, scored: list[tuple[Sequence, SequenceChunk, int]], logits: torch.Tensor) -> list[Sequence]:
        """Record each scored position's next-token logprob and greedy match (raw fp32 log_softmax);
        a scoring sequence whose tokens are all computed is finished (it generates nothing)."""
        rows, targets, points = [], [], []
        for seq, chunk, first_row in scored:
            end = chunk.start + len(chunk.token_ids)
            for j, q in enumerate(range(end - chunk.score_logits, end)):
                if q + 1 < len(seq.tokens):  # the last position scores nothing
                    rows.append(first_row + j)
                    targets.append(seq.tokens[q + 1])
                    points.append((seq, q))
        if rows:
            row_ids, target_ids = upload_packed([torch.tensor(rows, dtype=torch.int64),
                                                 torch.tensor(targets, dtype=torch.int64)], logits.device)
            picked = logits[row_ids].float()                                        # [P, V]
            logprob = picked.log_softmax(dim=1).gather(1, target_ids[:, None])[:, 0]  # [P]
            greedy = picked.argmax(dim=1) == target_ids                              # [P]
            values = torch.stack([logprob, greedy.float()], dim=1).tolist()
            for (seq, q), (lp, g) in zip(points, values):
                self.scores.setdefault(seq, {})[q] = (lp, g > 0.5)  # a recompute overwrites: each once
        done = []
        for seq, _, _ in scored:
            if seq.computed == len(seq.tokens) and not seq.finished:
                seq.finish("stop")
                self.scheduler.finish(seq)
                done.append(seq)
        return done

    def _decode(self, seqs: list[Sequence]) -> list[Sequence]:
        """Run one decode step and draw its tokens on the device. With overlap they stay in
        flight (`DecodeOverlap`) and the host reads the previous step's meanwhile, so the GPU
        never waits for the host's bookkeeping; otherwise they are read at once."""
        seqs = sorted(seqs, key=lambda seq: seq.priority)  # plan (DFS) order: sharers adjacent
        rows = decode_rows(seqs, self.overlap.step)
        logits = self.runner.decode(rows)  # [B, V]
        self._count_decode(seqs, rows)
        self.scheduler.advance([(seq, 1) for seq in seqs])
        return self._launch_draw(seqs, logits)

    def _launch_draw(self, seqs: list[Sequence], logits: torch.Tensor) -> list[Sequence]:
        """Draw `seqs`' tokens from their logits rows on the device and read the step in flight
        meanwhile; with overlap this step's tokens then stay in flight (`DecodeOverlap`), so the
        GPU never waits for the host's bookkeeping; otherwise they are read at once."""
        if not seqs:
            return self._postprocess(*self.overlap.take())
        if self._draws_from_host_tokens(seqs):
            # Read the step in flight first (its tokens landed before this forward began), so the
            # grammar matchers and penalties see every earlier token; the masks are then filled
            # while this step's forward still runs, and its own tokens can stay in flight.
            done = self._postprocess(*self.overlap.take())
            draw = self._draw(seqs, logits)
        else:
            draw = self._draw(seqs, logits)  # tokens [B] on the device
            done = self._postprocess(*self.overlap.take())
        if not self.config.overlap_decode:
            return done + self._postprocess(seqs, *read_now(draw))
        self.overlap.launch(seqs, draw)
        return done

    @staticmethod
    def _draws_from_host_tokens(seqs: list[Sequence]) -> bool:
        """Whether drawing this step needs each row's earlier tokens on the host: a grammar (its
        next mask follows the last token) or a repetition penalty (the tokens seen)."""
        return any(s.request.grammar is not None or s.request.sampling.repetition_penalty != 1.0 for s in seqs)

    def _count_decode(self, seqs: list[Sequence], rows: DecodeRows, mixed: bool = False) -> None:
        """A decode step's counters (`mixed`: the decode rows of a mixed step), ReplaySSM ring folds
        included (the cache mirrors every row's ring cursor; a full ring is folded into the
        checkpoint by the step's kernel)."""
        steps = dict(mixed_steps=1, mixed_seq_steps=len(seqs)) if mixed else \
            dict(decode_steps=1, decode_seq_steps=len(seqs))
        self.tally.add(**steps, decode_context_tokens=sum(rows.positions) + len(seqs),
                       decode_shared_kv_tokens=sum(rows.shared_with_prev),
                       replayssm_flushes=self.cache.ring_steps([seq.handle for seq in seqs]))

    # ---- postprocess: logits → tokens → progress -------------------------------------------
    def _draw(self, seqs: list[Sequence], logits: torch.Tensor) -> Draw:
        """Each sequence's next token from its logits ([N, V]), drawn on the device: [N] int64
        (no host sync), with the logprobs of the rows that ask (nothing computed when none does)."""
        params = [seq.request.sampling for seq in seqs]
        for seq in seqs:
            if seq.sample_key is None:
                seq.sample_key = identity_key(seq.request.sampling, seq.request.seed_key, seq.sample_index)
        # Index of the token drawn now among the outputs (tokens still in flight count).
        num_outputs = [len(seq.tokens) + seq.awaiting - seq.prompt_len for seq in seqs]
        penalised = any(p.repetition_penalty != 1.0 for p in params)
        banned = [(i, t) for i, (seq, p, n) in enumerate(zip(seqs, params, num_outputs)) if n < p.min_tokens
                  for t in sorted(self.stop_rules.stop_ids(seq))]
        tensors = SamplingTensors.from_columns(
            params, [seq.sample_key for seq in seqs], num_outputs,
            seen_token_ids=[seq.tokens if p.repetition_penalty != 1.0 else () for seq, p in zip(seqs, params)]
            if penalised else None, banned=banned, device=logits.device)
        asking = [i for i, p in enumerate(params) if p.logprobs is not None]
        constrained = [i for i, seq in enumerate(seqs) if seq.request.grammar is not None]
        raw = logits
        if constrained:
            logits = self._constrain([seqs[i] for i in constrained], constrained, logits, keep_raw=bool(asking))
        tokens = sample(logits, tensors)
        if not asking:
            return Draw(tokens)
        ks = tuple(params[i].logprobs for i in asking)
        rows = upload(torch.tensor(asking, dtype=torch.int64), logits.device)  # [R]
        return Draw(tokens, token_logprobs(raw, tokens, rows, max(ks)), tuple(asking), ks)

    def _constrain(self, seqs: list[Sequence], rows: list[int], logits: torch.Tensor, keep_raw: bool) -> torch.Tensor:
        """`logits` with each constrained row's disallowed tokens at -inf: the masks are filled on
        the host (on CUDA while the forward pass still runs: nothing here waits for it), uploaded
        as int32 bitmasks and unpacked on the device. A copy when the raw logits are still needed."""
        live, matchers = [], []
        for i, seq in enumerate(seqs):
            if seq.finished:  # stopped while this step was launched: its row is dropped, its matcher done
                continue
            matcher = self.matchers.get(seq)
            if matcher is None:
                matcher = self.matchers[seq] = seq.request.grammar.matcher()
            live.append(i)
            matchers.append(matcher)
        bitmask = np.full((len(seqs), (logits.shape[1] + 31) // 32), -1, dtype=np.int32)  # [R, W]; -1: all allowed
        if matchers:
            filled = np.zeros((len(matchers), bitmask.shape[1]), dtype=np.int32)
            seqs[live[0]].request.grammar.fill_masks(matchers, filled)
            bitmask[live] = filled
        device = logits.device
        with torch.inference_mode():  # the runner's logits are inference tensors: edited in place here
            masked = logits.clone() if keep_raw else logits
            every_row = len(rows) == logits.shape[0]  # rows are distinct and sorted: then 0..N-1
            apply_token_bitmask(masked, None if every_row else upload(torch.tensor(rows, dtype=torch.int64), device),
                                upload(torch.from_numpy(bitmask), device))
        return masked

    def _postprocess(self, seqs: list[Sequence], tokens: list[int],
                     logprobs: Optional[list[Optional[TokenLogprob]]] = None) -> list[Sequence]:
        """Append each sequence's drawn token (and its logprobs, where asked) and finish those
        that stop (the scheduler releases their cache). A row whose sequence already finished
        (it was fed once more while its stop token was in flight) is dropped."""
        done = []
        stop_rules, max_len = self.stop_rules, self.max_model_len
        for i, (seq, token) in enumerate(zip(seqs, tokens)):
            if seq.finished:
                continue
            seq.append_token(token)
            if logprobs is not None and logprobs[i] is not None:
                self.token_logprobs.setdefault(seq, []).append(logprobs[i])
            if seq.request.grammar is not None and not self.matchers[seq].accept(token):
                # The mask allowed nothing (e.g. min_tokens banned the only allowed EOS).
                seq.set_error(f"token {token} is not allowed by the grammar")
                seq.finish("error")
                self.scheduler.finish(seq)
                done.append(seq)
                continue
            p = seq.request.sampling
            outputs = len(seq.tokens) - seq.prompt_len
            # The common case decided here: a plain token, no stop strings, far from any limit.
            if (outputs <= p.min_tokens or token not in stop_rules.stop_ids(seq)) and not p.stop \
                    and outputs < p.max_tokens and len(seq.tokens) < max_len:
                continue
            reason = stop_rules.finish_reason(seq)
            if reason is not None:
                seq.finish(reason)
                self.scheduler.finish(seq)
                done.append(seq)
        return done

    @contextlib.contextmanager
    def _timed(self, stat: str):
        start, timing = time.perf_counter(), {}
        yield timing
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # GPU work is asynchronous: bill it to its phase
        timing["seconds"] = time.perf_counter() - start
        self.tally.add(**{stat: timing["seconds"]})

    # ---- reporting -------------------------------------------------------------------------
    @property
    def stats(self) -> EngineStats:
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
            "mixed_step": self.mixed_step,  # the config's, unless BATCHINFER_MIXED_STEP=0 turned it off
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
