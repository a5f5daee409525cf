"""One parsed event of an OpenAI-compatible stream, read for what a relay must know of it.

Read from the JSON's structure, never from its spelling: the same answer reaches the gateway from
vLLM 0.32 (compact, ``token_ids`` on request), older vLLM (no ids), SGLang, or a proxy that writes
``json.dumps`` spacing, reorders keys or adds fields. What counts as *content* is what a client reads
beyond bookkeeping: text, a chat delta's content, reasoning, tool calls or refusal, logprobs, a finish
reason, usage, or any field this reader does not know. Token ids, the prompt's ids, indices, ids and
empty values are not. A relay may drop an event only when it has no content.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

# Fields of a choice that are not content: bookkeeping, and what a relay asked for.
_NOT_CONTENT = frozenset({"index", "token_ids", "prompt_token_ids"})


class StreamChunk(NamedTuple):
    """What one event says, as far as a relay needs it (a tuple: made for every event read)."""

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
    if type(value) is list and all(type(t) is int for t in value):
        return value
    return None


def read_chunk(obj: Mapping[str, Any], *, chat: bool) -> StreamChunk | None:
    """The event ``obj`` (a parsed ``data`` field); None when it is not a chunk of a completion or chat
    stream (no ``choices`` list, or choices that are not objects).

    Empty values (null, "", [], {}, 0, false) are no content: a field is content when it says something.
    """
    choices = obj.get("choices")
    if type(choices) is not list:
        return None
    usage = obj.get("usage")
    usage = usage if type(usage) is dict else None
    content = usage is not None
    finished = False
    for choice in choices:
        if type(choice) is not dict:
            return None
        for key, value in choice.items():
            if not value or key in _NOT_CONTENT:
                continue
            if key == "delta" and chat and type(value) is dict:
                content = content or any(v for k, v in value.items() if k != "role")
            else:
                content = True  # a text, a finish reason, logprobs, a field not known here
                finished = finished or key == "finish_reason"
    prompt_ids = token_ids(obj.get("prompt_token_ids"))
    if not choices:
        return StreamChunk(0, False, None, prompt_ids, False, content, False, usage)
    first = choices[0]
    if prompt_ids is None:
        prompt_ids = token_ids(first.get("prompt_token_ids"))
    role = False
    if chat:
        delta = first.get("delta")
        delta = delta if type(delta) is dict else {}
        text = bool(delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning"))
        role = bool(delta.get("role"))
    else:
        text = bool(first.get("text"))
    return StreamChunk(
        len(choices), finished, token_ids(first.get("token_ids")), prompt_ids, text, content, role, usage
    )


def is_error(obj: Mapping[str, Any]) -> bool:
    """An error event in place of a chunk (vLLM's ``{"error": {...}}``, or an ``"object": "error"``)."""
    return "choices" not in obj and ("error" in obj or obj.get("object") == "error")
