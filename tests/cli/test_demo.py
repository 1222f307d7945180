"""The demo checkpoint: deterministic, concurrency-safe, loadable, and its chat prompts equal transformers'."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest

from batchinfer.demo import DEMO_VERSION, random_demo_checkpoint
from batchinfer.models.config import load_model_config
from batchinfer.jobs.inputs.prompts import build_prompts
from batchinfer.jobs.spec.job_file import PromptSpec
from batchinfer.jobs.inputs.tokenizer import CheckpointTokenizer


def file_hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


# Each child says it is ready, waits for the go file, then builds: both find no checkpoint and
# race to rename theirs into place.
RACER = """
import os, sys, time
from batchinfer.demo import demo_cache_dir, random_demo_checkpoint
ready, go = sys.argv[1:]
open(ready, "w").close()
while not os.path.exists(go):
    time.sleep(0.005)
print(demo_cache_dir().is_dir(), random_demo_checkpoint())
"""


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> Path:
    """Two processes' racing first builds into one cache folder."""
    cache = tmp_path_factory.mktemp("cache")
    signals = tmp_path_factory.mktemp("signals")
    env = {**os.environ, "BATCHINFER_CACHE_DIR": str(cache)}
    racers = [subprocess.Popen([sys.executable, "-c", RACER, str(signals / f"ready{i}"), str(signals / "go")],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    deadline = time.monotonic() + 120
    while not all((signals / f"ready{i}").exists() for i in range(2)) and time.monotonic() < deadline:
        time.sleep(0.01)
    (signals / "go").touch()
    results = [racer.communicate(timeout=300) for racer in racers]
    assert [racer.returncode for racer in racers] == [0, 0], [err for _, err in results]
    assert [out.split() for out, _ in results] == [["False", str(cache / DEMO_VERSION)]] * 2  # both built
    assert sorted(p.name for p in cache.iterdir()) == [DEMO_VERSION]  # no staging folder left behind
    return cache / DEMO_VERSION


def test_demo_is_deterministic_and_complete(demo_dir, tmp_path, monkeypatch):
    assert sorted(p.name for p in demo_dir.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    monkeypatch.setenv("BATCHINFER_CACHE_DIR", str(tmp_path))
    assert file_hashes(random_demo_checkpoint()) == file_hashes(demo_dir)
    config = load_model_config(demo_dir)
    assert config.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    tokenizer = CheckpointTokenizer.from_checkpoint(demo_dir)
    assert tokenizer.vocab_size == config.vocab_size
    assert tokenizer.eos_token_ids == (2, 0)
    text = "The river town woke early, 12 résumés 🙂"
    assert tokenizer.decode(tokenizer.encode_batch([text])[0]) == text  # byte-level: lossless


@pytest.mark.parametrize("system", [None, "You answer in one word."])
def test_chat_prompts_equal_transformers_apply_chat_template(demo_dir, system):
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(str(demo_dir))
    questions = ["What does the state hold?", "  Why do leaves look green?\n", "x" * 7]
    batch = build_prompts(pa.table({"q": questions}), PromptSpec(column="q"),
                          CheckpointTokenizer.from_checkpoint(demo_dir), chat=True, system=system, vocab_size=1024)
    for question, ids in zip(questions, batch.token_ids):
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": question}]
        expected = reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                 return_dict=False)
        assert ids == list(expected)


# ---- the trained demo: its task, tokenizer, training script and how `model: demo` finds it ----

import random  # noqa: E402
import re  # noqa: E402

from batchinfer import demo, demo_task  # noqa: E402

LINE = re.compile(r"The (" + "|".join(demo_task.ATTRIBUTES) + r") of ([A-Z][a-z]{4,7}) is ([1-9]\d{3})\.")


def test_task_documents_follow_the_issue_format():
    rng = random.Random(5)
    for n_facts in (10, 37, 80):
        facts = demo_task.make_document(rng, n_facts)
        lines = demo_task.document_text(facts).split("\n")
        assert len(lines) == n_facts
        pairs = [LINE.fullmatch(line).groups()[:2] for line in lines]
        assert len(set(pairs)) == n_facts  # each (attribute, Name) once
        fact = facts[3]
        assert demo_task.prompt_text(facts, fact) == (
            demo_task.document_text(facts) + f"\nQuestion: What is the {fact.attribute} of {fact.name}?\nAnswer:")
    rows = demo_task.held_out_rows(seed=3, n_docs=4, questions_per_doc=5)
    assert rows == demo_task.held_out_rows(seed=3, n_docs=4, questions_per_doc=5)  # seeded
    row = rows[0]
    facts_of_row = dict(((a, n), v) for a, n, v in (LINE.fullmatch(x).groups() for x in row["document"].split("\n")))
    attribute, name = re.fullmatch(r"What is the (\w+) of (\w+)\?", row["question"]).groups()
    assert facts_of_row[(attribute, name)] == row["answer"]
    assert demo_task.row_prompt(row) == f"{row['document']}\nQuestion: {row['question']}\nAnswer:"
    # Names repeat with other attributes, so a question must match both.
    assert any(len({n for _, n in pairs}) < len(pairs) for pairs in
               [[(f.attribute, f.name) for f in demo_task.make_document(random.Random(s), 60)] for s in range(5)])


@pytest.mark.parametrize("text, right", [(" 1234", True), ("1234\nQuestion", True), ("1234.", True),
                                         (" 12345", False), ("123", False), ("", False), ("x1234", False)])
def test_task_correctness_rule(text, right):
    assert demo_task.is_correct(text, "1234") is right


def test_demo_tokenizer_pieces_and_round_trip():
    from benchmarks.demo_model.tokenizer import build_tokenizer
    from benchmarks.demo_model.train import Encoder

    tokenizer = build_tokenizer()
    text = "The seat of Theodora is 4071.\nQuestion: What is the seat of Theodora?\nAnswer:"
    tokens = tokenizer.encode(text).tokens
    assert tokens[:4] == ["The", " seat", " of", " "] and tokens[4:12] == list("Theodora")  # a name: letters
    assert tokens[12:18] == [" is", " ", "4", "0", "7", "1"]
    assert tokens[-3:] == ["?", "\n", "Answer:"] and "Question:" in tokens and " What" in tokens
    odd = "12 résumés 🙂 <b>\t{x}"
    assert tokenizer.decode(tokenizer.encode(odd).ids) == odd  # byte fallback: lossless
    encoder = Encoder()
    for seed in range(3):
        encoder.check(random.Random(seed))  # the training loop's piece ids equal the tokenizer's


def test_model_demo_prefers_the_shipped_checkpoint(tmp_path, monkeypatch):
    shipped = tmp_path / "demo_checkpoint"
    shipped.mkdir()
    monkeypatch.setattr(demo, "SHIPPED_DEMO_DIR", shipped)
    monkeypatch.setenv("BATCHINFER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(demo, "random_demo_checkpoint", lambda: tmp_path / "random")
    monkeypatch.delenv("BATCHINFER_DEMO", raising=False)
    for name in demo.SHIPPED_DEMO_FILES[:-1]:
        (shipped / name).write_text("{}")
    assert demo.demo_checkpoint() == tmp_path / "random"  # incomplete: not used
    (shipped / demo.SHIPPED_DEMO_FILES[-1]).write_text("{}")
    assert demo.demo_checkpoint() == shipped
    monkeypatch.setenv("BATCHINFER_DEMO", "random")
    assert demo.demo_checkpoint() == tmp_path / "random"
    monkeypatch.setenv("BATCHINFER_DEMO", "trained")
    with pytest.raises(ValueError, match="BATCHINFER_DEMO"):
        demo.demo_checkpoint()


def test_pyproject_ships_the_demo_checkpoint_files():
    import tomllib

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert "demo_checkpoint/*" in pyproject["tool"]["setuptools"]["package-data"]["batchinfer"]
    assert demo.SHIPPED_DEMO_DIR.parent.name == "batchinfer"


def test_training_starts_gdn_layers_with_long_memory():
    """transformers' init forgets nearly everything after one token (the look-up never starts)."""
    import torch
    transformers = pytest.importorskip("transformers")
    import torch.nn.functional as F
    from benchmarks.demo_model import train

    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**train.model_config(416, tiny=True)))
    train.init_gdn_decay(model)
    gdn = [m for m in model.modules() if hasattr(m, "A_log")]
    assert len(gdn) == 3
    # Per-token decay of the state at a = 0: exp(-A softplus(dt_bias)).
    decay = torch.cat([torch.exp(-m.A_log.exp() * F.softplus(m.dt_bias)) for m in gdn])
    assert (decay > 0.2).float().mean() >= 0.75 and decay.median() > 0.5


def test_curriculum_starts_at_one_fact_and_grows_on_success_and_along_its_floor():
    from benchmarks.demo_model.train import Curriculum

    curriculum = Curriculum(max_facts=80, advance_at=0.8, floor_until=0.5)
    assert curriculum.level == 1 and curriculum.fact_range() == (1, 1)
    for _ in range(100):
        curriculum.update(0.3, progress=0.0)  # not learned: stays
    assert curriculum.level == 1
    levels = []
    while curriculum.level < 80:
        curriculum.update(1.0, progress=0.0)
        levels.append(curriculum.level)
    assert sorted(set(levels))[:6] == [1, 2, 3, 4, 5, 6] and len(set(levels)) < 30  # +1, then x1.25
    assert curriculum.fact_range() == (demo_task.MIN_FACTS, 80)  # the task's range at the end
    prefetched = Curriculum(max_facts=80, advance_at=0.8, floor_until=0.5, level=4)
    for _ in range(50):
        prefetched.update(1.0, progress=0.0, batch_level=3)  # made before the last level-up: ignored
    assert prefetched.level == 4
    stuck = Curriculum(max_facts=80, advance_at=0.8, floor_until=0.5)
    stuck.update(0.0, progress=0.25)
    assert 5 <= stuck.level <= 12  # the floor: geometric, 80 ** 0.5 ~ 9 halfway
    stuck.update(0.0, progress=0.5)
    assert stuck.level == 80


def test_training_loss_counts_whole_answers_right():
    import torch
    from benchmarks.demo_model import train

    encoder = train.Encoder()
    facts = demo_task.make_document(random.Random(1), 3)
    ids, answer, valid = (torch.from_numpy(a) for a in train.pad_rows([encoder.sequence(facts, facts[:2])], 0))

    class Oracle(torch.nn.Module):  # predicts every next token, except one digit of the second answer
        def forward(self, input_ids, use_cache):
            logits = torch.nn.functional.one_hot(input_ids[:, 1:], 416).float()
            logits = torch.cat([logits, logits[:, :1]], dim=1)
            second = answer[0].nonzero().flatten()[8]
            logits[0, second - 1] = logits[0, second - 1].roll(1)
            return type("Out", (), {"logits": logits})

    _, _, all_right, answers_right = train.losses(Oracle(), ids, answer, valid)
    assert float(answers_right) == 0.5 and not bool(all_right[0])


def test_training_writes_a_checkpoint_that_transformers_and_the_engine_agree_on(tmp_path):
    """A tiny run (2 steps) and its resume (1 more): both loaders give the same greedy tokens."""
    pytest.importorskip("transformers")
    from benchmarks.demo_model import train

    out = tmp_path / "ckpt"
    train.main(["--tiny", "--steps", "2", "--minutes", "5", "--out", str(out), "--eval-size", "4"])
    train.main(["--tiny", "--steps", "3", "--minutes", "5", "--out", str(out), "--resume", str(out)])
    assert sorted(p.name for p in out.iterdir()) == sorted(demo.SHIPPED_DEMO_FILES + ("train_state",))
    from safetensors import safe_open
    with safe_open(str(out / "train_state" / "exp_avg.safetensors"), "pt") as handle:
        assert '"step": 3' in handle.metadata()["meta"]
    assert_engine_and_transformers_agree(out, demo_task.held_out_rows(seed=11, n_docs=2, questions_per_doc=2,
                                                                      max_facts=12))


def assert_engine_and_transformers_agree(folder, rows, max_tokens: int = 5) -> None:
    """Our engine (fp32, CPU) and transformers' generate give the same greedy tokens on `rows`."""
    import torch
    transformers = pytest.importorskip("transformers")
    from batchinfer.engine.config import EngineConfig
    from benchmarks.demo_model import evaluate

    result = evaluate.evaluate(folder, rows, EngineConfig(device="cpu", dtype="float32"), max_tokens=max_tokens)
    tokenizer = CheckpointTokenizer.from_checkpoint(folder)
    reference = transformers.Qwen3_5ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for row in rows:
        ids = tokenizer.encode_batch([demo_task.row_prompt(row)])[0]
        expected = reference.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                                      eos_token_id=0, pad_token_id=0)[0, len(ids):].tolist()
        assert list(result.completions[row["question_id"]]) == expected


@pytest.mark.skipif(demo.shipped_demo_checkpoint() is None, reason="the trained demo is not in the package")
def test_the_shipped_demo_answers_fresh_questions():
    from batchinfer.engine.config import EngineConfig
    from benchmarks.demo_model import evaluate

    rows = demo_task.held_out_rows(seed=99, n_docs=4, questions_per_doc=4)
    result = evaluate.evaluate(demo.shipped_demo_checkpoint(), rows, EngineConfig(device="cpu", dtype="float32"))
    assert result.correct >= 14, result.texts  # of 16; the model card's measured accuracy is ~0.95+


@pytest.mark.skipif(demo.shipped_demo_checkpoint() is None, reason="the trained demo is not in the package")
def test_batchinfer_run_on_fresh_questions_is_at_least_95_percent_right(tmp_path):
    """The issue's bar, through the CLI: fresh documents (seed outside training and the example),
    greedy, the job's exact-match accuracy from its _stats.json."""
    import json
    import subprocess

    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = demo_task.held_out_rows(seed=4242, n_docs=12, questions_per_doc=8)
    pq.write_table(pa.table({k: [r[k] for r in rows] for k in ("question_id", "document", "question", "answer")}),
                   tmp_path / "q.parquet")
    (tmp_path / "job.yaml").write_text(
        "jobs:\n  - name: fresh\n    model: demo\n    input: q.parquet\n    id_column: question_id\n"
        "    prompt: {template: \"{document}\\nQuestion: {question}\\nAnswer:\"}\n"
        "    sampling: {max_tokens: 8, temperature: 0.0, stop: [\"\\n\"]}\n"
        "    eval: {answer_column: answer}\n    output: {path: out}\n    engine: {device: cpu}\n")
    done = subprocess.run([sys.executable, "-m", "batchinfer", "run", str(tmp_path / "job.yaml")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    evaluation = json.loads((tmp_path / "out" / "_stats.json").read_text())["eval"]
    assert evaluation["judged"] == len(rows) == 96
    assert evaluation["accuracy"] >= 0.95, evaluation
    texts = pq.read_table(tmp_path / "out", columns=["generated_text", "answer"]).to_pylist()
    assert sum(demo_task.is_correct(t["generated_text"], t["answer"]) for t in texts) >= 0.95 * len(rows)


@pytest.mark.skipif(demo.shipped_demo_checkpoint() is None, reason="the trained demo is not in the package")
def test_the_shipped_demo_loads_in_transformers_with_the_same_greedy_answers():
    assert_engine_and_transformers_agree(demo.shipped_demo_checkpoint(),
                                         demo_task.held_out_rows(seed=77, n_docs=2, questions_per_doc=2))
