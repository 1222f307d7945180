"""The chunked Gated DeltaNet prefill (chunk C = 64): `gdn_prefill` (prefill.py) plans the
intermediates (work.py) and runs one stage per file, each a kernel with its launcher.

Per chunk with cumulative log-decay G (from the chunk start), the C delta-rule updates
collapse into one triangular system (the WY / UT transform):

    M = I + strict_lower(beta_i · k_i·k_j · exp(G_i − G_j))
    W = M⁻¹ (beta · exp(G) · k)          U = M⁻¹ (beta · v)

so that for the chunk's initial state S0 the new values are u = U − W·S0, the outputs are
o = (q·exp(G))·S0 + causal(q·kᵀ · exp(G_i − G_j))·u, and the final state is
S0·exp(G_C) + kᵀ·(u · exp(G_C − G)), with q and k L2-normalised (q also scaled by d_k^-½).
W and U are never stored: since they share the factor M⁻¹, u = M⁻¹·diag(beta)·(v − exp(G)·k·S0),
and only M⁻¹·diag(beta) goes through memory (the "inverse form").
No kernel normalises q or k on its own: each runs its products on the raw input rows and folds
the inverse norms into row scales (the WY kernel gets the key norms from its Gram blocks and
stores them, [T, H_k] fp32). One kernel per stage, in launch order:

1. `chunk_wy_kernel`      (wy.py, `run_wy`) per (chunk, key head), all in registers by
                          16-row sub-blocks: the keys' Gram blocks once, then per value head the
                          gates and G, the system's blocks and M⁻¹ by blocks (substitution on the
                          diagonal, products below), stored as M⁻¹·diag(beta).
2. `state_pass_kernel`    (state_pass.py, `run_state_pass`) per (sequence, value head, d_v block): the
                          only sequential part — carries S in fp32 registers across chunks, saves
                          each chunk's q·S0 and u.
3. `chunk_output_kernel`  (output.py, `run_output`) per (chunk, key head, d_v block): the outputs of the key head's
                          value heads, fully parallel.

`reference` is the torch maths (kernels/ref/gdn.py: `gdn_prefill`, and `gdn_recurrent_reference`
token by token).
"""
from batchinfer.kernels._common import KernelLaunch
from batchinfer.kernels.gdn_prefill.output import chunk_output_kernel, run_output
from batchinfer.kernels.gdn_prefill.prefill import DEFAULT_LAUNCH, PrefillLaunch, gdn_prefill, piece_bounds, run_prefill
from batchinfer.kernels.gdn_prefill.state_pass import StatePassLaunch, as_state_pass_launch, run_state_pass, state_pass_kernel
from batchinfer.kernels.gdn_prefill.work import CHUNK, SUB, WY_KEY_STEP, PrefillWork, plan_prefill
from batchinfer.kernels.gdn_prefill.wy import chunk_wy_kernel, run_wy
from batchinfer.kernels.ref import gdn as reference

__all__ = [
    "CHUNK", "DEFAULT_LAUNCH", "KernelLaunch", "PrefillLaunch", "PrefillWork", "StatePassLaunch", "SUB", "WY_KEY_STEP",
    "as_state_pass_launch", "chunk_output_kernel", "chunk_wy_kernel", "gdn_prefill", "piece_bounds", "plan_prefill",
    "reference", "run_output", "run_prefill", "run_state_pass", "run_wy", "state_pass_kernel",
]
