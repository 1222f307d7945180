"""What one model step needs besides the weights: the step's metadata and the caches.

`ForwardBatch` describes a packed varlen batch of new tokens (docs/MODULES.md has the field
table); a mixed step's batch holds prefill chunks then decode rows, and carries each part as a
batch of its own (`parts`) for the mixers' kernels. `ModelCaches` holds the pool tensors the kernels update in place by slot index; the
real pools live in `cache/` (KVPool, GdnStatePool), which hands the model these same tensors.
`allocate_caches` builds a standalone set of the same shapes for tests and benchmarks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from batchinfer.models.config import ModelConfig
from batchinfer.kernels.public import ChunkTables
from batchinfer.kernels.ref.conv1d import conv_state_zeros


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor        # [T] int64 packed new tokens
    positions: torch.Tensor        # [T] int64 absolute positions (rotary)
    cu_seqlens: torch.Tensor       # [B+1] int32 new-token boundaries
    is_decode: bool                # one new token per sequence, all with state → decode kernels
    state_slots: torch.Tensor      # [B] int64 GDN working slot per sequence
    out_kv_slots: torch.Tensor     # [T] int64 KV slot of each new token
    kv_indices: torch.Tensor       # [Σctx] int64 each sequence's whole context (prefix + new)
    kv_indptr: torch.Tensor        # [B+1] int32
    logits_indices: torch.Tensor   # [N] int64 which of the T tokens get logits
    replay: bool = False           # decode through ReplaySSM (checkpoint + ring)
    # Decode only, optional: [B] int32, leading context positions whose KV slots row r shares
    # with row r-1 (a promise; may understate): attention reads a shared prefix's KV once.
    shared_with_prev: Optional[torch.Tensor] = None
    # Prefill only, optional: the chunk tables of cu_seqlens, built once for all layers by the
    # first kernel that asks (kernels/_common.py:ChunkTables); None: each kernel builds its own.
    chunk_tables: Optional[ChunkTables] = None
    # Mixed step only: (prefill part, decode part), each a batch of its own over this batch's
    # first `prefill.num_tokens` tokens and the rest (one per decode row). Token-wise layers run
    # once over all T; the mixers run each part's kernels on its rows (`segments`). The fields
    # above then describe all sequences, prefill first, and is_decode / replay are False.
    parts: Optional[tuple["ForwardBatch", "ForwardBatch"]] = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.state_slots.shape[0]

    @property
    def prefill_part(self) -> Optional["ForwardBatch"]:
        """The batch the prefill kernels run on (None: no prefill tokens in this step)."""
        if self.parts is not None:
            return self.parts[0]
        return None if self.is_decode else self

    @property
    def decode_part(self) -> Optional["ForwardBatch"]:
        """The batch the decode kernels run on (None: no decode rows in this step)."""
        if self.parts is not None:
            return self.parts[1]
        return self if self.is_decode else None

    def segments(self) -> list[tuple[slice, "ForwardBatch"]]:
        """(rows of this batch's T tokens, the batch whose kernels run on them), in token order."""
        if self.parts is None:
            return [(slice(None), self)]
        prefill, decode = self.parts
        split = prefill.num_tokens
        return [(slice(0, split), prefill), (slice(split, None), decode)]


@dataclass(frozen=True)
class ModelCaches:
    """Pool tensors, indexed by layer kind. Shapes (S state slots, S_kv KV slots, L ring length):

    kv_k[i], kv_v[i]  [S_kv, H_kv, d]          i-th attention layer, model dtype
    conv[j]           [S, D_conv, K-1]          j-th GDN layer, model (activation) dtype, entry-major view
    ssm[j]            [S, H_v, d_k, d_v]        recurrent state (fp32) or ReplaySSM checkpoint
    ring_k[j]         [S, L, H_k, d_k]          ReplaySSM only (checkpoint dtype)
    ring_u[j]         [S, L, H_v, d_v]          ReplaySSM only (checkpoint dtype)
    ring_g[j]         [S, L, H_v]               ReplaySSM only (fp32, cumulative log-decay)
    cursor            [S] int32                 ReplaySSM only; shared by all GDN layers
    """
    kv_k: Sequence[torch.Tensor]
    kv_v: Sequence[torch.Tensor]
    conv: Sequence[torch.Tensor]
    ssm: Sequence[torch.Tensor]
    ring_k: Sequence[torch.Tensor] = ()
    ring_u: Sequence[torch.Tensor] = ()
    ring_g: Sequence[torch.Tensor] = ()
    cursor: Optional[torch.Tensor] = None

    @classmethod
    def from_pools(cls, kv_pool, state_pool) -> "ModelCaches":
        """The model's view of a `cache.KVPool` and a `cache.GdnStatePool`: their own tensors,
        which the model updates in place (and whose `cursor` it advances after a ReplaySSM decode
        step); the pools keep owning them."""
        return cls(kv_k=kv_pool.k, kv_v=kv_pool.v, conv=state_pool.conv, ssm=state_pool.ssm,
                   ring_k=state_pool.ring_k, ring_u=state_pool.ring_u, ring_g=state_pool.ring_g,
                   cursor=state_pool.cursor)

    @property
    def has_replay(self) -> bool:
        return self.cursor is not None and len(self.ring_k) > 0

    @property
    def ring_len(self) -> int:
        return self.ring_k[0].shape[1] if self.has_replay else 0


def allocate_caches(
    config: ModelConfig,
    num_state_slots: int,
    num_kv_slots: int,
    dtype: torch.dtype,
    device: torch.device | str,
    replay_ring_len: Optional[int] = None,
    ckpt_dtype: Optional[torch.dtype] = None,
) -> ModelCaches:
    """Zeroed caches (a zero state is a fresh sequence's state).

    Without `replay_ring_len` the GDN state is fp32. With it, `ssm` is the ReplaySSM checkpoint
    in `ckpt_dtype` (default fp32), the ring stores k/u in that dtype and g in fp32.
    """
    c = config
    S, K = num_state_slots, c.linear_conv_kernel_dim

    def zeros(*shape: int, dt: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dt, device=device)

    n_gdn, n_attn = len(c.gdn_layer_ids), len(c.attn_layer_ids)
    state_dtype = torch.float32 if replay_ring_len is None else (ckpt_dtype or torch.float32)
    kv_shape = (num_kv_slots, c.num_kv_heads, c.head_dim)
    caches = dict(
        kv_k=[zeros(*kv_shape, dt=dtype) for _ in range(n_attn)],
        kv_v=[zeros(*kv_shape, dt=dtype) for _ in range(n_attn)],
        conv=[conv_state_zeros(S, c.conv_dim, K, dtype, device) for _ in range(n_gdn)],
        ssm=[zeros(S, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim, dt=state_dtype)
             for _ in range(n_gdn)],
    )
    if replay_ring_len is not None:
        L = replay_ring_len
        caches.update(
            ring_k=[zeros(S, L, c.linear_num_key_heads, c.linear_key_head_dim, dt=state_dtype) for _ in range(n_gdn)],
            ring_u=[zeros(S, L, c.linear_num_value_heads, c.linear_value_head_dim, dt=state_dtype)
                    for _ in range(n_gdn)],
            ring_g=[zeros(S, L, c.linear_num_value_heads, dt=torch.float32) for _ in range(n_gdn)],
            cursor=zeros(S, dt=torch.int32),
        )
    return ModelCaches(**caches)
