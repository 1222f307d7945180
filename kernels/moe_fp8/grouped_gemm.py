"""Triton grouped FP8 GEMMs of the routed experts: gate|up with SiLU·mul and re-quantization fused, then down.

Rows are (token, expert) assignments sorted by expert (`SparseMoE`'s layout); a program owns
one row tile of one expert (`tiles.py`) and one slice of the output columns, so it streams only
that expert's weight slice. Operands are e4m3: the tokens quantized once per (token, 128-column
group) and gathered by `token_of` inside the kernel (no [T·k, H] copy), weights with one fp32
scale per 128 × 128 block; each 128-deep K step is an fp8 tensor-core dot accumulated in fp32
with its two scales: acc += dot(a, b) · a_scale[row] · b_scale.

An expert every token takes (the MoE block's shared expert, `shared=`) rides in the same two
launches: its T rows follow the M routed ones (row M + t is token t), its row tiles follow the
table's and need no entries in it, and its programs read its own weights instead of an expert's.

Programs are numbered column block fastest: the programs of one row tile run together, so its
activation rows come from HBM once and from L2 for the other column blocks (the down GEMM has 16
of them at H = 2,048); numbered row tile fastest, every column block re-read all M rows.

The gate|up program owns 128 gate and the matching 128 up columns: its epilogue forms
silu(gate) · up in fp32 and quantizes it per (row, 128-column group), which is exactly one group
of the down GEMM's activations, so the [T·k, 2I] intermediate is never written. Other kernels
take the same tiles and rows: `swapped.py` (this pair with the weights on the dots' M side, for
decode's few rows an expert: the decode default) and `w8a16.py` (16-bit activations, opt-in).
Reference: kernels/ref/moe_fp8.py.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from batchinfer.kernels.fp8_gemm.reference import FP8_DTYPE, GROUP
from batchinfer.kernels.fp8_gemm.triton_fp8 import quantize_act
from batchinfer.kernels.moe_fp8.programs import (down_rows_and_columns, gate_up_columns, program_tile,
                                                  quantize_groups_and_store, tile_tokens)
from batchinfer.kernels.moe_fp8.swapped import down_swapped_kernel, gate_up_swapped_kernel
from batchinfer.kernels.moe_fp8.tiles import ExpertTiles, expert_tiles, tile_capacity
from batchinfer.kernels.moe_fp8.w8a16 import down_w8a16_kernel, fp16_operand, gate_up_w8a16_kernel
from batchinfer.kernels.ref.moe_fp8 import SharedExpert


@dataclass(frozen=True)
class KernelLaunch:
    """One grouped kernel's launch: rows of one expert per program (its row tile), warps, stages."""

    block_m: int
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class MoeFp8Launch:
    """The gate|up and down kernels' launches (each its own row tile), the down GEMM's column tile
    (a multiple or a divisor of 128), the program order, and the activations' precision."""

    gate_up: KernelLaunch
    down: KernelLaunch
    block_n_down: int = 128
    columns_fastest: bool = True  # program order; False (row tile fastest) is kept to measure against
    w8a16: bool = False  # activations unquantized, 16-bit dots on dequantized weight tiles (`w8a16.py`)
    fp16_dots: bool = False  # with w8a16: the dots in fp16 (activations converted), the cheaper dequantization
    swap_ab: bool = False  # W8A8 with the weights on the dots' M side (`swapped.py`): e4m3 wgmma at few rows

    def __post_init__(self):
        assert self.w8a16 or not self.fp16_dots, "fp16_dots is a W8A16 option"
        assert not (self.w8a16 and self.swap_ab), "the W8A16 pair has its weights on the M side already"

    @classmethod
    def same(cls, block_m: int, num_warps: int = 4, num_stages: int = 3, **kwargs) -> "MoeFp8Launch":
        """Both kernels on one launch (one row-tile table)."""
        launch = KernelLaunch(block_m, num_warps, num_stages)
        return cls(launch, launch, **kwargs)


# Rows an expert up to which a step is decode-sized: 16-row tiles up to NARROW, the swapped pair's
# 32-row ones up to DECODE.
NARROW_ROWS_PER_EXPERT = 24
DECODE_ROWS_PER_EXPERT = 32
# Rows an expert above which a step is prefill-wide (the 128-row gate|up tile fills).
WIDE_ROWS_PER_EXPERT = 256
PREFILL_LAUNCH_ENV = "BATCHINFER_MOE_PREFILL_LAUNCH"
DECODE_LAUNCH_ENV = "BATCHINFER_MOE_DECODE_LAUNCH"


def default_launch(num_rows: int, num_experts: int) -> MoeFp8Launch:
    """By rows per expert: decode (a few to tens of rows each) wants small row tiles, so a tile
    is rarely mostly padding; wider batches want wide ones for weight reuse. Measured at 35B-A3B
    shapes (docs/BENCHMARKS.md, "FP8 experts"), with the weights on the dots' M side (`swapped.py`)
    up to DECODE_ROWS_PER_EXPERT: 16-row tiles, 3 stages up to NARROW_ROWS_PER_EXPERT (H200:
    0.98-0.99x the row-major pair at 256 / 384 tokens), 32-row tiles at 32 (H200: 0.91x 64:8:4 at
    1,024 tokens, where 64:8:4 wins again at 48); above, 64 rows, 8 warps, 4 stages (H200: 0.95-0.99x the
    time of 3 stages at 2,048 / 8,192 / 32,768 tokens); from WIDE_ROWS_PER_EXPERT (8,192 tokens)
    gate|up on 128-row tiles over 16 warps, down unchanged (H100: 0.96x / 0.91x at 8,192 / 32,768
    tokens). BATCHINFER_MOE_DECODE_LAUNCH / BATCHINFER_MOE_PREFILL_LAUNCH (`parse_launch`'s text)
    replace the launch of the decode-sized steps / of every step wider; W8A16 only where
    BATCHINFER_MOE_W8A16 asks (2x slower on the H100 at every size)."""
    per_expert = num_rows / max(num_experts, 1)
    if w8a16_requested():
        return MoeFp8Launch.same(block_m=16 if per_expert <= NARROW_ROWS_PER_EXPERT else 64, num_warps=8,
                                 num_stages=3, w8a16=True,
                                 fp16_dots=os.environ["BATCHINFER_MOE_W8A16"].strip() == "fp16")
    decode = per_expert <= DECODE_ROWS_PER_EXPERT
    override = os.environ.get(DECODE_LAUNCH_ENV if decode else PREFILL_LAUNCH_ENV, "").strip()
    if override:
        return parse_launch(override)
    if decode:
        return MoeFp8Launch.same(block_m=16 if per_expert <= NARROW_ROWS_PER_EXPERT else 32, num_warps=4,
                                 num_stages=3, swap_ab=True)
    if per_expert >= WIDE_ROWS_PER_EXPERT:
        return MoeFp8Launch(KernelLaunch(128, 16, 3), KernelLaunch(64, 8, 4))
    return MoeFp8Launch.same(block_m=64, num_warps=8, num_stages=4)


def parse_launch(text: str) -> MoeFp8Launch:
    """`GATE_UP[/DOWN[:BLOCK_N]][+a16|+f16|+swap]`, each `BLOCK_M:WARPS:STAGES`; a trailing `:rows` on
    the gate|up part numbers the programs row tile fastest; `+a16`: the W8A16 kernels, `+f16` with
    their dots in fp16; `+swap`: the W8A8 pair with the weights on the dots' M side. One part: both
    kernels on that launch. E.g. `64:8:4`, `128:16:3/64:8:4`, `16:4:3+swap`."""
    try:
        body, plus, mode = text.strip().partition("+")
        if plus and mode not in ("a16", "f16", "swap"):
            raise ValueError(f"unknown suffix +{mode}")
        up_text, _, down_text = body.partition("/")
        up_fields = up_text.split(":")
        if len(up_fields) not in (3, 4) or up_fields[3:] not in ([], ["rows"]):
            raise ValueError("gate|up wants BLOCK_M:WARPS:STAGES[:rows]")
        down_fields = down_text.split(":") if down_text else up_fields[:3]
        if len(down_fields) not in (3, 4):
            raise ValueError("down wants BLOCK_M:WARPS:STAGES[:BLOCK_N]")
        gate_up = KernelLaunch(*(int(v) for v in up_fields[:3]))
        down = KernelLaunch(*(int(v) for v in down_fields[:3]))
        block_n = int(down_fields[3]) if len(down_fields) > 3 else 128
    except ValueError as error:
        raise ValueError(f"MoE FP8 launch {text!r}: {error}") from None
    return MoeFp8Launch(gate_up, down, block_n_down=block_n, columns_fastest=up_fields[3:] != ["rows"],
                        w8a16=mode in ("a16", "f16"), fp16_dots=mode == "f16", swap_ab=mode == "swap")


def w8a16_requested() -> bool:
    """BATCHINFER_MOE_W8A16=1: the routed experts run the W8A16 kernels (`w8a16.py`), =fp16 with
    their dots in fp16; 0 or unset: W8A8."""
    value = os.environ.get("BATCHINFER_MOE_W8A16", "0").strip()
    if value not in ("0", "1", "fp16"):
        raise ValueError(f"BATCHINFER_MOE_W8A16={value!r}: expected 0, 1 or fp16")
    return value != "0"


# Batch-size arguments are not specialised: one compiled variant serves every step.
@triton.jit(do_not_specialize=["num_tiles", "total_tiles", "num_rows", "num_tokens"])
def _gate_up_kernel(xq_ptr, xs_ptr, token_ptr, w_ptr, ws_ptr, shared_w_ptr, shared_ws_ptr, hq_ptr, hs_ptr,
                    tile_expert_ptr, tile_start_ptr, tile_end_ptr, K, I,
                    stride_xm, stride_xsm, stride_we, stride_wn, stride_wse, stride_wsn,
                    stride_hm, stride_hsm,
                    num_tiles, total_tiles, num_rows, num_tokens, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                    K_TILES: tl.constexpr, N_BLOCKS: tl.constexpr, COLUMNS_FASTEST: tl.constexpr):
    tile, pid_n, start, end, w_base, ws_base = program_tile(
        total_tiles, num_tiles, num_rows, num_tokens, tile_expert_ptr, tile_start_ptr, tile_end_ptr, w_ptr, ws_ptr,
        shared_w_ptr, shared_ws_ptr, stride_we, stride_wse, BLOCK_M, N_BLOCKS, COLUMNS_FASTEST)
    if end <= start:  # an unused tail tile of the table
        return
    rows, row_ok, tokens = tile_tokens(tile, num_tiles, start, end, num_rows, token_ptr, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    cols, gs_ptr, us_ptr = gate_up_columns(pid_n, ws_base, I, stride_wsn, BLOCK_K)
    a_ptrs = xq_ptr + tokens[:, None] * stride_xm + offs_k[None, :]  # [BM, BK]
    g_ptrs = w_base + cols[None, :] * stride_wn + offs_k[:, None]  # [BK, BN] view of the [2I, K] weight
    u_ptrs = g_ptrs + I * stride_wn
    xs_ptrs = xs_ptr + tokens * stride_xsm

    acc_g = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for kb in range(0, K_TILES):  # constexpr trip count: the interpreter cannot loop to a runtime int
        k_ok = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        g = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
        u = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
        a_s = tl.load(xs_ptrs + kb, mask=row_ok, other=0.0)  # [BM]
        acc_g += tl.dot(a, g) * (a_s * tl.load(gs_ptr + kb))[:, None]
        acc_u += tl.dot(a, u) * (a_s * tl.load(us_ptr + kb))[:, None]
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K

    h = acc_g * tl.sigmoid(acc_g) * acc_u  # [BM, 128]: one quantization group of the down GEMM's input
    quantize_groups_and_store(h, rows, row_ok, cols, pid_n, hq_ptr, hs_ptr, stride_hm, stride_hsm)


@triton.jit(do_not_specialize=["num_tiles", "total_tiles", "num_rows", "num_tokens"])
def _down_kernel(hq_ptr, hs_ptr, w_ptr, ws_ptr, shared_w_ptr, shared_ws_ptr, y_ptr,
                 tile_expert_ptr, tile_start_ptr, tile_end_ptr, N, K,
                 stride_hm, stride_hsm, stride_we, stride_wn, stride_wse, stride_wsn, stride_ym,
                 num_tiles, total_tiles, num_rows, num_tokens, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, K_TILES: tl.constexpr, N_BLOCKS: tl.constexpr, COLUMNS_FASTEST: tl.constexpr):
    tile, pid_n, start, end, w_base, ws_base = program_tile(
        total_tiles, num_tiles, num_rows, num_tokens, tile_expert_ptr, tile_start_ptr, tile_end_ptr, w_ptr, ws_ptr,
        shared_w_ptr, shared_ws_ptr, stride_we, stride_wse, BLOCK_M, N_BLOCKS, COLUMNS_FASTEST)
    if end <= start:
        return
    rows, row_ok, cols, col_ok = down_rows_and_columns(start, end, pid_n, N, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = hq_ptr + rows[:, None] * stride_hm + offs_k[None, :]
    w_ptrs = w_base + cols[None, :] * stride_wn + offs_k[:, None]  # [BK, BN]
    hs_ptrs = hs_ptr + rows * stride_hsm
    ws_cols = ws_base + (cols // BLOCK_K) * stride_wsn  # [BN]: wider tiles span several weight blocks
    ws_tile = ws_base + ((pid_n * BLOCK_N) // BLOCK_K) * stride_wsn  # narrower ones sit in one

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, K_TILES):  # K = I, a whole number of 128-column groups
        a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        b = tl.load(w_ptrs, mask=col_ok[None, :], other=0.0)
        a_s = tl.load(hs_ptrs + kb, mask=row_ok, other=0.0)
        if BLOCK_N > BLOCK_K:
            acc += tl.dot(a, b) * a_s[:, None] * tl.load(ws_cols + kb, mask=col_ok, other=0.0)[None, :]
        else:
            acc += tl.dot(a, b) * (a_s * tl.load(ws_tile + kb))[:, None]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def moe_fp8(x: torch.Tensor, token_of: torch.Tensor, ends: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor,
            w2: torch.Tensor, s2: torch.Tensor, launch: MoeFp8Launch | None = None,
            out: torch.Tensor | None = None, tiles: ExpertTiles | None = None,
            down_tiles: ExpertTiles | None = None, shared: SharedExpert | None = None) -> torch.Tensor:
    """x [T, H] (unit column stride); token_of [M] (sorted row → token); ends [E] (cumulative rows
    per expert, int); w13 e4m3 [E, 2I, H], s13 fp32 [E, 2I/128, ceil(H/128)]; w2 e4m3 [E, H, I],
    s2 fp32 [E, ceil(H/128), I/128] → [M, H] in x's dtype (into `out`, unit column stride, when
    given), rows in sorted order; `tiles` / `down_tiles`: the row tiles of `launch.gate_up.block_m`
    / `launch.down.block_m` rows when the caller has them (`ops.moe_align`), else built here.
    With `shared` (an expert of the same shapes that every token takes) → [M + T, H]: row M + t
    is token t's shared expert output, computed in the same two launches. No host sync."""
    T, H = x.shape
    E, two_i, _ = w13.shape
    I = two_i // 2
    M = token_of.shape[0]
    assert I % GROUP == 0, "the fused epilogue quantizes whole 128-column groups of silu(gate)·up"
    assert w13.shape == (E, 2 * I, H) and w2.shape == (E, H, I) and ends.shape == (E,)
    assert s13.shape == (E, 2 * I // GROUP, triton.cdiv(H, GROUP)) and s2.shape == (E, triton.cdiv(H, GROUP), I // GROUP)
    assert w13.stride(2) == 1 and w2.stride(2) == 1 and s13.stride(2) == 1 and s2.stride(2) == 1
    shared_rows = T if shared is not None else 0
    if shared is not None:  # read with the routed experts' strides
        assert shared.w13.shape == w13.shape[1:] and shared.w2.shape == w2.shape[1:]
        assert shared.s13.shape == s13.shape[1:] and shared.s2.shape == s2.shape[1:]
        assert (shared.w13.stride(), shared.w2.stride()) == (w13.stride()[1:], w2.stride()[1:])
        assert (shared.s13.stride(), shared.s2.stride()) == (s13.stride()[1:], s2.stride()[1:])
    y = torch.empty((M + shared_rows, H), dtype=x.dtype, device=x.device) if out is None else out
    assert y.shape == (M + shared_rows, H) and y.stride(1) == 1
    if M + shared_rows == 0:
        return y
    launch = launch or default_launch(M, E)
    assert GROUP % launch.block_n_down == 0 or launch.block_n_down % GROUP == 0
    if tiles is None:
        tiles = expert_tiles(ends, M, launch.gate_up.block_m)
    assert tiles.capacity == tile_capacity(M, E, launch.gate_up.block_m), "tiles of another row-tile size"
    if launch.down.block_m == launch.gate_up.block_m:
        down_tiles = tiles
    elif down_tiles is None:  # the down kernel's own (a dozen small launches, no host sync)
        down_tiles = expert_tiles(ends, M, launch.down.block_m)
    assert down_tiles.capacity == tile_capacity(M, E, launch.down.block_m), "down tiles of another row-tile size"
    token_of = token_of.to(torch.int32)
    shared_w13, shared_s13, shared_w2, shared_s2 = shared if shared is not None else (w13, s13, w2, s2)
    up_tiles = tiles.capacity + triton.cdiv(shared_rows, launch.gate_up.block_m)  # the shared expert's tiles last
    down_tiles_all = down_tiles.capacity + triton.cdiv(shared_rows, launch.down.block_m)
    up_blocks, down_blocks = I // GROUP, triton.cdiv(H, launch.block_n_down)
    up_grid, down_grid = (up_tiles * up_blocks,), (down_tiles_all * down_blocks,)
    up_sizes = dict(BLOCK_M=launch.gate_up.block_m, BLOCK_K=GROUP, K_TILES=triton.cdiv(H, GROUP), N_BLOCKS=up_blocks,
                    COLUMNS_FASTEST=launch.columns_fastest, num_warps=launch.gate_up.num_warps,
                    num_stages=launch.gate_up.num_stages)
    down_sizes = dict(BLOCK_M=launch.down.block_m, BLOCK_N=launch.block_n_down, BLOCK_K=GROUP, K_TILES=I // GROUP,
                      N_BLOCKS=down_blocks, COLUMNS_FASTEST=launch.columns_fastest,
                      num_warps=launch.down.num_warps, num_stages=launch.down.num_stages)
    if launch.w8a16:
        assert x.stride(1) == 1
        if launch.fp16_dots:  # operands loaded as the dots take them: converting in the loop stalls it
            x = fp16_operand(x)
        h = torch.empty((M + shared_rows, I), dtype=x.dtype, device=x.device)  # silu(gate)·up, rounded once
        precision = dict(PRECISION="ieee" if x.dtype == torch.float32 and not launch.fp16_dots else "tf32",
                         FP16_DOTS=launch.fp16_dots)  # tf32: unused by 16-bit dots
        gate_up_w8a16_kernel[up_grid](
            x, token_of, w13, s13, shared_w13, shared_s13, h, tiles.expert, tiles.start, tiles.end, H, I,
            x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), h.stride(0),
            tiles.capacity, up_tiles, M, shared_rows, **up_sizes, **precision)
        down_w8a16_kernel[down_grid](
            h, w2, s2, shared_w2, shared_s2, y, down_tiles.expert, down_tiles.start, down_tiles.end, H, I,
            h.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), y.stride(0),
            down_tiles.capacity, down_tiles_all, M, shared_rows, **down_sizes, **precision)
        return y
    hq = torch.empty((M + shared_rows, I), dtype=FP8_DTYPE, device=x.device)
    hs = torch.empty((M + shared_rows, I // GROUP), dtype=torch.float32, device=x.device)
    gate_up_kernel, down_kernel = ((gate_up_swapped_kernel, down_swapped_kernel) if launch.swap_ab
                                   else (_gate_up_kernel, _down_kernel))
    xq, xs = quantize_act(x)  # T rows, not T·k: quantization is per row, the kernel gathers
    gate_up_kernel[up_grid](
        xq, xs, token_of, w13, s13, shared_w13, shared_s13, hq, hs, tiles.expert, tiles.start, tiles.end, H, I,
        xq.stride(0), xs.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1),
        hq.stride(0), hs.stride(0), tiles.capacity, up_tiles, M, shared_rows, **up_sizes)
    down_kernel[down_grid](
        hq, hs, w2, s2, shared_w2, shared_s2, y, down_tiles.expert, down_tiles.start, down_tiles.end, H, I,
        hq.stride(0), hs.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), y.stride(0),
        down_tiles.capacity, down_tiles_all, M, shared_rows, **down_sizes)
    return y
