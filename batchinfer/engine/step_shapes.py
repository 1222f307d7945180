"""The engine's step shapes, and the trace that runs them for the precompile: every decode-graph
bucket, a set of prefill batches covering the integer classes Triton specialises on, and mixed
steps' eager decode rows, on the pools' scratch slots only.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class StepShapes:
    """What the engine will run: its decode-graph buckets and limits."""

    decode_buckets: Sequence[int]   # batch sizes of the decode graphs (or of eager decode steps)
    graph_ctx_cap: int              # context slots per row in the decode graphs' buffers
    decode_hint: bool               # decode steps pass shared_with_prev (the graphs do)
    max_batch_tokens: int
    max_running: int
    max_model_len: int
    replay: bool
    mixed_step: bool = False        # steps with prefill also carry the decode rows (eager decode kernels)


def prefill_shapes(shapes: StepShapes) -> list[list[tuple[int, int]]]:
    """Prefill batches as [(start, new tokens)] per sequence: the token count T and sequence count
    B each 1, a multiple of 16 and neither, fresh and continued sequences, the largest step."""
    most = max(2, min(shapes.max_batch_tokens, shapes.max_model_len - 1))
    cont = min(2048, shapes.max_model_len - most - 1) if shapes.max_model_len - most > 1 else 0
    many = max(1, min(shapes.max_running, most // 3))
    mixed = [(0, 1), (cont, 17), (0, 100), (cont, 300), (0, 5), (cont, 64), (0, 129)]
    batches = [
        [(0, most)],                                   # the largest fresh step
        [(cont, most - 1)],                            # a continued long prompt, T not a multiple of 16
        [(cont, 1)],                                   # a single token after a cached prefix
        [(cont, 128)] * min(32, many),                 # questions after a shared document
        [(0, most - 2), (cont, 2)],                    # a long prompt with a short one
        [(0, 3)] * many,                               # many short prompts
        [(s, min(n, most)) for s, n in mixed if s + n < shapes.max_model_len],
    ]
    batches = [[(s, n) for s, n in batch if n >= 1][:shapes.max_running] for batch in batches]
    return [batch for batch in batches if batch and sum(n for _, n in batch) <= most]


def mixed_decode_sizes(shapes: StepShapes) -> list[int]:
    """Decode rows of traced mixed steps: they run eagerly at any count, so one of each integer
    class (1, a multiple of 16, neither) in each of the decode kernels' batch ranges (32, 128)."""
    sizes = [1, 16, 17, 33, 48, 129, 144, shapes.max_running]
    return sorted({b for b in sizes if b <= shapes.max_running})


@dataclass(frozen=True)
class EngineTrace:
    """A trace to run (`run()`) and the key of what it launches (`trace_manifest.trace_key`)."""

    run: Callable[[], None]
    key: str

    def __call__(self) -> None:
        self.run()


def trace_parts(model, caches, shapes: StepShapes, device: torch.device) -> list[object]:
    """What the trace's launches depend on besides the code: the model's config and dtype, the
    step shapes, the pools' per-slot shapes and dtypes (not their slot counts, which follow the
    free memory and no kernel specialises on), and the device."""
    dtype = next(iter(model.parameters()), torch.empty(0)).dtype
    pools = {name: [(tuple(t.shape[1:]), str(t.dtype)) for t in getattr(caches, name)]
             for name in ("kv_k", "kv_v", "conv", "ssm", "ring_k", "ring_u", "ring_g")}
    target = (torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)) \
        if device.type == "cuda" else (device.type,)
    return [repr(model.config), str(dtype), repr(shapes), sorted(pools.items()), target]


def engine_trace(model, caches, shapes: StepShapes, pad_state_slot: int, pad_kv_slot: int,
                 device: torch.device) -> EngineTrace:
    """The engine's steps on scratch slots only (nothing the pools own is touched), keyed for
    the trace manifest."""
    from batchinfer.engine.trace_manifest import trace_key
    from batchinfer.engine.model_runner import DecodeRows, SequenceChunk, build_forward_batch, build_mixed_batch
    from batchinfer.models.forward_batch import ForwardBatch

    def decode(b: int) -> None:
        ctx = b * shapes.graph_ctx_cap
        batch = ForwardBatch(
            input_ids=torch.zeros(b, dtype=torch.int64, device=device),
            positions=torch.zeros(b, dtype=torch.int64, device=device),
            cu_seqlens=torch.arange(b + 1, dtype=torch.int32, device=device), is_decode=True,
            state_slots=torch.full((b,), pad_state_slot, dtype=torch.int64, device=device),
            out_kv_slots=torch.full((b,), pad_kv_slot, dtype=torch.int64, device=device),
            kv_indices=torch.full((ctx,), pad_kv_slot, dtype=torch.int64, device=device),
            kv_indptr=torch.arange(b + 1, dtype=torch.int32, device=device),
            logits_indices=torch.arange(b, dtype=torch.int64, device=device), replay=shapes.replay,
            shared_with_prev=torch.zeros(b, dtype=torch.int32, device=device) if shapes.decode_hint else None)
        model.forward(batch, caches)

    def prefill(seqs: list[tuple[int, int]]) -> None:
        chunks = [SequenceChunk(token_ids=[0] * n, start=s, state_slot=pad_state_slot,
                                context_kv=torch.full((s + n,), pad_kv_slot, dtype=torch.int64), wants_logits=True)
                  for s, n in seqs]
        model.forward(build_forward_batch(chunks, is_decode=False, replay=False, device=device), caches)

    def mixed(b: int) -> None:  # a short continued chunk, then b decode rows of one-slot contexts
        chunk = SequenceChunk(token_ids=[0] * 17, start=0, state_slot=pad_state_slot,
                              context_kv=torch.full((17,), pad_kv_slot, dtype=torch.int64), wants_logits=True)
        rows = DecodeRows(token_ids=[0] * b, positions=[0] * b, state_slots=[pad_state_slot] * b,
                          kv_indices=torch.full((b,), pad_kv_slot, dtype=torch.int64),
                          shared_with_prev=[0] * b if shapes.decode_hint else None)
        model.forward(build_mixed_batch([chunk], rows, replay=shapes.replay, device=device), caches)

    def sample(vocab: int) -> None:  # the sampler's draw as the engine dispatches it (the fused kernel: one compile)
        from batchinfer.engine.sampler import _gumbel_argmax
        _gumbel_argmax(torch.zeros(1, vocab, dtype=torch.float32, device=device),
                       torch.zeros(1, 2, dtype=torch.int64, device=device))

    @torch.inference_mode()
    def run() -> None:
        steps = [("decode", b) for b in reversed(list(shapes.decode_buckets))] + \
                [("prefill", seqs) for seqs in prefill_shapes(shapes)] + \
                [("mixed", b) for b in (mixed_decode_sizes(shapes) if shapes.mixed_step else [])]
        for kind, arg in steps:
            try:
                {"decode": decode, "prefill": prefill, "mixed": mixed}[kind](arg)
            except Exception as err:  # a shape the trace cannot run: its kernels compile lazily
                log.warning("precompile trace of a %s step failed: %s: %s", kind, type(err).__name__, err)
        sample(model.config.vocab_size)
        torch.cuda.synchronize(device)

    return EngineTrace(run, trace_key(trace_parts(model, caches, shapes, device)))
