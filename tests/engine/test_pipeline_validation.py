"""`parallel.pipeline_stages` checked before loading: the key's type, the fit of each stage's weights
in its GPU (with the model's size and the memory named), workers x stages against the GPUs, and
each local worker placed on its own run of GPUs."""
from __future__ import annotations

import pytest

from batchinfer.jobs.errors import JobError
from batchinfer.jobs.run.executors.placement import local_placements
from batchinfer.jobs.spec.job_file import load_job_file
from batchinfer.jobs.spec.pipeline_fit import check_pipeline
from batchinfer.models.checkpoint_writer import write_random_checkpoint
from batchinfer.models.presets import PRESETS
from tests.jobs_fixtures import job_entry, write_job_file


def _spec(folder, **parallel):
    write_job_file(folder, [job_entry(model="m", parallel=parallel, engine={"device": "cuda"})])
    return load_job_file(folder / "jobs.yaml").jobs[0]


def test_pipeline_stages_must_be_a_positive_integer(tmp_path):
    for bad in (0, "2", True):
        write_job_file(tmp_path, [job_entry(model="m", parallel={"pipeline_stages": bad})])
        with pytest.raises(JobError, match="parallel.pipeline_stages: must be an integer >= 1"):
            load_job_file(tmp_path / "jobs.yaml")


def test_a_model_too_big_for_its_stages_names_its_size_and_the_memory(tmp_path):
    ckpt = write_random_checkpoint(tmp_path / "m", PRESETS["tiny"])
    spec = _spec(tmp_path, pipeline_stages=2)
    with pytest.raises(JobError, match=r"parallel.pipeline_stages: m \(0.0 GiB of weights\) does not fit 2 pipeline "
                                       r"stages: stage \d needs .* GiB, 0.0 GiB available"):
        check_pipeline(spec, load_config(ckpt), ckpt, gpu_bytes=[1000, 1000])
    check_pipeline(spec, load_config(ckpt), ckpt, gpu_bytes=[1 << 30, 1 << 30])


def test_workers_times_stages_over_the_gpus_is_refused(tmp_path):
    ckpt = write_random_checkpoint(tmp_path / "m", PRESETS["tiny"])
    spec = _spec(tmp_path, pipeline_stages=2, workers=2)
    with pytest.raises(JobError, match="2 workers x 2 stages need 4 GPUs, 3 visible"):
        check_pipeline(spec, load_config(ckpt), ckpt, gpu_bytes=[1 << 30] * 3)


def test_each_worker_gets_its_own_run_of_gpus():
    placements = local_placements(2, "cuda", ["0", "1", "2", "3"], gpus_per_worker=2)
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in placements] == ["0,1", "2,3"]
    assert all(p.device == "cuda" and p.overrides == {"parallel.workers": 1} for p in placements)
    with pytest.raises(ValueError, match="3 workers x 2 pipeline stages need 6 GPUs, 4 visible"):
        local_placements(3, "cuda", ["0", "1", "2", "3"], gpus_per_worker=2)


def load_config(ckpt):
    from batchinfer.models.config import load_model_config

    return load_model_config(ckpt)


def test_a_ray_worker_is_one_pipeline_on_its_hosts_gpus():
    from batchinfer.jobs.run.executors.ray_executor import RayExecutor, actor_device
    from batchinfer.jobs.run.executors.contract import WorkerRecipe

    assert actor_device(1) == "cuda:0" and actor_device(0.5) == "cuda:0"  # one GPU or a share: the actor's cuda:0
    assert actor_device(4) == "cuda"  # four stages: the actor's cuda:0..3, one stage each
    recipe = WorkerRecipe("builtins:print")
    assert RayExecutor(recipe, workers=1, gpus_per_worker=4).gpus_per_worker == 4
    with pytest.raises(ValueError, match="whole number"):
        RayExecutor(recipe, workers=1, gpus_per_worker=1.5)
