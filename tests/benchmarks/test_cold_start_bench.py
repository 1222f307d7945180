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


def test_launcher_builds_first_launches_and_io_are_attributed_per_phase():
    reads = iter(range(0, 10_000, 100))
    timeline = Timeline(counters=lambda: {"major_faults": 2, "read_bytes": next(reads)})
    build = timeline.event("launcher_build", lambda: None)
    launch = timeline.event("first_launch", lambda: None)

    def capture():
        build()
        launch()

    timeline.phase("capture_graphs", capture)()
    launch()
    assert [(e["kind"], e["phase"]) for e in timeline.events] == [
        ("launcher_build", "capture_graphs"), ("first_launch", "capture_graphs"), ("first_launch", "other")]
    assert timeline.phases[0]["io"] == {"major_faults": 0, "read_bytes": 100}
    kept = timeline.keep("report", lambda: {"workers": 3}, lambda r: r["workers"])
    assert kept() == {"workers": 3} and timeline.records == {"report": 3}


def test_summary_counts_lazy_compiles_outside_the_precompile():
    compile_in = [("compile_wait", 1.0), ("precompile", 0.5), ("capture_graphs", 2.0), ("generate", 3.0)]
    timeline = {"spawn": 0.0, "interpreter_ready": 0.5, "imports": [0.5, 2.0], "end": 10.0,
                "phases": [{"name": "compile_wait", "start": 3.0, "end": 4.0, "io": {"major_faults": 5, "read_bytes": None}},
                           {"name": "generate", "start": 5.0, "end": 6.0, "io": {"major_faults": 1, "read_bytes": 10}},
                           {"name": "generate", "start": 7.0, "end": 8.0, "io": {"major_faults": 2, "read_bytes": 20}}],
                "compiles": [{"kernel": k, "constexprs": {}, "repr": "", "seconds": s, "phase": k} for k, s in compile_in],
                "events": [{"kind": "launcher_build", "seconds": 0.3, "phase": "generate"},
                           {"kind": "launcher_build", "seconds": 0.2, "phase": "generate"}],
                "records": {"precompile_report": {"workers": 15}}}
    run = summarise("first", 10.0, timeline, {"wall_seconds": 9.0})
    assert run["lazy_compiles"] == 2 and run["lazy_compile_seconds"] == 5.0
    assert run["events_by_phase"] == {"launcher_build": {"generate": {"count": 2, "seconds": 0.5}}}
    assert run["io_by_phase"]["generate"] == {"major_faults": 3, "read_bytes": 30}
    assert run["io_by_phase"]["compile_wait"] == {"major_faults": 5, "read_bytes": None}
    assert run["precompile_report"] == {"workers": 15}
