"""One parsed event of an OpenAI-compatible stream, read for what a relay must know of it.

Read from the JSON's structure, never from its spelling: the same answer reaches the gateway from
vLLM 0.32 (compact, ``token_ids`` on request), older vLLM (no ids), SGLang, or a proxy that writes
``json.dumps`` spacing, reorders keys or adds fields. What counts as *content* is what a client reads
beyond bookkeeping: text, a chat delta's content, reasoning, tool calls or refusal, logprobs, a finish
reason, usage, or any field this reader does not know. Token ids, the prompt's ids, indices, ids
and nulls or empty strings are not. A relay may drop an event only when it has no content.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Fields of a choice (or a chat delta) that are not content: bookkeeping, and what a relay asked for.
_NOT_CONTENT = frozenset({"index", "token_ids", "prompt_token_ids", "role"})


@dataclass(frozen=True, slots=True)
class StreamChunk:
    """What one event says, as far as a relay needs it."""

    choices: int  # how many choices the event has
    finished: bool  # a choice has a finish reason
    ids: list[int] | None  # the first choice's output token ids (None: absent, null or not ints)
    prompt_ids: list[int] | None  # the prompt's ids (the choice's, or chat's top-level field)
    text: bool  # the first choice carries text: completion text, delta content or reasoning
    content: bool  # anything beyond bookkeeping and ids (module docstring); a chat role not included
    role: bool  # a chat delta names the role
    usage: Mapping[str, Any] | None  # the top-level usage, when not null


def token_ids(value: Any) -> list[int] | None:
    """A list of token ids as an engine writes it; None for anything else."""
    if isinstance(value, list) and all(type(t) is int for t in value):
        return value
    return None


def _filled(value: Any) -> bool:
    return value is not None and value != "" and value != [] and value != {}


def _content(fields: Mapping[str, Any]) -> bool:
    return any(_filled(v) for k, v in fields.items() if k not in _NOT_CONTENT)


def read_chunk(obj: Mapping[str, Any], *, chat: bool) -> StreamChunk | None:
    """The event ``obj`` (a parsed ``data`` field); None when it is not a chunk of a completion or chat
    stream (no ``choices`` list, or choices that are not objects)."""
    choices = obj.get("choices")
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        return None
    usage = obj.get("usage")
    usage = usage if isinstance(usage, dict) else None
    prompt_ids = token_ids(obj.get("prompt_token_ids"))
    if not choices:
        return StreamChunk(0, False, None, prompt_ids, False, usage is not None, False, usage)
    first = choices[0]
    if prompt_ids is None:
        prompt_ids = token_ids(first.get("prompt_token_ids"))
    role = False
    if chat:
        delta = first.get("delta")
        delta = delta if isinstance(delta, dict) else {}
        text = any(_filled(delta.get(k)) for k in ("content", "reasoning_content", "reasoning"))
        role = _filled(delta.get("role"))
    else:
        text = _filled(first.get("text"))
    content = usage is not None
    for choice in choices:
        fields = dict(choice)
        inner = fields.pop("delta", None) if chat else None
        content = content or _content(fields) or (isinstance(inner, dict) and _content(inner))
    return StreamChunk(
        choices=len(choices),
        finished=any(c.get("finish_reason") is not None for c in choices),
        ids=token_ids(first.get("token_ids")),
        prompt_ids=prompt_ids,
        text=text,
        content=content,
        role=role,
        usage=usage,
    )


def is_error(obj: Mapping[str, Any]) -> bool:
    """An error event in place of a chunk (vLLM's ``{"error": {...}}``, or an ``"object": "error"``)."""
    return "choices" not in obj and ("error" in obj or obj.get("object") == "error")
