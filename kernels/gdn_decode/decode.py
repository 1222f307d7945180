"""Triton Gated DeltaNet decode: one recurrent step per sequence, state updated in place by slot.

The work is a set of tiles, one per (sequence, value head, d_v block): the [d_k, BLOCK_V] state
tile is read once, decayed, corrected by the delta rule and written once, in fp32 registers, so
the step is bound by state bandwidth (read + write of the pool entry). Both reductions over d_k
(Sᵀk and Sᵀq) run on the decayed state together, using o = S'ᵀq = (exp(g)·S)ᵀq + (k·q)·u, so the
write-back waits on one reduction round, not two.

Two variants (`DecodeLaunch.variant`):
- "tile": one program per tile. A program reads, computes, then writes, so the bytes in flight
  per SM are (resident programs) × (one tile) only while those programs are loading.
- "persistent": `programs_per_sm` programs per SM loop over the tiles, software-pipelined
  `num_stages` deep: Triton issues the state loads of the next tiles (cp.async into shared
  memory) while the current tile computes, so loads stay in flight through the compute.
With `tma=True` (sm_90+) the state tile arrives by one TMA bulk copy into shared memory instead
of per-thread loads: no address registers, and the persistent loop prefetches it the same way.
With `num_warps=1` a [d_k, BLOCK_V] tile lives in one warp and both d_k reductions are warp
shuffles: no shared-memory round trip, no barrier (Triton's layout puts several warps along d_k,
so their partial sums meet in shared memory). tl.dot is not used for the reductions: with the
fp32 state it would round the state to tf32 (~1e-3 relative, compounding over steps), and
"ieee" precision is not a tensor-core product.
What the persistent pipeline prefetches (sm_90a TTGIR): the slot one stage before its state tile,
and q, k, v, A_log, dt_bias with the tile, all by cp.async; a and b (2-byte scalars, too narrow for
cp.async) stay blocking loads in the loop unless `gates_ahead` loads them one tile early.
`stream_state` stores the state .cs (evict-first in L2) and loads it evict-first where the load is
a plain one (the pipelined cp.async drops that hint).
Reference: kernels/ref/gdn.py:gdn_decode.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from batchinfer.kernels._common import (
    LOOP_AS_WHILE, KernelLaunch, cuda_capability, gdn_gate_terms, l2_normalise_vector, multiprocessor_count,
    next_pow2_at_least_16,
)

VARIANTS = ("tile", "persistent")


@dataclass(frozen=True)
class DecodeLaunch:
    """Launch knobs: the d_v block a tile owns, warps, pipeline stages, and the variant.

    `programs_per_sm` only matters for "persistent" (grid = programs_per_sm × SMs, capped at the
    tile count); `num_stages` is the software-pipeline depth of its tile loop (1: no prefetch).
    """

    block_v: int = 32
    num_warps: int = 8
    num_stages: int = 1
    variant: str = "tile"
    programs_per_sm: int = 4
    tma: bool = False  # state tile loaded by a Hopper TMA descriptor (sm_90+; the interpreter emulates it)
    # A state line is read once and written once per step: load it evict-first, store it streaming
    # (.cs), so written lines leave L2 (to DRAM) early rather than in bursts as later reads evict them.
    stream_state: bool = False
    # "persistent": load a, b of the program's next tile one iteration early: otherwise each tile's
    # compute stalls on their round trip, since the pipeliner cannot prefetch 2-byte scalars.
    gates_ahead: bool = False

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise ValueError(f"DecodeLaunch.variant must be one of {VARIANTS}, got {self.variant!r}")


# The H200 sweep's best from 32 to 127 sequences: persistent programs, 6 per SM, 2 warps, next
# tiles prefetched 2 deep. benchmarks/bench_gdn.py (DECODE_SWEEP) sweeps the alternatives; why
# three launches: docs/BENCHMARKS.md, "GDN decode: the launch by batch".
DEFAULT_LAUNCH = DecodeLaunch(block_v=32, num_warps=2, num_stages=3, variant="persistent", programs_per_sm=6)
# Below 32 sequences the persistent loop has ~one tile per program and nothing to pipeline; the
# one-shot tile launch is faster there.
SMALL_BATCH_LAUNCH = DecodeLaunch(block_v=32, num_warps=8, num_stages=1, variant="tile")
SMALL_BATCH = 32
# From 128 sequences, 256-byte row pieces over 4 warps, 3 programs per SM, state streamed through
# L2: enough bytes in flight to reach ~85% of copy bandwidth, which needs that many sequences
# (below 128 it is slower than DEFAULT_LAUNCH).
LARGE_BATCH_LAUNCH = DecodeLaunch(block_v=64, num_warps=4, num_stages=3, variant="persistent", programs_per_sm=3,
                                  stream_state=True)
LARGE_BATCH = 128


def launch_for_batch(batch: int) -> DecodeLaunch:
    """The measured-best launch for `batch` sequences (what `gdn_decode` runs when given none)."""
    if batch < SMALL_BATCH:
        return SMALL_BATCH_LAUNCH
    return LARGE_BATCH_LAUNCH if batch >= LARGE_BATCH else DEFAULT_LAUNCH


@triton.jit
def _tile_gates(tile_id, a_ptr, b_ptr, stride_ab, stride_bb, H_V: tl.constexpr, N_VBLOCKS: tl.constexpr):
    """fp32 (a, b) of a flattened tile's (sequence, value head)."""
    seq, head = tile_id // (N_VBLOCKS * H_V), (tile_id // N_VBLOCKS) % H_V
    return (tl.load(a_ptr + seq * stride_ab + head).to(tl.float32),
            tl.load(b_ptr + seq * stride_bb + head).to(tl.float32))


@triton.jit
def _step_tile(
    seq, head, vblock, gate_a, gate_b, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, state_ptr,
    state_desc, slots_ptr, out_ptr,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_ab, stride_bb,
    stride_s0, stride_s1, stride_ob, stride_oh, scale,
    D_K: tl.constexpr, D_V: tl.constexpr, STRIDE_S2: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, USE_TMA: tl.constexpr,
    GATES_GIVEN: tl.constexpr, LOAD_EVICT: tl.constexpr, STORE_CACHE: tl.constexpr,
):
    """One tile: state[slots[seq], head, :, vblock·BLOCK_V:+BLOCK_V] stepped in place, its outputs stored.
    With GATES_GIVEN the caller has loaded a, b (gate_a, gate_b, fp32); else they are loaded here."""
    key_head = head // GROUP
    kk = tl.arange(0, BLOCK_K)
    vv = vblock * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok, v_ok = kk < D_K, vv < D_V
    # A tile that fits the head exactly needs no mask (constexpr): fewer predicates in registers.
    FULL_TILE: tl.constexpr = (BLOCK_K == D_K) and (D_V % BLOCK_V == 0)

    # The slot, then the tile it addresses: the only large load, issued before the small ones.
    # The row stride is a constexpr, so each thread's addresses are one base plus immediates.
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    tile_base = slot * stride_s0 + head * stride_s1 + vblock * BLOCK_V
    in_tile = kk[:, None] * STRIDE_S2 + tl.arange(0, BLOCK_V)[None, :]  # [BK, BV], the same for every tile
    # Loaded and stored through two differently built (equal) addresses: in the pipelined loop the
    # store then rebuilds its pointers from one scalar and the loop-invariant in_tile, instead of
    # carrying a [BK, BV] pointer tensor per stage in registers.
    load_tile = state_ptr + (tile_base + in_tile)
    store_tile = (state_ptr + tile_base) + in_tile
    if USE_TMA:  # one bulk copy into shared memory, zero-filled past d_k / d_v; 32-bit coordinates
        corner = [slot.to(tl.int32), head.to(tl.int32), 0, (vblock * BLOCK_V).to(tl.int32)]
        S = state_desc.load(corner).reshape(BLOCK_K, BLOCK_V)
    elif FULL_TILE:
        S = tl.load(load_tile, eviction_policy=LOAD_EVICT)  # [BK, BV]
    else:
        S = tl.load(load_tile, mask=k_ok[:, None] & v_ok[None, :], other=0.0, eviction_policy=LOAD_EVICT)
    q = tl.load(q_ptr + seq * stride_qb + key_head * stride_qh + kk, mask=k_ok, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + seq * stride_kb + key_head * stride_kh + kk, mask=k_ok, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + seq * stride_vb + head * stride_vh + vv, mask=v_ok, other=0.0).to(tl.float32)  # [BV]
    if not GATES_GIVEN:
        gate_a = tl.load(a_ptr + seq * stride_ab + head).to(tl.float32)
        gate_b = tl.load(b_ptr + seq * stride_bb + head).to(tl.float32)
    g, beta = gdn_gate_terms(gate_a, gate_b, tl.load(A_log_ptr + head).to(tl.float32),
                             tl.load(dt_bias_ptr + head).to(tl.float32))
    q = l2_normalise_vector(q) * scale  # [BK]
    k = l2_normalise_vector(k)  # [BK]

    S = S.to(tl.float32) * tl.exp(g)
    k_dot_S = tl.sum(S * k[:, None], axis=0)  # [BV]
    q_dot_S = tl.sum(S * q[:, None], axis=0)  # [BV]
    u = beta * (v - k_dot_S)  # [BV]
    S = (S + k[:, None] * u[None, :]).to(state_ptr.dtype.element_ty)
    if FULL_TILE:
        tl.store(store_tile, S, cache_modifier=STORE_CACHE)
    else:
        tl.store(store_tile, S, mask=k_ok[:, None] & v_ok[None, :], cache_modifier=STORE_CACHE)
    o = q_dot_S + tl.sum(q * k, axis=0) * u
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + vv, o.to(out_ptr.dtype.element_ty), mask=v_ok)


@triton.jit
def _gdn_decode_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, state_ptr, state_desc, slots_ptr, out_ptr,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_ab, stride_bb,
    stride_s0, stride_s1, stride_ob, stride_oh, scale, num_tiles,
    H_V: tl.constexpr, D_K: tl.constexpr, D_V: tl.constexpr, STRIDE_S2: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    PERSISTENT: tl.constexpr, NUM_STAGES: tl.constexpr, USE_TMA: tl.constexpr, LOOP_AS_WHILE: tl.constexpr,
    GATES_AHEAD: tl.constexpr, LOAD_EVICT: tl.constexpr, STORE_CACHE: tl.constexpr,
):
    """Tile grid (B, H_v, d_v blocks): one tile per program. Persistent grid (P,): program p steps
    tiles p, p + P, ... of the flattened (sequence, head, d_v block) order, d_v block fastest, so
    the programs of one iteration hold neighbouring tiles (whole state rows; shared q/k lines)."""
    N_VBLOCKS: tl.constexpr = (D_V + BLOCK_V - 1) // BLOCK_V
    if not PERSISTENT:
        _step_tile(tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2), 0.0, 0.0,
                   q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, state_ptr, state_desc, slots_ptr, out_ptr,
                   stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_ab, stride_bb,
                   stride_s0, stride_s1, stride_ob, stride_oh, scale,
                   D_K, D_V, STRIDE_S2, GROUP, BLOCK_K, BLOCK_V, USE_TMA, False, LOAD_EVICT, STORE_CACHE)
        return
    step = tl.num_programs(0)
    next_a, next_b = 0.0, 0.0  # GATES_AHEAD: a, b of the program's next tile, loaded an iteration early
    if GATES_AHEAD:
        next_a, next_b = _tile_gates(tl.program_id(0), a_ptr, b_ptr, stride_ab, stride_bb, H_V, N_VBLOCKS)
    if LOOP_AS_WHILE:  # the interpreter: no runtime-bounded `for`
        tile_id = tl.program_id(0).to(tl.int64)
        while tile_id < num_tiles:
            gate_a, gate_b = next_a, next_b
            if GATES_AHEAD:  # clamped on the last tile: a valid address, the value unused
                next_a, next_b = _tile_gates(tl.minimum(tile_id + step, num_tiles - 1), a_ptr, b_ptr, stride_ab,
                                             stride_bb, H_V, N_VBLOCKS)
            _step_tile(tile_id // (N_VBLOCKS * H_V), (tile_id // N_VBLOCKS) % H_V, tile_id % N_VBLOCKS,
                       gate_a, gate_b, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, state_ptr,
                       state_desc, slots_ptr, out_ptr, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb,
                       stride_vh, stride_ab, stride_bb, stride_s0, stride_s1, stride_ob, stride_oh, scale,
                       D_K, D_V, STRIDE_S2, GROUP, BLOCK_K, BLOCK_V, USE_TMA, GATES_AHEAD,
                       LOAD_EVICT, STORE_CACHE)
            tile_id += step
    else:
        # Software-pipelined NUM_STAGES deep: the slot loads, then the state loads (cp.async or
        # TMA into shared memory) of the next tiles are issued while this one computes.
        for tile_id in tl.range(tl.program_id(0), num_tiles, step, num_stages=NUM_STAGES):
            gate_a, gate_b = next_a, next_b
            if GATES_AHEAD:  # a plain load: it blocks only at its first use, an iteration later
                next_a, next_b = _tile_gates(tl.minimum(tile_id + step, num_tiles - 1), a_ptr, b_ptr, stride_ab,
                                             stride_bb, H_V, N_VBLOCKS)
            _step_tile(tile_id // (N_VBLOCKS * H_V), (tile_id // N_VBLOCKS) % H_V, tile_id % N_VBLOCKS,
                       gate_a, gate_b, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, state_ptr,
                       state_desc, slots_ptr, out_ptr, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb,
                       stride_vh, stride_ab, stride_bb, stride_s0, stride_s1, stride_ob, stride_oh, scale,
                       D_K, D_V, STRIDE_S2, GROUP, BLOCK_K, BLOCK_V, USE_TMA, GATES_AHEAD,
                       LOAD_EVICT, STORE_CACHE)


def _tma_can_load(state: torch.Tensor) -> bool:
    """A TMA descriptor needs sm_90+ and 16-byte aligned base and strides (d_v a multiple of 4
    for fp32, 8 for bf16); elsewhere a `tma` launch falls back to pointer loads."""
    # Not cached on the tensor: an lru_cache would keep every state pool it saw alive.
    if state.device.type == "cuda" and cuda_capability(state.device) < (9, 0):
        return False
    itemsize = state.element_size()
    return state.data_ptr() % 16 == 0 and all(s * itemsize % 16 == 0 for s in state.stride()[:-1])


def as_decode_launch(launch: DecodeLaunch | KernelLaunch) -> DecodeLaunch:
    """A plain KernelLaunch (the older knob type) means the tile variant with its three knobs."""
    if isinstance(launch, DecodeLaunch):
        return launch
    return DecodeLaunch(block_v=launch.block_v, num_warps=launch.num_warps, num_stages=launch.num_stages)


def _state_cache_hints(stream: bool) -> dict:
    """Cache policy of the state tile: evict-first loads and streaming (.cs) stores, or the defaults.
    (No .cg on the loads: ptxas rejects .cg combined with an eviction policy. Triton's cp.async
    lowering drops the eviction policy, so on the pipelined path only the .cs store remains.)"""
    if stream:
        return dict(LOAD_EVICT="evict_first", STORE_CACHE=".cs")
    return dict(LOAD_EVICT="", STORE_CACHE="")


def _unit_inner(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def gdn_decode(q, k, v, a, b, A_log, dt_bias, state, slots, launch: DecodeLaunch | KernelLaunch | None = None,
               *, out: torch.Tensor | None = None) -> torch.Tensor:
    """One step per sequence: q, k [B, H_k, d_k]; v [B, H_v, d_v]; a, b [B, H_v]; state [S, H_v, d_k, d_v].

    `launch` None: `launch_for_batch(B)`. Returns o [B, H_v, d_v] in q.dtype, written into `out`
    when given (contiguous in d_v).
    """
    launch = launch_for_batch(k.shape[0]) if launch is None else as_decode_launch(launch)
    q, k, v, a, b = (_unit_inner(t) for t in (q, k, v, a, b))
    assert state.stride(3) == 1, "state must be contiguous in d_v"
    B, H_k, d_k = k.shape
    H_v, d_v = v.shape[1:]
    if out is None:
        out = torch.empty((B, H_v, d_v), dtype=q.dtype, device=q.device)
    assert out.shape == (B, H_v, d_v) and out.stride(2) == 1, "out must be [B, H_v, d_v], contiguous in d_v"
    if B == 0:
        return out
    block_k = next_pow2_at_least_16(d_k)
    block_v = min(launch.block_v, next_pow2_at_least_16(d_v))
    n_vblocks = triton.cdiv(d_v, block_v)
    num_tiles = B * H_v * n_vblocks
    persistent = launch.variant == "persistent"
    if persistent:
        grid = (min(num_tiles, launch.programs_per_sm * multiprocessor_count(q.device)),)
    else:
        grid = (B, H_v, n_vblocks)
    use_tma = launch.tma and _tma_can_load(state)
    state_desc = TensorDescriptor.from_tensor(state, block_shape=[1, 1, block_k, block_v]) if use_tma else None
    _gdn_decode_kernel[grid](
        q, k, v, a, b, A_log, dt_bias, state, state_desc, slots, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
        state.stride(0), state.stride(1), out.stride(0), out.stride(1), d_k ** -0.5, num_tiles,
        H_V=H_v, D_K=d_k, D_V=d_v, STRIDE_S2=state.stride(2), GROUP=H_v // H_k, BLOCK_K=block_k, BLOCK_V=block_v,
        PERSISTENT=persistent, NUM_STAGES=launch.num_stages, USE_TMA=use_tma, LOOP_AS_WHILE=LOOP_AS_WHILE,
        GATES_AHEAD=persistent and launch.gates_ahead, **_state_cache_hints(launch.stream_state),
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )
    return out
