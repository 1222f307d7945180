"""A stand-in for `batchinfer.engine.Engine` with the same API, for fast tests of jobs/.

Outputs are a deterministic function of (prompt, seed, seed_key, sample), so a resumed
run must reproduce exactly what an uninterrupted run writes. Cached tokens are the
longest common prefix with any earlier prompt, like an ideal prefix cache. It yields
samples in reverse request order, so the runner cannot rely on output order. `generate_units`
runs each unit through `generate`, one after the other, marking each unit's last output.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Iterable, Iterator, Optional, Sequence

from batchinfer.engine.stats import EngineStats
from batchinfer.engine.types import Request, RequestOutput


class SimulatedFailure(RuntimeError):
    pass


def fake_tokens(request: Request, sample: int, vocab_size: int, eos_token_ids: Sequence[int]) -> tuple[int, ...]:
    rng = random.Random(hash((request.prompt_token_ids, request.sampling.seed, request.seed_key, sample)))
    tokens = []
    for _ in range(request.sampling.max_tokens):
        token = rng.randrange(3, vocab_size)
        # A stop (EOS) now and then, so finish_reason "stop" shows up.
        if not request.sampling.ignore_eos and eos_token_ids and rng.random() < 0.15 \
                and len(tokens) >= request.sampling.min_tokens:
            tokens.append(eos_token_ids[0])
            break
        tokens.append(token)
    return tuple(tokens)


@dataclass
class FakeEngine:
    vocab_size: int = 1024
    eos_token_ids: tuple[int, ...] = (2,)
    max_model_len: int = 4096
    fail_after: Optional[int] = None        # raise after yielding this many samples
    stats: EngineStats = field(default_factory=EngineStats)
    calls: list[list[Request]] = field(default_factory=list)
    _seen: list[tuple[int, ...]] = field(default_factory=list)
    _yielded: int = 0

    def settings(self) -> dict:
        return {"fake": True, "max_model_len": self.max_model_len}

    def _cached(self, prompt: tuple[int, ...]) -> int:
        best = 0
        for other in self._seen:
            common = 0
            for a, b in zip(prompt, other):
                if a != b:
                    break
                common += 1
            best = max(best, common)
        return min(best, len(prompt) - 1)

    def generate(self, requests: Iterable[Request]) -> Iterator[RequestOutput]:
        requests = list(requests)
        self.calls.append(requests)
        for request in reversed(requests):
            prompt = request.prompt_token_ids
            for sample in range(request.sampling.n):
                if sample in request.skip_samples:
                    continue
                if self.fail_after is not None and self._yielded >= self.fail_after:
                    raise SimulatedFailure("CUDA out of memory (simulated)")
                self._yielded += 1
                if len(prompt) + 1 > self.max_model_len:
                    yield RequestOutput(request.request_id, sample, (), "error", len(prompt), 0, 0,
                                        f"prompt has {len(prompt)} tokens; max_model_len is {self.max_model_len}")
                    continue
                cached = self._cached(prompt)
                self._seen.append(prompt)
                tokens = fake_tokens(request, sample, self.vocab_size, self.eos_token_ids)
                reason = "stop" if tokens and tokens[-1] in self.eos_token_ids else "length"
                self.stats = replace(self.stats, requests=self.stats.requests + 1,
                                     prompt_tokens=self.stats.prompt_tokens + len(prompt),
                                     cached_tokens=self.stats.cached_tokens + cached,
                                     output_tokens=self.stats.output_tokens + len(tokens))
                yield RequestOutput(request.request_id, sample, tokens, reason, len(prompt), cached, len(tokens))

    def generate_units(self, units: Iterable[Sequence[Request]]) -> Iterator[RequestOutput]:
        for index, unit in enumerate(units):
            previous = None
            for output in self.generate(unit):
                if previous is not None:
                    yield replace(previous, unit_index=index)
                previous = output
            if previous is not None:
                yield replace(previous, unit_index=index, unit_done=True)
