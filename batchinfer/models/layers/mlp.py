"""Feed-forward blocks: dense SwiGLU, and top-k MoE with a sigmoid-gated shared expert.

MoE routing follows transformers' Qwen3-Next / Qwen3.5-MoE router exactly: softmax over all
experts in fp32, top-k, optional renormalisation of the k weights. Routed tokens are sorted
by expert and run as one grouped matmul per projection (`torch._grouped_mm`, where the
device and dtype support it), else one matmul per expert.

The combine (routing weights x expert outputs, summed over the k experts, plus the gated
shared expert) is one op, `ops.moe_combine`: fp32 inside, rounded once (in bf16 every weight,
product and each of the k additions would round separately, which measurably raised the
block's error above a dense MLP's; transformers combines in the activation dtype, fp32 parity
is unaffected). On CUDA it is one Triton pass over the expert rows instead of four.

Every `silu(gate) · up` (dense MLP, shared expert, routed experts) is one `ops.silu_mul` over
the fused gate|up projection: fp32 inside, one rounding (exactly torch's result in fp32).

FP8 routed experts (both stacks `Fp8Weight`) run on CUDA as grouped FP8 GEMMs with their block
scales (`ops.moe_fp8`: activations quantized per token group, SiLU·mul fused between the two
GEMMs); on the CPU (and with BATCHINFER_KERNELS=ref) they are dequantized for the grouped GEMM.
An FP8 shared expert of a routed expert's shapes can ride in that kernel's launches as one more
expert every token takes (`shared_in_grouped`, by step size).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from batchinfer.models.config import ModelConfig
from batchinfer.models.layers.fp8_linear import Fp8Weight, block_aligned, dense_weight, linear, projection
from batchinfer.models.layers.params import empty_param
from batchinfer.kernels import ops
from batchinfer.kernels.moe_fp8 import grouped_gemm as moe_fp8_kernels
from batchinfer.kernels.ref.moe_fp8 import SharedExpert
from batchinfer.kernels.public import cuda_capability


def swiglu(x: torch.Tensor, gate_up, down) -> torch.Tensor:
    """down(silu(gate(x)) · up(x)) with gate|up stacked row-wise in `gate_up` [2I, hidden]
    (plain or `Fp8Weight` projections)."""
    return linear(ops.silu_mul(linear(x, gate_up)), down)  # [T, 2I] -> [T, I] -> [T, hidden]


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, device: torch.device | str,
                 fp8: frozenset[str] = frozenset()):
        super().__init__()
        self.gate_up = projection(2 * intermediate, hidden, dtype=dtype, device=device,  # rows: gate | up
                                  fp8="gate_up" in fp8 and block_aligned(intermediate, intermediate))
        self.down = projection(hidden, intermediate, dtype=dtype, device=device, fp8="down" in fp8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, self.gate_up, self.down)  # [T, hidden]


def _grouped_fp8_op(x: torch.Tensor):
    """`ops.moe_fp8`'s Triton kernel where it runs (CUDA with FP8 tensor cores, sm_89+, unless
    BATCHINFER_KERNELS=ref), else None: FP8 experts are then dequantized (the reference path)."""
    if not ops.uses_triton(x) or cuda_capability(x.device) < (8, 9):
        return None
    return ops.implementation("moe_fp8", True)


def _grouped_mm_supported(x: torch.Tensor) -> bool:
    # CUDA's grouped GEMM is bf16-only and needs Hopper (sm90) or newer; the CPU
    # implementation takes any float dtype.
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cpu":
        return True
    return x.is_cuda and x.dtype == torch.bfloat16 and cuda_capability(x.device) >= (9, 0)


# Steps of at most this many tokens run an FP8 shared expert inside the grouped kernel: it saves
# the shared expert's own launches, which weigh at decode, and costs tensor-core rate, which weighs
# in prefill. The whole block on the H100 (benchmarks/bench_moe_fp8.py --shared-in-grouped):
# 0.960 / 0.962 / 0.985x the time at 256 / 1,024 / 8,192 tokens; larger steps not measured.
SHARED_IN_GROUPED_MAX_TOKENS = 8192


def shared_in_grouped(tokens: int) -> bool:
    """Whether a step of `tokens` runs the shared expert in the grouped kernel: steps of at most
    SHARED_IN_GROUPED_MAX_TOKENS, or of at most BATCHINFER_MOE_SHARED_IN_GROUPED tokens where it is
    set (`all`: every step; 0: none)."""
    limit = os.environ.get("BATCHINFER_MOE_SHARED_IN_GROUPED", "").strip().lower()
    if limit == "all":
        return True
    if limit and not limit.isdigit():
        raise ValueError(f"BATCHINFER_MOE_SHARED_IN_GROUPED={limit!r}: expected a token count or 'all'")
    return 0 < tokens <= (int(limit) if limit else SHARED_IN_GROUPED_MAX_TOKENS)


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                 fp8: frozenset[str] = frozenset()):
        super().__init__()
        E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.dtype = dtype
        self.num_experts, self.top_k = E, config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.router = empty_param(E, H, dtype=dtype, device=device)
        # FP8 experts stay FP8 in memory (they are most of an MoE model's bytes): grouped FP8
        # GEMMs on CUDA, dequantized per layer call elsewhere.
        if "experts_gate_up" in fp8 and block_aligned(I, I):
            self.experts_gate_up = Fp8Weight(E, 2 * I, H, device=device)
        else:
            self.experts_gate_up = empty_param(E, 2 * I, H, dtype=dtype, device=device)  # per expert: gate | up
        if "experts_down" in fp8:
            self.experts_down = Fp8Weight(E, H, I, device=device)
        else:
            self.experts_down = empty_param(E, H, I, dtype=dtype, device=device)
        shared = {name.removeprefix("shared_expert.") for name in fp8 if name.startswith("shared_expert.")}
        self.shared_expert = DenseMLP(H, config.shared_expert_intermediate_size, dtype, device, frozenset(shared))
        self.shared_expert_gate = empty_param(1, H, dtype=dtype, device=device)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k expert ids [T, k] and their weights [T, k] (fp32)."""
        # Router logits in fp32: a bf16 rounding that flips a near-tied top-k choice is a
        # discontinuous jump in the output (cheap: E x hidden).
        return ops.moe_route(self._router_logits(x), self.top_k, self.norm_topk_prob)  # softmax, top-k, renorm

    def _router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """[T, E] fp32. On CUDA a half-precision GEMM with fp32 accumulation and output (the products
        of bf16 values are exact in fp32) runs on tensor cores; the fp32 GEMM ran at FMA speed."""
        if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
            return torch.mm(x, self.router.t(), out_dtype=torch.float32)
        return F.linear(x.float(), self.router.float())

    def routed(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum alone [T, hidden] in x.dtype (no shared expert)."""
        rows, slot = self._run_experts(x, experts)
        no_shared = torch.zeros_like(x)
        return ops.moe_combine(rows, slot, weights, no_shared, no_shared.new_zeros(x.shape[0], 1))  # zero rows: any gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        shared = self._shared_in_grouped(x)
        rows, slot = self._run_experts(x, experts, shared)  # [T·k (+ T), hidden] sorted by expert, [T, k]
        shared_gate_logits = F.linear(x, self.shared_expert_gate)  # [T, 1]: the combine takes their sigmoid
        routed_rows, shared_rows = rows[:slot.numel()], rows[slot.numel():]  # views
        shared_out = shared_rows if shared is not None else self.shared_expert(x)  # [T, hidden]
        return ops.moe_combine(routed_rows, slot, weights, shared_out, shared_gate_logits)  # [T, hidden]

    def _run_experts(self, x: torch.Tensor, experts: torch.Tensor,
                     shared: SharedExpert | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Each assignment's expert output, sorted by expert [T·k, hidden], and where token t's
        j-th assignment landed in that order [T, k]; with `shared` (the grouped FP8 kernel only),
        T more rows after them: token t's shared expert output."""
        T, k = experts.shape
        fp8 = self._grouped_fp8(x)
        assert shared is None or fp8 is not None
        # The grouped FP8 GEMM's launch is chosen once, and its row tiles come with the layout (one
        # pass, no host sync); read from the module, so that a launch sweep replaces both.
        launch = moe_fp8_kernels.default_launch(T * k, self.num_experts) if fp8 is not None else None
        layout = (ops.moe_align(experts, self.num_experts, launch.gate_up.block_m, launch.down.block_m)
                  if launch is not None else ops.moe_align(experts, self.num_experts))
        if fp8 is not None:
            gate_up, down = self.experts_gate_up, self.experts_down
            y = fp8(x.contiguous(), layout.token_of, layout.ends, gate_up.weight, gate_up.scale_inv, down.weight,
                    down.scale_inv, launch=launch, tiles=layout.tiles, down_tiles=layout.down_tiles, shared=shared)
        else:
            y = self._expert_rows(x, layout.token_of, layout.ends)
        return y, layout.slot

    def _shared_in_grouped(self, x: torch.Tensor) -> SharedExpert | None:
        """The shared expert as one more expert of the grouped FP8 kernel (its rows after the
        routed ones, no launches of its own) where `shared_in_grouped(T)` says so, the kernel
        runs, and the shared expert is FP8 in a routed expert's shapes; else None."""
        if not shared_in_grouped(x.shape[0]) or self._grouped_fp8(x) is None:
            return None
        gate_up, down = self.shared_expert.gate_up, self.shared_expert.down
        if not (isinstance(gate_up, Fp8Weight) and isinstance(down, Fp8Weight)):
            return None
        if gate_up.shape != self.experts_gate_up.shape[1:] or down.shape != self.experts_down.shape[1:]:
            return None
        return SharedExpert(gate_up.weight, gate_up.scale_inv, down.weight, down.scale_inv)

    def _grouped_fp8(self, x: torch.Tensor):
        """The grouped FP8 kernel for these experts (the tokens gathered inside it), or None where
        it does not run (unquantized experts, or no kernel): they are then dequantized."""
        if not (isinstance(self.experts_gate_up, Fp8Weight) and isinstance(self.experts_down, Fp8Weight)):
            return None
        return _grouped_fp8_op(x)

    def _expert_rows(self, x: torch.Tensor, token_of: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """Expert outputs of the sorted rows [T·k, hidden] by grouped (or per-expert) matmuls in
        the model dtype, FP8 experts dequantized first; expert e owns rows [ends[e-1], ends[e])."""
        x_sorted = x[token_of]  # [T·k, hidden]
        experts_gate_up = dense_weight(self.experts_gate_up, self.dtype)  # [E, 2I, hidden]
        experts_down = dense_weight(self.experts_down, self.dtype)  # [E, hidden, I]
        if _grouped_mm_supported(x):
            gate_up = torch._grouped_mm(x_sorted, experts_gate_up.transpose(1, 2), offs=ends)  # [T·k, 2I]
            # silu_mul's output is contiguous, as the grouped GEMM wants its operand.
            y = torch._grouped_mm(ops.silu_mul(gate_up), experts_down.transpose(1, 2), offs=ends)
        else:
            y = torch.empty_like(x_sorted)
            start = 0
            for expert, end in enumerate(ends.tolist()):
                if end > start:
                    rows = slice(start, end)
                    y[rows] = swiglu(x_sorted[rows], experts_gate_up[expert], experts_down[expert])
                    start = end
        return y
