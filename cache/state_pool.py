"""GDN state pool: per slot the conv window and recurrent state (or ReplaySSM state snapshot +
ring + cursor) of every GDN layer."""
from __future__ import annotations

from typing import Iterable, Sequence

import torch

from batchinfer.kernels import ops
from batchinfer.kernels.ref.conv1d import conv_state_zeros

from .shapes import GdnStateShape
from .slot_owner import SlotPool


def _as_slots(slots: int | Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(slots, dtype=torch.int64).reshape(-1).to(device)


class GdnStatePool(SlotPool):
    """Preallocated GDN states, one slot per live sequence or cached prefix state.

    Tensors (list index j = the j-th GDN layer; every tensor has num_slots + 1 rows, the last,
    `pad_slot`, being scratch that is never allocated, for padded batch entries):
    - `conv[j]`   [S+1, D_conv, K-1]   model dtype — last K-1 conv inputs, oldest first (stored
      entry-major: `conv_state_zeros`)
    - `ssm[j]`    [S+1, H_v, d_k, d_v] fp32 recurrent state S, or the ReplaySSM state snapshot C
    - ReplaySSM only (`shape.replay`): `ring_k[j]` [S+1, L, H_k, d_k] and `ring_u[j]`
      [S+1, L, H_v, d_v] in the snapshot dtype, `ring_g[j]` [S+1, L, H_v] fp32 (cumulative
      log decay), and one `cursor` [S+1] int32 shared by all layers (entries pending in the ring).
      Without ReplaySSM the ring lists are empty and `cursor` stays all zero.

    The state of a slot under ReplaySSM is (C, ring[:cursor]); the cursor is part of it. Every
    method that moves a state (`copy`, `flush`) leaves the destination with no pending entries
    (folded, cursor 0): a stale cursor would silently add or drop tokens. `zero_` gives a
    fresh (empty-prefix) state. A freshly allocated slot holds garbage until `zero_` or `copy`.
    """

    def __init__(self, num_slots: int, shape: GdnStateShape, device: torch.device | str = "cpu") -> None:
        self.shape = shape
        self.device = torch.device(device)
        super().__init__(num_slots)
        rows = num_slots + 1
        s = shape
        self.conv = [conv_state_zeros(rows, s.conv_dim, s.conv_kernel, s.conv_dtype, self.device)
                     for _ in range(s.num_layers)]
        self.ssm = [torch.zeros(rows, s.num_v_heads, s.head_k_dim, s.head_v_dim, dtype=s.ssm_dtype,
                                device=self.device) for _ in range(s.num_layers)]
        ring_layers = s.num_layers if s.replay else 0
        self.ring_k = [torch.zeros(rows, s.ring_len, s.num_k_heads, s.head_k_dim, dtype=s.ssm_dtype,
                                   device=self.device) for _ in range(ring_layers)]
        self.ring_u = [torch.zeros(rows, s.ring_len, s.num_v_heads, s.head_v_dim, dtype=s.ssm_dtype,
                                   device=self.device) for _ in range(ring_layers)]
        self.ring_g = [torch.zeros(rows, s.ring_len, s.num_v_heads, dtype=torch.float32, device=self.device)
                       for _ in range(ring_layers)]
        self.cursor = torch.zeros(rows, dtype=torch.int32, device=self.device)  # [S+1]

    # ---- ownership -------------------------------------------------------------------------
    def alloc(self) -> int | None:
        """A free slot index (contents undefined), or None when the pool is empty."""
        idx = self._free.alloc(1)
        return None if idx is None else int(idx[0])

    def free(self, slot: int | Iterable[int]) -> None:
        """Return slot(s) to the free list; freeing a slot that is not allocated raises."""
        self._free.free([slot] if isinstance(slot, int) else list(slot))

    # ---- state moves -----------------------------------------------------------------------
    def zero_(self, slots: int | Sequence[int] | torch.Tensor) -> None:
        """Fresh start: conv window and state (snapshot) zero, no pending ring entries."""
        idx = _as_slots(slots, self.device)
        for conv, ssm in zip(self.conv, self.ssm):
            conv[idx] = 0
            ssm[idx] = 0
        self.cursor[idx] = 0

    def copy(self, src: int | Sequence[int] | torch.Tensor, dst: int | Sequence[int] | torch.Tensor) -> None:
        """dst ← the state of src, for every GDN layer; src is left untouched.

        Under ReplaySSM the destination receives the src state *folded* at src's cursor (its
        pending ring entries included) and `cursor[dst] = 0`; src keeps its snapshot, ring and
        cursor. Destinations must be distinct and none may be a source (the GPU fold runs the pairs
        in any order); use `flush` to fold in place.
        """
        src_list = [int(s) for s in _as_slots(src, torch.device("cpu"))]
        dst_list = [int(d) for d in _as_slots(dst, torch.device("cpu"))]
        if len(src_list) != len(dst_list):
            raise ValueError("copy needs as many destinations as sources")
        if len(set(dst_list)) != len(dst_list) or set(dst_list) & set(src_list):
            raise ValueError("copy needs distinct destinations that are not sources")
        src_idx, dst_idx = _as_slots(src_list, self.device), _as_slots(dst_list, self.device)
        for conv in self.conv:
            conv[dst_idx] = conv[src_idx]
        if self.shape.replay:
            for j in range(self.shape.num_layers):
                ops.replay_fold(self.ssm[j], self.ring_k[j], self.ring_u[j], self.ring_g[j], self.cursor,
                                src_idx, dst_idx)
        else:
            for ssm in self.ssm:
                ssm[dst_idx] = ssm[src_idx]
        self.cursor[dst_idx] = 0  # the destination's ring (whatever it held) is now stale

    def flush(self, slots: int | Sequence[int] | torch.Tensor) -> None:
        """Fold each slot's pending ring entries into its own snapshot and set its cursor to 0.

        The state is unchanged (up to one rounding to the snapshot dtype). Needed before a slot's
        state is handed over as is (finish under no_buffer), and before a prefill on a slot that
        has decoded (prefill reads the snapshot only, not the ring). No-op without ReplaySSM.
        """
        if not self.shape.replay:
            return
        idx = _as_slots(slots, self.device)
        for j in range(self.shape.num_layers):
            ops.replay_fold(self.ssm[j], self.ring_k[j], self.ring_u[j], self.ring_g[j], self.cursor, idx, idx)
        self.cursor[idx] = 0

    def reset_cursor(self, slots: int | Sequence[int] | torch.Tensor) -> None:
        """Mark the ring of each slot empty (its snapshot alone is then its state)."""
        self.cursor[_as_slots(slots, self.device)] = 0
