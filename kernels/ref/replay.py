"""Plain-torch reference for ReplaySSM decode (ARCHITECTURE.md "ReplaySSM decode").

Per slot the GDN state is kept as a checkpoint `C` plus a ring of the last `n <= L`
tokens' `(k_i, u_i, G_i)`:

    S_n = exp(G_n) · C + Σ_{i<n} exp(G_n − G_i) · k_i ⊗ u_i

Ring layout (shared with the Triton kernels in `kernels/replay_ssm/`):
- `ring_k[slot, i]`  the L2-normalised key of entry i, per KEY head      [L, H_k, d_k]
- `ring_u[slot, i]`  the delta-rule "new value" u_i, per value head      [L, H_v, d_v]
- `ring_g[slot, i]`  the CUMULATIVE log decay G_i since the checkpoint,   [L, H_v]
  i.e. the sum of the per-token g of entries 0..i. Storing the running sum (not each
  token's g) lets a step read G_{n-1} directly instead of re-summing the ring.
- `cursor[slot] = n` the number of valid entries; entries at index >= n are stale.

All math is fp32; ring_k / ring_u are stored in the checkpoint dtype, ring_g in fp32.
Gathers use index_select / index_copy_: CPU advanced indexing wakes the intra-op thread pool
and costs milliseconds per call on a loaded 2-core machine.
The new token's own u enters its output unrounded (as the Triton kernel does); later
steps see the rounded copy from the ring.
"""
from __future__ import annotations

import torch

from batchinfer.kernels.ref.gdn import gdn_gates, normalise_qk


def _valid_entries(n: torch.Tensor, L: int) -> torch.Tensor:
    """Which ring entries hold data: index < n. n [B] → [B, L, 1] (broadcasts over heads)."""
    return torch.arange(L, device=n.device)[None, :, None] < n[:, None, None]


def _ring_weights(ring_g: torch.Tensor, n: torch.Tensor, g_end: torch.Tensor) -> torch.Tensor:
    """exp(g_end − G_i) for valid entries i < n, exactly 0 for stale ones.

    ring_g [B, L, H_v] (cumulative), n [B], g_end [B, H_v] → [B, L, H_v].
    """
    valid = _valid_entries(n, ring_g.shape[1])
    diff = torch.where(valid, g_end[:, None, :] - ring_g, torch.full_like(ring_g, -float("inf")))
    return torch.exp(diff)


def _load_ring(ring_k, ring_u, ring_g, n, slots, h_v: int):
    """fp32 ring entries of `slots`, stale ones (index >= n) zeroed so garbage/NaN cannot leak.

    → rk [B, L, H_v, d_k] (key heads expanded), ru [B, L, H_v, d_v], rg [B, L, H_v].
    """
    valid = _valid_entries(n, ring_k.shape[1])  # [B, L, 1]
    rk = torch.where(valid[..., None], ring_k.index_select(0, slots).float(), 0.0)
    ru = torch.where(valid[..., None], ring_u.index_select(0, slots).float(), 0.0)
    rg = torch.where(valid, ring_g.index_select(0, slots).float(), 0.0)
    return _expand_key_heads(rk, h_v), ru, rg


def _cumulative_g_at(ring_g: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """G_n: the cumulative log decay after n entries (0 for an empty ring). → [B, H_v]."""
    last = (n - 1).clamp(min=0)[:, None, None].expand(-1, 1, ring_g.shape[2])
    g_last = ring_g.gather(1, last)[:, 0]  # [B, H_v]
    return torch.where((n > 0)[:, None], g_last, torch.zeros_like(g_last))


def _expand_key_heads(x: torch.Tensor, h_v: int) -> torch.Tensor:
    """Key-head tensor [..., H_k, d_k] → value-head layout [..., H_v, d_k] (h uses h // (H_v/H_k))."""
    return x.repeat_interleave(h_v // x.shape[-2], dim=-2)


def _folded_states(ckpt, ring_k, ring_u, ring_g, n, slots) -> torch.Tensor:
    """S_n (fp32) of each slot in `slots` whose ring holds n entries. → [B, H_v, d_k, d_v]."""
    h_v = ckpt.shape[1]
    C = ckpt.index_select(0, slots).float()  # [B, H_v, d_k, d_v]
    rk, ru, rg = _load_ring(ring_k, ring_u, ring_g, n, slots, h_v)  # [B, L, H_v, ·]
    g_end = _cumulative_g_at(rg, n)  # [B, H_v]
    w = _ring_weights(rg, n, g_end)  # [B, L, H_v]
    # Σ_i w_i k_i ⊗ u_i as a batched [d_k, L] @ [L, d_v] product.
    ring_part = (w[..., None] * rk).permute(0, 2, 3, 1) @ ru.permute(0, 2, 1, 3)  # [B, H_v, d_k, d_v]
    return torch.exp(g_end)[:, :, None, None] * C + ring_part


def replay_state(ckpt, ring_k, ring_u, ring_g, cursor, slot: int) -> torch.Tensor:
    """The fp32 GDN state S of one slot at its cursor (tests / debugging). → [H_v, d_k, d_v]."""
    slots = torch.tensor([slot], device=ckpt.device, dtype=torch.long)
    n = cursor.index_select(0, slots).long()
    return _folded_states(ckpt, ring_k, ring_u, ring_g, n, slots)[0]


def replay_fold(ckpt, ring_k, ring_u, ring_g, cursor, src_slots, dst_slots) -> None:
    """ckpt[dst] ← state of src at its cursor (rounded to ckpt dtype). Cursors untouched.

    All states are computed before any write, so src/dst lists may overlap.
    """
    src = src_slots.long()
    dst = dst_slots.long()
    if src.numel() == 0:
        return
    states = _folded_states(ckpt, ring_k, ring_u, ring_g, cursor.index_select(0, src).long(), src)
    ckpt.index_copy_(0, dst, states.to(ckpt.dtype))


def replay_decode(q, k, v, a, b, A_log, dt_bias, ckpt, ring_k, ring_u, ring_g, cursor, slots):
    """One ReplaySSM decode step per sequence (contract: docs/MODULES.md).

    q, k [B, H_k, d_k]; v [B, H_v, d_v]; a, b [B, H_v]; ckpt [S, H_v, d_k, d_v];
    ring_k [S, L, H_k, d_k]; ring_u [S, L, H_v, d_v]; ring_g [S, L, H_v] fp32; cursor [S];
    slots [B] (distinct). Returns o [B, H_v, d_v] in q.dtype. Updates ckpt (on a full
    ring) and the ring in place (pools must be contiguous); never changes `cursor`.
    """
    slots = slots.long()
    L = ring_k.shape[1]
    h_v = v.shape[1]
    n = cursor.index_select(0, slots).long()  # [B]
    full = n == L
    if bool(full.any()):
        # A full ring is folded into the checkpoint (rounded once, here) and restarts at 0.
        replay_fold(ckpt, ring_k, ring_u, ring_g, cursor, slots[full], slots[full])
        n = torch.where(full, 0, n)

    g, beta = gdn_gates(a, b, A_log, dt_bias)  # [B, H_v]
    qn, kn = normalise_qk(q, k, k.shape[1])  # per key head, unexpanded  [B, H_k, d_k]
    qv = _expand_key_heads(qn, h_v)  # [B, H_v, d_k]
    kv = _expand_key_heads(kn, h_v)  # [B, H_v, d_k]

    C = ckpt.index_select(0, slots).float()  # [B, H_v, d_k, d_v]
    rk, ru, rg = _load_ring(ring_k, ring_u, ring_g, n, slots, h_v)  # [B, L, H_v, ·]

    g_new = _cumulative_g_at(rg, n) + g  # G_{n+1}: decay of the new token included  [B, H_v]
    w = _ring_weights(rg, n, g_new)  # [B, L, H_v]
    decay_c = torch.exp(g_new)[:, :, None]  # [B, H_v, 1]

    # (exp(g)·S_n)ᵀ k without materialising S: checkpoint part + ring part.
    # (torch.einsum is avoided here: on CPU some of these tiny contractions take a
    # pathological path for L >= 32, ~500x slower than the broadcast sums.)
    ck = (C * kv[..., None]).sum(2)  # [B, H_v, d_v]
    rk_dot_k = (rk * kv[:, None]).sum(-1)  # [B, L, H_v]
    decayed_s_k = decay_c * ck + ((w * rk_dot_k)[..., None] * ru).sum(1)
    u = beta[:, :, None] * (v.float() - decayed_s_k)  # [B, H_v, d_v]

    # o = S_{n+1}ᵀ q = (exp(g)·S_n)ᵀ q + u (k·q)
    cq = (C * qv[..., None]).sum(2)  # [B, H_v, d_v]
    rk_dot_q = (rk * qv[:, None]).sum(-1)  # [B, L, H_v]
    o = decay_c * cq + ((w * rk_dot_q)[..., None] * ru).sum(1)
    o = o + (kv * qv).sum(-1, keepdim=True) * u

    entry = slots * L + n  # row of the new entry in the [S·L, ...] view of each ring
    ring_k.view(-1, *ring_k.shape[2:]).index_copy_(0, entry, kn.to(ring_k.dtype))
    ring_u.view(-1, *ring_u.shape[2:]).index_copy_(0, entry, u.to(ring_u.dtype))
    ring_g.view(-1, ring_g.shape[2]).index_copy_(0, entry, g_new.to(ring_g.dtype))
    return o.to(q.dtype)
