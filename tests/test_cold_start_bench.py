"""benchmarks/cold_start.py: the phase timeline and the compile records it builds from triton's hooks."""
from types import SimpleNamespace

from benchmarks.cold_start import Timeline, summarise


def _fake_fn(*names):
    return SimpleNamespace(module="kernels.x", name="kern", jit_function=SimpleNamespace(
        params=[SimpleNamespace(name=n) for n in names]))


def test_compiles_are_named_and_attributed_to_the_open_phase():
    timeline = Timeline()

    def compile_once():
        assert timeline.before_compile(key=None) is None  # a true value would skip triton's compile
        timeline.after_compile(key=None, repr="kern[num_warps=4](x: *bf16, n: i32D)", fn=_fake_fn("x", "n", "BLOCK"),
                               compile={"constants": {(2,): 64, (1,): 1}})

    timeline.phase("capture_graphs", compile_once)()
    compile_once()
    first, second = timeline.compiles
    assert first["phase"] == "capture_graphs" and second["phase"] == "other"
    assert first["constexprs"] == {"BLOCK": 64, "n": 1}
    assert first["kernel"] == "kernels.x.kern" and first["seconds"] >= 0


def test_summary_sums_phases_and_compiles_per_phase():
    timeline = {"spawn": 0.0, "interpreter_ready": 0.5, "imports": [0.5, 2.0], "end": 10.0,
                "phases": [{"name": "generate", "start": 3.0, "end": 5.0}, {"name": "generate", "start": 6, "end": 7},
                           {"name": "plan", "start": 2.0, "end": None}],
                "compiles": [{"kernel": "a", "constexprs": {}, "repr": "", "seconds": 1.0, "phase": "generate"},
                             {"kernel": "b", "constexprs": {}, "repr": "", "seconds": 2.0, "phase": "generate"}]}
    run = summarise("first", 10.0, timeline, {"wall_seconds": 9.0})
    assert run["phases_seconds"] == {"generate": 3.0}  # an unfinished phase is not counted
    assert run["compile_by_phase"] == {"generate": {"count": 2, "seconds": 3.0}}
    assert [c["kernel"] for c in run["compiles"]] == ["b", "a"]  # slowest first
    assert run["process_start_seconds"] == 0.5 and run["imports_seconds"] == 1.5


def test_device_drawn_checkpoint_loads(tmp_path):
    import json

    import torch

    from batchinfer.models.loader import load_model
    from batchinfer.models.presets import PRESETS
    from benchmarks.cold_start import write_child_main

    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(PRESETS["tiny"]))
    write_child_main(tmp_path / "ckpt", config_path, device="cpu")
    model = load_model(tmp_path / "ckpt", torch.float32)  # every tensor named, shaped and present
    assert all(torch.isfinite(p).all() for p in model.parameters())
