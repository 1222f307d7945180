"""Gumbel-max sampling at decode shapes: the engine's torch path against the fused Triton kernel.

    python -m benchmarks.bench_sampling                 # H200: batch 16 / 64 / 256 × vocab 248,320
    TRITON_INTERPRET=1 python -m benchmarks.bench_sampling --quick   # CPU smoke run, small shapes

Per batch: ms of `batchinfer.engine.sampler._gumbel_argmax` (the counter-hash noise as torch
ops) and of `batchinfer.kernels.sampling.gumbel_argmax` (one pass), the fused kernel's GB/s over
the logits it reads, and whether both pick the same tokens. The engine uses the fused kernel
with BATCHINFER_FUSED_SAMPLER=1.
"""
from __future__ import annotations

import argparse
import time

import torch

from batchinfer.engine.sampler import _gumbel_argmax
from batchinfer.kernels.sampling import gumbel_argmax


def time_ms(fn, device: str) -> float:
    if device == "cuda":
        import triton.testing
        return triton.testing.do_bench(fn, warmup=5, rep=40)
    start = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=248320)
    parser.add_argument("--batches", default="16,64,256")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    vocab, batches = (1000, [4]) if args.quick else (args.vocab, [int(b) for b in args.batches.split(",")])
    print(f"{'batch':>6} {'vocab':>8} {'torch ms':>9} {'fused ms':>9} {'speed-up':>9} {'fused GB/s':>11} {'same tokens':>12}")
    for batch in batches:
        g = torch.Generator(device=device).manual_seed(batch)
        scaled = torch.randn(batch, vocab, device=device, generator=g) * 2
        keys = torch.randint(0, 2**32, (batch, 2), device=device, generator=g, dtype=torch.int64)
        same = torch.equal(_gumbel_argmax(scaled, keys), gumbel_argmax(scaled, keys))
        ref_ms = time_ms(lambda: _gumbel_argmax(scaled, keys), device)
        fused_ms = time_ms(lambda: gumbel_argmax(scaled, keys), device)
        print(f"{batch:6d} {vocab:8d} {ref_ms:9.3f} {fused_ms:9.3f} {ref_ms / fused_ms:8.1f}x "
              f"{scaled.numel() * 4 / fused_ms / 1e6:11.0f} {str(same):>12}")


if __name__ == "__main__":
    main()
