"""Prompt token ids as sort keys: big-endian uint32 bytes, so byte order is token order.

Every token takes exactly four bytes, most significant first, so comparing two keys byte
by byte compares their token ids one by one, and a key that is a prefix of another sorts
first: `bytes` comparison (memcmp) is the lexicographic order of the token-id lists that
the planner's sort uses. Rows without a prompt get the empty key and sort before every
prompt, where they share no prefix with anything.
"""
from __future__ import annotations

import struct
from typing import Sequence

import numpy as np

TOKEN_BYTES = 4
MAX_TOKEN_ID = (1 << 32) - 1
_BIG_ENDIAN_U32 = np.dtype(">u4")


def encode_key(token_ids: Sequence[int]) -> bytes:
    """The key of one prompt; raises struct.error for ids outside [0, 2**32)."""
    return struct.pack(f">{len(token_ids)}I", *token_ids)


def decode_key(key: bytes) -> list[int]:
    return np.frombuffer(key, dtype=_BIG_ENDIAN_U32).tolist()


def key_tokens(key: bytes) -> int:
    return len(key) // TOKEN_BYTES


def common_prefix_tokens(a: bytes, b: bytes) -> int:
    """Leading tokens that keys `a` and `b` share."""
    if len(a) > len(b):
        a, b = b, a
    if b.startswith(a):
        return len(a) // TOKEN_BYTES
    length = len(a)
    # The highest set bit of the XOR marks the first differing byte (C-speed on long keys).
    diff = int.from_bytes(a, "big") ^ int.from_bytes(b[:length], "big")
    first_differing_byte = length - 1 - (diff.bit_length() - 1) // 8
    return first_differing_byte // TOKEN_BYTES
