"""A job's sampling values: its own, else the checkpoint's generation_config.json, else built-in defaults.

Model publishers put their recommended sampling in generation_config.json (Qwen3.5-35B-A3B:
temperature 1.0, top_p 0.95, top_k 20); a job that names no temperature decodes with it, as
vLLM does. The keys the sampler supports are taken; the other sampling keys a file may hold
(presence_penalty, typical_p, num_beams, ...) are reported as ignored. `do_sample: false` means
greedy decoding, as it does in transformers' `generate`. `sampling.use_generation_config: false`
leaves the file out. Which value came from where is reported in `_stats.json` and the summary.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from batchinfer.engine.types import SamplingParams
from batchinfer.jobs.errors import JobError
from batchinfer.jobs.spec.job_file import SAMPLING_KEYS, JobSpec

GENERATION_CONFIG = "generation_config.json"
# generation_config.json keys our sampler implements (the same names in a job's `sampling:`)
TAKEN_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# sampling keys transformers' GenerationConfig may hold that our sampler does not implement
IGNORED_KEYS = ("presence_penalty", "frequency_penalty", "typical_p", "epsilon_cutoff", "eta_cutoff",
                "num_beams", "penalty_alpha", "no_repeat_ngram_size", "length_penalty", "max_new_tokens",
                "min_new_tokens", "max_length", "min_length")
SOURCE_JOB = "job"
SOURCE_CHECKPOINT = GENERATION_CONFIG
SOURCE_DEFAULT = "default"


@dataclass(frozen=True)
class ResolvedSampling:
    params: SamplingParams
    sources: tuple[tuple[str, str], ...]   # (sampling key, SOURCE_*) for every SamplingParams field
    ignored: tuple[str, ...] = ()          # generation_config.json keys present but not implemented here

    def report(self) -> dict[str, Any]:
        """What `_stats.json` records under "sampling"."""
        values = {name: getattr(self.params, name) for name, _ in self.sources}
        values = {name: list(value) if isinstance(value, tuple) else value for name, value in values.items()}
        return {"values": values, "sources": dict(self.sources), "generation_config_ignored": list(self.ignored)}


def _generation_config(checkpoint: Path, spec: JobSpec) -> dict:
    path = checkpoint / GENERATION_CONFIG
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise JobError(spec.job_file, spec.where("model"), f"{GENERATION_CONFIG} cannot be read: {exc}") from None
    if not isinstance(raw, dict):
        raise JobError(spec.job_file, spec.where("model"), f"{GENERATION_CONFIG} must hold a JSON object")
    return raw


def checkpoint_sampling(checkpoint: Path, spec: JobSpec) -> tuple[dict[str, Any], tuple[str, ...]]:
    """(the sampling values generation_config.json sets that the sampler supports, keys it ignores)."""
    raw = _generation_config(checkpoint, spec)
    values: dict[str, Any] = {}
    for key in TAKEN_KEYS:
        if raw.get(key) is None:
            continue
        try:
            values[key] = SAMPLING_KEYS[key](raw[key])
        except ValueError as exc:
            raise JobError(spec.job_file, spec.where("model"), f"{GENERATION_CONFIG}: {key}: {exc}") from None
    if raw.get("do_sample") is False:
        values["temperature"] = 0.0
    # transformers fills absent keys with its own defaults, which say nothing about the model.
    ignored = tuple(key for key in IGNORED_KEYS if raw.get(key) is not None)
    return values, ignored


def resolve_sampling(spec: JobSpec, checkpoint: Path) -> ResolvedSampling:
    """The job's sampling with each value it did not set taken from the checkpoint, where it has one."""
    from_checkpoint, ignored = checkpoint_sampling(checkpoint, spec) if spec.use_generation_config else ({}, ())
    taken = {key: value for key, value in from_checkpoint.items() if key not in spec.sampling_keys}
    try:
        params = replace(spec.sampling, **taken)
    except ValueError as exc:  # a combination the engine refuses, e.g. min_tokens vs max_tokens
        raise JobError(spec.job_file, spec.where("sampling"), f"with {GENERATION_CONFIG}'s values: {exc}") from None
    sources = tuple((f.name, SOURCE_JOB if f.name in spec.sampling_keys else
                     SOURCE_CHECKPOINT if f.name in taken else SOURCE_DEFAULT)
                    for f in fields(SamplingParams) if f.name in SAMPLING_KEYS)
    return ResolvedSampling(params=params, sources=sources, ignored=ignored)
