"""Per-stage decode CUDA graphs of a pipelined model: `DecodeGraphs`' strategy for `PipelinedModel`.

DecodeGraphs keeps the static buffers and the padding (pad rows point at the pad slots, which
every stage's pools have: staged pools give each stage the same slot count). For a bucket of b
rows, each (stage s, micro-batch m) gets one graph of `stage.run` over micro-batch m of the
bucket's static batch (`decode_micro_batch`: edges from b, not from the live rows, so shapes are
static), captured on stage s's stream into a memory pool of the stage's own (stages on one GPU
replay at once on their streams, so they must not share a pool). A graph's carry (hidden, pending
MLP output) stays alive as its static output: the next stage's graph reads it directly on the
same device, or its own static input buffers on another, filled by a copy after each replay. A
stage on another device than the first reads a mirror of the static buffers, refreshed before
the replays. The last stage writes its logits into its rows of the logits buffer. Replays follow
`PipelinedModel`'s wavefront, on its streams, behind the same kind of events.

`capture=False` (DecodeGraphs without CUDA) runs the very same steps in the same order directly,
so the CPU tests run this path; `copy_hand_over=True` makes every stage after the first use the
mirror and input copies, as a stage on another device does.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from batchinfer.engine.cuda_graphs import DecodeGraphs
from batchinfer.models.forward_batch import ForwardBatch
from batchinfer.models.micro_batches import decode_micro_batch, wavefront
from batchinfer.models.pipeline import PipelinedModel, StagedCaches

_MIRRORED = ("input_ids", "positions", "cu_seqlens", "state_slots", "out_kv_slots", "kv_indices", "kv_indptr",
             "logits_indices", "shared_with_prev")


@dataclass
class _Bucket:
    """One bucket's per-(stage, micro-batch) state."""
    batches: list[ForwardBatch]            # [stage] the bucket's static batch as that stage reads it
    parts: int                             # micro-batches
    logits: list[torch.Tensor]             # [micro] its rows of the last stage's logits buffer
    out: torch.Tensor                      # [b, V] DecodeGraphs' logits rows (first device)
    copy_logits: bool                      # the last stage writes elsewhere: copy them to `out`
    inputs: list[list] = field(default_factory=list)   # [stage][micro] the carry it reads (None: stage 0)
    outputs: list[list] = field(default_factory=list)  # [stage][micro] the carry it returns (None: last)
    graphs: list[list] = field(default_factory=list)   # [stage][micro] CUDA graphs (capture only)


class StageGraphs:
    def __init__(self, model: PipelinedModel, caches: StagedCaches, *, max_batch: int,
                 copy_hand_over: bool = False) -> None:
        self.model, self.caches, self.max_batch = model, caches, max_batch
        self.first = model.device
        # Which stages read copies (inputs, carries) rather than the producer's tensors.
        self.copied = [s > 0 and (copy_hand_over or st.device != self.first) for s, st in enumerate(model.stages)]
        self._mirrors: dict[int, dict[str, torch.Tensor]] = {}  # stage → full-size static buffers
        self._last_logits: Optional[torch.Tensor] = None  # [max_batch, V] on the last stage's device
        self._buckets: dict[int, _Bucket] = {}
        self._pools: list = [None] * model.num_stages
        self.graphs: dict[int, list[list]] = {}  # bucket → [stage][micro] graphs (DecodeGraphs._graphs)

    # --- building a bucket -------------------------------------------------------------------
    def _mirror(self, s: int, batch: ForwardBatch) -> ForwardBatch:
        """The bucket's batch over stage s's full-size copies of the static buffers."""
        if s not in self._mirrors:
            b, device, mirror = batch.num_seqs, self.model.stages[s].device, {}
            for name in _MIRRORED:
                t = getattr(batch, name)
                if t is None:
                    continue
                offsets = name in ("cu_seqlens", "kv_indptr")  # [b + 1]; the others scale with b
                n = (t.numel() - 1) * self.max_batch // b + 1 if offsets else t.numel() * self.max_batch // b
                mirror[name] = torch.zeros(n, dtype=t.dtype, device=device)
            self._mirrors[s] = mirror
        mirror = self._mirrors[s]
        return replace(batch, **{n: mirror[n][:getattr(batch, n).numel()] for n in mirror})

    def _bucket(self, b: int, batch: ForwardBatch, logits: torch.Tensor) -> _Bucket:
        if b in self._buckets:
            return self._buckets[b]
        model, S = self.model, self.model.num_stages
        parts = min(model.micro_batches, b)
        edges = [b * m // parts for m in range(parts + 1)]
        last = model.stages[-1].device
        copy_logits = last != self.first or self.copied[-1]
        if copy_logits and self._last_logits is None:
            self._last_logits = torch.empty(self.max_batch, logits.shape[1], dtype=torch.float32, device=last)
        rows = self._last_logits if copy_logits else logits
        bucket = _Bucket(batches=[self._mirror(s, batch) if self.copied[s] else batch for s in range(S)],
                         parts=parts, logits=[rows[a:c] for a, c in zip(edges[:-1], edges[1:])], out=logits,
                         copy_logits=copy_logits)
        bucket.inputs = [[None] * parts for _ in range(S)]
        bucket.outputs = [[None] * parts for _ in range(S)]
        self._buckets[b] = bucket
        return bucket

    def _step(self, bucket: _Bucket, s: int, m: int):
        """Stage s on micro-batch m: the one thing a graph captures."""
        stage = self.model.stages[s]
        micro = decode_micro_batch(bucket.batches[s], bucket.parts, m)
        out = stage.run(micro, self.caches.stages[s], bucket.inputs[s][m])
        if stage.last:
            bucket.logits[m].copy_(out)
            return None
        return out

    def _hand_over(self, bucket: _Bucket, s: int, m: int) -> None:
        """Make stage s's carry for micro-batch m stage s+1's input: the tensor itself, or a copy
        in the next stage's static input buffers."""
        out = bucket.outputs[s][m]
        if not self.copied[s + 1]:
            bucket.inputs[s + 1][m] = out
            return
        device = self.model.stages[s + 1].device
        if bucket.inputs[s + 1][m] is None:
            bucket.inputs[s + 1][m] = tuple(torch.empty_like(t, device=device) for t in out)
        for dst, src in zip(bucket.inputs[s + 1][m], out):
            dst.copy_(src, non_blocking=True)

    def _refresh(self, bucket: _Bucket, source: ForwardBatch, kv_used: int) -> None:
        """Copy this step's static buffers into the mirrored stages' copies."""
        for s, copied in enumerate(self.copied):
            if not copied:
                continue
            target = bucket.batches[s]
            for name in self._mirrors[s]:
                src = getattr(source, name)
                n = kv_used if name == "kv_indices" else src.numel()
                getattr(target, name)[:n].copy_(src[:n], non_blocking=True)

    def _copy_logits(self, bucket: _Bucket, b: int) -> None:
        if bucket.copy_logits:
            bucket.out.copy_(self._last_logits[:b], non_blocking=True)

    # --- DecodeGraphs' strategy ----------------------------------------------------------------
    def eager(self, b: int, batch: ForwardBatch, logits: torch.Tensor, kv_used: int) -> torch.Tensor:
        """The graphs' steps run directly, in wavefront order (capture=False)."""
        bucket = self._bucket(b, batch, logits)
        self._refresh(bucket, batch, kv_used)
        for s, m in wavefront(bucket.parts, self.model.num_stages):
            started = time.perf_counter()
            bucket.outputs[s][m] = self._step(bucket, s, m)
            self.model.add_busy(s, time.perf_counter() - started)
            if s + 1 < self.model.num_stages:
                self._hand_over(bucket, s, m)
        self._copy_logits(bucket, b)
        return logits

    def capture(self, b: int, batch: ForwardBatch, logits: torch.Tensor) -> None:
        """Warm up (Triton compiles, allocator settles), then capture every (stage, micro-batch)
        on its stage's stream, stage by stage so each graph's input carry exists."""
        bucket = self._bucket(b, batch, logits)
        kv_used = batch.kv_indices.numel()
        streams, S = self.model.streams, self.model.num_stages
        for _ in range(2):  # one stage at a time: a one-off, kept simple
            self._refresh(bucket, batch, kv_used)
            self._sync_all()
            for s, m in wavefront(bucket.parts, S):
                with torch.cuda.device(streams[s].device), torch.cuda.stream(streams[s]):
                    bucket.outputs[s][m] = self._step(bucket, s, m)
                    if s + 1 < S:
                        self._hand_over(bucket, s, m)
                self._sync_all()
        bucket.graphs = [[None] * bucket.parts for _ in self.model.stages]
        for s in range(S):
            device = self.model.stages[s].device
            with torch.cuda.device(device):
                if self._pools[s] is None:
                    self._pools[s] = torch.cuda.graph_pool_handle()
                for m in range(bucket.parts):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self._pools[s], stream=streams[s]):
                        bucket.outputs[s][m] = self._step(bucket, s, m)
                    bucket.graphs[s][m] = graph
                    if s + 1 < S and not self.copied[s + 1]:
                        bucket.inputs[s + 1][m] = bucket.outputs[s][m]  # the next graph reads this output
            self._sync_all()
        self.graphs[b] = bucket.graphs

    def replay(self, b: int, kv_used: int) -> None:
        """The bucket's graphs in wavefront order: stage s replays micro-batch m on its stream
        once stage s-1 has (and, across devices, has copied its carry)."""
        bucket = self._buckets[b]
        model, streams = self.model, self.model.streams
        caller = torch.cuda.current_stream(self.first)
        self._refresh(bucket, bucket.batches[0], kv_used)
        for stream in streams:
            stream.wait_stream(caller)  # the step's uploads and the pools' last writes
            if stream.device != self.first:
                stream.wait_stream(torch.cuda.current_stream(stream.device))  # the mirror's copies
        ready: list = [None] * bucket.parts
        for s, m in wavefront(bucket.parts, model.num_stages):
            stream = streams[s]
            with torch.cuda.device(stream.device), torch.cuda.stream(stream):
                if ready[m] is not None:
                    stream.wait_event(ready[m])
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
                bucket.graphs[s][m].replay()
                end.record(stream)
                model.add_busy(s, events=(start, end))
                if s + 1 < model.num_stages and self.copied[s + 1]:
                    self._hand_over(bucket, s, m)
                ready[m] = torch.cuda.Event()
                ready[m].record(stream)
        for event in ready:
            caller.wait_event(event)
            if bucket.copy_logits:  # the copy runs on the last device's current stream
                torch.cuda.current_stream(model.stages[-1].device).wait_event(event)
        self._copy_logits(bucket, b)

    def _sync_all(self) -> None:
        for device in {st.device for st in self.model.stages}:
            torch.cuda.synchronize(device)


def check_pad_slots(kv_pool, state_pool) -> None:
    """Padding rows point at the staged pools' pad slots: each stage's pools must have that row."""
    for name, pool in (("KV", kv_pool), ("state", state_pool)):
        wrong = [s for s, stage in enumerate(pool.stages) if stage.pad_slot != pool.pad_slot]
        if wrong:
            raise ValueError(f"pipeline stage {wrong[0]}'s {name} pool has no pad slot {pool.pad_slot}")


def stage_decode_graphs(model: PipelinedModel, caches: StagedCaches, device: torch.device, *, replay: bool,
                        max_batch: int, kv_pool, state_pool, ctx_cap: int, capture: bool = True,
                        copy_hand_over: bool = False) -> DecodeGraphs:
    """DecodeGraphs over a pipelined model's staged pools, replaying per-stage graphs (not yet
    captured: call `capture_all`)."""
    check_pad_slots(kv_pool, state_pool)
    forward = StageGraphs(model, caches, max_batch=max_batch, copy_hand_over=copy_hand_over)
    return DecodeGraphs(model, caches, device, replay=replay, max_batch=max_batch, pad_state_slot=state_pool.pad_slot,
                        pad_kv_slot=kv_pool.pad_slot, ctx_cap=ctx_cap, capture=capture, forward=forward)
