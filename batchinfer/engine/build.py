"""Building an engine: the memory budget, the pools and cache, the kernel precompile and the
decode CUDA graphs, and the model itself for `Engine.from_pretrained`.

`EngineBuilder` plans the pools when made (`pool_plan`) and `build` allocates them, compiles
the kernels while the weights load, and captures the graphs; the engine keeps what it returns
(`EngineParts`). Every phase adds its seconds to the `startup_seconds` it is given.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from batchinfer.engine.activations import decode_graph_bytes, step_activation_bytes
from batchinfer.engine.config import FALLBACK_MAX_BATCH_TOKENS, EngineConfig
from batchinfer.engine.cuda_graphs import DecodeGraphs, bucket_sizes
from batchinfer.engine.model_runner import ModelRunner
from batchinfer.engine.pipeline_pools import build_pipeline_pools, plan_pipeline_pools
from batchinfer.engine.stage_graphs import stage_decode_graphs
from batchinfer.engine.startup import max_running_shortfall, phase
from batchinfer.models.forward_batch import ModelCaches
from batchinfer.models.pipeline import PipelinedModel, StagedCaches
from batchinfer.cache.budget import PoolPlan, build_pools, memory_budget, plan_pools
from batchinfer.cache.shapes import shapes_from_model_config
from batchinfer.cache.state_cache import CacheConfig, StateCache

# The engine's logger: the shortfall warning keeps the name operators filter on.
log = logging.getLogger("batchinfer.engine.engine")
_CPU_DEFAULT_BUDGET_BYTES = 256 << 20  # no free-memory query on the CPU: a modest fixed pool
_GRAPH_CTX_CAP = 32768  # context slots per row in the decode graphs' buffer; longer steps run eagerly
# Reserved over the activation estimate for the caching allocator's rounding and fragmentation.
ACTIVATION_MARGIN = 1.25
# The default step gives way to FALLBACK_MAX_BATCH_TOKENS where its activations would
# take more than this share of the pools (a model that nearly fills its GPU: the FP8 122B-A10B on one H200).
STEP_POOL_SHARE = 0.1


def activation_reserve_bytes(model_config, config: EngineConfig, max_model_len: int,
                             max_batch_tokens: Optional[int] = None) -> int:
    """Memory the pools must leave free on CUDA: the largest eager step (of `max_batch_tokens`,
    default the config's) plus the decode graphs, with ACTIVATION_MARGIN for the allocator. The
    fraction alone left 10% of the free memory, less than one prefill step needs on a nearly full
    device (docs/BENCHMARKS.md, "Memory budget: the activation reserve")."""
    dtype = config.resolved_dtype()
    tokens = max_batch_tokens or config.resolved_max_batch_tokens()
    reserve = step_activation_bytes(model_config, dtype, tokens, config.resolved_max_running(model_config))
    if config.cuda_graphs:
        reserve += decode_graph_bytes(model_config, dtype, bucket_sizes(config.resolved_max_running(model_config)),
                                      min(max_model_len, _GRAPH_CTX_CAP))
    return int(reserve * ACTIVATION_MARGIN)


def larger_step_fits(pools_at_default: int, pools_at_larger: int) -> bool:
    """Whether the larger step's activations leave the pools at least 1 − STEP_POOL_SHARE of what
    they get beside a FALLBACK_MAX_BATCH_TOKENS step (where the memory fraction binds, they lose nothing)."""
    return pools_at_larger >= (1 - STEP_POOL_SHARE) * pools_at_default


def default_step_tokens(config: EngineConfig, pools_beside: Callable[[int], int]) -> int:
    """The default tokens per step (`config.resolved_max_batch_tokens`), stepped down to
    FALLBACK_MAX_BATCH_TOKENS unless the larger default `larger_step_fits`; `pools_beside(tokens)`:
    the pools' bytes beside steps of that many tokens (ValueError: its activations alone do not fit)."""
    chosen = config.resolved_max_batch_tokens()
    if chosen <= FALLBACK_MAX_BATCH_TOKENS:
        return chosen
    at_default = pools_beside(FALLBACK_MAX_BATCH_TOKENS)
    try:
        at_larger = pools_beside(chosen)
    except ValueError:
        at_larger = 0
    if larger_step_fits(at_default, at_larger):
        return chosen
    log.info("max_batch_tokens %d: %d-token steps would take %.1f of the pools' %.1f GiB", FALLBACK_MAX_BATCH_TOKENS,
             chosen, (at_default - at_larger) / 2**30, at_default / 2**30)
    return FALLBACK_MAX_BATCH_TOKENS


def load_model(model: str, config: EngineConfig, seed: int, loaded: dict[str, float]):
    """→ (model, fill): a preset built with random weights drawn from `seed` (fill None), or a
    model checkpoint's model allocated only, `fill` loading its weights (the engine calls it while
    its kernels compile). The time spent here goes to `loaded["load"]`."""
    from batchinfer.models.loader import empty_model, load_weights
    from batchinfer.models.presets import PRESETS, build_model

    device = config.resolved_device()
    if config.pipeline_stages > 1:  # each stage allocated on its device, filled with its tensors only
        from batchinfer.models.pipeline_build import pipelined_model

        with phase("allocating the model", loaded, "load"):
            return pipelined_model(str(model), config.resolved_dtype(), device, config.pipeline_stages, seed=seed)
    if str(model) in PRESETS:  # random weights: drawn before the engine (nothing to overlap)
        with phase("loading weights", loaded, "load"):
            built = build_model(model, config.resolved_dtype(), device, seed=seed)
            if device.type == "cuda":
                torch.cuda.synchronize()
        return built, None
    with phase("allocating the model", loaded, "load"):  # on CUDA also the device's initialisation
        built = empty_model(model, config.resolved_dtype(), device)

    def fill() -> None:
        load_weights(built, model)
        if device.type == "cuda":
            torch.cuda.synchronize()  # the copies to the device are part of the load

    return built, fill


def staged_trace(trace, model: PipelinedModel):
    """The engine trace run through the stages (their micro-batch shapes, which the decode
    graphs replay: edges from the bucket size), keyed apart from the whole model's trace and
    from other splits."""
    from batchinfer.engine.step_shapes import EngineTrace
    from batchinfer.engine.trace_manifest import trace_key

    return EngineTrace(trace.run, trace_key([trace.key, "pipeline", model.split.bounds, model.micro_batches]))


@dataclass(frozen=True)
class EngineParts:
    """What building leaves the engine."""
    pool_plan: PoolPlan
    cache: StateCache
    runner: ModelRunner
    precompile_report: object   # precompile.PrecompileReport, None: no precompile


class EngineBuilder:
    def __init__(self, model, config: EngineConfig, max_model_len: int, mixed_step: bool,
                 startup_seconds: dict[str, float]) -> None:
        """Plans the pools for `model` (built on config's device) under the memory budget."""
        self.model = model
        self.config = config
        self.device = config.resolved_device()
        self.max_model_len = max_model_len
        self.mixed_step = mixed_step
        self.startup_seconds = startup_seconds  # the engine's: each phase adds to it
        self.cache_config = CacheConfig(mode=config.state_cache, prefix_cache=config.prefix_cache)
        ring_len = config.ring_len if config.replayssm else 0
        self.kv_shape, self.state_shape = shapes_from_model_config(
            model.config, config.resolved_dtype(), ring_len=ring_len, ckpt_dtype=config.resolved_ckpt_dtype(),
            kv_dtype=config.resolved_kv_dtype())
        # One working slot per running request, plus plan_pools' shared pool of cached states
        # that tracking borrows from (a tracked state goes to the tree at once) and eviction
        # refills: tree states are never pinned by running requests, only during admission.
        self.pipelined = isinstance(model, PipelinedModel)
        self.max_batch_tokens = self._step_tokens()  # the scheduler's, the reserve's and the trace's
        if self.pipelined:  # each stage priced against its own device (engine/pipeline_pools.py)
            requested = config.resolved_max_running(model.config)
            self.pool_plan = plan_pipeline_pools(
                model, self.kv_shape, self.state_shape, max_running=requested, cpu_budget=_CPU_DEFAULT_BUDGET_BYTES,
                fraction=config.memory_fraction, budget_bytes=config.memory_budget_bytes,
                reserve_bytes=activation_reserve_bytes(model.config, config, max_model_len, self.max_batch_tokens))
        else:  # sized from the job's row figure when it posted one (config.row_tokens)
            budget = self._budget_bytes()
            requested = config.resolved_max_running(
                model.config, (budget, self.kv_shape.bytes_per_token, self.state_shape.bytes_per_slot))
            self.pool_plan = plan_pools(self.kv_shape, self.state_shape, budget, max_running=requested)
        if max_running_shortfall(self.pool_plan.max_running, config.max_running, requested, self.device.type):
            log.warning("memory budget fits %d concurrent requests, not max_running=%d (%.0f MiB per state slot)",
                        self.pool_plan.max_running, requested, self.pool_plan.bytes_per_state_slot / 2**20)

    def build(self, load_weights: Optional[Callable[[], None]]) -> EngineParts:
        """Allocate the pools, compile the kernels while `load_weights` (when given) fills the
        model, then capture the decode graphs."""
        if self.pipelined:
            kv_pool, state_pool = build_pipeline_pools(self.model, self.pool_plan, self.kv_shape, self.state_shape)
        else:
            kv_pool, state_pool = build_pools(self.pool_plan, self.kv_shape, self.state_shape, self.device)
        cache = StateCache(kv_pool, state_pool, self.cache_config)
        caches = (StagedCaches if self.pipelined else ModelCaches).from_pools(kv_pool, state_pool)
        # Before the graphs, which would compile the kernels one by one at their first launch.
        report = self._load_and_compile(caches, kv_pool, state_pool, load_weights)
        runner = ModelRunner(self.model, caches, self.device, replay=self.config.replayssm,
                             decode_graphs=self._decode_graphs(caches, kv_pool, state_pool))
        return EngineParts(self.pool_plan, cache, runner, report)

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
        if self.device.type != "cuda":
            return None
        from batchinfer.engine.precompile import start_precompile
        from batchinfer.engine.step_shapes import StepShapes, engine_trace

        shapes = StepShapes(decode_buckets=bucket_sizes(self.pool_plan.max_running),
                            graph_ctx_cap=min(self.max_model_len, _GRAPH_CTX_CAP), decode_hint=True,
                            max_batch_tokens=self.max_batch_tokens,
                            max_running=self.pool_plan.max_running,
                            max_model_len=self.max_model_len, replay=self.config.replayssm,
                            mixed_step=self.mixed_step)
        trace = engine_trace(self.model, caches, shapes, state_pool.pad_slot, kv_pool.pad_slot, self.device)
        if self.pipelined:
            trace = staged_trace(trace, self.model)
        with phase("tracing kernels", self.startup_seconds, "compile_and_capture"):
            pending = start_precompile(trace, spare_cpus=spare_cpus)
        if self.pipelined:
            self.model.reset_busy()
        return pending

    def _decode_graphs(self, caches, kv_pool, state_pool) -> Optional[DecodeGraphs]:
        if not (self.config.cuda_graphs and self.device.type == "cuda"):
            return None
        ctx_cap = min(self.max_model_len, _GRAPH_CTX_CAP)
        if self.pipelined:  # one graph per (stage, micro-batch) and bucket
            graphs = stage_decode_graphs(self.model, caches, self.device, replay=self.config.replayssm,
                                         max_batch=self.pool_plan.max_running, kv_pool=kv_pool,
                                         state_pool=state_pool, ctx_cap=ctx_cap)
        else:
            graphs = DecodeGraphs(self.model, caches, self.device, replay=self.config.replayssm,
                                  max_batch=self.pool_plan.max_running, pad_state_slot=state_pool.pad_slot,
                                  pad_kv_slot=kv_pool.pad_slot, ctx_cap=ctx_cap)
        try:
            with phase("capturing CUDA graphs", self.startup_seconds, "compile_and_capture"):
                graphs.capture_all()
        except Exception as err:  # e.g. an op that syncs with the host (MoE routing): run eagerly
            log.warning("decode CUDA graphs disabled, capture failed: %s", err)
            return None
        return graphs

    def _budget_bytes(self, max_batch_tokens: Optional[int] = None) -> int:
        """The pools' bytes beside steps of `max_batch_tokens` (default: the engine's)."""
        if self.config.memory_budget_bytes is not None:
            return self.config.memory_budget_bytes
        if self.device.type == "cuda":
            reserve = activation_reserve_bytes(self.model.config, self.config, self.max_model_len,
                                               max_batch_tokens or self.max_batch_tokens)
            return memory_budget(self.device, self.config.memory_fraction, reserve_bytes=reserve)
        return memory_budget(self.device, self.config.memory_fraction, cpu_total_bytes=_CPU_DEFAULT_BUDGET_BYTES)

    def _step_tokens(self) -> int:
        """Tokens per step: the config's, else the default, which on CUDA (one stage, no fixed
        budget) gives way to FALLBACK_MAX_BATCH_TOKENS (logged) unless it `larger_step_fits` the
        device's free memory."""
        if (self.config.max_batch_tokens is not None or self.pipelined or self.device.type != "cuda"
                or self.config.memory_budget_bytes is not None):
            return self.config.resolved_max_batch_tokens()
        return default_step_tokens(self.config, self._budget_bytes)
