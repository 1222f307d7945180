"""Sampling at decode shapes: the engine's torch path against the fused Triton kernel.

    python -m benchmarks.bench_sampling                 # H200: batch 16 / 64 / 256 × vocab 248,320
    TRITON_INTERPRET=1 python -m benchmarks.bench_sampling --quick   # CPU smoke run, small shapes

Per batch: ms of `batchinfer.engine.sampler.gumbel_argmax_torch` (the counter-hash noise as torch
ops) and of `batchinfer.kernels.sampling.gumbel_argmax` (one pass), the fused kernel's GB/s over
the logits it reads, and whether both pick the same tokens. The engine uses the fused kernel
with BATCHINFER_FUSED_SAMPLER=1.
"""
from __future__ import annotations

import argparse

import torch

from batchinfer.engine.sampler import gumbel_argmax_torch, token_logprobs_torch
from batchinfer.kernels.sampling import gumbel_argmax, row_logprobs
from benchmarks.bench_utils import time_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=248320)
    parser.add_argument("--batches", default="16,64,256")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    vocab, batches = (1000, [4]) if args.quick else (args.vocab, [int(b) for b in args.batches.split(",")])
    print(f"{'op':>10} {'batch':>6} {'vocab':>8} {'torch ms':>9} {'fused ms':>9} {'speed-up':>9} {'fused GB/s':>11} "
          f"{'same':>6}")
    for batch in batches:
        g = torch.Generator(device=device).manual_seed(batch)
        scaled = torch.randn(batch, vocab, device=device, generator=g) * 2
        keys = torch.randint(0, 2**32, (batch, 2), device=device, generator=g, dtype=torch.int64)
        tokens = torch.randint(0, vocab, (batch,), device=device, generator=g)
        rows = torch.arange(batch, device=device)
        k = 5
        ref_lp, fused_lp = token_logprobs_torch(scaled, tokens, rows, k), row_logprobs(scaled, tokens, rows, k)
        ops = [("gumbel", lambda: gumbel_argmax_torch(scaled, keys), lambda: gumbel_argmax(scaled, keys),
                torch.equal(gumbel_argmax_torch(scaled, keys), gumbel_argmax(scaled, keys))),
               ("logprobs5", lambda: token_logprobs_torch(scaled, tokens, rows, k),
                lambda: row_logprobs(scaled, tokens, rows, k),
                torch.allclose(ref_lp[:, :1 + k], fused_lp[:, :1 + k], atol=1e-4)
                and torch.equal(ref_lp[:, 1 + k:].view(torch.int32), fused_lp[:, 1 + k:].view(torch.int32)))]
        for name, ref, fused, same in ops:
            ref_ms, fused_ms = time_ms(ref, device, warmup=5, rep=40), time_ms(fused, device, warmup=5, rep=40)
            print(f"{name:>10} {batch:6d} {vocab:8d} {ref_ms:9.3f} {fused_ms:9.3f} {ref_ms / fused_ms:8.1f}x "
                  f"{scaled.numel() * 4 / fused_ms / 1e6:11.0f} {str(same):>6}")


if __name__ == "__main__":
    main()
