"""The global plan end to end on the demo model (fp32, CPU): a shuffled and a grouped copy of the
same rag prompts, with more rows than a unit or a window holds, reach the same cached tokens —
the global ideal — under a state pool that makes the per-window plan evict, with the tokens of
a run without prefix caching."""
from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from batchinfer.engine import Engine, EngineConfig
from batchinfer.models.presets import build_model
from batchinfer.jobs.global_plan import UnitConfig
from batchinfer.jobs.run.prepare import prepare_job
from batchinfer.jobs.run.runner import run_job
from batchinfer.jobs.spec.job_file import engine_config_kwargs, load_job_file
from tests.job_process import demo_cache  # noqa: F401 (fixture)
from tests.jobs_fixtures import job_entry, write_job_file, write_parquet

pytestmark = pytest.mark.slow  # whole-job runs of the demo model in subprocesses

TEMPLATE = "{document}\n\nQuestion: {question}\nAnswer:"
WORDS = "river town baker shutters bread morning market lantern harbor bridge stone garden".split()
DOCS, QUESTIONS = 6, 4                       # 24 rows
UNITS = UnitConfig(max_rows=8, units_goal=1)  # units of two documents: cuts between groups are free
WINDOW_ROWS = 8
POOL_BYTES = 4_000_000                       # 4 running + 8 cached states: fewer than the plans open


def rag_rows(shuffle: bool) -> pa.Table:
    rng = random.Random(3)
    # Each document starts with its own letter: no prefix is shared across documents, so a cut
    # between two of them loses nothing and the units keep the whole global ideal.
    documents = ["ABCDEFGH"[i] + "x " + " ".join(rng.choice(WORDS) for _ in range(16)) for i in range(DOCS)]
    rows = [(documents[d], f"What about the {WORDS[q]} {q}?") for d in range(DOCS) for q in range(QUESTIONS)]
    if shuffle:
        random.Random(5).shuffle(rows)
    return pa.table({"document": [r[0] for r in rows], "question": [r[1] for r in rows]})


def global_ideal(prompts: list[list[int]]) -> int:
    """Σ over the globally sorted prompts of min(lcp with the predecessor, len − 1)."""
    rows = sorted(tuple(p) for p in prompts)
    total = 0
    for before, row in zip(rows, rows[1:]):
        lcp = next((i for i, (a, b) in enumerate(zip(before, row)) if a != b), min(len(before), len(row)))
        total += min(lcp, len(row) - 1)
    return total


@pytest.fixture(autouse=True)
def uses_the_demo_cache(demo_cache, monkeypatch) -> Path:  # noqa: F811 - the jobs below name model: demo
    # The random demo: POOL_BYTES is sized to its states (the trained one's are 4x larger).
    monkeypatch.setenv("BATCHINFER_DEMO", "random")
    return demo_cache


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory):
    """The demo model, loaded once for every run here (each run builds its own engine around it)."""
    from batchinfer.demo import demo_checkpoint

    with pytest.MonkeyPatch.context() as env:
        env.setenv("BATCHINFER_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "demo-cache"))  # as demo_cache
        env.setenv("BATCHINFER_DEMO", "random")
        checkpoint = demo_checkpoint()
    return checkpoint, build_model(str(checkpoint), EngineConfig(dtype="fp32").resolved_dtype(), "cpu")


def run(folder: Path, table: pa.Table, demo_model, plan: str = "global", prefix_cache: bool = True) -> tuple[dict, pa.Table]:
    write_parquet(table, folder / "data" / "rag.parquet")
    job_file = write_job_file(folder, [job_entry(
        model="demo", prompt={"template": TEMPLATE}, sampling={"max_tokens": 3, "ignore_eos": True},
        engine={"device": "cpu", "dtype": "float32", "max_running": 4, "track_interval": 16,
                "prefix_cache": prefix_cache})])
    job = prepare_job(load_job_file(job_file).jobs[0])

    def small_pool(job, window_rows: int) -> Engine:
        config = EngineConfig(**engine_config_kwargs(job.spec.engine), memory_budget_bytes=POOL_BYTES,
                              plan_window=window_rows)
        return Engine(demo_model[1], config, eos_token_ids=job.tokenizer.eos_token_ids, detokenize=job.tokenizer.decode)

    stats = run_job(job, Console(quiet=True), engine_factory=small_pool, window_rows=WINDOW_ROWS, unit_config=UNITS,
                    plan=plan)
    return stats, pq.read_table(folder / "out" / "rag")


def by_prompt(out: pa.Table) -> dict:
    return {(r["document"], r["question"]): tuple(r["output_token_ids"]) for r in out.to_pylist()}


def prompt_ids(table: pa.Table, tokenizer_folder: Path) -> list[list[int]]:
    from batchinfer.jobs.inputs.tokenizer import CheckpointTokenizer

    tokenizer = CheckpointTokenizer.from_checkpoint(tokenizer_folder)
    texts = [TEMPLATE.format(document=d, question=q) for d, q in zip(table["document"].to_pylist(),
                                                                      table["question"].to_pylist())]
    return tokenizer.encode_batch(texts, add_special_tokens=True)


def test_shuffled_and_grouped_copies_reach_the_global_ideal_with_the_tokens_of_no_prefix_cache(tmp_path, demo_model):
    ideal = global_ideal(prompt_ids(rag_rows(shuffle=False), demo_model[0]))
    reference_stats, reference = run(tmp_path / "reference", rag_rows(shuffle=False), demo_model, prefix_cache=False)
    assert reference_stats["cached_tokens"] == 0
    for shuffle in (True, False):
        stats, out = run(tmp_path / f"shuffled-{shuffle}", rag_rows(shuffle), demo_model)
        assert out.num_rows == DOCS * QUESTIONS > max(UNITS.max_rows, WINDOW_ROWS)
        assert stats["plan"]["units"] >= 3 and stats["plan"]["recomputed_root_tokens"] == 0
        assert stats["plan"]["global_ideal_cached_tokens"] == ideal > 0
        assert stats["cached_tokens"] == stats["planned_cached_tokens"] == ideal
        assert stats["states_evicted"] > 0  # the pool was short, and still nothing planned was lost
        assert stats["plan"]["planned_reuse_lost_tokens"] == stats["plan"]["branch_states_over_capacity"] == 0
        assert by_prompt(out) == by_prompt(reference)


def test_the_per_window_plan_of_the_shuffled_copy_evicts_and_falls_short(tmp_path, demo_model):
    ideal = global_ideal(prompt_ids(rag_rows(shuffle=False), demo_model[0]))
    stats, _ = run(tmp_path, rag_rows(shuffle=True), demo_model, plan="window")
    plan = stats["plan"]
    assert (plan["mode"], plan["window_rows"]) == ("window", WINDOW_ROWS) and "global_ideal_cached_tokens" not in plan
    assert plan["units"] == -(-DOCS * QUESTIONS // WINDOW_ROWS)  # a unit a window, in input order
    assert plan["unit_ideal_cached_tokens"] < ideal  # windows planned alone, no reuse across them
    assert stats["states_evicted"] > 0 and stats["cached_tokens"] < ideal
