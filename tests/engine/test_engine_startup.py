"""Engine start-up order: the kernel trace and compile submission come before the weight load, the
wait for the compiles after it, and the phases say so (on the CPU with a stand-in precompile: the
real one needs CUDA, test_engine_precompile_gpu)."""
import pytest
import torch

from batchinfer.engine import Engine, EngineConfig
from batchinfer.engine.build import EngineBuilder
from batchinfer.engine.precompile import PrecompileReport
from batchinfer.engine.startup import listening
from batchinfer.models import loader
from batchinfer.models.checkpoint_writer import write_random_checkpoint
from batchinfer.models.presets import PRESETS

CONFIG = EngineConfig(device="cpu", dtype="float32", max_running=4, memory_budget_bytes=16 << 20)


class FakePending:
    def __init__(self, events: list) -> None:
        self.events, self.compiling, self.missing = events, True, 5

    def finish(self) -> PrecompileReport:
        self.events.append("finish")
        return PrecompileReport(7, 5, 5, 4, 0.1, 2.0, 0.1, 0.5)

    def cancel(self) -> None:
        self.events.append("cancel")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt"), PRESETS["tiny"], seed=1, dtype=torch.float32)


def _record(monkeypatch, events: list, fail_load: bool = False) -> None:
    real = loader.load_weights

    def start(self, caches, kv_pool, state_pool, spare_cpus=0):
        events.append(("trace+submit", spare_cpus))
        return FakePending(events)

    def load(model, path, **kwargs):
        events.append("load")
        if fail_load:
            raise loader.CheckpointError("bad checkpoint")
        real(model, path, **kwargs)

    monkeypatch.setattr(EngineBuilder, "_start_precompile", start)
    monkeypatch.setattr(loader, "load_weights", load)


def test_weights_load_while_the_kernels_compile(monkeypatch, checkpoint):
    events, heard = [], []
    _record(monkeypatch, events)
    with listening(lambda label, seconds: heard.append((label, seconds is None))):
        engine = Engine.from_pretrained(str(checkpoint), CONFIG)
    assert events == [("trace+submit", 1), "load", "finish"]  # a CPU left to the load
    assert heard == [("allocating the model", True), ("allocating the model", False),
                     ("loading weights (and compiling 5 kernels in parallel)", True),
                     ("loading weights (and compiling 5 kernels in parallel)", False),
                     ("compiling kernels", True), ("compiling kernels", False)]
    assert engine.precompile_report.compiled == 5
    assert engine.startup_seconds["load"] > 0 and engine.startup_seconds["compile_and_capture"] >= 0
    reference = loader.load_model(checkpoint, torch.float32)  # the weights are the checkpoint's
    for (name, ours), (_, theirs) in zip(engine.model.named_parameters(), reference.named_parameters()):
        assert torch.equal(ours, theirs), name


def test_a_failed_load_stops_the_compiles(monkeypatch, checkpoint):
    events = []
    _record(monkeypatch, events, fail_load=True)
    with pytest.raises(loader.CheckpointError, match="bad checkpoint"):
        Engine.from_pretrained(str(checkpoint), CONFIG)
    assert events == [("trace+submit", 1), "load", "cancel"]


def test_a_loaded_model_is_not_loaded_again(monkeypatch, checkpoint):
    events = []
    _record(monkeypatch, events)
    engine = Engine(loader.load_model(checkpoint, torch.float32), CONFIG)  # `load` recorded once, by load_model
    assert events == ["load", ("trace+submit", 0), "finish"] and engine.startup_seconds["load"] == 0.0
