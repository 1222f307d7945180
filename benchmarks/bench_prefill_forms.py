"""The chunked GDN prefill's two forms side by side with fla-core, same inputs, one run (H200):

    source .whl/env.sh && python -m benchmarks.bench_prefill_forms [--budget-s 240]

- W/U form: the WY stage stores W and U ([T, H_v, d] each), the state pass reads them.
- inverse form: the WY stage stores M⁻¹·diag(beta) ([N, H_v, 64, 64]) and the state pass forms
  the new values from it and the raw keys and values (kernels/gdn_prefill_state_inverse.py).

Per shape (the issue's 1×32768, 8×2048, 64×512 at Qwen3.5-27B's 16 / 48 heads × 128, bf16): both
forms checked against the fp32 reference first, then the whole op timed (median of
triton.testing.do_bench after warm-up) for each form at its default launch and for fla; then
each stage of the inverse form alone, its state pass over a few launches, and the whole op at the
best of them. The summary table prints last.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch

from benchmarks import bench_gdn as gdn
from kernels._common import ChunkTables, multiprocessor_count

STATE_LAUNCHES = [  # (block_v, warps, stages, key_parts); sm_90a registers from benchmarks/sm90_compile.py
    (32, 4, 2, 1),  # 176 regs
    (64, 4, 2, 2),  # 255, 104 B spill
    (32, 4, 3, 1),
    (32, 4, 2, 2),  # 194
    (64, 8, 2, 2),  # 254
    (16, 4, 2, 1),
]
# WY: (warps, share_key_head) at block_v 64. Not shared: 196 regs (sm_90a); shared: 255 + 160 B spill.
# 2 warps unshared: 1.13 vs 0.51 ms at 1x32768 (session 8).
WY_LAUNCHES = [(1, False), (1, True), (2, True)]
# (block_v, warps, stages, share_key_head); sm_90a registers / shared memory per program from
# benchmarks/sm90_compile.py: shared 64/4/2 235 regs 74 KB, 64/8/2 239 regs, 128/8/2 255 regs + 96 B spill.
OUTPUT_LAUNCHES = [(128, 4, 3, False), (64, 4, 2, True), (64, 8, 2, True), (64, 4, 3, True), (128, 8, 2, True),
                   (64, 4, 2, False)]


def _bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def bench_shape(num_seqs: int, seq_len: int, fla, deadline: float) -> dict:
    from kernels import gdn_prefill as ours
    from kernels.ref import gdn as ref

    gen = torch.Generator(device="cuda").manual_seed(0)
    T = num_seqs * seq_len
    x = gdn._gdn_inputs(T, gen)
    cu = torch.arange(0, T + 1, seq_len, device="cuda", dtype=torch.int32)
    slots = torch.randperm(num_seqs, device="cuda", generator=gen)
    state0 = torch.randn(num_seqs, gdn.H_V, gdn.D_K, gdn.D_V, device="cuda", generator=gen) * 0.1
    ref_state = state0.clone()
    expect = ref.gdn_prefill(**{n: t.float() for n, t in x.items()}, state=ref_state, slots=slots, cu_seqlens=cu)
    inverse = dataclasses.replace(ours.DEFAULT_LAUNCH, inverse_form=True)
    wu = dataclasses.replace(ours.DEFAULT_LAUNCH, inverse_form=False)
    result = dict(shape=f"{num_seqs}x{seq_len}")
    state = state0.clone()
    for name, launch in (("wu", wu), ("inverse", inverse)):
        state.copy_(state0)
        out = ours.gdn_prefill(**x, state=state, slots=slots, cu_seqlens=cu, launch=launch)
        result[f"{name}_err"] = f"{gdn._rel_err(out, expect):.1e}/{gdn._rel_err(state, ref_state):.1e}"
        result[name] = _bench(lambda launch=launch: ours.gdn_prefill(**x, state=state, slots=slots, cu_seqlens=cu,
                                                                     launch=launch))
    # As in a model step, where every layer's prefill shares one set of chunk tables (fla caches
    # its chunk indices per cu_seqlens tensor the same way): the table built once, outside the timing.
    tables = ChunkTables(cu, T)
    result["inverse_tables"] = _bench(lambda: ours.gdn_prefill(**x, state=state, slots=slots, cu_seqlens=cu,
                                                               launch=inverse, chunk_tables=tables))
    if fla is not None:
        result["fla"], result["fla_check"] = gdn._compare_fla(
            lambda: gdn._fla_runner(fla[0], x, state0[slots].clone(), (1, T), cu.long()), out, False)
    print(f"{result['shape']}: W/U {result['wu']:.3f} ms ({result['wu_err']}), inverse {result['inverse']:.3f} ms "
          f"({result['inverse_err']}), inverse with the step's tables {result['inverse_tables']:.3f} ms, "
          f"fla {result.get('fla') or float('nan'):.3f} ms{result.get('fla_check', '')}",
          flush=True)

    # Stages of each form alone, on one planned work per form.
    for name, form in (("wu", False), ("inverse", True)):
        work = ours.plan_prefill(**x, state=state, slots=slots, cu_seqlens=cu, inverse_form=form)
        default = inverse if form else wu
        state_launch = default.state_pass_for(num_seqs, gdn.H_V, gdn.D_V, multiprocessor_count(torch.device("cuda")))
        result[f"{name}_wy"] = _bench(lambda: ours.run_wy(work, default.wy))
        result[f"{name}_state"] = _bench(lambda: ours.run_state_pass(work, state_launch))
        result[f"{name}_output"] = _bench(lambda: ours.run_output(work, default.output))
        print(f"  {name} stages: wy {result[f'{name}_wy']:.3f}  state pass {result[f'{name}_state']:.3f} "
              f"({state_launch})  output {result[f'{name}_output']:.3f} ms", flush=True)
        if form:
            inverse_work = work

    def sweep(title, launches, run):
        best = None
        for launch in launches:
            if time.monotonic() > deadline:
                print(f"    ({title} sweep stopped: time budget)")
                break
            ms = _bench(lambda: run(launch))
            print(f"    inverse {title} {launch}: {ms:.3f} ms", flush=True)
            if best is None or ms < best[1]:
                best = (launch, ms)
        return best

    best_wy = sweep("wy", [ours.WyLaunch(64, w, 1, share_key_head=share) for w, share in WY_LAUNCHES],
                    lambda launch: ours.run_wy(inverse_work, launch))
    best_out = sweep("output", [ours.OutputLaunch(bv, w, st, share_key_head=share) for bv, w, st, share in OUTPUT_LAUNCHES],
                     lambda launch: ours.run_output(inverse_work, launch))
    best_state = sweep("state pass", [ours.StatePassLaunch(bv, w, st, key_parts=p) for bv, w, st, p in STATE_LAUNCHES],
                       lambda launch: ours.run_state_pass(inverse_work, launch))
    if best_wy and best_state and best_out:
        tuned = dataclasses.replace(inverse, wy=best_wy[0], state_pass=best_state[0], output=best_out[0],
                                    state_pass_few_programs=None)
        state.copy_(state0)
        out = ours.gdn_prefill(**x, state=state, slots=slots, cu_seqlens=cu, launch=tuned)
        err = f"{gdn._rel_err(out, expect):.1e}/{gdn._rel_err(state, ref_state):.1e}"
        result["tuned"] = _bench(lambda: ours.gdn_prefill(**x, state=state, slots=slots, cu_seqlens=cu, launch=tuned,
                                                          chunk_tables=tables))
        result["tuned_launch"] = f"wy {best_wy[0]}, state {best_state[0]}, output {best_out[0]}"
        print(f"  inverse at the best launches, with the step's tables ({result['tuned_launch']}): "
              f"{result['tuned']:.3f} ms ({err})", flush=True)
    return result


def print_summary(results: list[dict]) -> None:
    print("\ninv+tab: the inverse form with the chunk tables built once (as a model step shares them); "
          "inv tuned: that at the best stage launches")
    print(f"{'shape':<10}{'W/U ms':>9}{'inv ms':>9}{'inv+tab':>9}{'inv tuned':>10}{'fla ms':>9}{'W/U x':>7}"
          f"{'inv x':>7}{'+tab x':>7}{'tuned x':>8}   stages wy/state/output ms: W/U | inverse")
    for r in results:
        fla = r.get("fla")
        ratio = lambda ms: f"{fla / ms:7.2f}" if fla and ms else f"{'—':>7}"  # noqa: E731
        tuned = r.get("tuned")
        print(f"{r['shape']:<10}{r['wu']:9.3f}{r['inverse']:9.3f}{r['inverse_tables']:9.3f}"
              f"{tuned if tuned else float('nan'):10.3f}{fla if fla else float('nan'):9.3f}{ratio(r['wu'])}"
              f"{ratio(r['inverse'])}{ratio(r['inverse_tables'])}{ratio(tuned):>8}   "
              f"{r['wu_wy']:.3f}/{r['wu_state']:.3f}/{r['wu_output']:.3f} | "
              f"{r['inverse_wy']:.3f}/{r['inverse_state']:.3f}/{r['inverse_output']:.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=240.0, help="launch sweeps stop after this many seconds")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_prefill_forms needs CUDA")
        return 0
    fla, start = gdn._load_fla(), time.monotonic()
    results = []
    for i, (n, length) in enumerate(gdn.PREFILL_SHAPES):
        # Each shape gets an equal share of what is left of the budget for its sweeps.
        left = args.budget_s - (time.monotonic() - start)
        results.append(bench_shape(n, length, fla, time.monotonic() + left / (len(gdn.PREFILL_SHAPES) - i)))
    print_summary(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
