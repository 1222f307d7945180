"""A decode step's rows: which token each sequence feeds (from the host, or from the device
when the previous step's draw is still in flight), and which KV each shares with the row before.

A step kept in flight (`overlap.InFlightDecode`) feeds its tokens to the next step straight
from the device (`DecodeRows.token_from`).
"""
from __future__ import annotations

from typing import Optional

from batchinfer.engine.model_runner import DecodeRows
from batchinfer.engine.overlap import InFlightDecode
from batchinfer.engine.sequence import Sequence
from batchinfer.cache.seq_handle import pack_kv


def decode_rows(seqs: list[Sequence], prior: Optional[InFlightDecode]) -> DecodeRows:
    """The rows of a decode step over `seqs` (each handle already holds this step's context;
    a sequence with a token in flight must be a row of `prior`)."""
    positions = [seq.computed for seq in seqs]
    handles = [seq.handle for seq in seqs]
    token_from = None
    if prior is not None:
        row_of = {id(seq): i for i, seq in enumerate(prior.seqs)}
        token_from = [row_of[id(seq)] if seq.awaiting else -1 for seq in seqs]
    return DecodeRows(token_ids=[0 if seq.awaiting else seq.tokens[p] for seq, p in zip(seqs, positions)],
                      positions=positions, state_slots=[h.working_slot for h in handles],
                      kv_indices=pack_kv(handles), token_from=token_from,
                      prior_tokens=None if prior is None else prior.tokens,
                      shared_with_prev=shared_with_prev(seqs))


def shared_with_prev(seqs: list[Sequence]) -> list[int]:
    """For each decode row, how many leading context positions hold the same KV slots as the
    row before it (0 for the first). Only tree-owned slots are ever shared, so the comparison
    stops at the shorter tree part; a row's value is recomputed only when its or its
    predecessor's handle or tree part changes (donation re-points slots), i.e. rarely."""
    out = [0] * len(seqs)
    for i in range(1, len(seqs)):
        prev, cur = seqs[i - 1].handle, seqs[i].handle
        memo = seqs[i].shared_memo
        if memo is None or memo[0] is not prev or memo[1] is not cur or memo[2] != (prev.tree_len, cur.tree_len):
            n = min(prev.tree_len, cur.tree_len)
            differ = (prev.kv_indices[:n] != cur.kv_indices[:n]).nonzero()
            memo = seqs[i].shared_memo = (prev, cur, (prev.tree_len, cur.tree_len),
                                          int(differ[0]) if differ.numel() else n)
        out[i] = memo[3]
    return out
