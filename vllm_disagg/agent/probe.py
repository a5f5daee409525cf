"""What an attached engine's answers carry, found out by asking it: three one-token requests.

The gateway resumes a stream on another instance from the token ids the engine sent (docs/
vllm-resume-facts.md), so it must know, before any user request, which engines send them. An engine
the agent launched is the vLLM 0.32 it launched (``VLLM_CAPABILITIES``); an attached one may be any
OpenAI-compatible server, so it is asked:

1. a streamed ``/v1/completions`` with ``return_token_ids``: do the events carry the prompt's ids and
   the token's (vLLM 0.10.2 and later; not vLLM before it, not every SGLang)?
2. the same for a streamed chat (SGLang refuses ``return_token_ids`` on a streamed chat);
3. a chat whose ``kv_transfer_params.prompt_token_ids`` are its rendered prompt plus one token: does
   its usage count those ids (vLLM 0.32 runs them as the prompt) or the rendered messages?

The readers are pure; ``probe_capabilities`` is the thin HTTP part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import aiohttp

from vllm_disagg import jsonutil
from vllm_disagg.protocol.messages import EngineCapabilities
from vllm_disagg.wire.sse import EventFramer, data_of
from vllm_disagg.wire.stream_chunk import token_ids

PROBE_TEXT = "Hi"


class ProbeUnanswered(Exception):
    """A probe got no answer at all (a timeout, a dropped connection): silence is not a "no"."""


def completions_probe(model: str) -> dict[str, Any]:
    """Probe 1: a streamed one-token completion asking for token ids."""
    return {
        "model": model,
        "prompt": PROBE_TEXT,
        "max_tokens": 1,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
    }


def chat_probe(model: str) -> dict[str, Any]:
    """Probe 2: a streamed one-token chat asking for token ids."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": PROBE_TEXT}],
        "max_tokens": 1,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
    }


def chat_ids_probe(model: str, prompt_ids: list[int]) -> dict[str, Any]:
    """Probe 3: a one-token chat given its prompt as ids (what a resumed chat is sent)."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": PROBE_TEXT}],
        "max_tokens": 1,
        "temperature": 0,
        "kv_transfer_params": {"prompt_token_ids": prompt_ids},
    }


@dataclass(frozen=True, slots=True)
class StreamIds:
    """What a streamed answer said of its tokens."""

    prompt: list[int] | None  # the prompt's ids (a choice's, or chat's top-level field)
    output: list[int]  # every event's token ids, in order


def read_stream_ids(body: bytes) -> StreamIds:
    """The ids a streamed answer carries (events that are not JSON objects are skipped)."""
    framer = EventFramer()
    events = framer.feed(body + b"\n\n")  # the last event may lack its blank line
    prompt: list[int] | None = None
    output: list[int] = []
    for event in events.split(b"\n\n"):
        data = data_of(event) if event else None
        if data is None or data == b"[DONE]":
            continue
        try:
            obj = jsonutil.loads(data)
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        choices = obj.get("choices")
        first = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
        if prompt is None:
            prompt = token_ids(obj.get("prompt_token_ids")) or token_ids(first.get("prompt_token_ids"))
        output += token_ids(first.get("token_ids")) or []
    return StreamIds(prompt, output)


def prompt_tokens(body: bytes) -> int | None:
    """A whole answer's ``usage.prompt_tokens``; None without one."""
    try:
        obj = jsonutil.loads(body)
    except ValueError:
        return None
    usage = obj.get("usage") if isinstance(obj, dict) else None
    count = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return count if type(count) is int else None


def said_ids(status: int, body: bytes) -> StreamIds | None:
    """A probe's ids when it answered 200 with the prompt's ids and at least one token's; else None."""
    if status != 200:
        return None
    ids = read_stream_ids(body)
    return ids if ids.prompt is not None and ids.output else None


async def probe_capabilities(
    http: aiohttp.ClientSession, base: str, model: str, *, timeout_s: float = 10.0
) -> tuple[EngineCapabilities, list[str]]:
    """Ask the engine at ``base`` (serving ``model``); its capabilities and what the operator should
    read about them. ``ProbeUnanswered`` when a probe gets no answer."""

    async def post(path: str, body: dict[str, Any], retried: bool = False) -> tuple[int, bytes]:
        try:
            async with http.post(
                base + path,
                data=jsonutil.dumps(body),
                headers={"Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as resp:
                return resp.status, await resp.read()
        except TimeoutError:
            raise ProbeUnanswered(f"POST {base}{path}: no answer in {timeout_s:g} s") from None
        except aiohttp.ServerDisconnectedError:
            # A kept-alive connection the engine's server closed as it was reused: the probes change
            # nothing, so one more try, on a new connection, is safe; a second drop is an answer.
            if retried:
                raise ProbeUnanswered(f"POST {base}{path}: Server disconnected") from None
            return await post(path, body, retried=True)
        except aiohttp.ClientError as exc:
            raise ProbeUnanswered(f"POST {base}{path}: {exc or type(exc).__name__}") from None

    notes = []
    status, body = await post("/v1/completions", completions_probe(model))
    completions = said_ids(status, body)
    if completions is None:
        notes.append(_no_ids("completions", status, body))
    status, body = await post("/v1/chat/completions", chat_probe(model))
    chat = said_ids(status, body)
    chat_prompt_ids = False
    if chat is None:
        notes.append(_no_ids("chat", status, body))
    else:
        assert chat.prompt is not None
        ids = [*chat.prompt, chat.output[0]]  # one more than the rendered messages: told apart by count
        status, body = await post("/v1/chat/completions", chat_ids_probe(model, ids))
        chat_prompt_ids = status == 200 and prompt_tokens(body) == len(ids)
        if not chat_prompt_ids:
            notes.append("a chat does not take its prompt as kv_transfer_params.prompt_token_ids")
    if notes:
        notes.append("streams it cannot say the ids of are relayed as they come and are not resumable")
    capabilities = EngineCapabilities(
        known=True,
        completions_token_ids=completions is not None,
        chat_token_ids=chat is not None,
        chat_prompt_ids=chat_prompt_ids,
    )
    return capabilities, notes


def _no_ids(route: str, status: int, body: bytes) -> str:
    if status != 200:
        said = body[:200].decode(errors="replace")
        return f"a streamed {route} with return_token_ids was refused (HTTP {status}: {said})"
    return f"a streamed {route} with return_token_ids carries no token ids"
