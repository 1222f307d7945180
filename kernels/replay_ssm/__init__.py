"""ReplaySSM: `replay_decode` (step.py) and `replay_fold` (fold.py), one stage per file with its
kernel and launcher; `reference` is the torch maths and ring layout (kernels/ref/replay.py).

Decode is bound by memory latency and, with the loads in flight, by the instructions the SMs
issue, not by bytes (Nsight Compute: docs/BENCHMARKS.md, "ReplaySSM: tensor-core dots and many
small programs"). So the work per loaded byte is kept small. With the default launch knobs a step is
three launches:

1. `replay_flush_kernel` (flush.py), a persistent grid (8 programs per SM), folds every FULL ring (cursor
   == L) into its state snapshot: each program ranks the batch's full rows from the cursors and takes
   work items (full row, value head, d_v block) in turn. Sized by the full rings, not the batch, so a step on
   which no ring is full pays one wave of programs that read B cursors. Being its own launch,
   it finishes before the step starts, so the step never folds: no fold registers on the common
   path, and no race between a fold reading ring entry 0 and the step overwriting it.
   (`flush_persistent=False`: `replay_fold_kernel` in flush mode, one program per (sequence,
   key head) or per (sequence, value head, d_v block), most of which read the cursor and exit.)
2. `replay_key_dots_kernel` (key_dots.py), one one-warp program per (sequence, key head), writes the ring-key
   dots rk·k, rk·q for the step, which otherwise recomputes them in every program (GROUP × d_v /
   block_v times the same numbers, the same ring keys re-read from L2 each time).
3. `replay_step_kernel` (step.py), one program per (sequence, value head, d_v block of BLOCK_V), has a
   dependency chain of two round trips for the bulk: `slots[seq]`, then cursor and C tile at
   once. With `live_ring_loads` the ring entries wait for the cursor and only the live ones are
   loaded (half the ring on average, for a third dependent round trip that only the ring
   loads wait for; docs/BENCHMARKS.md, "ReplaySSM: the flush launch and live ring loads"). Validity (index < n) is applied in registers with tl.where
   either way, so stale entries (garbage, NaN) never leak; G_n is picked out of the loaded G
   vector, not gathered.
   With `tensor_cores` the products are mma's with N = 2: raw k and q are the two columns of
   a [BLOCK_K, 2] operand, so Cᵀ[BV, BK] @ [k q] gives Cᵀk and Cᵀq in one accumulator (the mma
   pads N to 8; the columns split in-thread, no reduction), rk[BL, BK] @ [k q] the ring-key
   dots, and ruᵀ[BV, BL] @ coef[BL, 2] the ring's share. 16-bit operands are exact; an fp32
   operand against a 16-bit one goes in as its high and low 16-bit parts (two mma's: ~16
   mantissa bits, fp32 sums); fp32 against fp32 is true fp32 (`ieee`).
   It also appends the new entry: ring_u[n] (its own d_v columns), ring_g[n] (by the
   head's first d_v block) and ring_k[n] (by the first value head of the key-head group).
   Other programs may read entry n concurrently, but entry n is never live for this step
   (it is masked out in registers), so any program order is correct.
All launches are graph-capturable, without host sync.
"""
from batchinfer.kernels.ref import replay as reference
from batchinfer.kernels.replay_ssm.flush import flush_full_rings
from batchinfer.kernels.replay_ssm.fold import replay_fold
from batchinfer.kernels.replay_ssm.launch import DEFAULT_STEP_LAUNCH, StepLaunch
from batchinfer.kernels.replay_ssm.step import replay_decode

__all__ = ["DEFAULT_STEP_LAUNCH", "StepLaunch", "flush_full_rings", "reference", "replay_decode", "replay_fold"]
