"""Triton kernels: per-token-group activation quantization and the block-scaled FP8 GEMM.

The GEMM runs e4m3 × e4m3 tensor-core dots (`tl.dot` on float8e4nv, fp32 accumulation) over
K in steps of 128, so each step sees one activation scale per row and one weight scale per
128-column block of the output: acc += dot(a, b) · a_scale[m] · b_scale[n // 128].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from batchinfer.kernels.fp8_gemm.reference import AMAX_FLOOR, FP8_DTYPE, FP8_MAX, GROUP

_FP8_MAX = tl.constexpr(FP8_MAX)
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)


@dataclass(frozen=True)
class Fp8GemmLaunch:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    group_m: int = 8


def default_launch(M: int, N: int, K: int) -> Fp8GemmLaunch:
    """Tile choice by batch rows: small M (decode) wants narrow row tiles and deep pipelines."""
    if M <= 64:
        return Fp8GemmLaunch(block_m=64, block_n=64, num_warps=4, num_stages=4)
    if M <= 512:
        return Fp8GemmLaunch(block_m=64, block_n=128, num_warps=4, num_stages=4)
    return Fp8GemmLaunch(block_m=128, block_n=128, num_warps=8, num_stages=3)


@triton.jit
def _round_to_e4m3(q):
    """Round fp32 |q| <= 448 to the nearest e4m3 value (ties to even), still in fp32.

    The hardware cast does this itself; doing it first makes the cast exact, so the CPU
    interpreter (whose fp32→fp8 cast mishandles the carry into the next binade) agrees bit
    for bit with torch's cast."""
    exponent = ((q.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    ulp_exp = tl.maximum(exponent, -6) - 3  # 3 mantissa bits; below 2^-6 the subnormal step 2^-9
    ulp = ((ulp_exp + 127) << 23).to(tl.float32, bitcast=True)
    inv_ulp = ((127 - ulp_exp) << 23).to(tl.float32, bitcast=True)
    steps = q * inv_ulp  # exact: a power-of-two scaling, |steps| <= 16
    rounded = (steps + 12582912.0) - 12582912.0  # 1.5·2^23: fp32 addition rounds to an integer, ties to even
    return rounded * ulp


@triton.jit
def _quant_act_kernel(x_ptr, q_ptr, s_ptr, K, G, stride_xm, stride_qm, stride_sm, stride_sg,
                      BLOCK_G: tl.constexpr, GROUP_SIZE: tl.constexpr):
    row = tl.program_id(0)
    groups = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)  # [BLOCK_G]
    cols = groups[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]  # [BLOCK_G, GROUP]
    mask = cols < K
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), _AMAX_FLOOR)  # [BLOCK_G]
    scale = tl.math.div_rn(amax, _FP8_MAX)
    q = tl.math.div_rn(x, scale[:, None])
    q = tl.minimum(tl.maximum(q, -_FP8_MAX), _FP8_MAX)
    tl.store(q_ptr + row * stride_qm + cols, _round_to_e4m3(q).to(tl.float8e4nv), mask=mask)
    tl.store(s_ptr + row * stride_sm + groups * stride_sg, scale, mask=groups < G)


def quantize_act(x: torch.Tensor, block_g: int = 8, rows: int | None = None,
                 scales_transposed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit column stride) → (e4m3 [R, K], fp32 scales [R, ceil(K/128)]), R = `rows`
    (default M; rows past M are zeros with scale 1: the padding cuBLAS's layout asks for).
    `scales_transposed`: the scales are the [R, G] view of a contiguous [G, R] buffer."""
    assert x.dim() == 2 and x.stride(1) == 1, "quantize_act wants a [M, K] matrix with unit column stride"
    M, K = x.shape
    R = M if rows is None else rows
    assert R >= M
    G = triton.cdiv(K, GROUP)
    q = torch.empty((R, K), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((G, R), dtype=torch.float32, device=x.device).t() if scales_transposed else \
        torch.empty((R, G), dtype=torch.float32, device=x.device)
    if R > M:
        q[M:].zero_()
        s[M:].fill_(1.0)
    if M:
        _quant_act_kernel[(M, triton.cdiv(G, block_g))](
            x, q, s, K, G, x.stride(0), q.stride(0), s.stride(0), s.stride(1),
            BLOCK_G=block_g, GROUP_SIZE=GROUP, num_warps=4)
    return q, s


@triton.jit
def _fp8_gemm_kernel(a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, M, N, K,
                     stride_am, stride_bn, stride_cm, stride_asm, stride_bsn,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, SCALE_BLOCK_N: tl.constexpr, K_TILES: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped order: GROUP_M row tiles walk the same weight columns while they sit in L2.
    width = GROUP_M * num_pid_n
    first_m = (pid // width) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_rows
    pid_n = (pid % width) // group_rows

    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M  # wrapped rows: loads need no row mask
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]  # [BM, BK]
    b_ptrs = b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None]  # [BK, BN] view of the [N, K] weight
    as_ptrs = as_ptr + offs_m * stride_asm
    bs_ptrs = bs_ptr + (offs_n // SCALE_BLOCK_N) * stride_bsn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, K_TILES):  # constexpr trip count: the interpreter cannot loop to a runtime int
        k_left = K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        a_s = tl.load(as_ptrs + kb)  # [BM]
        b_s = tl.load(bs_ptrs + kb)  # [BN]
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + rows[:, None] * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def fp8_block_matmul(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                     out_dtype: torch.dtype = torch.bfloat16, launch: Fp8GemmLaunch | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Quantized activations (e4m3 [M, K], scales [M, ceil(K/128)]) · weight (e4m3 [N, K],
    scale_inv [ceil(N/128), ceil(K/128)])ᵀ → [M, N] in out_dtype (into `out` [M, N], unit
    column stride, when given)."""
    M, K = xq.shape
    N = weight.shape[0]
    assert weight.shape[1] == K and xq.stride(1) == 1 and weight.stride(1) == 1
    assert scale_inv.shape == (triton.cdiv(N, GROUP), triton.cdiv(K, GROUP)), "scale_inv must be one per 128x128 block"
    if out is None:
        out = torch.empty((M, N), dtype=out_dtype, device=xq.device)
    assert out.shape == (M, N) and out.stride(1) == 1
    if M == 0:
        return out
    launch = launch or default_launch(M, N, K)
    assert GROUP % launch.block_n == 0 or launch.block_n % GROUP == 0
    grid = (triton.cdiv(M, launch.block_m) * triton.cdiv(N, launch.block_n),)
    _fp8_gemm_kernel[grid](
        xq, weight, out, x_scale, scale_inv, M, N, K,
        xq.stride(0), weight.stride(0), out.stride(0), x_scale.stride(0), scale_inv.stride(0),
        BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, BLOCK_K=GROUP, GROUP_M=launch.group_m,
        SCALE_BLOCK_N=GROUP, K_TILES=triton.cdiv(K, GROUP), num_warps=launch.num_warps, num_stages=launch.num_stages)
    return out


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
             out_dtype: torch.dtype | None = None, launch: Fp8GemmLaunch | None = None) -> torch.Tensor:
    """x [M, K] · dequant(weight, scale_inv)ᵀ with x quantized per token group on the fly."""
    xq, xs = quantize_act(x)
    return fp8_block_matmul(xq, xs, weight, scale_inv, out_dtype or x.dtype, launch)


@triton.jit
def _dequant_kernel(q_ptr, s_ptr, out_ptr, N, K, Gn, Gk, BLOCK: tl.constexpr, TO_BF16: tl.constexpr):
    """One 128 × 128 block of one [N, K] matrix of a stack per program: fp8 · scale in fp32,
    rounded once to the output dtype (as the reference's `(q.float() · s).to(dtype)`)."""
    block_k, block_n, matrix = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = block_n * BLOCK + tl.arange(0, BLOCK)
    cols = block_k * BLOCK + tl.arange(0, BLOCK)
    mask = (rows[:, None] < N) & (cols[None, :] < K)
    offsets = matrix.to(tl.int64) * N * K + rows[:, None] * K + cols[None, :]
    scale = tl.load(s_ptr + (matrix * Gn + block_n) * Gk + block_k)
    q = tl.load(q_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    value = q * scale
    if TO_BF16:  # round to nearest even on the bits: the interpreter's own cast truncates
        bits = value.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 == 0xFFFF0000
        value = bits.to(tl.float32, bitcast=True)  # exactly a bf16 value now
    tl.store(out_ptr + offsets, value.to(out_ptr.dtype.element_ty), mask=mask)


def block_dequantize(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Contiguous e4m3 [..., N, K] with fp32 block scales [..., ceil(N/128), ceil(K/128)] → dtype."""
    assert q.is_contiguous() and scale_inv.is_contiguous()
    N, K = q.shape[-2:]
    Gn, Gk = triton.cdiv(N, GROUP), triton.cdiv(K, GROUP)
    assert scale_inv.shape[-2:] == (Gn, Gk) and dtype in (torch.bfloat16, torch.float32)
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    matrices = q.numel() // max(N * K, 1)
    if q.numel():
        _dequant_kernel[(Gk, Gn, matrices)](q, scale_inv, out, N, K, Gn, Gk, BLOCK=GROUP,
                                            TO_BF16=dtype == torch.bfloat16, num_warps=4)
    return out
