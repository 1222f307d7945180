"""Reference Gated DeltaNet (plain torch, fp32): chunked prefill, one-step decode, and a
token-by-token recurrence that the tests treat as ground truth.

Per value head, with `g = -exp(A_log)·softplus(a + dt_bias)` and `beta = sigmoid(b)`:

    S ← exp(g)·S;   u = beta·(v − Sᵀk);   S ← S + k ⊗ u;   o = Sᵀq

q and k are L2-normalised per head (eps 1e-6 inside the rsqrt, as transformers/fla) and q is
scaled by d_k^-½; value head h reads key head h // (H_v / H_k). States live in a slot pool
`state[S, H_v, d_k, d_v]` (fp32 or bf16): read by slot, computed in fp32, written back in
the pool's dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64
L2NORM_EPS = 1e-6


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """Log-decay g and write strength beta, both fp32 and shaped like `a` ([..., H_v])."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float())


def normalise_qk(q: torch.Tensor, k: torch.Tensor, heads_v: int):
    """fp32 L2-normalised q (times d_k^-½) and k, expanded to one head per value head."""
    q32, k32 = q.float(), k.float()  # [..., H_k, d_k]
    q32 = q32 * torch.rsqrt(q32.pow(2).sum(-1, keepdim=True) + L2NORM_EPS) * q.shape[-1] ** -0.5
    k32 = k32 * torch.rsqrt(k32.pow(2).sum(-1, keepdim=True) + L2NORM_EPS)
    group = heads_v // k.shape[-2]
    return q32.repeat_interleave(group, dim=-2), k32.repeat_interleave(group, dim=-2)  # [..., H_v, d_k]


def _to_padded(x: torch.Tensor, seq_ids: torch.Tensor, pos: torch.Tensor, num_seqs: int, padded_len: int):
    """Packed [T, H, ...] → zero-padded [B, H, padded_len, ...]."""
    out = x.new_zeros((num_seqs, padded_len) + tuple(x.shape[1:]))
    out[seq_ids, pos] = x
    return out.transpose(1, 2)


def _chunked_scan(q, k, v, g, beta, state):
    """Chunked gated delta rule over zero-padded sequences.

    q, k: [B, H, P, d_k]; v: [B, H, P, d_v]; g, beta: [B, H, P]; state: [B, H, d_k, d_v]; P is a
    multiple of CHUNK_SIZE. Padded positions carry k = 0, beta = 0, g = 0, which leaves the state
    untouched, so every sequence's final state is exact. Returns (o [B, H, P, d_v], final state).
    """
    B, H, P, d_k = k.shape
    C, N = CHUNK_SIZE, P // CHUNK_SIZE
    q, k, v = (t.reshape(B, H, N, C, t.shape[-1]) for t in (q, k, v))
    g, beta = g.reshape(B, H, N, C), beta.reshape(B, H, N, C)

    cum = g.cumsum(-1)  # [B, H, N, C]: log-decay from the chunk start through position i
    causal = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()
    # exp(cum_i - cum_j) for j <= i; masked before exp so that j > i cannot overflow.
    pair_decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [B,H,N,C,C]

    # WY / UT transform: (I + strict_lower(beta_i k_i·k_j decay_ij)) turns the C sequential delta
    # updates of a chunk into triangular solves; u = u_const − w·S0 for the chunk's initial state S0.
    system = (beta[..., None] * (k @ k.transpose(-1, -2)) * pair_decay).tril(-1)
    system = system + torch.eye(C, dtype=system.dtype, device=system.device)
    u_const = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, (beta * cum.exp())[..., None] * k, upper=False, unitriangular=True)

    intra = (q @ k.transpose(-1, -2)) * pair_decay  # [B, H, N, C, C], diagonal included
    q_decayed = q * cum.exp()[..., None]  # reads the chunk's initial state
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]  # writes into the chunk's final state
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [B, H, N, 1, 1]

    out = torch.empty_like(v)  # [B, H, N, C, d_v]
    for n in range(N):
        u = u_const[:, :, n] - w[:, :, n] @ state  # [B, H, C, d_v]
        out[:, :, n] = q_decayed[:, :, n] @ state + intra[:, :, n] @ u
        state = state * chunk_decay[:, :, n] + k_to_end[:, :, n].transpose(-1, -2) @ u
    return out.reshape(B, H, P, -1), state


def gdn_prefill(q, k, v, a, b, A_log, dt_bias, state, slots, cu_seqlens, chunk_tables=None) -> torch.Tensor:
    """Chunked GDN over packed sequences; `state[slots]` in, final states written back.
    (`chunk_tables` is the Triton kernels' shared chunk tables of the step; ignored here.)

    q, k: [T, H_k, d_k]; v: [T, H_v, d_v]; a, b: [T, H_v]; state: [S, H_v, d_k, d_v];
    slots: [B]; cu_seqlens: [B+1]. Returns o: [T, H_v, d_v] in q.dtype.
    """
    T, H_v = v.shape[:2]
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]  # [B]
    num_seqs = lengths.numel()
    padded_len = max(1, -(-int(lengths.max()) // CHUNK_SIZE)) * CHUNK_SIZE if num_seqs else CHUNK_SIZE
    seq_ids = torch.repeat_interleave(torch.arange(num_seqs, device=v.device), lengths.long())  # [T]
    pos = torch.arange(T, device=v.device) - cu_seqlens[:-1].long()[seq_ids]  # [T]

    g, beta = gdn_gates(a, b, A_log, dt_bias)  # [T, H_v]
    qn, kn = normalise_qk(q, k, H_v)  # [T, H_v, d_k]
    padded = [_to_padded(t, seq_ids, pos, num_seqs, padded_len) for t in (qn, kn, v.float(), g, beta)]
    out, final = _chunked_scan(*padded, state[slots].float())
    state[slots] = final.to(state.dtype)
    return out.transpose(1, 2)[seq_ids, pos].to(q.dtype)  # [T, H_v, d_v]


def _recurrent_step(S, q, k, v, g, beta):
    """One token for a batch of heads: S [..., d_k, d_v] fp32, q/k [..., d_k], v [..., d_v], g/beta [...]."""
    S = S * g.exp()[..., None, None]
    u = beta[..., None] * (v - (S * k[..., :, None]).sum(-2))
    S = S + k[..., :, None] * u[..., None, :]
    return S, (S * q[..., :, None]).sum(-2)


def gdn_decode(q, k, v, a, b, A_log, dt_bias, state, slots) -> torch.Tensor:
    """One recurrent step per sequence (q, k: [B, H_k, d_k]; v: [B, H_v, d_v]); state updated in place."""
    g, beta = gdn_gates(a, b, A_log, dt_bias)  # [B, H_v]
    qn, kn = normalise_qk(q, k, v.shape[1])
    S, out = _recurrent_step(state[slots].float(), qn, kn, v.float(), g, beta)
    state[slots] = S.to(state.dtype)
    return out.to(q.dtype)  # [B, H_v, d_v]


def gdn_recurrent_reference(q, k, v, a, b, A_log, dt_bias, state, slots, cu_seqlens) -> torch.Tensor:
    """Token-by-token ground truth with gdn_prefill's signature and effects (slow; tests only)."""
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    qn, kn = normalise_qk(q, k, v.shape[1])
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)  # [T, H_v, d_v]
    bounds = cu_seqlens.tolist()
    for i, slot in enumerate(slots.tolist()):
        S = state[slot].float()  # [H_v, d_k, d_v]
        for t in range(bounds[i], bounds[i + 1]):
            S, out[t] = _recurrent_step(S, qn[t], kn[t], v[t].float(), g[t], beta[t])
        state[slot] = S.to(state.dtype)
    return out.to(q.dtype)
