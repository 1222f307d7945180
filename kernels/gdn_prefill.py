"""Triton chunked Gated DeltaNet prefill over packed varlen sequences (chunk 64): the public
op, its launch knobs and the plan of its intermediates; the kernels and their maths are in
kernels/gdn_prefill_kernels.py (overview, output), gdn_prefill_wy.py and gdn_prefill_state.py.

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

from kernels._common import (
    LOOP_AS_WHILE, TRITON_DTYPES, ChunkTable, ChunkTables, KernelLaunch, chunk_table_for, multiprocessor_count,
    next_pow2_at_least_16,
)
from kernels.gdn_prefill_kernels import chunk_output_kernel
from kernels.gdn_prefill_state import state_pass_kernel
from kernels.gdn_prefill_wy import chunk_wy_kernel

CHUNK = 64
SUB = 16  # rows of the WY kernel's sub-blocks (its triangular inverse works on SUB×SUB blocks)
WY_KEY_STEP = 32  # d_k columns per step of the WY kernel's key products (sm90_compile: registers)


@dataclass(frozen=True)
class StatePassLaunch(KernelLaunch):
    """The state pass's knobs: KernelLaunch plus key_parts — 1, or 2: the state as two d_k halves
    (d_k < 32 runs in one part). A plain KernelLaunch means one part."""

    key_parts: int = 1

    def __post_init__(self):
        if self.key_parts not in (1, 2):
            raise ValueError(f"key_parts is 1 or 2, not {self.key_parts}")


def as_state_pass_launch(launch: KernelLaunch) -> StatePassLaunch:
    if isinstance(launch, StatePassLaunch):
        return launch
    return StatePassLaunch(launch.block_v, launch.num_warps, launch.num_stages)


@dataclass(frozen=True)
class PrefillLaunch:
    """Knobs per kernel (block_v = d_v block; the WY kernel has no d_v dimension and ignores it).

    Stages share no block_v-dependent buffer or grid: every intermediate is allocated at full d_v
    (plan_prefill) and each launch sizes its own grid, so any mix of per-stage knobs is valid
    (tests/test_kernels_gdn.py: MIXED_LAUNCHES). Defaults: the fastest of the H200 sweeps
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


def _unit_inner(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@dataclass(frozen=True)
class PrefillWork:
    """Inputs, chunk table and intermediates of one prefill call; each stage reads and writes these.

    Intermediates and matmul operands are in the input dtype (bf16 on the GPU), G in fp32.
    """

    q: torch.Tensor  # [T, H_k, d_k] raw
    k: torch.Tensor  # [T, H_k, d_k] raw
    v: torch.Tensor  # [T, H_v, d_v]
    a: torch.Tensor  # [T, H_v]
    b: torch.Tensor  # [T, H_v]
    A_log: torch.Tensor  # [H_v]
    dt_bias: torch.Tensor  # [H_v]
    state: torch.Tensor  # [S, H_v, d_k, d_v]
    slots: torch.Tensor  # [B]
    cu: torch.Tensor  # [B+1] int32
    chunks: ChunkTable
    G: torch.Tensor  # [T, H_v] fp32 cumulative log-decay within each chunk
    k_inv_norm: torch.Tensor  # [T, H_k] fp32: 1/‖k‖ (rsqrt(Σk² + eps)), written by the WY kernel
    minv: torch.Tensor  # [N, H_v, C, C] M⁻¹·diag(beta) per chunk (its 10 lower 16×16 blocks)
    v_new: torch.Tensor  # [T, H_v, d_v]
    q_states: torch.Tensor  # [T, H_v, d_v]: raw q·S0 with S0 the state at the token's chunk start
    out: torch.Tensor  # [T, H_v, d_v]

    @property
    def dims(self):
        T, H_k, d_k = self.k.shape
        return T, H_k, d_k, self.v.shape[1], self.v.shape[2]


def plan_prefill(q, k, v, a, b, A_log, dt_bias, state, slots, cu_seqlens,
                 chunk_tables: ChunkTables | None = None) -> PrefillWork:
    q, k, v, a, b = (_unit_inner(t) for t in (q, k, v, a, b))
    assert state.stride(3) == 1, "state must be contiguous in d_v"
    T, H_k, d_k = k.shape
    H_v, d_v = v.shape[1:]
    chunks = chunk_table_for(cu_seqlens, CHUNK, T, chunk_tables)
    # Chunks and sequences index grid dims 1-2 (CUDA caps them at 65535): ~4M tokens per call.
    assert chunks.capacity <= 65535 and slots.numel() <= 65535, "split the prefill into smaller calls"
    dev, inter = q.device, q.dtype
    return PrefillWork(
        q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, state=state, slots=slots,
        cu=cu_seqlens.to(torch.int32), chunks=chunks,
        G=torch.empty((T, H_v), dtype=torch.float32, device=dev),
        k_inv_norm=torch.empty((T, H_k), dtype=torch.float32, device=dev),
        minv=torch.empty((chunks.capacity, H_v, CHUNK, CHUNK), dtype=inter, device=dev),
        v_new=torch.empty((T, H_v, d_v), dtype=inter, device=dev),
        q_states=torch.empty((T, H_v, d_v), dtype=inter, device=dev),
        out=torch.empty((T, H_v, d_v), dtype=q.dtype, device=dev),
    )


def _chunk_range(work: PrefillWork, chunks: tuple[int, int] | None) -> tuple[int, int]:
    return (0, work.chunks.capacity) if chunks is None else chunks


def run_wy(work: PrefillWork, launch: KernelLaunch, chunks: tuple[int, int] | None = None) -> None:
    """`chunks`: the piece [lo, hi) of the chunk table to run (None: all of it); likewise below."""
    T, H_k, d_k, H_v, d_v = work.dims
    block_k = next_pow2_at_least_16(d_k)
    lo, hi = _chunk_range(work, chunks)
    chunk_wy_kernel[(H_k, hi - lo)](
        work.k, work.a, work.b, work.A_log, work.dt_bias, work.chunks.start, work.chunks.seq_end, lo,
        work.G, work.k_inv_norm, work.minv,
        work.k.stride(0), work.k.stride(1), work.a.stride(0), work.b.stride(0), H_v, H_k, d_k,
        GROUP=H_v // H_k, C=CHUNK, SUB=SUB, BLOCK_K=block_k, K_STEP=min(WY_KEY_STEP, block_k),
        PRECISION="ieee" if work.q.dtype == torch.float32 else "tf32",
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )


def run_state_pass(work: PrefillWork, launch: KernelLaunch, chunks: tuple[int, int] | None = None) -> None:
    """`launch`: a StatePassLaunch, or a plain KernelLaunch (one d_k part). A sequence with no
    chunk in the piece (an empty one, always) keeps its state as it is."""
    T, H_k, d_k, H_v, d_v = work.dims
    launch = as_state_pass_launch(launch)
    block_v = min(launch.block_v, next_pow2_at_least_16(d_v))
    block_k = next_pow2_at_least_16(d_k)
    # Halves narrower than 16 columns cannot be tl.dot operands: small heads run in one part.
    key_parts = launch.key_parts if block_k // launch.key_parts >= 16 else 1
    state = work.state
    lo, hi = _chunk_range(work, chunks)
    state_pass_kernel[(triton.cdiv(d_v, block_v), H_v, work.slots.numel())](
        work.q, work.k, work.v, work.k_inv_norm, work.minv, work.G, state, work.slots, work.cu,
        work.chunks.seq_offsets, lo, hi, work.q_states, work.v_new, work.q.stride(0), work.q.stride(1),
        work.k.stride(0), work.k.stride(1), work.v.stride(0), work.v.stride(1),
        state.stride(0), state.stride(1), state.stride(2), H_v, H_k,
        D_K=d_k, D_V=d_v, GROUP=H_v // H_k, C=CHUNK, SUB=SUB, BLOCK_K=block_k, BLOCK_V=block_v,
        KEY_PARTS=key_parts, DOT_DTYPE=TRITON_DTYPES[work.q.dtype], LOOP_AS_WHILE=LOOP_AS_WHILE,
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )


def run_output(work: PrefillWork, launch: KernelLaunch, chunks: tuple[int, int] | None = None) -> None:
    T, H_k, d_k, H_v, d_v = work.dims
    block_v = min(launch.block_v, next_pow2_at_least_16(d_v))
    lo, hi = _chunk_range(work, chunks)
    chunk_output_kernel[(triton.cdiv(d_v, block_v), H_k, hi - lo)](
        work.q, work.k, work.k_inv_norm, work.G, work.q_states, work.v_new, work.out,
        work.chunks.start, work.chunks.seq_end, lo, work.q.stride(0), work.q.stride(1), work.k.stride(0),
        work.k.stride(1), work.out.stride(0), work.out.stride(1), H_v, H_k, d_k, d_v, d_k ** -0.5,
        GROUP=H_v // H_k, C=CHUNK, BLOCK_K=next_pow2_at_least_16(d_k), BLOCK_V=block_v,
        DOT_DTYPE=TRITON_DTYPES[work.q.dtype], num_warps=launch.num_warps, num_stages=launch.num_stages,
    )


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
