"""Triton chunked Gated DeltaNet prefill over packed varlen sequences (chunk 64): the public
op and its launch knobs, running the three stages (the maths: kernels/gdn_prefill/__init__.py)
on a planned `PrefillWork` (work.py): `wy.py`, `state_pass.py`, `output.py`, each a kernel with
its launcher.

Chunks never straddle sequences; a sequence's initial state is read from `state[slot]` and its
final state written back there. No host sync: the chunk grid is sized from shapes
(kernels/_common.py:ChunkTable). Launch knobs per kernel: `PrefillLaunch`; each stage can be
launched alone on a planned `PrefillWork` (`run_wy`, `run_state_pass`, `run_output`:
benchmarks/bench_gdn.py tunes them one by one), on the whole chunk table or a piece of it, or all
in order (`run_prefill`; for a few long sequences it overlaps them over pieces of the table on
two streams: PrefillLaunch). q and k are never normalised into a copy: each kernel folds the
inverse norms into its products' row scales.
Reference: kernels/ref/gdn.py:gdn_prefill.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch
import triton

from batchinfer.kernels._common import ChunkTables, KernelLaunch, multiprocessor_count
from batchinfer.kernels.gdn_prefill.output import run_output
from batchinfer.kernels.gdn_prefill.state_pass import StatePassLaunch, run_state_pass
from batchinfer.kernels.gdn_prefill.work import PrefillWork, plan_prefill
from batchinfer.kernels.gdn_prefill.wy import run_wy


@dataclass(frozen=True)
class PrefillLaunch:
    """Knobs per kernel (block_v = d_v block; the WY kernel has no d_v dimension and ignores it).

    Stages share no block_v-dependent buffer or grid: every intermediate is allocated at full d_v
    (plan_prefill) and each launch sizes its own grid, so any mix of per-stage knobs is valid
    (tests/kernels/test_kernels_gdn.py: MIXED_LAUNCHES). Defaults: the fastest of the H200 sweeps
    (docs/BENCHMARKS.md, "GDN prefill: launch defaults"). The register-resident WY kernel runs
    ONE warp: at 255 registers per thread a 16-row tile is replicated in every warp, so more
    warps add work. `state_pass_few_programs` replaces `state_pass` when its grid would have
    fewer programs than the GPU has SMs (a few long sequences): each program then walks a long
    chain of chunks, so narrower d_v blocks (more programs) win. None: always `state_pass`.

    With those few programs most of the GPU idles while the state pass walks its chains, so
    run_prefill then cuts the chunk table into up to `overlap_pieces` pieces and runs piece p's
    state pass on a side stream beside the WY kernels of the later pieces and the outputs of the
    earlier ones (the state in the pool carries each sequence across cuts). A piece shorter than
    `overlap_min_chunks` costs more in launches than it overlaps, and with many programs pieces
    only add launches (docs/BENCHMARKS.md, "GDN prefill: overlapped pieces").
    """

    wy: KernelLaunch = field(default_factory=lambda: KernelLaunch(block_v=64, num_warps=1, num_stages=1))
    state_pass: KernelLaunch = field(
        default_factory=lambda: StatePassLaunch(block_v=64, num_warps=4, num_stages=2, key_parts=2))
    output: KernelLaunch = field(default_factory=lambda: KernelLaunch(block_v=128, num_warps=4, num_stages=1))
    state_pass_few_programs: KernelLaunch | None = field(
        default_factory=lambda: StatePassLaunch(block_v=32, num_warps=4, num_stages=2))

    overlap_pieces: int = 4
    overlap_min_chunks: int = 128

    def _few_programs(self, num_seqs: int, num_heads: int, d_v: int, sm_count: int) -> bool:
        programs = num_seqs * num_heads * triton.cdiv(d_v, self.state_pass.block_v)
        return self.state_pass_few_programs is not None and programs < sm_count

    def state_pass_for(self, num_seqs: int, num_heads: int, d_v: int, sm_count: int) -> KernelLaunch:
        """The state-pass launch for this many sequences × value heads on `sm_count` SMs."""
        if self._few_programs(num_seqs, num_heads, d_v, sm_count):
            return self.state_pass_few_programs
        return self.state_pass

    def pieces_for(self, num_seqs: int, num_heads: int, d_v: int, sm_count: int, num_chunks: int) -> int:
        """How many pieces of a `num_chunks` chunk table run_prefill pipelines: with the
        few-programs state pass up to overlap_pieces of at least overlap_min_chunks each, else 1."""
        if not self._few_programs(num_seqs, num_heads, d_v, sm_count):
            return 1
        return max(1, min(self.overlap_pieces, num_chunks // self.overlap_min_chunks))


DEFAULT_LAUNCH = PrefillLaunch()


def piece_bounds(capacity: int, pieces: int) -> list[tuple[int, int]]:
    """[lo, hi) of `pieces` near-equal consecutive pieces of a chunk table (none empty)."""
    pieces = max(1, min(pieces, capacity))
    edges = [capacity * p // pieces for p in range(pieces + 1)]
    return list(zip(edges[:-1], edges[1:]))


def run_prefill(work: PrefillWork, launch: PrefillLaunch = DEFAULT_LAUNCH, pieces: int | None = None) -> torch.Tensor:
    """Every stage on a planned PrefillWork; returns work.out. `pieces`: how many pieces of the
    chunk table to pipeline (None: the launch's choice for this batch, `PrefillLaunch.pieces_for`)."""
    T, H_k, d_k, H_v, d_v = work.dims
    if work.slots.numel() == 0 or work.chunks.capacity == 0 or T == 0:
        return work.out  # no token: every state stays as it is
    batch = (work.slots.numel(), H_v, d_v, multiprocessor_count(work.q.device))  # what the launch choice reads
    state_launch = launch.state_pass_for(*batch)
    if pieces is None:
        pieces = launch.pieces_for(*batch, work.chunks.capacity)
    bounds = piece_bounds(work.chunks.capacity, pieces)
    if len(bounds) == 1:
        run_wy(work, launch.wy)
        run_state_pass(work, state_launch)
        run_output(work, launch.output)
        return work.out
    # The pieces hand each sequence's state on through `state`: a 16-bit pool would round it at
    # every cut, so they carry it in fp32 ([B, H_v, d_k, d_v]: few sequences, when pieces pay).
    pool, slots, carried = work.state, work.slots, work.state.dtype != torch.float32
    if carried:
        work = dataclasses.replace(work, state=pool[work.slots].float(),
                                   slots=torch.arange(work.slots.numel(), device=work.slots.device))
    if work.q.device.type != "cuda":  # one stream: the pieces in turn (what the CPU tests check)
        for piece in bounds:
            run_wy(work, launch.wy, piece)
            run_state_pass(work, state_launch, piece)
            run_output(work, launch.output, piece)
    else:
        _run_pieces_overlapped(work, launch, state_launch, bounds)
    if carried:
        pool[slots] = work.state.to(pool.dtype)
    return work.out


def _run_pieces_overlapped(work: PrefillWork, launch: PrefillLaunch, state_launch: KernelLaunch,
                           bounds: list[tuple[int, int]]) -> None:
    """The state pass of piece p on a high-priority side stream, beside the WY kernels of the
    later pieces and the outputs of the earlier ones on the caller's stream (see PrefillLaunch).

    The caller's stream runs WY 0..P-1 then output 0..P-1, each output waiting on its piece's
    state pass, which waits on its piece's WY; the last output waits on the last state pass, so
    whatever the caller queues next comes after all of it (and the caching allocator may reuse
    the work's buffers then)."""
    caller = torch.cuda.current_stream(work.q.device)
    chain = _state_pass_stream(work.q.device)
    wy_done = []
    for piece in bounds:
        run_wy(work, launch.wy, piece)
        wy_done.append(caller.record_event())
    state_done = []
    with torch.cuda.stream(chain):
        for piece, ready in zip(bounds, wy_done):
            chain.wait_event(ready)
            run_state_pass(work, state_launch, piece)
            state_done.append(chain.record_event())
    for piece, ready in zip(bounds, state_done):
        caller.wait_event(ready)
        run_output(work, launch.output, piece)


@functools.lru_cache(maxsize=None)
def _state_pass_stream(device: torch.device) -> torch.cuda.Stream:
    """One high-priority stream per device for the overlapped state pass: its few programs get
    the next free SM slots ahead of the WY / output programs queued beside them."""
    return torch.cuda.Stream(device=device, priority=-1)


def gdn_prefill(q, k, v, a, b, A_log, dt_bias, state, slots, cu_seqlens,
                launch: PrefillLaunch = DEFAULT_LAUNCH, chunk_tables: ChunkTables | None = None) -> torch.Tensor:
    """Chunked GDN: q, k [T, H_k, d_k]; v [T, H_v, d_v]; a, b [T, H_v]; state [S, H_v, d_k, d_v]
    read and written by `slots` [B]; cu_seqlens [B+1]. Returns o [T, H_v, d_v] in q.dtype.
    `chunk_tables`: the step's shared tables for this cu_seqlens (built here if None)."""
    work = plan_prefill(q, k, v, a, b, A_log, dt_bias, state, slots, cu_seqlens, chunk_tables=chunk_tables)
    return run_prefill(work, launch)
