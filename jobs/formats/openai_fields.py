"""One OpenAI / vLLM batch request line → its fields (`parse_line`), or a `LineError` naming the field.

Accepted as OpenAI's Batch API and vLLM's `run-batch` accept them: the sampling fields the engine
has (max_tokens / max_completion_tokens, temperature, top_p, seed, stop, n, logprobs, and vLLM's
top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids), `response_format`
text / json_object / json_schema, per-line `chat_template_kwargs`, a completions `prompt` as a
string, a list of one string, or token ids. A field the engine does not implement is accepted
only at its no-op value (penalties 0, `logit_bias` empty or all 0, `include_stop_str_in_output`
false): any other value would silently change the output, so the line is refused naming it.
Fields that cannot change the output (`user`, `metadata`, `store`, ...) are ignored; the ones
OpenAI would act on (`store: true`, `metadata`, a `service_tier`) give the line a warning.
"""
from __future__ import annotations

import json
import math
from typing import Any, Optional

from batchinfer.jobs.spec.task import ENGINE_FEATURES, MAX_LOGPROBS
from batchinfer.jobs.tasks.schema_strict import strict_schema

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
CHAT, TEXT = "chat.completion", "text_completion"
MAX_CHOICES = 128  # n per line: each choice is a row
MAX_INT = (1 << 31) - 1
# body keys accepted and not used: they do not change what is generated
IGNORED_BODY_KEYS = ("model", "user", "metadata", "store", "service_tier", "stream_options", "parallel_tool_calls")
# vLLM body keys accepted only at the value that changes nothing: (key, no-op value)
NO_OP_KEYS = (("include_stop_str_in_output", False), ("echo", False), ("best_of", 1))
SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "n", "stop", "seed", "logprobs", "top_k", "min_p",
                 "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "min_tokens",
                 "ignore_eos", "stop_token_ids", "stream", "response_format", "chat_template_kwargs")
BODY_KEYS = {CHAT: ("messages", "max_completion_tokens", "top_logprobs") + SAMPLING_KEYS + IGNORED_BODY_KEYS
             + tuple(key for key, _ in NO_OP_KEYS),
             TEXT: ("prompt",) + SAMPLING_KEYS + IGNORED_BODY_KEYS + tuple(key for key, _ in NO_OP_KEYS)}


class LineError(ValueError):
    """Why a request line cannot run (its output line's error message); `param`: the field, if one."""

    def __init__(self, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.param = param if param is not None else param_of(message)


def param_of(message: str) -> Optional[str]:
    """The field a message names (`body.x...: why` → `x...`), None when it names none."""
    head = message.split(":", 1)[0]
    return head[len("body."):] if head.startswith("body.") and " " not in head else None


def _int(body: dict, key: str, low: int, high: int) -> Optional[int]:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise LineError(f"body.{key}: must be an integer in [{low}, {high}], got {value!r}")
    return value


def _number(body: dict, key: str, low: float, high: float, low_open: bool = False) -> Optional[float]:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high or (low_open and value == low):
        raise LineError(f"body.{key}: must be a number in {'(' if low_open else '['}{low}, {high}], got {value!r}")
    return float(value)


def _bool(body: dict, key: str) -> Optional[bool]:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise LineError(f"body.{key}: must be true or false, got {value!r}")
    return value


def _stop(body: dict) -> Optional[list[str]]:
    value = body.get("stop")
    if value is None:
        return None
    value = [value] if isinstance(value, str) else value
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise LineError(f"body.stop: must be a string or a list of non-empty strings, got {value!r}")
    return value or None


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_INT
                                           for t in value)


def _stop_token_ids(body: dict) -> Optional[list[int]]:
    value = body.get("stop_token_ids")
    if value is None:
        return None
    if not _token_ids(value):
        raise LineError(f"body.stop_token_ids: must be a list of token ids, got {value!r}")
    return value or None


def _message_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: text parts only
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise LineError(f"body.messages[{index}].content: only text parts are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise LineError(f"body.messages[{index}].content: must be a string or a list of text parts")


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise LineError("body.messages: must be a non-empty list of messages")
    clean = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise LineError(f"body.messages[{index}]: must be a mapping with a role")
        clean.append({**message, "content": _message_text(message.get("content"), index)})
    return clean


def _prompt(body: dict) -> tuple[Optional[str], Optional[list[int]]]:
    """(prompt text, None) or (None, prompt token ids): one prompt per line."""
    value = body.get("prompt")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a list of one prompt is that prompt
    elif isinstance(value, list) and value and all(isinstance(item, (str, list)) for item in value):
        raise LineError(f"body.prompt: one prompt per line is supported, got {len(value)}")
    if isinstance(value, str) and value:
        return value, None
    if value and _token_ids(value):
        return None, value
    raise LineError("body.prompt: must be a non-empty string, a list of one string, or a list of token ids")


def _logprobs(body: dict, endpoint: str) -> Optional[int]:
    if endpoint == CHAT:  # chat: logprobs is a switch, top_logprobs the k
        _bool(body, "logprobs")
        top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
        if top is not None and not body.get("logprobs"):
            raise LineError("body.top_logprobs: needs logprobs: true")
        return (top or 0) if body.get("logprobs") else None
    return _int(body, "logprobs", 0, MAX_LOGPROBS)  # completions: the k itself


def _response_schema(body: dict) -> Optional[str]:
    form = body.get("response_format")
    if form is None:
        return None
    if not isinstance(form, dict) or form.get("type") not in ("text", "json_object", "json_schema"):
        raise LineError("body.response_format: type must be text, json_object or json_schema")
    if form["type"] == "text":
        return None
    if form["type"] == "json_object":  # any JSON object: an open object schema, never made strict
        return json.dumps({"type": "object"})
    spec = form.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise LineError("body.response_format.json_schema.schema: must be a JSON schema (an object)")
    strict = spec.get("strict", True)  # absent: strict, as every job's schema (jobs/tasks/schema_strict.py)
    if strict is not None and not isinstance(strict, bool):
        raise LineError(f"body.response_format.json_schema.strict: must be true or false, got {strict!r}")
    # Key order kept: it is the order properties are generated in.
    return json.dumps(strict_schema(schema) if strict is not False else schema)


def _check_no_ops(body: dict) -> None:
    """Fields the engine does not implement: only their no-op value runs (any other changes the output)."""
    for key in ("presence_penalty", "frequency_penalty"):  # clients send 0 by default
        value = body.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise LineError(f"body.{key}: must be a number, got {value!r}")
        if value not in (None, 0):
            raise LineError(f"body.{key}: not supported (only 0; use repetition_penalty)")
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                 for v in bias.values()):
            raise LineError(f"body.logit_bias: must map token ids to numbers, got {bias!r}")
        if any(v != 0 for v in bias.values()):
            raise LineError("body.logit_bias: not supported (only empty or all 0)")
    for key, no_op in NO_OP_KEYS:
        if key in body and body[key] is not None and (body[key] != no_op or isinstance(body[key], bool)
                                                      != isinstance(no_op, bool)):
            raise LineError(f"body.{key}: not supported (only {json.dumps(no_op)}), got {body[key]!r}")
    if body.get("stream"):
        raise LineError("body.stream: a batch request cannot stream")


def _warnings(body: dict) -> list[str]:
    """Ignored fields OpenAI would act on (it would store the completion, bill another tier)."""
    notes = []
    if body.get("store") is True:
        notes.append("body.store: ignored (nothing is stored)")
    if body.get("metadata"):
        notes.append("body.metadata: ignored")
    if body.get("service_tier") not in (None, "auto", "default"):
        notes.append(f"body.service_tier: ignored ({body['service_tier']!r})")
    return notes


def _template_kwargs(body: dict) -> Optional[dict]:
    value = body.get("chat_template_kwargs")
    if value is not None and not (isinstance(value, dict) and all(isinstance(k, str) for k in value)):
        raise LineError(f"body.chat_template_kwargs: must be a mapping, got {value!r}")
    return value or None


def parse_line(text: str) -> dict:
    """One request line → its fields (custom_id, endpoint, prompt / prompt_ids or messages, the
    sampling overrides, chat_template_kwargs, warnings); raises LineError with the line's custom_id
    (when it has one) in `.custom_id`."""
    custom_id = None
    try:
        try:
            request = json.loads(text)
        except ValueError as exc:
            raise LineError(f"invalid JSON: {exc}") from None
        if not isinstance(request, dict):
            raise LineError("must be a JSON object")
        custom_id = request.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            custom_id = None
            raise LineError("custom_id: missing (a non-empty string is required)", "custom_id")
        if request.get("method", "POST") != "POST":
            raise LineError(f"method: must be POST, got {request.get('method')!r}", "method")
        url = request.get("url")
        endpoint = {CHAT_URL: CHAT, COMPLETIONS_URL: TEXT}.get(url)
        if endpoint is None:
            raise LineError(f"url: {url!r} is not supported (use {CHAT_URL} or {COMPLETIONS_URL})", "url")
        body = request.get("body")
        if not isinstance(body, dict):
            raise LineError("body: must be a JSON object", "body")
        unknown = [key for key in body if key not in BODY_KEYS[endpoint]]
        if unknown:
            raise LineError(f"body.{unknown[0]}: not supported for {url}")
        _check_no_ops(body)
        fields: dict[str, Any] = {"custom_id": custom_id, "endpoint": endpoint, "warnings": _warnings(body),
                                  "model": body.get("model") if isinstance(body.get("model"), str) else None}
        if endpoint == CHAT:
            fields["messages"] = _messages(body)
            if "max_tokens" in body and "max_completion_tokens" in body:
                raise LineError("body.max_completion_tokens: give max_tokens or max_completion_tokens, not both")
            key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
            fields["max_tokens"] = _int(body, key, 1, MAX_INT)
            fields["template_kwargs"] = _template_kwargs(body)
        else:
            fields["prompt"], fields["prompt_ids"] = _prompt(body)
            fields["max_tokens"] = _int(body, "max_tokens", 1, MAX_INT)
            if body.get("chat_template_kwargs") is not None:
                raise LineError(f"body.chat_template_kwargs: only for {CHAT_URL}")
        fields.update(temperature=_number(body, "temperature", 0.0, 2.0), top_p=_number(body, "top_p", 0.0, 1.0, True),
                      top_k=_int(body, "top_k", -1, 1 << 31), min_p=_number(body, "min_p", 0.0, 1.0),
                      repetition_penalty=_number(body, "repetition_penalty", 0.0, 1e6, True),
                      seed=_int(body, "seed", 0, (1 << 63) - 1), stop=_stop(body),
                      choices=_int(body, "n", 1, MAX_CHOICES) or 1, logprobs_k=_logprobs(body, endpoint),
                      response_schema=_response_schema(body), min_tokens=_int(body, "min_tokens", 0, MAX_INT),
                      ignore_eos=_bool(body, "ignore_eos"), stop_token_ids=_stop_token_ids(body))
        if fields["top_k"] == -1:  # vLLM's "off"
            fields["top_k"] = 0
        if fields["min_tokens"] is not None and fields["max_tokens"] is not None \
                and fields["min_tokens"] > fields["max_tokens"]:
            raise LineError(f"body.min_tokens: must be <= max_tokens ({fields['max_tokens']}), "
                            f"got {fields['min_tokens']}")
        if fields["logprobs_k"] is not None and "logprobs" not in ENGINE_FEATURES:
            raise LineError("body.logprobs: not supported yet by the engine")
        if fields["response_schema"] is not None and "grammar" not in ENGINE_FEATURES:
            raise LineError("body.response_format: not supported yet by the engine")
        return fields
    except LineError as exc:
        exc.custom_id = custom_id  # type: ignore[attr-defined]
        raise
