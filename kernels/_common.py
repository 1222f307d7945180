"""Helpers shared by the GDN and conv1d kernels: gating, q/k normalisation, launch knobs, and the
varlen chunk table.

The Triton helpers mirror kernels/ref/gdn.py exactly (same eps, same softplus threshold) so that
the Triton path and the reference differ only by rounding.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

L2NORM_EPS = tl.constexpr(1e-6)
SOFTPLUS_THRESHOLD = tl.constexpr(20.0)  # torch.nn.functional.softplus's default: linear above it

# The Triton interpreter (CPU tests) keeps scalars as 1-element arrays, which Python's range()
# rejects as a bound; loops over runtime bounds fall back to `while` there. Compiled kernels keep
# `for`, which Triton software-pipelines (it does not pipeline `while`).
LOOP_AS_WHILE = os.environ.get("TRITON_INTERPRET", "0") == "1"

TRITON_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@dataclass(frozen=True)
class KernelLaunch:
    """Launch knobs of one kernel: the d_v (or channel) block it owns, warps, pipeline stages."""

    block_v: int
    num_warps: int
    num_stages: int = 1


@triton.jit
def gdn_gate_terms(a, b, A_log, dt_bias):
    """fp32 (g, beta): g = -exp(A_log)·softplus(a + dt_bias), beta = sigmoid(b)."""
    x = a + dt_bias
    softplus = tl.where(x > SOFTPLUS_THRESHOLD, x, tl.log(1.0 + tl.exp(tl.minimum(x, SOFTPLUS_THRESHOLD))))
    return -tl.exp(A_log) * softplus, tl.sigmoid(b)


@triton.jit
def l2_normalise_vector(x):
    """x / sqrt(Σx² + eps) for one fp32 head vector [d]."""
    return x * tl.rsqrt(tl.sum(x * x, axis=0) + L2NORM_EPS)


def multiprocessor_count(device: torch.device) -> int:
    """SMs of a CUDA device; 1 elsewhere (the interpreter: a small grid, so its programs loop).
    Asked at every decode / prefill launch: the device query is cached per device index."""
    if device.type != "cuda":
        return 1
    return _cuda_multiprocessor_count(torch.cuda.current_device() if device.index is None else device.index)


@functools.lru_cache(maxsize=None)
def _cuda_multiprocessor_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def next_pow2_at_least_16(n: int) -> int:
    """Tile width for a head dim: a power of two, ≥ 16 so that tl.dot accepts it."""
    return max(16, triton.next_power_of_2(n))


@dataclass(frozen=True)
class ChunkTable:
    """Fixed-size chunks of packed sequences (a chunk never crosses a sequence boundary).

    Sized from shapes alone — `capacity = T // chunk + B` bounds Σ ceil(L_i / chunk) — so building
    it needs no device-to-host sync; the unused tail chunks have `seq_end == start` (no rows) and
    their programs exit at once.
    """

    start: torch.Tensor  # [N] int32: first token of the chunk
    seq_end: torch.Tensor  # [N] int32: one past the last token of the chunk's sequence (== start: unused)
    seq: torch.Tensor  # [N] int32: the chunk's sequence (clamped to B-1 for unused chunks)
    seq_offsets: torch.Tensor  # [B+1] int32: index of each sequence's first chunk
    capacity: int


def chunk_table(cu_seqlens: torch.Tensor, chunk: int, num_tokens: int) -> ChunkTable:
    cu = cu_seqlens.to(torch.int32)
    num_seqs = cu.numel() - 1
    lengths = cu[1:] - cu[:-1]  # [B]
    offsets = torch.zeros(num_seqs + 1, dtype=torch.int32, device=cu.device)
    torch.cumsum((lengths + chunk - 1) // chunk, 0, out=offsets[1:])
    capacity = num_tokens // chunk + num_seqs
    ids = torch.arange(capacity, dtype=torch.int32, device=cu.device)
    seq = torch.searchsorted(offsets[1:].contiguous(), ids, right=True)  # [N] in [0, B]; B = unused
    used = seq < num_seqs
    seq = seq.clamp(max=max(num_seqs - 1, 0))
    start = cu[seq] + chunk * (ids - offsets[seq])
    seq_end = torch.where(used, cu[seq + 1], start)
    return ChunkTable(start.to(torch.int32), seq_end.to(torch.int32), seq.to(torch.int32), offsets, capacity)


class ChunkTables:
    """The chunk tables of one packed batch, built on first request per chunk size and then reused.

    Building a table is ~17 small device ops; every prefill kernel of every layer of a model step
    tiles the same cu_seqlens, so a step passes one ChunkTables to all of them (ForwardBatch)
    instead of each call building its own (2 tables × 48 GDN layers per step on Qwen3.5-27B)."""

    def __init__(self, cu_seqlens: torch.Tensor, num_tokens: int) -> None:
        self.cu_seqlens = cu_seqlens  # the tensor the tables describe (callers check identity)
        self.num_tokens = num_tokens
        self._tables: dict[int, ChunkTable] = {}

    def get(self, chunk: int) -> ChunkTable:
        if chunk not in self._tables:
            self._tables[chunk] = chunk_table(self.cu_seqlens, chunk, self.num_tokens)
        return self._tables[chunk]


def chunk_table_for(cu_seqlens: torch.Tensor, chunk: int, num_tokens: int, tables: ChunkTables | None) -> ChunkTable:
    """The table of this chunk size: from `tables` (built once there), or a fresh one when `tables`
    is None. Raises ValueError when `tables` describes another batch (another cu_seqlens tensor —
    identity, not values, so no device sync — or another token count)."""
    if tables is None:
        return chunk_table(cu_seqlens, chunk, num_tokens)
    if tables.cu_seqlens is not cu_seqlens or tables.num_tokens != num_tokens:
        raise ValueError("chunk_tables were built for another batch (cu_seqlens / token count differ)")
    return tables.get(chunk)


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) of a CUDA device, cached per device index (asked at launches)."""
    return _cuda_capability(torch.cuda.current_device() if device.index is None else device.index)


@functools.lru_cache(maxsize=None)
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)
