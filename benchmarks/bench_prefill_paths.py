"""The chunked GDN prefill's two paths side by side on CUDA, with fla-core on the same inputs:
staged (WY → state pass → output kernel, chunk states and new values through memory) and fused
(WY → a state pass that writes the outputs itself: kernels/gdn_prefill.py:run_fused), each fused
launch in FUSED_LAUNCHES. This is the measurement behind PrefillLaunch.fused_few_programs and the
rule that picks the path (PrefillLaunch.fuses).

    python -m benchmarks.bench_prefill_paths            # every shape (~3 min on an H200)
    python -m benchmarks.bench_prefill_paths --shapes 1x32768 8x2048

Every timed path is first checked against the fp32 reference on the same bf16 inputs. Times are
medians of triton.testing.do_bench with warm-up, each path with the step's shared chunk tables
(as the model calls it). "stages" times the stages of each path alone at its default launch.
"""
from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from benchmarks.bench_gdn import D_K, D_V, H_V, _bench, _compare_fla, _fla_runner, _gdn_inputs, _load_fla, _rel_err

SHAPES = [(1, 32768), (2, 16384), (4, 8192), (8, 2048), (64, 512)]


def _fused_launches():
    from kernels.gdn_prefill import StatePassLaunch as S

    return [S(32, 4, 2), S(32, 8, 2), S(32, 4, 2, key_parts=2), S(32, 8, 2, key_parts=2),
            S(16, 4, 2, key_parts=2), S(16, 8, 2, key_parts=2), S(32, 4, 3), S(64, 8, 2, key_parts=2)]


def measure_shape(num_seqs: int, seq_len: int, fla, stages: bool) -> list[tuple[str, float, str]]:
    from kernels import gdn_prefill as P
    from kernels._common import ChunkTables, multiprocessor_count
    from kernels.ref import gdn as ref

    gen = torch.Generator(device="cuda").manual_seed(0)
    T = num_seqs * seq_len
    x = _gdn_inputs(T, gen)
    cu = torch.arange(0, T + 1, seq_len, device="cuda", dtype=torch.int32)
    slots = torch.randperm(num_seqs, device="cuda", generator=gen)
    state0 = torch.randn(num_seqs, H_V, D_K, D_V, device="cuda", generator=gen) * 0.1
    expect_state = state0.clone()
    expect = ref.gdn_prefill(**{n: t.float() for n, t in x.items()}, state=expect_state, slots=slots, cu_seqlens=cu)
    tables = ChunkTables(cu, T)
    rows = []

    def run(launch, fused, state):
        work = P.plan_prefill(**x, state=state, slots=slots, cu_seqlens=cu, chunk_tables=tables, fused=fused)
        return P.run_prefill(work, launch)

    def timed(name, launch, fused):
        state = state0.clone()
        out = run(launch, fused, state)
        torch.cuda.synchronize()
        check = f"ref {_rel_err(out, expect):.1e}/{_rel_err(state[slots], expect_state[slots]):.1e}"
        rows.append((name, _bench(lambda: run(launch, fused, state), False), check))
        return out

    staged = replace(P.DEFAULT_LAUNCH, fused_few_programs=None)
    out = timed("staged (default knobs)", staged, False)
    for launch in _fused_launches():
        try:
            timed(f"fused bv{launch.block_v} w{launch.num_warps} st{launch.num_stages} parts{launch.key_parts}",
                  replace(P.DEFAULT_LAUNCH, fused_few_programs=launch), True)
        except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: report, go on
            rows.append((f"fused {launch}", float("nan"), f"FAILED {type(exc).__name__}: {str(exc)[:60]}"))
    if fla is not None:
        fla_ms, fla_check = _compare_fla(
            lambda: _fla_runner(fla[0], x, state0[slots].clone(), (1, T), cu.long()), out, False)
        rows.append(("fla-core", fla_ms if fla_ms is not None else float("nan"), fla_check.strip()))
    default_fused = P.DEFAULT_LAUNCH.fuses(num_seqs, H_V, D_V, multiprocessor_count(torch.device("cuda")))
    rows.append((f"default path: {'fused' if default_fused else 'staged'}", float("nan"), ""))

    if stages:
        state = state0.clone()
        work = P.plan_prefill(**x, state=state, slots=slots, cu_seqlens=cu, chunk_tables=tables)
        fused_work = P.plan_prefill(**x, state=state, slots=slots, cu_seqlens=cu, chunk_tables=tables, fused=True)
        P.run_wy(work, P.DEFAULT_LAUNCH.wy)
        P.run_wy(fused_work, P.DEFAULT_LAUNCH.wy)
        few = P.DEFAULT_LAUNCH.state_pass_for(num_seqs, H_V, D_V, multiprocessor_count(torch.device("cuda")))
        for name, fn in [("  stage wy", lambda: P.run_wy(work, P.DEFAULT_LAUNCH.wy)),
                         ("  stage state pass", lambda: P.run_state_pass(work, few)),
                         ("  stage output", lambda: P.run_output(work, P.DEFAULT_LAUNCH.output)),
                         ("  stage fused pass (default)", lambda: P.run_fused(fused_work, P.DEFAULT_LAUNCH.fused_few_programs))]:
            rows.append((name, _bench(fn, False), ""))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", default=[f"{n}x{t}" for n, t in SHAPES])
    parser.add_argument("--no-stages", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("CUDA required")
        return 1
    fla = _load_fla()
    table = []
    for shape in args.shapes:
        n, t = (int(s) for s in shape.split("x"))
        rows = measure_shape(n, t, fla, stages=not args.no_stages)
        for name, ms, check in rows:
            print(f"{shape:<9}{name:<36}{ms:9.3f} ms  {check}", flush=True)
        table.append((shape, rows))
    print(f"\n{'shape':<9}{'path':<36}{'ms':>9}  {'vs fla':>7}  check")
    for shape, rows in table:
        fla_ms = next((ms for name, ms, _ in rows if name == "fla-core"), float("nan"))
        for name, ms, check in rows:
            print(f"{shape:<9}{name:<36}{ms:9.3f}  {fla_ms / ms:7.2f}×  {check}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
