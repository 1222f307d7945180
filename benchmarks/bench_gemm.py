"""Two questions about the decode step's GEMMs (H200), as CUDA-graph replays at batch 256
(docs/BENCHMARKS.md: "Logits: fp32 from the GEMM, one buffer for all decode graphs", "Not fixed:
the memset before the MLP's gate_up GEMM"):

    python -m benchmarks.bench_gemm

1. Logits: `torch.mm(x, W.t(), out_dtype=torch.float32)` (cuBLAS writes its fp32 accumulators;
   what HybridModel._logits does on CUDA) against `F.linear(x, W).float()` at the qwen3.5-27b
   lm_head shape, with the differences between the two results.
2. The MLP block (gate_up GEMM, SiLU·mul, down GEMM), 16 in a graph, µs per block: ways to call
   the gate_up GEMM (cuBLAS puts a memset before the one it picks for F.linear), with the default
   BLAS library and with cuBLASLt; then the kernels of one replay, the memset included.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from benchmarks.bench_replay_attn import bench_graph

M, HIDDEN, INTERMEDIATE, VOCAB = 256, 5120, 17408, 248320
BLOCKS = 16


def graph_us(fn, per: int = 1) -> float:
    """Median µs of fn() replayed from a CUDA graph (bench_replay_attn.bench_graph), divided by `per`."""
    return 1e3 * bench_graph(fn) / per


def logits_rows() -> None:
    x = torch.randn(M, HIDDEN, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(VOCAB, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
    rounded = F.linear(x, w).float()
    direct = torch.mm(x, w.t(), out_dtype=torch.float32)
    exact = x.float() @ w.float().t()
    print(f"logits [{M} x {HIDDEN}] x [{HIDDEN} x {VOCAB}]: max |out_dtype - bf16-rounded| "
          f"{(direct - rounded).abs().max().item():.4f}, max |out_dtype - fp32 product| "
          f"{(direct - exact).abs().max().item():.2e}")
    print(f"  linear + float   {graph_us(lambda: F.linear(x, w).float()):8.1f} us")
    print(f"  mm out_dtype     {graph_us(lambda: torch.mm(x, w.t(), out_dtype=torch.float32)):8.1f} us")


def mlp_rows() -> None:
    x = torch.randn(M, HIDDEN, device="cuda", dtype=torch.bfloat16)
    w_gu = torch.randn(2 * INTERMEDIATE, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
    w_g, w_u = w_gu[:INTERMEDIATE].contiguous(), w_gu[INTERMEDIATE:].contiguous()
    w_d = torch.randn(HIDDEN, INTERMEDIATE, device="cuda", dtype=torch.bfloat16) * 0.02
    out_gu = torch.empty(M, 2 * INTERMEDIATE, device="cuda", dtype=torch.bfloat16)
    variants = {
        "linear gate_up": lambda y: F.linear(y, w_gu),
        "mm out= gate_up": lambda y: torch.mm(y, w_gu.t(), out=out_gu),
        "two linears (gate, up)": lambda y: (F.linear(y, w_g), F.linear(y, w_u)),
        "matmul gate_up": lambda y: torch.matmul(y, w_gu.t()),
    }

    def chain(gemm):
        def run():
            y = x
            for _ in range(BLOCKS):
                h = gemm(y)
                g, u = h if isinstance(h, tuple) else (h[:, :INTERMEDIATE], h[:, INTERMEDIATE:])
                y = F.linear(F.silu(g) * u, w_d)
        return run

    for library in ("default", "cublaslt"):
        if library == "cublaslt":
            torch.backends.cuda.preferred_blas_library("cublaslt")
        for name, gemm in variants.items():
            print(f"{library:9s} {name:24s} {graph_us(chain(gemm), BLOCKS):8.1f} us per MLP block")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            chain(variants["linear gate_up"])()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=6))
    torch.backends.cuda.preferred_blas_library("default")


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    torch.manual_seed(0)
    logits_rows()
    mlp_rows()


if __name__ == "__main__":
    main()
