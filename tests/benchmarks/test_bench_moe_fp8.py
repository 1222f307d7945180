"""The FP8 expert benchmark's launch sweep (`bench_moe_fp8 --launches`), on the CPU (interpreter,
tiny shapes): a fixed launch reaches both the layout's row tiles and the kernel, and the default
comes back after."""
from __future__ import annotations

import os

from batchinfer.kernels.moe_fp8 import grouped_gemm
from tests.conftest import interpreter_only


@interpreter_only
def test_a_swept_launch_reaches_the_layout_and_the_kernel(capsys):
    from benchmarks.bench_moe_fp8 import make_block, sweep_launches

    default = grouped_gemm.default_launch
    block = make_block("qwen3.5-35b-a3b", "cpu", quick=True)
    assert default(4 * block.top_k, block.num_experts).gate_up.block_m != 32  # the sweep changes the row tile
    sweep_launches(block, [4], "cpu", "32:4:3")
    assert grouped_gemm.default_launch is default
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("32:4:3 | ") and "x, " in line and "TFLOP/s, err " in line
    assert float(line.rsplit("err ", 1)[1].rstrip(")")) < 0.05  # the swept launch's rows are right


def test_launch_text_names_each_kernel():
    from batchinfer.kernels.moe_fp8.grouped_gemm import parse_launch
    from batchinfer.kernels.moe_fp8.grouped_gemm import KernelLaunch, MoeFp8Launch

    assert parse_launch("64:8:4") == MoeFp8Launch.same(64, 8, 4)
    assert parse_launch("64:8:4:rows") == MoeFp8Launch.same(64, 8, 4, columns_fastest=False)
    assert parse_launch("128:16:3/64:8:3:256") == MoeFp8Launch(KernelLaunch(128, 16, 3), KernelLaunch(64, 8, 3),
                                                                block_n_down=256)
    assert parse_launch("64:8:3+a16") == MoeFp8Launch.same(64, 8, 3, w8a16=True)
    assert parse_launch("64:8:3/16:4:3+a16").w8a16
    assert parse_launch("16:4:3/16:4:3:256+swap") == MoeFp8Launch.same(16, 4, 3, block_n_down=256, swap_ab=True)


@interpreter_only
def test_the_block_a_b_runs_the_shared_expert_both_ways():
    from benchmarks.bench_moe_fp8 import make_block, measure_block

    block = make_block("qwen3.5-35b-a3b", "cpu", quick=True)
    row = measure_block(block, 4, "cpu")
    assert row["separate_ms"] > 0 and row["grouped_ms"] > 0
    # Two paths (bf16 rounding of the separate expert's gate|up output only on one): close, not identical.
    assert 0 < row["rel_diff"] < 0.05
    assert os.environ.get("BATCHINFER_MOE_SHARED_IN_GROUPED") is None  # the switch is the A/B's alone


@interpreter_only
def test_each_part_is_left_out_alone_and_everything_comes_back(monkeypatch):
    """`--parts` times the path whole and then without each part: every timed call runs all four
    parts but the one left out, and the module attributes it replaces come back after."""
    from batchinfer.kernels import ops
    from benchmarks.bench_moe_fp8 import make_block, measure_parts

    block = make_block("qwen3.5-35b-a3b", "cpu", quick=True)
    ran: list[set] = []  # the parts each timed call ran

    class Recorded:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            ran[-1].add(self.name)
            return self.kernel[grid]

    def recorded_function(name, fn):
        return lambda *args, **kwargs: ran[-1].add(name) or fn(*args, **kwargs)

    run_experts = block._run_experts
    monkeypatch.setattr(block, "_run_experts",
                        lambda *args, **kwargs: ran.append(set()) or run_experts(*args, **kwargs))
    monkeypatch.setattr(ops, "moe_align", recorded_function("layout", ops.moe_align))
    monkeypatch.setattr(grouped_gemm, "quantize_act", recorded_function("quantize", grouped_gemm.quantize_act))
    kernels = {"gate_up": ("_gate_up_kernel", "gate_up_swapped_kernel"),
               "down": ("_down_kernel", "down_swapped_kernel")}
    for part, names in kernels.items():  # whichever pair the default launch runs
        for name in names:
            monkeypatch.setattr(grouped_gemm, name, Recorded(part, getattr(grouped_gemm, name)))
    patched = (ops.moe_align, grouped_gemm.quantize_act,
               *(getattr(grouped_gemm, name) for names in kernels.values() for name in names))
    ran.append(set())  # measure_parts' own calls before the timed ones
    row = measure_parts(block, 4, "cpu")
    parts = {"layout", "quantize", "gate_up", "down"}
    timed = {frozenset(calls) for calls in ran[1:]}
    assert timed == {frozenset(parts)} | {frozenset(parts - {part}) for part in parts}
    assert (ops.moe_align, grouped_gemm.quantize_act,
            *(getattr(grouped_gemm, name) for names in kernels.values() for name in names)) == patched
    assert {"whole_ms", "layout_ms", "quantize_ms", "gate_up_ms", "down_ms", "gate_up_floor_ms"} <= row.keys()
