"""The decode-step floor: what one decode step of a model must cost on this device, measured.

    python -m benchmarks.decode_floor                                   # qwen3.5-27b, batch 256, ctx 2176
    python -m benchmarks.decode_floor --preset tiny --device cpu --batch 8 --context 64   # CPU smoke run

Floor = the step's GEMMs, each timed alone at its exact shape (`decode_gemms`: every projection
of every layer and the lm_head, [B, K] × [K, N] in the model dtype, through `gemm_fn`: cuBLAS via
torch.matmul by default, an FP8 GEMM when one is passed), plus every other kernel's bytes at the
copy bandwidth measured in the same run (a large device-to-device copy, read + write bytes):

    state  GDN recurrent state read + write per GDN layer (fp32), or ReplaySSM's checkpoint read,
           the live ring entries read (a cycle's mean, (L-1)/2), the new entry written, the key
           dots' scratch, and the flush (checkpoint read + write + L entries) amortised over L steps
    kv     KV read per attention layer, as the attention kernel reads it: each row its whole
           context, except that a block of `SharedPrefixLaunch.rows` rows reads its shared prefix
           once (the shared-prefix stage's S_b, docs/MODULES.md "attention_decode"), plus the
           context's slot indices
    other  the activations every other kernel reads and writes (norms, rotary, conv1d with its
           state, silu_mul, the attention gate, the embedding gather, the sampler's one read of
           the logits), at the bytes the model's kernels move

GEMM timings are medians of `reps` after warm-up (CUDA events, L2 emptied by writing a large
buffer before each rep; on the CPU perf_counter). MoE experts run as one grouped GEMM of the B·top_k routed rows spread
evenly over the experts (random routing touches nearly all of them at B = 256; an FP8 model's as
its grouped FP8 GEMMs, `ops.moe_fp8`, gate_up and down in one call); the router is
timed in fp32 as the model runs it. Not in the floor: kernel launch gaps, the attention's split
partials and merge, and host work — what the step spends beyond the floor is those plus each
kernel's distance from copy bandwidth.
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Callable, Optional, Sequence

import torch

from batchinfer.models.config import ModelConfig

SHARED_PREFIX_BLOCK_ROWS = 8  # kernels/attention/shared_prefix.py: SharedPrefixLaunch().rows (its default)


@dataclass(frozen=True)
class Gemm:
    """One GEMM shape of a decode step: [m, k] × [k, n] (the weight stored [n, k], as F.linear
    takes it), `count` times per step; `groups` > 1: a grouped GEMM (MoE experts), the m rows
    spread evenly over `groups` weights of [n, k]."""
    name: str
    m: int
    k: int
    n: int
    count: int = 1
    groups: int = 1
    fp32: bool = False                  # inputs and weight in fp32 (the MoE router)
    out_fp32: bool = False              # fp32 output from 16-bit inputs (the lm_head)

    @property
    def flops(self) -> int:
        return 2 * self.m * self.k * self.n * self.count  # grouped: each row meets one group's weight

    @property
    def weight_elements(self) -> int:
        return self.groups * self.k * self.n * self.count


def decode_gemms(config: ModelConfig, batch: int) -> list[Gemm]:
    """Every GEMM of one decode step of B = `batch` rows, same shapes merged (count = layers),
    in layer order of first use. Derived from the config, not the parameters, so a test can hold
    it against the model's actual matrix products."""
    c, B = config, batch
    hidden = c.hidden_size
    shapes: dict[tuple, Gemm] = {}

    def add(name: str, k: int, n: int, m: int = B, **kw) -> None:
        key = (name, m, k, n, tuple(sorted(kw.items())))
        g = shapes.get(key)
        shapes[key] = Gemm(name, m, k, n, **kw) if g is None else replace(g, count=g.count + 1)

    for layer in range(c.num_layers):
        if layer in c.gdn_layer_ids:
            add("gdn.in_proj", hidden, c.conv_dim + c.gdn_value_dim + 2 * c.linear_num_value_heads)  # q|k|v, z, b, a
            add("gdn.out_proj", c.gdn_value_dim, hidden)
        else:
            H, H_kv, d = c.num_attention_heads, c.num_kv_heads, c.head_dim
            add("attn.qkv_proj", hidden, 2 * H * d + 2 * H_kv * d)  # q | gate per head, k, v
            add("attn.o_proj", H * d, hidden)
        if c.is_moe_layer(layer):
            E, k, I = c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size
            add("moe.router", hidden, E, fp32=True)
            add("moe.experts_gate_up", hidden, 2 * I, m=B * k, groups=E)
            add("moe.experts_down", I, hidden, m=B * k, groups=E)
            add("moe.shared_gate_up", hidden, 2 * c.shared_expert_intermediate_size)
            add("moe.shared_down", c.shared_expert_intermediate_size, hidden)
            add("moe.shared_expert_gate", hidden, 1)
        else:
            add("mlp.gate_up", hidden, 2 * c.intermediate_size)
            add("mlp.down", c.intermediate_size, hidden)
    add("lm_head", hidden, c.vocab_size, out_fp32=True)
    return list(shapes.values())


# ---- non-GEMM bytes ------------------------------------------------------------------------

def attention_kv_positions(contexts: Sequence[int], shared_with_prev: Optional[Sequence[int]],
                           block_rows: int = SHARED_PREFIX_BLOCK_ROWS) -> int:
    """KV positions the decode attention reads per layer: Σ contexts without the hint; with it,
    each block of `block_rows` rows reads its shared length S_b = min(hints of the rows after the
    first, every row's context) once and each row its own [S_b, ctx)."""
    if shared_with_prev is None:
        return sum(contexts)
    total = 0
    for start in range(0, len(contexts), block_rows):
        ctx = contexts[start:start + block_rows]
        hints = shared_with_prev[start + 1:start + block_rows]
        shared = min(min(hints), min(ctx)) if hints else 0
        total += shared + sum(n - shared for n in ctx)
    return total


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def decode_bytes_breakdown(config: ModelConfig, contexts: Sequence[int], *, replay: bool, dtype: torch.dtype,
                           shared_with_prev: Optional[Sequence[int]] = None, ring_len: int = 16,
                           ckpt_dtype: Optional[torch.dtype] = None,
                           block_rows: int = SHARED_PREFIX_BLOCK_ROWS) -> dict[str, float]:
    """Bytes one decode step's non-GEMM kernels move: {"state", "kv", "other"} (and their parts).
    `contexts` [B]: KV positions each row attends over, its new token included. `ckpt_dtype`
    None: the engine's default (bf16 when the model is bf16, else fp32)."""
    c, B, a = config, len(contexts), _size(dtype)
    hidden, n_gdn, n_attn = c.hidden_size, len(c.gdn_layer_ids), len(c.attn_layer_ids)
    H_k, H_v, d_k, d_v = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    state_elems = H_v * d_k * d_v
    if replay:
        cs = _size(ckpt_dtype or (torch.bfloat16 if dtype == torch.bfloat16 else torch.float32))
        entry = H_k * d_k * cs + H_v * d_v * cs + H_v * 4  # ring_k, ring_u, ring_g (fp32)
        L = ring_len
        flush_per_row = (2 * state_elems * cs + L * entry) / L  # checkpoint read + write + L entries, once in L steps
        per_row = (state_elems * cs + (L - 1) / 2 * entry + entry  # checkpoint, live entries, the new one
                   + H_k * L * 2 * 4 * 2                            # key dots' fp32 scratch, written and read
                   + flush_per_row)
    else:
        flush_per_row, per_row = 0.0, 2 * state_elems * 4  # fp32 state read + write
    state = n_gdn * B * per_row

    H, H_kv, d = c.num_attention_heads, c.num_kv_heads, c.head_dim
    kv = n_attn * attention_kv_positions(contexts, shared_with_prev, block_rows) * (2 * H_kv * d * a + 8)

    K = c.linear_conv_kernel_dim
    norms = B * hidden * a * (2 + 4 * (2 * c.num_layers - 1) + 8)  # first rms_norm, add_rms_norms, final (+ gather)
    gdn = n_gdn * B * a * (c.conv_dim * (2 + 2 * (K - 1))            # conv1d: x, state read + write, out
                           + c.conv_dim + 2 * H_v + c.gdn_value_dim  # delta rule: q|k|v, a, b in, o out
                           + 3 * c.gdn_value_dim)                    # gated_rms_norm: o, z in, out
    gdn += n_gdn * c.conv_dim * K * a
    attn = n_attn * B * a * (2 * H * d + 2 * H_kv * d + 2 * H_kv * d  # q, k norm + rope; v made contiguous
                             + 4 * H_kv * d + 2 * H * d               # store_kv; attention q in, o out
                             + 5 * H * d)                             # sigmoid(gate), o * it
    mlp = 0.0
    for layer in range(c.num_layers):
        if c.is_moe_layer(layer):
            E, k, I, I_s = c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.shared_expert_intermediate_size
            mlp += E * hidden * (a + 4) + B * hidden * (a + 4) + 2 * B * E * 4  # router weight and x in fp32, softmax
            mlp += B * k * (2 * hidden * a + 3 * I * a)                           # gather rows; silu_mul
            mlp += B * k * hidden * (a + 4 + 4 + 4 + 4) + B * hidden * 4          # y.float(), * w, index_add
            mlp += B * (3 * I_s * a + 2 * 4 + hidden * (a + 4 + 4 * 3 + 4 + a))   # shared: silu_mul, gate, combine
        else:
            mlp += B * 3 * c.intermediate_size * a  # silu_mul: gate|up in, out
    embed = B * (2 * hidden * a + 8)
    sampler = B * c.vocab_size * 4  # the logits, read at least once
    other = norms + gdn + attn + mlp + embed + sampler
    return dict(state=float(state), state_flush=float(n_gdn * B * flush_per_row),  # the flush: part of state
                kv=float(kv), other=float(other), other_norms=float(norms),
                other_gdn=float(gdn), other_attention=float(attn), other_mlp=float(mlp),
                other_embed=float(embed), other_sampler=float(sampler))


# ---- timing --------------------------------------------------------------------------------

def _timed_ms(fn: Callable[[], object], device: torch.device, reps: int, warmup: int, evict: str = "write") -> float:
    """Median ms of fn() after `warmup` calls; on CUDA by events, with L2 emptied before each by
    writing a large buffer (`evict="read"`: by reading it; `"none"`: left as fn left it)."""
    if device.type != "cuda":
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - start))
        return statistics.median(times)
    flush = torch.ones(256 * 2**20, dtype=torch.uint8, device=device)  # > the H200's 50 MB L2
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        # Weights come from HBM in the step; timed alone they would stay in L2. A write leaves
        # dirty lines that the timed op may have to write back, which a read does not.
        if evict == "write":
            flush.zero_()
        elif evict == "read":
            flush.amax()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: Optional[int] = None, reps: int = 10) -> float:
    """B/s of a device-to-device copy, read + write bytes counted (1 GiB on CUDA, 64 MiB on CPU)."""
    nbytes = nbytes or (2**30 if device.type == "cuda" else 64 * 2**20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    ms = _timed_ms(lambda: dst.copy_(src), device, reps, warmup=3)
    return 2 * nbytes / (ms / 1e3)


GemmBuilder = Callable[[Gemm, torch.dtype, torch.device], Callable[[], object]]


def matmul_gemm(gemm: Gemm, dtype: torch.dtype, device: torch.device) -> Callable[[], object]:
    """The default `gemm_fn`: builds the operands of one `gemm` call (random, `dtype`) and returns
    the op to time — torch.matmul as F.linear runs it (cuBLAS on CUDA), the lm_head's fp32-output
    mm, the MoE experts' grouped mm as the model calls it. An FP8 builder quantizes its weight
    here, outside the timing."""
    from batchinfer.models.layers.mlp import _grouped_mm_supported  # the model's own test of the path

    dt = torch.float32 if gemm.fp32 else dtype
    x = torch.randn(gemm.m, gemm.k, dtype=dt, device=device)  # [m, k]
    if gemm.groups > 1:
        w = torch.randn(gemm.groups, gemm.n, gemm.k, dtype=dt, device=device)  # [E, n, k]
        counts = [gemm.m // gemm.groups + (e < gemm.m % gemm.groups) for e in range(gemm.groups)]
        if _grouped_mm_supported(x):
            offs = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
            return lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs)  # [m, n]
        bounds = [0]
        for n in counts:
            bounds.append(bounds[-1] + n)
        return lambda: [torch.matmul(x[s:e], w[g].t()) for g, (s, e) in enumerate(zip(bounds, bounds[1:])) if e > s]
    w = torch.randn(gemm.n, gemm.k, dtype=dt, device=device)  # [n, k]
    if gemm.out_fp32 and x.is_cuda and dt in (torch.bfloat16, torch.float16):
        return lambda: torch.mm(x, w.t(), out_dtype=torch.float32)  # as HybridModel._logits
    return lambda: torch.matmul(x, w.t())  # [m, n]


def fp8_experts(gemm: Gemm, dtype: torch.dtype, device: torch.device) -> Callable[[], object]:
    """An FP8 model's routed experts as it runs them: `ops.moe_fp8`, the gate_up and down grouped
    FP8 GEMMs in one call (activation quantization, SiLU·mul and its requantization fused), over
    the m rows spread evenly over the experts. Timed under `moe.experts_gate_up` (k = hidden,
    n = 2·intermediate); `moe.experts_down` is inside it and times nothing."""
    from batchinfer.kernels import ops
    from batchinfer.kernels.fp8_gemm import block_quantize

    if gemm.name == "moe.experts_down":
        return lambda: None
    E, hidden, inter = gemm.groups, gemm.k, gemm.n // 2
    x = torch.randn(gemm.m, hidden, dtype=dtype, device=device)  # [m, H]: one token a row
    w13, s13 = block_quantize(torch.randn(E, 2 * inter, hidden, device=device))  # e4m3 [E, 2I, H]
    w2, s2 = block_quantize(torch.randn(E, hidden, inter, device=device))  # e4m3 [E, H, I]
    counts = torch.tensor([gemm.m // E + (e < gemm.m % E) for e in range(E)])
    ends = counts.cumsum(0).to(device)
    token_of = torch.arange(gemm.m, device=device)
    op = lambda: ops.moe_fp8(x, token_of, ends, w13, s13, w2, s2)  # noqa: E731
    return graphed(op) if device.type == "cuda" else op


def fp8_gemm_builder(gemm: Gemm, dtype: torch.dtype, device: torch.device) -> Callable[[], object]:
    """The `gemm_fn` of an FP8 model: each dense projection as the FP8 block GEMM (activation
    quantization included, as the model runs it) over its 128-aligned output rows; the routed
    experts as the model's grouped FP8 GEMMs (`fp8_experts`); what the model keeps in `dtype`
    (lm_head, router, the GDN b|a rows) through `matmul_gemm`."""
    from batchinfer.kernels.fp8_gemm import block_quantize, fp8_gemm

    fp8_rows = gemm.n - gemm.n % 128
    if gemm.groups > 1 and gemm.name in ("moe.experts_gate_up", "moe.experts_down"):
        intermediate = gemm.n // 2 if gemm.name == "moe.experts_gate_up" else gemm.k
        if intermediate % 128 == 0:  # the FP8 experts' block scales (models/layers/fp8_linear.block_aligned)
            return fp8_experts(gemm, dtype, device)
    if gemm.fp32 or gemm.out_fp32 or gemm.groups > 1 or gemm.k % 128 or not fp8_rows:
        return matmul_gemm(gemm, dtype, device)
    x = torch.randn(gemm.m, gemm.k, dtype=dtype, device=device)  # [m, k]
    q, scale_inv = block_quantize(torch.randn(fp8_rows, gemm.k, device=device))  # e4m3 [n', k]
    rest = matmul_gemm(replace(gemm, n=gemm.n % 128), dtype, device) if gemm.n % 128 else None
    op = lambda: (fp8_gemm(x, q, scale_inv), rest() if rest else None)
    return graphed(op) if device.type == "cuda" else op


def graphed(op: Callable[[], object]) -> Callable[[], object]:
    """`op` as one CUDA-graph replay, as decode steps run it: an op of several small kernels
    (the FP8 GEMM's activation quant, then the GEMM) timed eagerly would time its launches."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            op()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op()
    return graph.replay


@dataclass
class FloorMeter:
    """Measures floors on one device; GEMM times and the copy bandwidth are measured once per
    process and reused for every later step of the same shapes."""
    device: torch.device
    gemm_fn: GemmBuilder = matmul_gemm
    reps: int = 20
    warmup: int = 5
    evict: str = "write"                # _timed_ms: how L2 is emptied before each GEMM rep
    _gemm_ms: dict = field(default_factory=dict)
    _bandwidth: Optional[float] = None

    @property
    def bandwidth(self) -> float:
        if self._bandwidth is None:
            self._bandwidth = copy_bandwidth(self.device)
        return self._bandwidth

    def gemm_ms(self, gemm: Gemm, dtype: torch.dtype) -> float:
        """ms of one call of `gemm` (not times its count)."""
        key = (gemm.name, gemm.m, gemm.k, gemm.n, gemm.groups, gemm.fp32, gemm.out_fp32, dtype)
        if key not in self._gemm_ms:
            op = self.gemm_fn(gemm, dtype, self.device)
            self._gemm_ms[key] = _timed_ms(op, self.device, self.reps, self.warmup, self.evict)
            del op
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # the lm_head's operands alone are GBs
        return self._gemm_ms[key]

    def floor(self, model, contexts: Sequence[int], *, replay: bool,
              shared_with_prev: Optional[Sequence[int]] = None, ring_len: int = 16,
              ckpt_dtype: Optional[torch.dtype] = None) -> dict:
        """The floor of one decode step of `model` over rows of these `contexts` (see the module
        docstring): {gemm_ms, state_ms, kv_ms, other_ms, floor_ms, copy_bandwidth, gemms, bytes}."""
        config, dtype = model.config, model.dtype
        gemms = decode_gemms(config, len(contexts))
        per_gemm = {g.name: g.count * self.gemm_ms(g, dtype) for g in gemms}
        nbytes = decode_bytes_breakdown(config, contexts, replay=replay, dtype=dtype,
                                        shared_with_prev=shared_with_prev, ring_len=ring_len, ckpt_dtype=ckpt_dtype)
        bw = self.bandwidth
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the engine sizes its pools from mem_get_info: hand the scratch back
        result = dict(gemm_ms=sum(per_gemm.values()), state_ms=1e3 * nbytes["state"] / bw,
                      kv_ms=1e3 * nbytes["kv"] / bw, other_ms=1e3 * nbytes["other"] / bw)
        result["floor_ms"] = result["gemm_ms"] + result["state_ms"] + result["kv_ms"] + result["other_ms"]
        result.update(copy_bandwidth=bw, batch=len(contexts), context_tokens=sum(contexts),
                      gemm_tflops=sum(g.flops for g in gemms) / (result["gemm_ms"] / 1e3) / 1e12,
                      gemms=per_gemm, bytes=nbytes)
        return result


@lru_cache(maxsize=None)
def shared_meter(device: str, fp8: bool = False) -> FloorMeter:
    """One meter per device (and GEMM path) for a whole benchmark run (its timings reused across arms)."""
    return FloorMeter(torch.device(device), fp8_gemm_builder if fp8 else matmul_gemm)


def decode_floor(model, contexts: Sequence[int], *, replay: bool, shared_with_prev: Optional[Sequence[int]] = None,
                 ring_len: int = 16, ckpt_dtype: Optional[torch.dtype] = None,
                 gemm_fn: GemmBuilder = matmul_gemm, meter: Optional[FloorMeter] = None) -> dict:
    """`FloorMeter(model.device, gemm_fn).floor(...)`, or `meter.floor(...)` to reuse its timings."""
    meter = meter or FloorMeter(model.device, gemm_fn)
    return meter.floor(model, contexts, replay=replay, shared_with_prev=shared_with_prev, ring_len=ring_len,
                       ckpt_dtype=ckpt_dtype)


def grouped_contexts(batch: int, context: int, shared_prefix: int = 0, group_rows: int = 1) -> tuple[list, list]:
    """(contexts, shared_with_prev) of `batch` rows of `context` positions each, consecutive
    groups of `group_rows` rows sharing their first `shared_prefix` positions."""
    hints = [shared_prefix if r % group_rows else 0 for r in range(batch)]
    return [context] * batch, hints


# ---- the engine's decode steps -------------------------------------------------------------

class DecodeRowsLog:
    """Contexts and shared-prefix hints of every decode step a `ModelRunner` ran while recorded
    (`record_decode_rows`). Holds only lists: never the runner, whose pools must be freeable."""

    def __init__(self) -> None:
        self.steps: list[tuple[list[int], Optional[list[int]]]] = []

    def full_batch_rows(self) -> tuple[list[int], Optional[list[int]]]:
        """(contexts, hints) of the step at the largest batch with the median total context."""
        full = max(len(ctx) for ctx, _ in self.steps)
        picked = sorted((s for s in self.steps if len(s[0]) == full), key=lambda s: sum(s[0]))
        return picked[(len(picked) - 1) // 2]


def record_decode_rows(runner) -> DecodeRowsLog:
    """Wrap `runner.decode` to log each step's contexts (position + 1) and shared_with_prev."""
    log, inner = DecodeRowsLog(), runner.decode

    def decode(rows):
        shared = None if rows.shared_with_prev is None else list(rows.shared_with_prev)
        log.steps.append(([p + 1 for p in rows.positions], shared))
        return inner(rows)

    runner.decode = decode
    return log


def floor_columns(meter: FloorMeter, model, log: DecodeRowsLog, step_ms: Optional[float], *, replay: bool,
                  ring_len: int, ckpt_dtype: Optional[torch.dtype]) -> dict:
    """engine_arms' columns: the floor of the run's full-batch step, the step over it, the breakdown."""
    if not log.steps:
        return {}
    contexts, shared = log.full_batch_rows()
    floor = meter.floor(model, contexts, replay=replay, shared_with_prev=shared, ring_len=ring_len,
                        ckpt_dtype=ckpt_dtype)
    return dict(floor_ms=floor["floor_ms"], step_x_floor=(step_ms or float("nan")) / floor["floor_ms"], floor=floor)


def print_floor(floor: dict) -> None:
    print(f"floor at batch {floor['batch']}, {floor['context_tokens'] / floor['batch']:.0f} context per row: "
          f"{floor['floor_ms']:.2f} ms = GEMMs {floor['gemm_ms']:.2f} ({floor['gemm_tflops']:.0f} TFLOP/s) + state "
          f"{floor['state_ms']:.2f} (flush {1e3 * floor['bytes']['state_flush'] / floor['copy_bandwidth']:.2f}) + KV {floor['kv_ms']:.2f} + other {floor['other_ms']:.2f} "
          f"at {floor['copy_bandwidth'] / 1e12:.2f} TB/s copy")
    print("  GEMMs, ms per step: " + ", ".join(f"{name} {ms:.3f}" for name, ms in floor["gemms"].items()))


def step_weights(model) -> list[tuple[str, torch.Tensor]]:
    """The 16-bit matrices one decode step multiplies by, in layer order (the embedding is a
    gather and conv1d's taps are not a GEMM)."""
    weights = [(name, p) for name, p in model.named_parameters()
               if p.dim() == 2 and p.dtype in (torch.bfloat16, torch.float16) and name != "embed"
               and not name.endswith("conv_weight")]
    return sorted(weights, key=lambda item: item[0] == "lm_head")  # registered first, runs last


def step_gemms_in_order_ms(model, batch: int, reps: int = 10) -> float:
    """ms of one step's dense GEMMs on the model's own weights, in layer order, as one CUDA-graph
    replay: no flush between them, each weight streamed from HBM as the step streams it. A check
    on the per-GEMM timings the floor sums (bf16 models; the lm_head with fp32 output)."""
    import torch.nn.functional as F

    weights = step_weights(model)
    inputs = {k: torch.randn(batch, k, dtype=model.dtype, device=model.device) for k in {p.shape[1] for _, p in weights}}

    def step():
        for name, w in weights:
            if name == "lm_head":
                torch.mm(inputs[w.shape[1]], w.t(), out_dtype=torch.float32)
            else:
                F.linear(inputs[w.shape[1]], w)

    return _timed_ms(graphed(step), model.device, reps, warmup=3, evict="none")


def main() -> None:
    from benchmarks.engine_arms import build_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3.5-27b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=2176, help="KV positions per row (rag: 2048 + 128)")
    parser.add_argument("--shared-prefix", type=int, default=0, help="positions each group of rows shares")
    parser.add_argument("--group-rows", type=int, default=32)
    parser.add_argument("--replayssm", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--check-gemms", action="store_true",
                        help="also time the step's GEMMs in layer order as one graph (CUDA, bf16 models)")
    args = parser.parse_args()
    model, _ = build_model(args.preset, args.layers, args.device)
    contexts, hints = grouped_contexts(args.batch, args.context, args.shared_prefix, args.group_rows)
    floor = decode_floor(model, contexts, replay=args.replayssm, shared_with_prev=hints)
    print_floor(floor)
    if args.check_gemms and args.device != "cuda":
        print("--check-gemms: skipped, it replays a CUDA graph")
    elif args.check_gemms:
        in_order = step_gemms_in_order_ms(model, args.batch)
        read = FloorMeter(torch.device(args.device), evict="read")
        read_ms = sum(g.count * read.gemm_ms(g, model.dtype) for g in decode_gemms(model.config, args.batch))
        print(f"the step's GEMMs: in layer order as one graph {in_order:.2f} ms; summed alone, L2 emptied by a write "
              f"{floor['gemm_ms']:.2f} (the floor's), by a read {read_ms:.2f}")


if __name__ == "__main__":
    main()
