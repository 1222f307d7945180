"""Train the demo model: a Qwen3.5 GDN hybrid (3 GDN : 1 gated attention) on document look-ups.

    PYTHONUNBUFFERED=1 python -m benchmarks.demo_model.train --minutes 8 --out $OUT/demo_ckpt     # H200, one call
    # a second call continuing it (CKPT: the first call's demo_ckpt, carried; LR re-warms to the
    # cosine position of elapsed/total):
    PYTHONUNBUFFERED=1 python -m benchmarks.demo_model.train --minutes 8 --total-minutes 16 \
        --resume CKPT --out $OUT/demo_ckpt
    python -m benchmarks.demo_model.train --minutes 0.5 --tiny --out /tmp/demo_tiny   # CPU smoke

Each training sequence is one document followed by several questions, each answered and
ended by EOS (`doc\nQuestion: ..\nAnswer: 1234<eos>\nQuestion: ..`), so the first question
sits exactly where an inference prompt's does and the others add signal at no extra document
cost. Loss: mean cross-entropy over answer tokens (` `, 4 digits, EOS) plus `--aux-weight`
times the mean over all other tokens.

Curriculum (the look-up is not learned without it: started at 10 facts, the answer loss stays
at the no-retrieval level): documents start at 1 fact; the largest fact count grows by x1.25
(at least +1) each time the running fraction of answers right under teacher forcing passes
`--advance-at`, and at least along a floor that reaches 80 facts at `--curriculum` of training.
A batch's documents have between min(level/4, 10) and `level` facts. GDN layers start with the
long-memory decay init of flash-linear-attention (dt log-uniform in [1e-3, 0.1]); transformers'
init (dt_bias = 1, A up to 16) forgets almost everything after one token.
The LR schedule (warmup, flat, cosine over the last quarter) and the curriculum floor follow
training progress: steps/`--steps` when given (exactly reproducible from the seed on the CPU),
otherwise elapsed/`--total-minutes` (wall-clock, reproducible in distribution).

The output folder is a Hugging Face checkpoint (config.json, model.safetensors in bf16,
tokenizer files) that transformers and batchinfer both load, plus `train_state/` (AdamW moments
in bf16 with step and elapsed time) for `--resume`, which continues from the bf16 weights; the
shipped model omits train_state. 7 files, each under 16 MiB.
Uses flash-linear-attention's GDN kernels when `fla` imports (transformers picks them up),
else transformers' torch implementation; the first line printed says which.
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import copy
import importlib.util
import json
import math
import multiprocessing
import random
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from batchinfer import demo_task
from benchmarks.demo_model.tokenizer import EOS_TOKEN, build_tokenizer, write_tokenizer_files

MAX_POSITIONS = 4096
ANSWER_TOKENS = 6  # space, 4 digits, EOS


def model_config(vocab_size: int, tiny: bool) -> dict:
    """Qwen3.5-text config: 8 layers (GDN, GDN, GDN, attention) x 2; --tiny: 4 layers, hidden 64."""
    hidden, layers, inter = (64, 4, 128) if tiny else (256, 8, 512)
    head_dim = 16 if tiny else 64
    return dict(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim, linear_conv_kernel_dim=4, hidden_act="silu", rms_norm_eps=1e-6,
        max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=False, initializer_range=0.02,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        bos_token_id=None, eos_token_id=0, pad_token_id=0,
    )


def init_gdn_decay(model) -> None:
    """Long-memory GDN decay at init, as flash-linear-attention's GatedDeltaNet does: A ~ U(1, 16),
    dt log-uniform in [1e-3, 0.1] (dt_bias = softplus^-1(dt)), so g = -A dt is mostly small.
    transformers' init (dt_bias = 1) gives g ~ -A * 1.3: nearly every head forgets each token."""
    for module in model.modules():
        if hasattr(module, "A_log") and hasattr(module, "dt_bias"):
            n = module.dt_bias.numel()
            dt = torch.exp(torch.rand(n) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            with torch.no_grad():
                module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
                module.A_log.copy_(torch.empty(n).uniform_(1, 16).log())


class Curriculum:
    """The largest fact count per document: starts at 1, x`grow` (at least +1) whenever the EMA of
    answers right (teacher-forced) passes `advance_at`, never below a floor rising to `max_facts`."""

    def __init__(self, max_facts: int, advance_at: float, floor_until: float, grow: float = 1.25, level: int = 1):
        self.max_facts, self.advance_at, self.floor_until, self.grow = max_facts, advance_at, floor_until, grow
        self.level, self.ema = level, 0.0

    def floor(self, progress: float) -> int:
        # Geometric from 1 to max_facts: each level gets a similar share of training.
        frac = min(1.0, progress / self.floor_until) if self.floor_until > 0 else 1.0
        return max(1, math.floor(self.max_facts ** frac))

    def update(self, answers_right: float, progress: float, batch_level: int | None = None) -> None:
        """`batch_level`: the level the batch was made at; prefetched batches of an older level
        do not count, so that easy batches cannot advance the level twice."""
        if batch_level is None or batch_level >= self.level:
            self.ema = 0.9 * self.ema + 0.1 * answers_right
        if self.ema > self.advance_at and self.level < self.max_facts:
            self.level, self.ema = min(self.max_facts, max(self.level + 1, round(self.level * self.grow))), 0.0
        floor = self.floor(progress)
        if floor > self.level:
            self.level, self.ema = floor, 0.0

    def fact_range(self) -> tuple[int, int]:
        return max(1, min(self.level // 4, demo_task.MIN_FACTS)), self.level


def gdn_backend() -> str:
    if importlib.util.find_spec("fla") is None:
        return "torch (transformers' chunked fallback; fla not installed)"
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except Exception as error:  # broken fla install: transformers falls back too
        return f"torch (fla import failed: {error})"
    return "fla (flash-linear-attention kernels)"


class Encoder:
    """Token ids of task text built straight from its pieces (the tokenizer's own split, checked
    against `tokenizer.encode` at start-up): data generation must keep up with the GPU."""

    def __init__(self):
        self.tokenizer = build_tokenizer()
        vocab = self.tokenizer.get_vocab()
        self.eos = vocab[EOS_TOKEN]
        self.id = vocab

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def _name(self, name: str) -> list[int]:
        return [self.id[" "]] + [self.id[c] for c in name]

    def _value(self, value: int) -> list[int]:
        return [self.id[" "]] + [self.id[c] for c in str(value)]

    def document(self, facts: list[demo_task.Fact]) -> list[int]:
        v = self.id
        ids: list[int] = []
        for i, f in enumerate(facts):
            if i:
                ids.append(v["\n"])
            ids += [v["The"], v[" " + f.attribute], v[" of"], *self._name(f.name), v[" is"], *self._value(f.value),
                    v["."]]
        return ids

    def question(self, fact: demo_task.Fact) -> list[int]:
        """`\nQuestion: What is the {attribute} of {Name}?\nAnswer:`"""
        v = self.id
        return [v["\n"], v["Question:"], v[" What"], v[" is"], v[" the"], v[" " + fact.attribute], v[" of"],
                *self._name(fact.name), v["?"], v["\n"], v["Answer:"]]

    def answer(self, fact: demo_task.Fact) -> list[int]:
        return self._value(fact.value) + [self.eos]

    def sequence(self, facts: list[demo_task.Fact], asked: list[demo_task.Fact]) -> tuple[list[int], list[bool]]:
        """Ids of the document and its questions, and a mask of the answer tokens (space, digits, EOS)."""
        ids = self.document(facts)
        mask = [False] * len(ids)
        for fact in asked:
            question, answer = self.question(fact), self.answer(fact)
            ids += question + answer
            mask += [False] * len(question) + [True] * len(answer)
        return ids, mask

    def check(self, rng: random.Random) -> None:
        facts = demo_task.make_document(rng, 12)
        text = demo_task.prompt_text(facts, facts[0]) + demo_task.answer_text(facts[0])
        built = self.document(facts) + self.question(facts[0]) + self.answer(facts[0])[:-1]
        assert built == self.encode(text), "piece ids differ from the tokenizer's"


_ENCODER: Encoder | None = None


def batch_arrays(seed: int, step: int, fact_range: tuple[int, int], batch_tokens: int, questions: int):
    """One training batch as numpy arrays (ids int64 [B, T], answer mask, valid mask), right-padded
    (causal: pads never leak into real tokens). A function of its arguments alone, for worker processes."""
    global _ENCODER
    if _ENCODER is None:
        _ENCODER = Encoder()
    rng = random.Random(seed * 1_000_003 + step)
    rows, tokens = [], 0
    while tokens < batch_tokens or len(rows) < 2:
        facts = demo_task.make_document(rng, rng.randint(*fact_range))
        rows.append(_ENCODER.sequence(facts, rng.sample(facts, min(questions, len(facts)))))
        tokens += len(rows[-1][0])
    return pad_rows(rows, _ENCODER.eos)


def pad_rows(rows, eos: int):
    import numpy as np

    length = max(len(ids) for ids, _ in rows)
    ids = np.full((len(rows), length), eos, dtype=np.int64)
    answer = np.zeros((len(rows), length), dtype=bool)
    valid = np.zeros((len(rows), length), dtype=bool)
    for row, (row_ids, mask) in enumerate(rows):
        ids[row, :len(row_ids)] = row_ids
        answer[row, :len(row_ids)] = mask
        valid[row, :len(row_ids)] = True
    return ids, answer, valid


def to_device(arrays, device):
    return tuple(torch.from_numpy(a).to(device, non_blocking=True) for a in arrays)


def losses(model, ids, answer, valid):
    """(answer loss, other-token loss, per-row all-answers-right, fraction of answers right;
    both under teacher forcing)."""
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()  # [B, T-1, V]
    targets, answer_t, valid_t = ids[:, 1:], answer[:, 1:], valid[:, 1:]
    token_loss = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")  # [B, T-1]
    other_t = valid_t & ~answer_t
    answer_loss = (token_loss * answer_t).sum() / answer_t.sum().clamp(min=1)
    other_loss = (token_loss * other_t).sum() / other_t.sum().clamp(min=1)
    wrong = (logits.argmax(-1) != targets) & answer_t
    # Every answer is ANSWER_TOKENS contiguous tokens: row-major selection groups them in order.
    answers_right = (~wrong)[answer_t].view(-1, ANSWER_TOKENS).all(dim=1).float().mean()
    return answer_loss, other_loss, ~wrong.any(dim=1), answers_right


@torch.no_grad()
def held_out_accuracy(model, encoder: Encoder, batches: list, autocast) -> float:
    """Greedy accuracy on fixed held-out prompts (one question each, 10-80 facts): teacher-forced argmax
    over ` value<eos>` equals what greedy decoding would produce, and EOS ends the answer."""
    model.eval()
    right = total = 0
    for ids, answer, valid in batches:
        with autocast():
            _, _, ok, _ = losses(model, ids, answer, valid)
        right += int(ok.sum())
        total += ok.numel()
    model.train()
    return right / max(1, total)


def held_out_batches(encoder: Encoder, n: int, device, seed: int, max_facts: int = demo_task.MAX_FACTS) -> list:
    rng = random.Random(demo_task.HELD_OUT_SEED_OFFSET + seed)
    batches = []
    for start in range(0, n, 16):
        rows = []
        for _ in range(min(16, n - start)):
            facts = demo_task.make_document(rng, rng.randint(demo_task.MIN_FACTS, max_facts))
            rows.append(encoder.sequence(facts, [rng.choice(facts)]))
        batches.append(to_device(pad_rows(rows, encoder.eos), device))
    return batches


def lr_at(progress: float, peak: float, warmup: float, decay_from: float = 0.75) -> float:
    """Warmup, flat (the curriculum needs a high LR at every level), cosine to 10% from decay_from."""
    if progress < warmup:
        return peak * max(progress, 1e-3) / warmup
    frac = min(1.0, max(0.0, progress - decay_from) / max(1e-9, 1 - decay_from))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def save_checkpoint(model, optimizer, out: Path, meta: dict) -> None:
    """Write into a sibling temp folder, then swap it in: a kill mid-save leaves the old one whole."""
    from safetensors.torch import save_file

    out = Path(out)
    staging = out.with_name(out.name + ".saving")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    shipped = copy.deepcopy(model).to(torch.bfloat16)
    shipped.save_pretrained(staging, safe_serialization=True)
    write_tokenizer_files(staging, MAX_POSITIONS)
    # Resume state: AdamW moments in bf16, one file each (files coming back from the device are
    # at most 16 MiB each, 8 in all); the weights resume from model.safetensors (bf16).
    state = staging / "train_state"
    state.mkdir()
    names = {id(p): n for n, p in model.named_parameters()}
    moments = {"exp_avg": {}, "exp_avg_sq": {}}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if s := optimizer.state.get(p):
                for key, tensors in moments.items():
                    tensors[names[id(p)]] = s[key].to(torch.bfloat16).cpu().contiguous()
    for key, tensors in moments.items():
        save_file(tensors, str(state / f"{key}.safetensors"), metadata={"meta": json.dumps(meta)})
    old = out.with_name(out.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    staging.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def load_resume(model, optimizer, folder: Path) -> dict:
    from safetensors import safe_open
    from safetensors.torch import load_file

    folder = Path(folder)
    weights = load_file(str(folder / "model.safetensors"))
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
    assert not unexpected and all("lm_head" not in m for m in missing), (missing, unexpected)
    state = folder / "train_state"
    with safe_open(str(state / "exp_avg.safetensors"), "pt") as handle:
        meta = json.loads(handle.metadata()["meta"])
    exp_avg = load_file(str(state / "exp_avg.safetensors"))
    exp_avg_sq = load_file(str(state / "exp_avg_sq.safetensors"))
    for name, p in model.named_parameters():
        if name in exp_avg:
            optimizer.state[p] = {"step": torch.tensor(float(meta["step"]), dtype=torch.float32, device=p.device),
                                  "exp_avg": exp_avg[name].to(p.device, torch.float32),
                                  "exp_avg_sq": exp_avg_sq[name].to(p.device, torch.float32)}
    return meta


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="checkpoint folder (rewritten at every save)")
    p.add_argument("--minutes", type=float, required=True, help="wall-clock budget of this call")
    p.add_argument("--total-minutes", type=float, default=None,
                   help="length of the whole schedule across resumed calls (default: elapsed so far + --minutes)")
    p.add_argument("--steps", type=int, default=None, help="schedule by steps instead of time (exact reproducibility)")
    p.add_argument("--resume", type=Path, default=None, help="checkpoint folder written by this script")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="a 4-layer hidden-64 model and short documents (CPU smoke)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--batch-tokens", type=int, default=None, help="tokens per batch (default 65536; --tiny 2048)")
    p.add_argument("--max-facts", type=int, default=None,
                   help="largest documents (default the task's 80; --tiny 20), reached by the curriculum")
    p.add_argument("--questions", type=int, default=16, help="questions per training document (at most its facts)")
    p.add_argument("--aux-weight", type=float, default=0.1)
    p.add_argument("--curriculum", type=float, default=0.6,
                   help="fraction of progress by which the curriculum floor reaches the largest documents")
    p.add_argument("--advance-at", type=float, default=0.8,
                   help="grow documents when this running fraction of answers is right (teacher-forced)")
    p.add_argument("--warmup", type=float, default=0.02)
    p.add_argument("--save-every", type=float, default=3.0, help="minutes between checkpoints")
    p.add_argument("--log-every", type=float, default=20.0, help="seconds between progress lines")
    p.add_argument("--eval-size", type=int, default=128, help="held-out questions per progress line")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--workers", type=int, default=None,
                   help="data-generation processes (default: 6 on CUDA, 0 = in the training loop on CPU)")
    args = p.parse_args(argv)
    if args.workers is None:
        args.workers = 6 if args.device.startswith("cuda") else 0
    return args


def main(argv=None) -> None:
    import transformers as tf

    args = parse_args(argv)
    device = torch.device(args.device)
    torch.set_float32_matmul_precision("high")  # TF32 for the fp32 matmuls of the torch GDN fallback
    torch.manual_seed(args.seed)
    encoder = Encoder()
    encoder.check(random.Random(args.seed))
    # Workers start before CUDA is touched; each builds whole batches from (seed, step) alone.
    pool = (concurrent.futures.ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn"))
            if args.workers else None)
    vocab = -(-encoder.tokenizer.get_vocab_size() // 32) * 32
    config = tf.Qwen3_5TextConfig(**model_config(vocab, args.tiny))
    model = tf.Qwen3_5ForCausalLM(config)
    init_gdn_decay(model)
    model = model.to(device)
    model.config.use_cache = False
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in name or "embed" in name else decay).append(p)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    meta = {"step": 0, "elapsed_s": 0.0, "seed": args.seed, "tiny": args.tiny, "level": 1}
    if args.resume:
        meta = load_resume(model, optimizer, args.resume)
    prior_s = meta["elapsed_s"]
    total_s = 60 * (args.total_minutes if args.total_minutes else prior_s / 60 + args.minutes)
    use_bf16 = device.type == "cuda"
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if use_bf16 else contextlib.nullcontext
    params = sum(p.numel() for p in model.parameters())
    max_facts = args.max_facts or (20 if args.tiny else demo_task.MAX_FACTS)
    print(f"GDN kernel: {gdn_backend()}; device {device}; bf16 autocast {use_bf16}; params {params / 1e6:.2f}M "
          f"(bf16 {2 * params / 2**20:.1f} MiB); vocab {vocab}; attention {model.config._attn_implementation}; "
          f"data workers {args.workers}; resume step {meta['step']}", flush=True)
    curriculum = Curriculum(max_facts, args.advance_at, args.curriculum, level=meta.get("level", 1))
    eval_batches = held_out_batches(encoder, 16 if args.tiny else args.eval_size, device, seed=args.seed + 7,
                                    max_facts=max_facts)

    start = time.monotonic()
    last_log = last_save = start
    step, tokens_since, loss_sum, loss_n = meta["step"], 0, torch.zeros((), device=device), 0
    batch_tokens = args.batch_tokens or (2048 if args.tiny else 65536)

    def progress_at(at_step: int) -> float:
        return at_step / args.steps if args.steps else (prior_s + time.monotonic() - start) / total_s

    def submit(at_step: int):
        # The batch's fact range is the curriculum's at submit time (a few steps stale with workers: harmless).
        job = (args.seed, at_step, curriculum.fact_range(), batch_tokens, args.questions)
        return (pool.submit(batch_arrays, *job) if pool else job), curriculum.level

    pending = collections.deque(submit(step + k) for k in range(max(1, 2 * args.workers)))
    model.train()
    while True:
        elapsed = time.monotonic() - start
        if elapsed >= 60 * args.minutes or (args.steps and step >= args.steps):
            break
        progress = progress_at(step)
        job, cur_max = pending.popleft()
        arrays = job.result() if pool else batch_arrays(*job)
        pending.append(submit(step + len(pending) + 1))
        ids, answer, valid = to_device(arrays, device)
        lr = lr_at(progress, args.lr, args.warmup)
        for group in optimizer.param_groups:
            group["lr"] = lr
        with autocast():
            answer_loss, other_loss, _, answers_right = losses(model, ids, answer, valid)
            loss = answer_loss + args.aux_weight * other_loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        curriculum.update(float(answers_right), progress_at(step), cur_max)  # one sync per step: cheap next to it
        tokens_since += int(arrays[2].sum())
        loss_sum += answer_loss.detach()  # stays on the device: no sync per step
        loss_n += 1
        now = time.monotonic()
        if now - last_log >= args.log_every:
            acc = held_out_accuracy(model, encoder, eval_batches, autocast)
            print(f"step {step} | {(prior_s + now - start) / 60:5.1f} min | answer loss {float(loss_sum) / loss_n:.3f} "
                  f"| other {float(other_loss.detach()):.3f} | held-out acc {acc:.3f} | facts<={cur_max} (answers right {curriculum.ema:.2f}) "
                  f"| lr {lr:.2e} | {tokens_since / (now - last_log):,.0f} tok/s", flush=True)
            last_log, tokens_since, loss_sum, loss_n = now, 0, torch.zeros((), device=device), 0
        if now - last_save >= 60 * args.save_every:
            save_checkpoint(model, optimizer, args.out, {**meta, "step": step, "elapsed_s": prior_s + now - start,
                                                         "level": curriculum.level})
            last_save = time.monotonic()
    if pool:
        pool.shutdown(wait=False, cancel_futures=True)
    elapsed = time.monotonic() - start
    acc = held_out_accuracy(model, encoder, eval_batches, autocast)
    save_checkpoint(model, optimizer, args.out, {**meta, "step": step, "elapsed_s": prior_s + elapsed,
                                                 "level": curriculum.level})
    size = (args.out / "model.safetensors").stat().st_size
    print(f"done: step {step}, {(prior_s + elapsed) / 60:.1f} min in total, held-out acc {acc:.3f} "
          f"(n={sum(b[0].shape[0] for b in eval_batches)}), saved {args.out} (model.safetensors {size / 2**20:.1f} MiB)",
          flush=True)


if __name__ == "__main__":
    main()
