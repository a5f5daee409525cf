"""What a client reads from an OpenAI-compatible answer: text, finish reasons, usage, ids, errors.

Streams are parsed as an EventSource does (the WHATWG server-sent events rules): lines end in
``\\r\\n``, ``\\r`` or ``\\n``; a blank line ends an event; ``data:`` fields join with ``\\n``; a line
starting with ``:`` is a comment; other fields are ignored, and so is an event the body cut off before
its blank line. Each event's data is ``[DONE]`` or one JSON value.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Answer:
    """What a client read."""

    text: str  # choice 0's text (completions) or content (chat), joined in order
    finish_reasons: tuple[str | None, ...]  # choice 0's non-null finish reasons, in order
    usage: dict[str, Any] | None  # the last usage seen
    token_ids: tuple[int, ...] | None  # choice 0's generated ids, joined; None when no event had any
    prompt_token_ids: tuple[int, ...] | None
    ids: frozenset[str]  # every response id seen
    errors: tuple[dict[str, Any], ...]  # error objects, in order
    done: bool  # a ``data: [DONE]`` event came


def sse_data(body: bytes) -> list[str]:
    """The data of each complete event of an SSE body, in order."""
    events: list[str] = []
    data: list[str] | None = None
    lines = re.split(r"\r\n|\r|\n", body.decode())
    complete = lines[:-1]  # the last piece did not end with a line break
    for line in complete:
        if not line:
            if data is not None:
                events.append("\n".join(data))
            data = None
        elif line.startswith(":"):
            continue
        else:
            name, _, value = line.partition(":")
            if name == "data":
                data = [*(data or []), value.removeprefix(" ")]
    return events


def read_answer(body: bytes, *, stream: bool, chat: bool) -> Answer:
    """Read ``body``: an SSE stream, or a whole JSON body."""
    values: list[Any] = []
    done = False
    if stream:
        for data in sse_data(body):
            if data == "[DONE]":
                done = True
            else:
                values.append(json.loads(data))
    else:
        values.append(json.loads(body))
    reader = _Reader(chat)
    for value in values:
        reader.read(value)
    return Answer(
        text="".join(reader.text),
        finish_reasons=tuple(reader.finish_reasons),
        usage=reader.usage,
        token_ids=tuple(reader.token_ids) if reader.token_ids is not None else None,
        prompt_token_ids=reader.prompt_token_ids,
        ids=frozenset(reader.ids),
        errors=tuple(reader.errors),
        done=done,
    )


class _Reader:
    """Accumulates what the events (or the body) of one answer say."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.text: list[str] = []
        self.finish_reasons: list[str | None] = []
        self.usage: dict[str, Any] | None = None
        self.token_ids: list[int] | None = None
        self.prompt_token_ids: tuple[int, ...] | None = None
        self.ids: set[str] = set()
        self.errors: list[dict[str, Any]] = []

    def read(self, value: Any) -> None:
        if not isinstance(value, dict):
            return
        if isinstance(value.get("error"), dict):  # vLLM: {"error": {...}}
            self.errors.append(value["error"])
            return
        if value.get("object") == "error":  # SGLang: the ErrorResponse itself
            self.errors.append(value)
            return
        if isinstance(value.get("id"), str):
            self.ids.add(value["id"])
        if value.get("usage") is not None:
            self.usage = value["usage"]
        self._prompt_ids(value.get("prompt_token_ids"))  # vLLM chat: top level
        for choice in value.get("choices") or []:
            if choice.get("index", 0) == 0:
                self._choice(choice)

    def _choice(self, choice: dict[str, Any]) -> None:
        if self.chat:
            part = choice.get("delta") or choice.get("message") or {}
            self.text.append(part.get("content") or "")
        else:
            self.text.append(choice.get("text") or "")
        if choice.get("finish_reason") is not None:
            self.finish_reasons.append(choice["finish_reason"])
        self._prompt_ids(choice.get("prompt_token_ids"))
        ids = choice.get("token_ids", choice.get("response_token_ids"))  # SGLang's whole chat
        if ids is not None:
            self.token_ids = [*(self.token_ids or []), *ids]

    def _prompt_ids(self, ids: list[int] | None) -> None:
        if ids is not None and self.prompt_token_ids is None:
            self.prompt_token_ids = tuple(ids)
