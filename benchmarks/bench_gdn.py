"""GDN kernel benchmark on CUDA: our Triton prefill / decode / conv1d vs fla-core, same inputs.

    python -m benchmarks.bench_gdn            # full table (< 3 minutes on an H200)
    python -m benchmarks.bench_gdn --quick    # one shape per kernel

Every row is correctness-checked before it is timed: ours vs the fp32 reference (kernels/ref) on
the same bf16-rounded inputs, and ours vs fla where fla runs. Times are medians of
triton.testing.do_bench (with warm-up). Shapes: Qwen3.5-27B's GDN (16 key / 48 value heads × 128).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

H_K, H_V, D_K, D_V, CONV_K = 16, 48, 128, 128, 4
D_CONV = 2 * H_K * D_K + H_V * D_V
PEAK_BYTES_PER_S = 4.28e12  # H200 device-to-device copy bandwidth
PREFILL_SHAPES = [(1, 32768), (8, 2048), (64, 512)]  # (sequences, tokens per sequence)
DECODE_BATCHES = [1, 32, 128, 256, 512]


@dataclass(frozen=True)
class Row:
    kernel: str
    shape: str
    ours_ms: float
    fla_ms: float | None
    rate: str  # tokens/s or GB/s
    pct_peak: str
    check: str


def _bench(fn, quick: bool) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10 if quick else 25, rep=40 if quick else 100, return_mode="median")


def _rel_err(got, expect) -> float:
    return ((got.float() - expect.float()).norm() / expect.float().norm().clamp_min(1e-30)).item()


def _load_fla():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception:  # noqa: BLE001 - any import failure means "no fla to compare with"
        print("fla missing: timing ours only")
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def _gdn_inputs(T: int, gen: torch.Generator):
    dev, bf16 = "cuda", torch.bfloat16
    rnd = lambda *s: torch.randn(*s, generator=gen, device=dev).to(bf16)  # noqa: E731
    return dict(
        q=rnd(T, H_K, D_K), k=rnd(T, H_K, D_K), v=rnd(T, H_V, D_V), a=rnd(T, H_V), b=rnd(T, H_V),
        A_log=torch.empty(H_V, device=dev).uniform_(0.0, 2.5, generator=gen).log(),
        dt_bias=torch.randn(H_V, generator=gen, device=dev),
    )


def _fla_runner(fla_fn, x, state0, batch_shape, cu=None):
    """A closure running fla on our inputs reshaped to `batch_shape` ([1, T] packed prefill, or
    [B, 1] decode); value heads grouped natively if this fla supports it, else q/k expanded."""
    from kernels.ref.gdn import gdn_gates

    g, beta = gdn_gates(x["a"], x["b"], x["A_log"], x["dt_bias"])
    shaped = lambda t: t.reshape(*batch_shape, *t.shape[1:])  # noqa: E731
    q, k, v = shaped(x["q"]), shaped(x["k"]), shaped(x["v"])
    kwargs = dict(g=shaped(g), beta=shaped(beta).to(v.dtype), initial_state=state0, output_final_state=True,
                  use_qk_l2norm_in_kernel=True)
    if cu is not None:
        kwargs["cu_seqlens"] = cu
    try:
        fla_fn(q=q, k=k, v=v, **kwargs)
    except Exception:  # noqa: BLE001 - older fla: one key head per value head
        group = H_V // H_K
        q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    return lambda: fla_fn(q=q, k=k, v=v, **kwargs)


def _compare_fla(make_runner, ours_out, quick: bool):
    """(fla ms, check text); fla failing is reported in the check column, not fatal."""
    try:
        run = make_runner()
        fla_out, _ = run()
        err = _rel_err(ours_out, fla_out.reshape(ours_out.shape))
        return _bench(run, quick), f" fla {err:.1e}"
    except Exception as exc:  # noqa: BLE001
        return None, f" fla error: {type(exc).__name__}"


def bench_prefill(num_seqs: int, seq_len: int, fla, quick: bool) -> Row:
    from kernels import gdn_prefill as ours
    from kernels.ref import gdn as ref

    gen = torch.Generator(device="cuda").manual_seed(0)
    T = num_seqs * seq_len
    x = _gdn_inputs(T, gen)
    cu = torch.arange(0, T + 1, seq_len, device="cuda", dtype=torch.int32)
    slots = torch.randperm(num_seqs, device="cuda", generator=gen)
    state0 = torch.randn(num_seqs, H_V, D_K, D_V, device="cuda", generator=gen) * 0.1

    state = state0.clone()
    out = ours.gdn_prefill(**x, state=state, slots=slots, cu_seqlens=cu)
    ref_state = state0.clone()
    expect = ref.gdn_prefill(**{n: t.float() for n, t in x.items()}, state=ref_state, slots=slots, cu_seqlens=cu)
    check = f"ref {_rel_err(out, expect):.1e}/{_rel_err(state, ref_state):.1e}"
    ours_ms = _bench(lambda: ours.gdn_prefill(**x, state=state, slots=slots, cu_seqlens=cu), quick)

    fla_ms = None
    if fla is not None:
        runner = lambda: _fla_runner(fla[0], x, state0[slots].clone(), (1, T), cu.long())  # noqa: E731
        fla_ms, fla_check = _compare_fla(runner, out, quick)
        check += fla_check
    return Row("gdn_prefill", f"{num_seqs}x{seq_len}", ours_ms, fla_ms, f"{T / ours_ms / 1e3:.2f} Mtok/s", "", check)


def bench_decode(batch: int, fla, quick: bool) -> Row:
    from kernels import gdn_decode as ours
    from kernels.ref import gdn as ref

    gen = torch.Generator(device="cuda").manual_seed(1)
    x = _gdn_inputs(batch, gen)
    pool = torch.randn(batch + 7, H_V, D_K, D_V, device="cuda", generator=gen) * 0.1
    slots = torch.randperm(batch + 7, device="cuda", generator=gen)[:batch]
    ref_pool, fla_initial = pool.clone(), pool[slots].clone()  # before our runs move the pool
    out = ours.gdn_decode(**x, state=pool, slots=slots)
    expect = ref.gdn_decode(**{n: t.float() for n, t in x.items()}, state=ref_pool, slots=slots)
    check = f"ref {_rel_err(out, expect):.1e}/{_rel_err(pool, ref_pool):.1e}"
    ours_ms = _bench(lambda: ours.gdn_decode(**x, state=pool, slots=slots), quick)
    state_bytes = 2 * batch * H_V * D_K * D_V * 4  # fp32 state read + written

    fla_ms = None
    if fla is not None:  # B sequences of one token each, dense initial states
        fla_ms, fla_check = _compare_fla(lambda: _fla_runner(fla[1], x, fla_initial, (batch, 1)), out, quick)
        check += fla_check
    gbps = state_bytes / ours_ms / 1e6
    pct = f"{gbps * 1e9 / PEAK_BYTES_PER_S:.0%}"
    return Row("gdn_decode", f"B={batch}", ours_ms, fla_ms, f"{gbps:.0f} GB/s", pct, check)


def bench_conv(num_tokens: int, decode: bool, quick: bool) -> Row:
    from kernels import conv1d as ours
    from kernels.ref import conv1d as ref

    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(num_tokens, D_CONV, device="cuda", generator=gen).bfloat16()
    weight = torch.randn(D_CONV, CONV_K, device="cuda", generator=gen).bfloat16()
    pool = torch.randn(num_tokens if decode else 8, D_CONV, CONV_K - 1, device="cuda", generator=gen).bfloat16()
    ref_pool = pool.clone()
    if decode:
        slots = torch.randperm(num_tokens, device="cuda", generator=gen)
        run = lambda p: ours.causal_conv1d_decode(x, weight, None, p, slots)  # noqa: E731
        expect = ref.causal_conv1d_decode(x, weight, None, ref_pool, slots)
        shape = f"B={num_tokens}"
    else:
        slots = torch.randperm(8, device="cuda", generator=gen)
        cu = torch.linspace(0, num_tokens, 9, device="cuda").to(torch.int32)
        run = lambda p: ours.causal_conv1d_prefill(x, weight, None, p, slots, cu)  # noqa: E731
        expect = ref.causal_conv1d_prefill(x, weight, None, ref_pool, slots, cu)
        shape = f"8x{num_tokens // 8}"
    out = run(pool)
    check = f"ref {_rel_err(out, expect):.1e}/{_rel_err(pool, ref_pool):.1e}"
    ms = _bench(lambda: run(pool), quick)
    moved = 2 * x.numel() * 2 + (2 * num_tokens * D_CONV * (CONV_K - 1) * 2 if decode else 0)
    gbps = moved / ms / 1e6
    name = "conv1d_decode" if decode else "conv1d_prefill"
    return Row(name, shape, ms, None, f"{gbps:.0f} GB/s", f"{gbps * 1e9 / PEAK_BYTES_PER_S:.0%}", check)


def print_table(rows: list[Row]) -> None:
    header = (f"{'kernel':<15}{'shape':<11}{'ours ms':>9}{'fla ms':>9}{'speedup':>9}  "
              f"{'rate':<15}{'%peak':>6}  check (rel err)")
    print(header)
    print("-" * len(header))
    for r in rows:
        fla = f"{r.fla_ms:9.3f}" if r.fla_ms is not None else f"{'—':>9}"
        speedup = f"{r.fla_ms / r.ours_ms:8.2f}x" if r.fla_ms is not None else f"{'—':>9}"
        print(f"{r.kernel:<15}{r.shape:<11}{r.ours_ms:9.3f}{fla}{speedup}  {r.rate:<15}{r.pct_peak:>6}  {r.check}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one shape per kernel, shorter timing")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gdn needs CUDA")
        return 0
    fla = _load_fla()
    prefill = PREFILL_SHAPES[1:2] if args.quick else PREFILL_SHAPES
    decode = [128] if args.quick else DECODE_BATCHES
    rows = [_guarded(bench_prefill, n, length, fla, args.quick) for n, length in prefill]
    rows += [_guarded(bench_decode, batch, fla, args.quick) for batch in decode]
    rows += [_guarded(bench_conv, 16384, False, args.quick), _guarded(bench_conv, 256, True, args.quick)]
    print_table([r for r in rows if r is not None])
    return 0


def _guarded(bench_row, *args) -> Row | None:
    """One failing row (e.g. out of memory) is reported and does not sink the table."""
    try:
        return bench_row(*args)
    except Exception as exc:  # noqa: BLE001
        print(f"{bench_row.__name__}{args[:2]}: FAILED {type(exc).__name__}: {exc}", file=sys.stderr)
        return None


if __name__ == "__main__":
    sys.exit(main())
