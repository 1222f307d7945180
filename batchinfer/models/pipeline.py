"""Pipeline stages: one model split by layers over several devices, run as one model.

`PipelinedModel.forward(batch, caches, logits_out)` is `HybridModel.forward`'s interface, so the
model runner takes either. Each `StageModel` holds only its layers' weights (the embedding on the
first stage, the final norm and LM head on the last) and reads its own `ModelCaches` (its
attention layers' KV pools and its GDN layers' states, on its device; a slot index is the same
row on every stage, so the cache's bookkeeping is shared). A decode step's rows are cut into
micro-batches (`micro_batches`, default one per stage; cut without a host read), a prefill
step's sequences likewise (balanced by tokens, a sequence never cut); they go through the stages
in wavefront order: on CUDA each stage issues on its own stream and the activations (hidden +
the pending MLP output) move device to device behind stream events, so stages overlap; on the
CPU the same code runs in order. A mixed step is one micro-batch. Per-stage busy time: CUDA
events, perf_counter on the CPU. Decode steps may instead replay per-stage CUDA graphs
(engine/stage_graphs.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from batchinfer.kernels import ops
from batchinfer.models.config import ModelConfig
from batchinfer.models.forward_batch import ForwardBatch, ModelCaches
from batchinfer.models.layers.params import empty_param
from batchinfer.models.layers.rotary import RotaryEmbedding
from batchinfer.models.micro_batches import batch_on, split_decode, split_prefill, wavefront
from batchinfer.models.qwen3_hybrid import DecoderLayer, advance_ring_cursors, fold_pending_ring_entries, fp32_logits
from batchinfer.models.stage_split import StageSplit


class StageModel(nn.Module):
    """Layers `[start, end)` of a `HybridModel`, with its parameter names (`layers.<i>.…`,
    `embed`, `final_norm`, `lm_head`), so the loader fills a stage as it fills the whole model
    and reads only the tensors this stage holds."""

    def __init__(self, config: ModelConfig, layers: range, dtype: torch.dtype, device: torch.device | str,
                 fp8_params: frozenset[str] | None = None):
        super().__init__()
        self.config, self.dtype, self.device, self.fp8_params = config, dtype, torch.device(device), fp8_params
        self.first, self.last = layers.start == 0, layers.stop == config.num_layers
        self.layer_ids = layers
        hidden = config.hidden_size
        tied = config.tie_word_embeddings
        self.embed = empty_param(config.vocab_size, hidden, dtype=dtype, device=device) \
            if self.first or (self.last and tied) else None
        self.layers = nn.ModuleDict({str(i): DecoderLayer(config, i, dtype, device, fp8_params) for i in layers})
        # The stage's caches hold only its layers: cache indices count within the stage.
        gdn = [i for i in layers if i in config.gdn_layer_ids]
        attn = [i for i in layers if i in config.attn_layer_ids]
        for i in layers:
            layer = self.layers[str(i)]
            layer.mixer.cache_index = gdn.index(i) if layer.is_gdn else attn.index(i)
        self.num_gdn_layers, self.num_attn_layers = len(gdn), len(attn)
        self.final_norm = empty_param(hidden, dtype=dtype, device=device) if self.last else None
        self.lm_head = empty_param(config.vocab_size, hidden, dtype=dtype, device=device) \
            if self.last and not tied else None
        self.rotary = RotaryEmbedding(config.rotary_dim, config.rope_theta, device)

    def run(self, batch: ForwardBatch, caches: ModelCaches, carry: Optional[tuple],
            logits_out: Optional[torch.Tensor] = None):
        """carry: None on the first stage, else (x, pending MLP output) from the stage before.
        → the carry for the next stage, or the logits [N, vocab] fp32 on the last."""
        prefill, decode = batch.prefill_part, batch.decode_part
        if caches.has_replay and prefill is not None and self.num_gdn_layers:
            fold_pending_ring_entries(prefill.state_slots, caches)
        if carry is None:
            x, mlp_out = F.embedding(batch.input_ids, self.embed), None  # [T, hidden]
        else:
            x, mlp_out = carry
        cos, sin = self.rotary.cos_sin(batch.positions)
        for layer in self.layers.values():
            x, mlp_out = layer(x, mlp_out, batch, caches, self.rotary, cos, sin)
        if decode is not None and decode.replay and self.num_gdn_layers:
            advance_ring_cursors(decode.state_slots, caches)  # this stage's cursors
        if not self.last:
            return x, mlp_out
        rows = batch.logits_indices
        if rows.numel() == 0:  # a prefill micro-batch of chunks that end before their last token
            return torch.empty(0, self.config.vocab_size, dtype=torch.float32, device=x.device)
        _, x = ops.add_rms_norm(x[rows], mlp_out[rows], self.final_norm, self.config.rms_norm_eps)
        return fp32_logits(x, self.embed if self.lm_head is None else self.lm_head)


@dataclass(frozen=True)
class StagedCaches:
    """One `ModelCaches` per stage, each over that stage's pools on its device."""

    stages: tuple[ModelCaches, ...]

    def __getattr__(self, name: str):
        """A pool kind over all stages in stage order (`kv_k`, `ssm`, …): what the precompile's
        trace key reads of the per-slot shapes."""
        if name in ("kv_k", "kv_v", "conv", "ssm", "ring_k", "ring_u", "ring_g"):
            return [t for stage in self.stages for t in getattr(stage, name)]
        raise AttributeError(name)

    @classmethod
    def from_pools(cls, kv_pool, state_pool) -> "StagedCaches":
        """From staged pools (`cache.staged_pools`): each stage's own pool tensors."""
        return cls(tuple(ModelCaches.from_pools(kv, st) for kv, st in zip(kv_pool.stages, state_pool.stages)))


class PipelinedModel(nn.Module):
    """Stages run as one model: `forward(batch, caches: StagedCaches, logits_out)` → logits on the
    first stage's device (where the engine samples)."""

    def __init__(self, stages: Sequence[StageModel], split: StageSplit, micro_batches: Optional[int] = None):
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.split = split
        first = stages[0]
        self.config, self.dtype, self.device, self.fp8_params = first.config, first.dtype, first.device, first.fp8_params
        self.micro_batches = micro_batches or len(stages)
        cuda = self.device.type == "cuda"
        self._streams = [torch.cuda.Stream(device=s.device) for s in stages] if cuda else None
        self._events: list[list[tuple]] = [[] for _ in stages]  # CUDA: (start, end) per stage run
        self._busy = [0.0] * len(stages)  # seconds resolved so far

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def devices(self) -> list[torch.device]:
        return [s.device for s in self.stages]

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, caches: StagedCaches,
                logits_out: Optional[torch.Tensor] = None) -> torch.Tensor:
        cut = split_decode if batch.is_decode else split_prefill
        micro = cut(batch, self.micro_batches)
        run = self._wavefront_cpu if self._streams is None else self._wavefront_cuda
        logits = run(micro, caches)  # one [N_m, vocab] per micro-batch
        out = (torch.cat(logits) if len(logits) > 1 else logits[0]).to(self.device)
        return out if logits_out is None else logits_out.copy_(out)

    def _wavefront_cpu(self, micro: list[ForwardBatch], caches: StagedCaches) -> list[torch.Tensor]:
        carries: list = [None] * len(micro)
        for s, m in wavefront(len(micro), self.num_stages):
            stage = self.stages[s]
            started = time.perf_counter()
            carries[m] = stage.run(batch_on(micro[m], stage.device), caches.stages[s], carries[m])
            self._busy[s] += time.perf_counter() - started
        return carries

    def _wavefront_cuda(self, micro: list[ForwardBatch], caches: StagedCaches) -> list[torch.Tensor]:
        """Stage s runs micro-batch m on its own stream once stage s-1 has handed it over; the
        hand-over is a device-to-device copy on the producer's stream behind an event."""
        caller = torch.cuda.current_stream(self.device)
        for stream in self._streams:
            stream.wait_stream(caller)  # the batch's upload and the pools' last writes
        carries: list = [None] * len(micro)
        ready: list = [None] * len(micro)  # the event after which carry m may be read
        for s, m in wavefront(len(micro), self.num_stages):
            stage, stream = self.stages[s], self._streams[s]
            with torch.cuda.stream(stream):
                if ready[m] is not None:
                    stream.wait_event(ready[m])
                    for t in carries[m] if isinstance(carries[m], tuple) else ():
                        t.record_stream(stream)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
                result = stage.run(batch_on(micro[m], stage.device), caches.stages[s], carries[m])
                end.record(stream)
                self._events[s].append((start, end))
                target = self.stages[s + 1].device if s + 1 < self.num_stages else self.device
                if isinstance(result, tuple):
                    result = tuple(t.to(target, non_blocking=True) for t in result)
                else:
                    result = result.to(target, non_blocking=True)
                ready[m] = torch.cuda.Event()
                ready[m].record(stream)
            carries[m] = result
        for m, event in enumerate(ready):
            caller.wait_event(event)
            carries[m].record_stream(caller)
        return carries

    @property
    def streams(self) -> Optional[list]:
        """Each stage's CUDA stream (None on the CPU)."""
        return self._streams

    def add_busy(self, stage: int, seconds: float = 0.0, events: Optional[tuple] = None) -> None:
        """Account a stage run made elsewhere (the stage graphs): seconds, or CUDA (start, end)."""
        if events is not None:
            self._events[stage].append(events)
        self._busy[stage] += seconds

    def reset_busy(self) -> None:
        """Forget the busy time so far (the precompile's trace is no work of the job)."""
        for events in self._events:
            events.clear()
        self._busy = [0.0] * self.num_stages

    def stage_busy_seconds(self) -> list[float]:
        """Seconds each stage has computed so far (CUDA: synchronises to read its events)."""
        if self._streams is not None and any(self._events):
            for stream in self._streams:
                stream.synchronize()
            for s, events in enumerate(self._events):
                self._busy[s] += sum(a.elapsed_time(b) for a, b in events) / 1000.0
                events.clear()
        return list(self._busy)
