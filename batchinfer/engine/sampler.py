"""Token sampling on the device, reproducible per (seed, seed_key, sample index, position).

Randomness is a counter-based hash, not a generator with state: the noise for token id v of a
row is a pure function of (seed, seed_key, sample_index, position, v). The same request sample
therefore draws the same token at the same position whatever else shares the batch, across
reruns and after a preemption recomputes it. Sampling is Gumbel-max over the filtered,
temperature-scaled logits: argmax(logits / T + G), G = -log(-log(u)), which draws exactly
from softmax(logits / T) restricted to the kept tokens.

The hash works on 32-bit words held in int64 tensors; every product stays below 2^63, so no
step relies on signed overflow.

Order of operations (as Hugging Face's processors): repetition penalty → banned tokens
(min_tokens) → greedy argmax, or temperature → top-k → top-p → min-p → Gumbel-max.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import torch

from batchinfer.engine.host_copy import upload, upload_packed
from batchinfer.engine.types import SamplingParams, TokenLogprob

_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1
_NOISE_ELEMENTS_PER_CHUNK = 1 << 24  # bounds the [rows, vocab] int64 temporaries (~128 MB each)


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x · constant) mod 2^32 for x < 2^32, split in 16-bit halves so products stay < 2^63."""
    low, high = constant & 0xFFFF, constant >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche finaliser (xorshift-multiply, 'lowbias32' constants)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _split64(value: int) -> tuple[int, int]:
    value &= _MASK64
    return value & _MASK32, value >> 32


def _mix32_int(x: int) -> int:
    """`_mix32` on one Python int (same arithmetic mod 2^32): for per-sequence constants."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def identity_key(params: SamplingParams, seed_key: int, sample_index: int) -> tuple[int, int]:
    """`row_keys`' two running keys after a row's five identity words (seed, seed_key, sample
    index), before its position: constant over a sample's life, so the engine computes it once
    and `finish_row_keys` mixes in each step's position."""
    seed_lo, seed_hi = _split64(params.seed)
    key_lo, key_hi = _split64(seed_key)
    first, second = 0x9E3779B9, 0x85EBCA6B
    for word in (seed_lo, seed_hi, key_lo, key_hi, sample_index & _MASK32):
        first = _mix32_int(first ^ word)
        second = _mix32_int(second ^ first)
    return first, second


def finish_row_keys(identity: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`row_keys` of (identity words, position) from the identity keys [N, 2] and positions [N]."""
    first = _mix32(identity[:, 0] ^ (positions & _MASK32))
    second = _mix32(identity[:, 1] ^ first)
    return torch.stack([first, second], dim=1)  # [N, 2]


def row_keys(words: torch.Tensor) -> torch.Tensor:
    """Two 32-bit keys per row from its identity words [N, W] (each < 2^32) → [N, 2] int64."""
    first = torch.full_like(words[:, 0], 0x9E3779B9)
    second = torch.full_like(words[:, 0], 0x85EBCA6B)
    for column in range(words.shape[1]):
        first = _mix32(first ^ words[:, column])
        second = _mix32(second ^ first)
    return torch.stack([first, second], dim=1)


def uniform_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """u in (0, 1) for every (row, token id): [N, 2] int64 keys → [N, V] fp32."""
    token_ids = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)
    h = _mix32(keys[:, :1] ^ token_ids)          # [N, V]
    h = _mix32(h ^ keys[:, 1:])
    return unit_interval(h >> 8)


# The largest fp32 below 1: (2^24 - 1 + 0.5) / 2^24 rounds up to 1.0 in fp32, where the noise
# -log(-log(u)) is +inf and a -inf (masked) logit plus it is NaN, which argmax picks.
_BELOW_ONE = 1.0 - 2.0 ** -24


def unit_interval(bits24: torch.Tensor) -> torch.Tensor:
    """24-bit integers [0, 2^24) → fp32 u strictly inside (0, 1): (b + 0.5) / 2^24, the top one
    kept below 1."""
    return (((bits24.to(torch.float32) + 0.5) * (1.0 / (1 << 24)))).clamp_(max=_BELOW_ONE)


@dataclass(frozen=True)
class SampleRow:
    """One sequence to sample a token for, described on the host."""
    params: SamplingParams
    seed_key: int
    sample_index: int
    position: int                       # index of the token being drawn among the outputs
    seen_token_ids: Sequence[int] = ()  # prompt + outputs so far (only read for repetition penalty)
    banned_token_ids: Sequence[int] = ()  # e.g. stop tokens while below min_tokens


@dataclass(frozen=True)
class SamplingTensors:
    """One step's sampling parameters as device tensors, one row per sampled sequence."""
    temperature: torch.Tensor           # [N] fp32, 0 → greedy
    top_k: torch.Tensor                 # [N] int64, 0 → off
    top_p: torch.Tensor                 # [N] fp32
    min_p: torch.Tensor                 # [N] fp32
    repetition_penalty: torch.Tensor    # [N] fp32
    keys: torch.Tensor | None           # [N, 2] int64 hash keys of (seed, seed_key, sample, position);
                                        # rows with temperature 0 hold 0; None when every row is greedy
    seen_token_ids: torch.Tensor | None  # [N, M] int64 (rows padded by repeating an id), or None
    banned_rows: torch.Tensor | None     # [K] int64
    banned_token_ids: torch.Tensor | None  # [K] int64
    sampled_rows: torch.Tensor | None   # [N_s] int64 rows with temperature > 0 (None: all greedy)
    needs_top_k_top_p: bool             # host-side flags, so sampling never waits on the device
    needs_min_p: bool

    @staticmethod
    def build(rows: Sequence[SampleRow], device: torch.device) -> "SamplingTensors":
        return SamplingTensors.from_columns(
            [row.params for row in rows],
            [identity_key(row.params, row.seed_key, row.sample_index) for row in rows],
            [row.position for row in rows],
            seen_token_ids=[row.seen_token_ids for row in rows],
            banned=[(i, t) for i, row in enumerate(rows) for t in row.banned_token_ids], device=device)

    @staticmethod
    def from_columns(params: Sequence[SamplingParams], identity_keys: Sequence[tuple[int, int]],
                     positions: Sequence[int], *, seen_token_ids: Sequence[Sequence[int]] | None,
                     banned: Sequence[tuple[int, int]], device: torch.device) -> "SamplingTensors":
        """The engine's hot path: one entry per row in plain lists, a handful of tensor builds.
        `identity_keys[i]` = `identity_key(params[i], seed_key, sample_index)`; `seen_token_ids`
        is only read when some row has a repetition penalty; `banned` holds (row, token id)."""
        n = len(params)
        # Rows mostly share a few SamplingParams objects: one table row per distinct object.
        distinct: dict[int, int] = {}
        which = [distinct.setdefault(id(p), len(distinct)) for p in params]
        table_params = list({id(p): p for p in params}.values())  # in first-seen order, as `distinct`
        table = torch.tensor([(p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.top_k)
                              for p in table_params], dtype=torch.float64)               # [U, 5]
        columns = upload(table[torch.tensor(which, dtype=torch.int64)], device)        # [N, 5]
        floats = columns[:, :4].to(torch.float32)

        sampled = [i for i, p in enumerate(params) if p.temperature > 0]
        keys = None
        if sampled:  # greedy rows draw no noise: their keys are never needed
            words, sampled_rows = upload_packed(
                [torch.tensor([identity_keys[i][0] for i in sampled] + [identity_keys[i][1] for i in sampled]
                              + [positions[i] for i in sampled], dtype=torch.int64),
                 torch.tensor(sampled, dtype=torch.int64)], device)
            words = words.view(3, -1)
            keys = torch.zeros(n, 2, dtype=torch.int64, device=device)
            keys[sampled_rows] = finish_row_keys(words[:2].T, words[2])   # [N, 2]; greedy rows 0

        seen = None
        if any(p.repetition_penalty != 1.0 for p in table_params):
            width = max(1, max(len(ids) for ids in seen_token_ids))
            padded = [list(ids) + [ids[0] if ids else 0] * (width - len(ids)) for ids in seen_token_ids]
            seen = upload(torch.tensor(padded, dtype=torch.int64), device)
        banned_rows = banned_ids = None
        if banned:
            pairs = upload(torch.tensor(banned, dtype=torch.int64), device)
            banned_rows, banned_ids = pairs[:, 0], pairs[:, 1]
        sampled_params = [p for p in table_params if p.temperature > 0]
        return SamplingTensors(
            temperature=floats[:, 0], top_k=columns[:, 4].to(torch.int64), top_p=floats[:, 1], min_p=floats[:, 2],
            repetition_penalty=floats[:, 3],
            keys=keys, seen_token_ids=seen, banned_rows=banned_rows, banned_token_ids=banned_ids,
            sampled_rows=sampled_rows if sampled else None,
            needs_top_k_top_p=any(p.top_k > 0 or p.top_p < 1 for p in sampled_params),
            needs_min_p=any(p.min_p > 0 for p in sampled_params))


def _apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> None:
    """Seen tokens: positive logits divided by the penalty, negative ones multiplied (in place)."""
    picked = logits.gather(1, seen)                            # [N, M]
    factor = penalty[:, None]
    logits.scatter_(1, seen, torch.where(picked > 0, picked / factor, picked * factor))


def _filter_top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """-inf below each row's threshold; ties at the threshold are all kept (deterministic)."""
    ordered, _ = scaled.sort(dim=1, descending=True)           # [N, V]
    vocab = scaled.shape[1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    kth = ordered.gather(1, (k - 1)[:, None])                   # [N, 1]
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    probs = ordered.softmax(dim=1)
    mass_before = probs.cumsum(dim=1) - probs                   # exclusive cumulative mass
    kept = (mass_before < top_p[:, None]).sum(dim=1).clamp(min=1)  # the top token always stays
    threshold = torch.maximum(kth, ordered.gather(1, (kept - 1)[:, None]))
    return scaled.masked_fill(scaled < threshold, float("-inf"))


def _filter_min_p(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens with p < min_p · p_max, i.e. logit < max + log(min_p)."""
    top = scaled.max(dim=1, keepdim=True).values
    floor = top + torch.log(min_p.clamp(min=1e-30))[:, None]
    return scaled.masked_fill((scaled < floor) & (min_p[:, None] > 0), float("-inf"))


def fused_sampler_enabled() -> bool:
    """Gumbel-max through the one-pass Triton kernel on CUDA (kernels/sampling), unless
    BATCHINFER_FUSED_SAMPLER=0 (the same tokens as the torch path; speed: docs/BENCHMARKS.md)."""
    return os.environ.get("BATCHINFER_FUSED_SAMPLER", "1").strip() != "0"


def fused_logprobs_enabled() -> bool:
    """`sampling.logprobs` through the one-pass Triton kernel on CUDA (kernels/sampling/logprobs.py),
    unless BATCHINFER_FUSED_LOGPROBS=0 (the same values as the torch path; speed: docs/BENCHMARKS.md)."""
    return os.environ.get("BATCHINFER_FUSED_LOGPROBS", "1").strip() != "0"


# The kernel runs one program per row: below this many rows most SMs idle and the torch ops are
# faster (H200, 248k vocabulary: 0.36 vs 0.19 ms at 16 rows, 0.36 vs 0.45 at 64, 0.42 vs 1.32 at 256).
FUSED_LOGPROBS_MIN_ROWS = 64


def _gumbel_argmax(scaled: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    if scaled.is_cuda and fused_sampler_enabled():
        from batchinfer.kernels.sampling import gumbel_argmax
        return gumbel_argmax(scaled.contiguous(), keys)
    return gumbel_argmax_torch(scaled, keys)


def gumbel_argmax_torch(scaled: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The Gumbel-max draw as torch ops (the fused kernel's reference): scaled [N, V], keys [N, 2] → [N]."""
    rows = max(1, _NOISE_ELEMENTS_PER_CHUNK // scaled.shape[1])
    picks = []
    for start in range(0, scaled.shape[0], rows):
        chunk = scaled[start:start + rows]
        u = uniform_noise(keys[start:start + rows], scaled.shape[1])
        picks.append((chunk - torch.log(-torch.log(u))).argmax(dim=1))
    return torch.cat(picks)


def sample(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """Draw one token per row: logits [N, V] → token ids [N] int64 (on the logits' device)."""
    logits = logits.float()
    if params.seen_token_ids is not None or params.banned_rows is not None:
        logits = logits.clone()  # edited in place below; the caller's logits stay as they were
    if params.seen_token_ids is not None:
        _apply_repetition_penalty(logits, params.seen_token_ids, params.repetition_penalty)
    if params.banned_rows is not None:
        logits[params.banned_rows, params.banned_token_ids] = float("-inf")

    tokens = logits.argmax(dim=1)                               # greedy rows keep these
    sampled = params.sampled_rows
    if sampled is None:
        return tokens
    scaled = logits[sampled] / params.temperature[sampled, None]
    if params.needs_top_k_top_p:
        scaled = _filter_top_k_top_p(scaled, params.top_k[sampled], params.top_p[sampled])
    if params.needs_min_p:
        scaled = _filter_min_p(scaled, params.min_p[sampled])
    tokens[sampled] = _gumbel_argmax(scaled, params.keys[sampled])
    return tokens


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor, k: int) -> torch.Tensor:
    """The raw distribution's logprobs for `rows` (the rows that ask), packed for one download:
    logits [N, V], drawn tokens [N], rows [R] → [R, 1 + 2k] fp32: the drawn token's logprob,
    the top-k logprobs, then the top-k ids as int32 bit patterns (exact for any vocabulary)."""
    # logit - logsumexp instead of a materialised log_softmax: two reads of the [R, V] logits
    # (logsumexp, top-k) and no [R, V] write; no row gather when every row asks.
    if (logits.is_cuda and rows.numel() >= FUSED_LOGPROBS_MIN_ROWS and fused_logprobs_enabled()
            and logits.dtype == torch.float32 and logits.stride(1) == 1):
        from batchinfer.kernels.sampling import row_logprobs
        return row_logprobs(logits, tokens, rows, k)  # one pass per row (kernels/sampling)
    return token_logprobs_torch(logits, tokens, rows, k)


def token_logprobs_torch(logits: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor, k: int) -> torch.Tensor:
    """`token_logprobs` as torch ops (the fused kernel's reference)."""
    every_row = rows.numel() == logits.shape[0]  # rows are distinct and sorted: then 0..N-1
    picked = logits if every_row else logits[rows]                  # [R, V]
    picked_tokens = tokens if every_row else tokens[rows]
    lse = torch.logsumexp(picked.float(), dim=1, keepdim=True)     # [R, 1]
    chosen = picked.gather(1, picked_tokens[:, None]).float() - lse  # [R, 1]
    if k == 0:
        return chosen
    top = picked.topk(k, dim=1)
    return torch.cat([chosen, top.values.float() - lse, top.indices.to(torch.int32).view(torch.float32)], dim=1)


def unpack_logprobs(packed: torch.Tensor, ks: Sequence[int]) -> list[TokenLogprob]:
    """`token_logprobs`' rows on the host ([R, 1 + 2k] CPU) → one TokenLogprob per row, each
    keeping its own k (≤ the packed k)."""
    k = (packed.shape[1] - 1) // 2
    values = packed[:, :1 + k].tolist()
    ids = packed[:, 1 + k:].contiguous().view(torch.int32).tolist()
    return [TokenLogprob(v[0], tuple(i[:kk]), tuple(v[1:1 + kk])) for v, i, kk in zip(values, ids, ks)]


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor | None, bitmask: torch.Tensor) -> None:
    """Disallowed tokens → -inf in place: logits [N, V] fp32, rows [R] (None: every row, R = N),
    bitmask [R, W] int32 on the logits' device, bit t % 32 of word t // 32 set where token t is
    allowed (llguidance's layout)."""
    vocab = logits.shape[1]
    # Unpacked a byte at a time (little-endian words: byte j of word w holds tokens 32w + 8j ...),
    # so the temporaries are one byte per token, not four.
    packed = bitmask.contiguous().view(torch.uint8)                                  # [R, 4W]
    shifts = torch.arange(8, device=bitmask.device, dtype=torch.uint8)
    disallowed = ((packed[:, :, None] >> shifts) & 1).view(packed.shape[0], -1)[:, :vocab] == 0  # [R, V]
    if rows is None:  # a grammar job: every row, no gather / scatter
        logits.masked_fill_(disallowed, float("-inf"))
    else:
        logits[rows] = logits[rows].masked_fill(disallowed, float("-inf"))
