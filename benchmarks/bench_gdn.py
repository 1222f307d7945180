"""GDN kernel benchmark on CUDA: our Triton prefill / decode / conv1d vs fla-core, same inputs.

    python -m benchmarks.bench_gdn            # default-launch table, then launch sweeps (< 120 s on an H200)
    python -m benchmarks.bench_gdn --quick    # one shape per kernel
    python -m benchmarks.bench_gdn --no-sweep # default launches only (the table)

Every row is correctness-checked before it is timed: ours vs the fp32 reference (kernels/ref) on
the same bf16-rounded inputs, and ours vs fla where fla runs. Times are medians of
triton.testing.do_bench (with warm-up); the default-launch rows repeat that REPEATS times, ours
and fla taking turns, and report the median. Shapes: Qwen3.5-27B's GDN (16 key / 48 value heads × 128).

Two phases. First every kernel at its DEFAULT launch for every shape, and the table is printed.
Then the sweeps: each kernel's launch knobs (KernelLaunch / ConvLaunch) over a handful of configs;
for prefill each stage alone (wy, state pass, output), so they also show where the time
goes. "tuned ms" is the default replaced by the best of each stage's sweep (prefill: re-timed end
to end). A CUDA error is sticky (every later call fails), so the first one ends all sweeps: the
failing config is named and the table is reprinted with what was measured before it.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, replace

import torch

from benchmarks import bench_utils

H_K, H_V, D_K, D_V, CONV_K = 16, 48, 128, 128, 4
D_CONV = 2 * H_K * D_K + H_V * D_V
PEAK_BYTES_PER_S = 4.28e12  # H200 device-to-device copy bandwidth
PREFILL_SHAPES = [(1, 32768), (8, 2048), (64, 512)]  # (sequences, tokens per sequence)
DECODE_BATCHES = [1, 32, 128, 256, 512]
REPEATS = 5  # rounds of side-by-side timing per row (medians; --quick: one)


@dataclass(frozen=True)
class Row:
    kernel: str
    shape: str
    ours_ms: float
    tuned_ms: float | None
    fla_ms: float | None
    rate: str  # tokens/s or GB/s
    pct_peak: str
    check: str
    # prefill: our time with the step's chunk tables built once, as a model step shares them
    # across its layers (fla caches its chunk indices per cu_seqlens tensor the same way)
    shared_tables_ms: float | None = None


def _bench(fn, quick: bool) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10 if quick else 25, rep=40 if quick else 100, return_mode="median")


SWEEP_DEADLINE_S = 105.0  # sweeps stop once the run is this old, so the whole bench stays < 120 s
_START = time.monotonic()


class StickyCudaError(RuntimeError):
    """A CUDA error (e.g. illegal address) poisons the context: nothing after it can run."""


def _is_sticky_cuda_error(exc: Exception) -> bool:
    text = str(exc)
    return "CUDA error" in text or "illegal" in text or type(exc).__name__ == "AcceleratorError"


def _sweep(title: str, configs, run_with, quick: bool):
    """Times run_with(config) for each config; prints them, marks the best; returns (best, ms)."""
    timings = []
    for cfg in configs:
        if time.monotonic() - _START > SWEEP_DEADLINE_S:
            print(f"  {title}: sweep stopped (time budget)")
            break
        try:
            run_with(cfg)  # compile + warm
            torch.cuda.synchronize()  # a fault surfaces here, attributed to this config
            timings.append((cfg, _bench(lambda: run_with(cfg), quick)))
        except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: skip the config
            if _is_sticky_cuda_error(exc):
                raise StickyCudaError(f"{title} {cfg}: {str(exc).splitlines()[0][:120]}") from exc
            print(f"  {title} {cfg}: FAILED {type(exc).__name__}: {str(exc)[:80]}")
    if not timings:
        return None, None
    best = min(timings, key=lambda t: t[1])
    for cfg, ms in timings:
        print(f"  {title:<12}{ms:9.3f} ms  {cfg}{'   <- best' if cfg == best[0] else ''}")
    return best


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
    from batchinfer.kernels.ref.gdn import gdn_gates

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


def _checked_fla(make_runner, ours_out):
    """(fla runner or None, check text): fla run once and compared with our output; fla failing
    is reported in the check column, not fatal."""
    try:
        run = make_runner()
        fla_out, _ = run()
        return run, f" fla {_rel_err(ours_out, fla_out.reshape(ours_out.shape)):.1e}"
    except Exception as exc:  # noqa: BLE001
        return None, f" fla error: {type(exc).__name__}"


def _bench_side_by_side(runs: dict, quick: bool) -> dict:
    """{name: ms}: the median over REPEATS rounds of each run's do_bench median, the runs taking
    turns within a round. One do_bench per row moved the launch-bound decode rows (B <= 32, tens
    of µs) between fresh machines by more than the differences being measured
    (docs/BENCHMARKS.md, "Benchmark method: warm-up, clocks, full-batch medians")."""
    times = {name: [] for name, run in runs.items() if run is not None}
    for _ in range(1 if quick else REPEATS):
        for name in times:
            times[name].append(_bench(runs[name], quick))
    return {name: statistics.median(t) for name, t in times.items()}


def _prefill_sweeps(quick: bool, big: bool):
    """Launch configs per prefill stage (fewer for the biggest shape: compile time dominates).

    State pass: StatePassLaunch(block_v, warps, stages, key_parts=), most promising first (sm_90a
    registers per thread from benchmarks/sm90_compile.py in the comments). For 1 sequence each
    program walks the whole chain of chunks (1–2 programs per SM), so the big shape keeps the
    narrow blocks.
    """
    from batchinfer.kernels.gdn_prefill import KernelLaunch as L
    from batchinfer.kernels.gdn_prefill import StatePassLaunch as S

    wy = [L(64, 1, 1), L(64, 2, 1)]  # the WY kernel has no d_v block; 1 warp: 255 regs, 160 B spill
    state = [
        S(64, 4, 2, key_parts=2),  # the default (255 regs, 56 B spill)
        S(32, 4, 2),  # the default for a few long sequences (255 regs, 32 B spill, 95 KB smem)
        S(32, 4, 3),  # 255 regs, 140 KB smem: one program per SM
        S(32, 4, 2, key_parts=2),  # 189
        S(64, 8, 2, key_parts=2),  # 236
        S(64, 8, 2),
        S(16, 4, 2),
    ]
    # The output kernel has no loop: stages change nothing, warps and block_v do.
    out = [L(128, 4, 1), L(64, 4, 1), L(128, 8, 1), L(64, 8, 1), L(32, 4, 1)]
    if quick or big:
        wy, state, out = wy[:1], state[:4 if quick else 5], out[:3]
    return wy, state, out


def bench_prefill(num_seqs: int, seq_len: int, fla, quick: bool):
    """(row at the default launch, sweep closure returning the row with its tuned time)."""
    from batchinfer.kernels import gdn_prefill as ours
    from batchinfer.kernels.public import ChunkTables
    from batchinfer.kernels.ref import gdn as ref

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
    tables = ChunkTables(cu, T)
    fla_run = None
    if fla is not None:
        fla_run, fla_check = _checked_fla(lambda: _fla_runner(fla[0], x, state0[slots].clone(), (1, T), cu.long()),
                                          out)
        check += fla_check
    times = _bench_side_by_side({
        "ours": lambda: ours.gdn_prefill(**x, state=state, slots=slots, cu_seqlens=cu),
        "tables": lambda: ours.gdn_prefill(**x, state=state, slots=slots, cu_seqlens=cu, chunk_tables=tables),
        "fla": fla_run}, quick)
    ours_ms, tables_ms, fla_ms = times["ours"], times["tables"], times.get("fla")
    row = Row("gdn_prefill", f"{num_seqs}x{seq_len}", ours_ms, None, fla_ms, f"{T / ours_ms / 1e3:.2f} Mtok/s", "",
              check, shared_tables_ms=tables_ms)

    def sweep() -> Row:
        # Stages in launch order (wy, state_pass, output; q/k normalisation is folded into them),
        # each timed alone on one planned work: wy first, as the later stages read what it writes.
        print(f"sweep gdn_prefill {num_seqs}x{seq_len} (each stage alone: wy, state_pass, output; "
              f"default {ours.DEFAULT_LAUNCH})")
        work = ours.plan_prefill(**x, state=state, slots=slots, cu_seqlens=cu)
        wy_cfgs, state_cfgs, out_cfgs = _prefill_sweeps(quick, big=T >= 32768 and num_seqs == 1)
        best_wy, _ = _sweep("wy", wy_cfgs, lambda c: ours.run_wy(work, c), quick)
        best_state, _ = _sweep("state_pass", state_cfgs, lambda c: ours.run_state_pass(work, c), quick)
        best_out, _ = _sweep("output", out_cfgs, lambda c: ours.run_output(work, c), quick)
        tuned = ours.DEFAULT_LAUNCH
        tuned = replace(tuned, wy=best_wy or tuned.wy, state_pass=best_state or tuned.state_pass,
                        output=best_out or tuned.output)
        run_tuned = lambda: ours.gdn_prefill(**x, state=state, slots=slots, cu_seqlens=cu, launch=tuned,  # noqa: E731
                                             chunk_tables=tables)
        _, tuned_ms = _sweep("end to end", [tuned], lambda _: run_tuned(), quick)  # guarded like any config
        if tuned_ms is None:  # out of time budget, or the combination failed (printed)
            return row
        state.copy_(state0)
        tuned_err = _rel_err(run_tuned(), expect)
        print(f"  best {tuned} -> {tuned_ms:.3f} ms end to end (rel err {tuned_err:.1e})")
        best = min(ours_ms, tuned_ms)
        return replace(row, tuned_ms=tuned_ms, rate=f"{T / best / 1e3:.2f} Mtok/s", check=f"{check} tuned {tuned_err:.1e}")

    return row, sweep


# DecodeLaunch(block_v, num_warps, num_stages, variant, programs_per_sm, tma, stream_state,
# gates_ahead), most promising first (--quick takes four). programs_per_sm is what fits on an SM
# (sm_90a offline compile: registers, shared memory); one more would start a second wave that
# serialises. Issue 3 (85% of copy bandwidth at B >= 128) — the new knobs first:
#   stream: state stored .cs (evict-first; the pipelined cp.async drops the load hint), so written
#           lines leave L2 early; bv 128: one program owns whole 512-B state rows, a contiguous
#           64 KB tile per (sequence, head), like a copy's access pattern; ahead: a, b (2-byte
#           scalars the pipeliner cannot cp.async) loaded one tile early.
DECODE_SWEEP = [
    (32, 2, 3, "persistent", 6, False, True),  # default + stream: 156 regs, 34 KB smem, 6/SM
    (128, 8, 3, "persistent", 1, False, True),  # whole rows: 169 regs, 133 KB smem (2 tiles ahead), 1/SM
    (64, 4, 3, "persistent", 3, False, True),  # 256-B row pieces: 162 regs, 65 KB smem, 3/SM
    (32, 2, 3, "persistent", 6, False, True, True),  # default + stream + ahead: 164 regs, 6/SM
    (128, 8, 3, "persistent", 1, True, True),  # whole rows by TMA bulk copies: 204 regs, 133 KB smem, 1/SM
    (16, 1, 3, "persistent", 12, False, True),  # one warp (shuffle reductions) + stream: 149 regs, 12/SM
    # Session 2's launches that fit an SM (the default first: this run's control):
    (32, 2, 3, "persistent", 6), (32, 2, 3, "persistent", 6, True), (32, 4, 3, "persistent", 5),
    (16, 2, 4, "persistent", 8), (16, 1, 3, "persistent", 12), (32, 1, 1), (32, 8, 1, "tile"),
]


def bench_decode(batch: int, fla, quick: bool):
    from batchinfer.kernels import gdn_decode as ours
    from batchinfer.kernels.ref import gdn as ref

    gen = torch.Generator(device="cuda").manual_seed(1)
    x = _gdn_inputs(batch, gen)
    pool = torch.randn(batch + 7, H_V, D_K, D_V, device="cuda", generator=gen) * 0.1
    slots = torch.randperm(batch + 7, device="cuda", generator=gen)[:batch]
    ref_pool, fla_initial = pool.clone(), pool[slots].clone()  # before our runs move the pool
    out = ours.gdn_decode(**x, state=pool, slots=slots)
    expect = ref.gdn_decode(**{n: t.float() for n, t in x.items()}, state=ref_pool, slots=slots)
    check = f"ref {_rel_err(out, expect):.1e}/{_rel_err(pool, ref_pool):.1e}"
    fla_run = None
    if fla is not None:  # B sequences of one token each, dense initial states
        fla_run, fla_check = _checked_fla(lambda: _fla_runner(fla[1], x, fla_initial, (batch, 1)), out)
        check += fla_check
    times = _bench_side_by_side({"ours": lambda: ours.gdn_decode(**x, state=pool, slots=slots), "fla": fla_run},
                                quick)
    ours_ms, fla_ms = times["ours"], times.get("fla")
    state_bytes = 2 * batch * H_V * D_K * D_V * 4  # fp32 state read + written

    def rates(ms: float):
        gbps = state_bytes / ms / 1e6
        return dict(rate=f"{gbps:.0f} GB/s", pct_peak=f"{gbps * 1e9 / PEAK_BYTES_PER_S:.0%}")

    row = Row("gdn_decode", f"B={batch}", ours_ms, None, fla_ms, check=check, **rates(ours_ms))

    def sweep() -> Row:
        print(f"sweep gdn_decode B={batch} (default {ours.launch_for_batch(batch)})")
        configs = [ours.DecodeLaunch(*c) for c in (DECODE_SWEEP[:4] if quick else DECODE_SWEEP)]
        _, tuned_ms = _sweep("decode", configs, lambda c: ours.gdn_decode(**x, state=pool, slots=slots, launch=c),
                             quick)
        return row if tuned_ms is None else replace(row, tuned_ms=tuned_ms, **rates(min(ours_ms, tuned_ms)))

    return row, (sweep if batch >= 32 else None)


def run_decode_sweeps(batches=(128, 512), budget_s: float = 240.0, quick: bool = False) -> list[Row]:
    """The decode rows and their launch sweeps alone (the full bench sweeps prefill first, which can
    spend the shared time budget before decode's turn):

        python -c "from benchmarks.bench_gdn import run_decode_sweeps as r; r()"
    """
    global SWEEP_DEADLINE_S
    SWEEP_DEADLINE_S = time.monotonic() - _START + budget_s
    fla, rows = _load_fla(), []
    for batch in batches:
        measured = _guarded(bench_decode, batch, fla, quick)
        if measured is not None:
            row, sweep = measured
            rows.append(sweep() if sweep is not None else row)
    print_table(rows)
    return rows


CONV_PREFILL_SWEEP = [(16, 256, 4), (32, 256, 4), (32, 256, 8), (16, 512, 4), (64, 256, 8), (8, 1024, 8), (32, 512, 8)]
CONV_DECODE_SWEEP = [(1, 256, 4), (1, 512, 4), (1, 1024, 4), (1, 128, 2), (1, 1024, 8)]


def bench_conv(num_tokens: int, decode: bool, quick: bool):
    from batchinfer.kernels import conv1d as ours
    from batchinfer.kernels.ref import conv1d as ref

    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(num_tokens, D_CONV, device="cuda", generator=gen).bfloat16()
    weight = torch.randn(D_CONV, CONV_K, device="cuda", generator=gen).bfloat16()
    pool = torch.randn(num_tokens if decode else 8, D_CONV, CONV_K - 1, device="cuda", generator=gen).bfloat16()
    ref_pool = pool.clone()
    if decode:
        slots = torch.randperm(num_tokens, device="cuda", generator=gen)
        run = lambda p, launch=ours.DEFAULT_DECODE_LAUNCH: ours.causal_conv1d_decode(  # noqa: E731
            x, weight, None, p, slots, launch=launch)
        expect = ref.causal_conv1d_decode(x, weight, None, ref_pool, slots)
        shape = f"B={num_tokens}"
    else:
        slots = torch.randperm(8, device="cuda", generator=gen)
        cu = torch.linspace(0, num_tokens, 9, device="cuda").to(torch.int32)
        run = lambda p, launch=ours.DEFAULT_PREFILL_LAUNCH: ours.causal_conv1d_prefill(  # noqa: E731
            x, weight, None, p, slots, cu, launch=launch)
        expect = ref.causal_conv1d_prefill(x, weight, None, ref_pool, slots, cu)
        shape = f"8x{num_tokens // 8}"
    out = run(pool)
    check = f"ref {_rel_err(out, expect):.1e}/{_rel_err(pool, ref_pool):.1e}"
    ms = _bench(lambda: run(pool), quick)
    name = "conv1d_decode" if decode else "conv1d_prefill"
    moved = 2 * x.numel() * 2 + (2 * num_tokens * D_CONV * (CONV_K - 1) * 2 if decode else 0)

    def rates(best_ms: float):
        gbps = moved / best_ms / 1e6
        return dict(rate=f"{gbps:.0f} GB/s", pct_peak=f"{gbps * 1e9 / PEAK_BYTES_PER_S:.0%}")

    row = Row(name, shape, ms, None, None, check=check, **rates(ms))

    def sweep() -> Row:
        from batchinfer.kernels.conv1d import ConvLaunch

        print(f"sweep {name} {shape} (ConvLaunch(block_t, block_d, num_warps))")
        configs = [ConvLaunch(*c) for c in (CONV_DECODE_SWEEP if decode else CONV_PREFILL_SWEEP)]
        _, tuned_ms = _sweep(name, configs[:3] if quick else configs, lambda c: run(pool, c), quick)
        return row if tuned_ms is None else replace(row, tuned_ms=tuned_ms, **rates(min(ms, tuned_ms)))

    return row, sweep


HEADER = (f"{'kernel':<15}{'shape':<11}{'ours ms':>9}{'tuned ms':>9}{'fla ms':>9}{'speedup':>9}  "
          f"{'rate':<15}{'%peak':>6}  check (rel err)")


def row_line(r: Row) -> str:
    fla = f"{r.fla_ms:9.3f}" if r.fla_ms is not None else f"{'—':>9}"
    tuned = f"{r.tuned_ms:9.3f}" if r.tuned_ms is not None else f"{'—':>9}"
    best = min(r.ours_ms, r.tuned_ms or r.ours_ms)  # speedup and rate: our best launch
    speedup = f"{r.fla_ms / best:8.2f}x" if r.fla_ms is not None else f"{'—':>9}"
    shared = ""
    if r.shared_tables_ms is not None:
        ratio = f", {r.fla_ms / r.shared_tables_ms:.2f}x fla" if r.fla_ms is not None else ""
        shared = f"  [step's chunk tables: {r.shared_tables_ms:.3f} ms{ratio}]"
    return f"{r.kernel:<15}{r.shape:<11}{r.ours_ms:9.3f}{tuned}{fla}{speedup}  {r.rate:<15}{r.pct_peak:>6}  {r.check}{shared}"


def print_table(rows: list[Row]) -> None:
    bench_utils.print_table(HEADER, map(row_line, rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one shape per kernel, shorter timing")
    parser.add_argument("--no-sweep", action="store_true", help="default launch configs only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gdn needs CUDA")
        return 0
    fla = _load_fla()
    prefill = PREFILL_SHAPES[1:2] if args.quick else PREFILL_SHAPES
    decode = [128] if args.quick else DECODE_BATCHES
    cases = [(bench_prefill, (n, length, fla, args.quick)) for n, length in prefill]
    cases += [(bench_decode, (batch, fla, args.quick)) for batch in decode]
    cases += [(bench_conv, (16384, False, args.quick)), (bench_conv, (256, True, args.quick))]

    # Phase 1: every kernel at its default launch; the table is printed before any sweep.
    measured, context_ok = [], True
    for bench, case_args in cases:
        try:
            measured.append(_guarded(bench, *case_args))
        except StickyCudaError as exc:
            print(f"STOPPED: CUDA error in {bench.__name__}{case_args[:2]} at its default launch: {exc}")
            context_ok = False
            break
    rows = [m[0] for m in measured if m is not None]
    print(f"default launches ({time.monotonic() - _START:.0f} s)")
    print_table(rows)
    if args.no_sweep or not context_ok:
        return 0

    # Phase 2: sweeps, in table order, until the time budget or the first sticky CUDA error.
    swept = {}
    for row, sweep in (m for m in measured if m is not None and m[1] is not None):
        try:
            swept[id(row)] = sweep()
        except StickyCudaError as exc:
            print(f"SWEEP STOPPED: CUDA error in {exc}; later sweeps skipped (the context is unusable)")
            break
        except Exception as exc:  # noqa: BLE001 - one broken sweep does not sink the others
            print(f"sweep {row.kernel} {row.shape}: FAILED {type(exc).__name__}: {exc}", file=sys.stderr)
    print(f"with sweeps (total {time.monotonic() - _START:.0f} s)")
    print_table([swept.get(id(row), row) for row in rows])
    return 0


def _guarded(bench_row, *args):
    """One failing row (e.g. out of memory) is reported and does not sink the table; a sticky CUDA
    error is raised as StickyCudaError, since every later row would fail too."""
    try:
        return bench_row(*args)
    except StickyCudaError:
        raise
    except Exception as exc:  # noqa: BLE001
        if _is_sticky_cuda_error(exc):
            raise StickyCudaError(str(exc).splitlines()[0][:120]) from exc
        print(f"{bench_row.__name__}{args[:2]}: FAILED {type(exc).__name__}: {exc}", file=sys.stderr)
        return None


if __name__ == "__main__":
    sys.exit(main())
