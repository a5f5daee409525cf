"""Mid-stream resume: a stream whose decode engine fails goes on from another instance, seamlessly.

The decode leg of a resumable stream asks the engine for ``return_token_ids`` (vLLM 0.32 always sends
``"prompt_token_ids"`` and ``"token_ids"``, as ``null`` unless asked, so asking changes no key order;
docs/vllm-resume-facts.md). ``StreamState`` relays the stream event by event, keeps the prompt's ids
and the output ids the client has, and puts the bytes back as the client asked for them. When the
engine fails (the connection breaks, or it sends an ``{"error"`` event), the gateway sends the prompt
plus the output so far, as token ids, to another instance — ``/v1/completions`` with an id-list
prompt, or chat with ``kv_transfer_params.prompt_token_ids`` — so nothing is re-tokenized. The
resumed leg's events are rewritten to the first leg's ``id``/``created`` head, its repeated role
chunk is dropped, and its ``usage`` is restated as the whole request's, so under greedy decoding the
client's stream equals an uninterrupted run byte for byte.

A token that ends inside a UTF-8 character has empty text (the detokenizer holds its bytes back);
resuming right after it would make the new leg emit the whole context. So a leg resumes after the
last event with text, and the events the client already had (empty text) are regenerated and dropped.

Events are read by their JSON, never by its spelling: a run of vLLM 0.32's exact token events takes a
fast path (one pattern match, ids counted in place), and every other event is parsed. So an engine
that spaces its JSON, orders keys otherwise, adds fields or writes no ids at all is relayed whole; an
engine without ids is only not resumable (``can_resume``). Only an event with no content for the
client is ever dropped (``wire.stream_chunk``), and one that cannot be read goes on as it came.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from vllm_disagg import jsonutil
from vllm_disagg.errors import UpstreamError
from vllm_disagg.orchestrator.gateway.handoff import decode_body, dumps_leg
from vllm_disagg.orchestrator.gateway.server import ClientStream
from vllm_disagg.orchestrator.state.views import InstanceView
from vllm_disagg.wire.sse import EventFramer, data_of, with_data
from vllm_disagg.wire.stream_chunk import StreamChunk, is_error, read_chunk

# vLLM 0.32's ordinary token events, exactly: one choice with text (never empty) and token ids, no
# finish reason, no prompt ids, nothing after ``choices``. A JSON string: quotes and backslashes only
# escaped; written unrolled and possessive (runs of plain bytes at once, no backtracking into one), a
# third of the time of the plain alternation. Whatever else an engine writes is parsed instead.
_STR = rb'"[^"\\\n]*+(?:\\.[^"\\\n]*+)*+"'
_TEXT = rb'"(?=[^"])[^"\\\n]*+(?:\\.[^"\\\n]*+)*+"'
_HEAD = (
    rb'data: \{"id":'
    + _STR
    + rb',"object":"%s","created":\d++,"model":'
    + _STR
    + rb',"choices":\[\{"index":0,'
)
_IDS = rb'"token_ids":\[\d++(?:,\d++)*+\]\}\]\}\n\n'
_COMPLETION_EVENT = (
    (_HEAD % b"text_completion")
    + rb'"text":'
    + _TEXT
    + rb',"logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,'
    + _IDS
)
_CHAT_EVENT = (
    (_HEAD % b"chat.completion.chunk")
    + rb'"delta":\{"content":'
    + _TEXT
    + rb'\},"logprobs":null,"finish_reason":null,'
    + _IDS
)
_RUNS = {
    False: re.compile(rb"(?:" + _COMPLETION_EVENT + rb")++"),
    True: re.compile(rb"(?:" + _CHAT_EVENT + rb")++"),
}
_TOKEN_IDS_RE = re.compile(rb'"token_ids":\[([\d,]*)\]')
_NULL_IDS = b'"token_ids":null'
# Fields that make a resumed leg differ from an uninterrupted one (offsets, several choices, tool-call
# parser state, echoed prompts): such requests are not resumed.
_NOT_RESUMABLE = ("logprobs", "top_logprobs", "echo", "best_of", "use_beam_search", "tools", "suffix")
_COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # vLLM's default for /v1/completions


class StreamBroken(UpstreamError):
    """The engine's stream broke off or reported an error after its first event."""


def stream_state(
    view: InstanceView | None, d: str, chat: bool, body: dict[str, Any], max_tokens: int | None, usage: bool
) -> tuple[StreamState | None, str, str]:
    """The relay state of a resumable stream's decode leg on ``d`` (``view``), and why not (a reason, a
    sentence): none when its engine says no token ids for this route, so the stream is relayed as it
    comes (a cut ends it with an error). ``usage``: the client asked for the usage."""
    if view is not None and not view.info.capabilities.token_ids(chat):
        route = "chat" if chat else "completion"
        why = f"not resumable: decode instance '{d}' says no token ids in a streamed {route}"
        return None, "no_token_ids", why
    client_ids = body.get("return_token_ids") is True
    return StreamState(chat=chat, client_ids=client_ids, max_tokens=max_tokens, client_usage=usage), "", ""


def resumable_decode_body(
    body: dict[str, Any], kv: Any | None, state: StreamState, judged: bool, client_usage: bool
) -> bytes:
    """A resumable stream's decode leg body: it asks for token ids (what a resume starts from) and,
    where D's usage tells whether it loaded the KV or recomputed it (``judged``), for the usage, which
    the relay drops again for a client that did not ask (``state.forced_usage``)."""
    leg = dict(body, return_token_ids=True)
    state.forced_usage = judged and not client_usage
    if state.forced_usage:
        leg["stream_options"] = {"include_usage": True}
    return decode_body(leg, kv) if kv is not None else dumps_leg(leg)


def ids_missing(state: StreamState | None, decode_id: str) -> tuple[str, str] | None:
    """Why a stream its engine relayed could not have been resumed, if its events left out ids."""
    if state is not None and state.head is not None and (state.prompt_ids is None or not state.whole_ids):
        what = "its prompt's ids" if state.prompt_ids is None else "the ids of some tokens"
        return "ids_missing", f"not resumable: decode instance '{decode_id}' left out {what}"
    return None


def resumable(body: dict[str, Any], chat: bool) -> bool:
    """Can this streaming request be resumed mid-way on another instance?"""
    if body.get("n") not in (None, 1) or any(body.get(name) for name in _NOT_RESUMABLE):
        return False
    if chat:
        return True
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    return isinstance(prompt, str) or (isinstance(prompt, list) and all(type(t) is int for t in prompt))


def _parsed(raw: bytes) -> list[int]:
    """``b"1,2,3"`` -> ``[1, 2, 3]``."""
    return [int(t) for t in raw.split(b",") if t]


def _raw(ids: list[int]) -> bytes:
    """``[1, 2, 3]`` -> ``b"1,2,3"``, as the fast path keeps them."""
    return b",".join(b"%d" % i for i in ids)


def _null_ids(obj: dict[str, Any], keys: tuple[str, ...] = ("token_ids", "prompt_token_ids")) -> bool:
    """Make the ids of ``keys`` ``null`` (as vLLM writes ids it was not asked for); whether any was."""
    changed = False
    if "prompt_token_ids" in keys and obj.get("prompt_token_ids") is not None:
        obj["prompt_token_ids"] = None
        changed = True
    for choice in obj.get("choices", ()):
        for key in keys:
            if choice.get(key) is not None:
                choice[key] = None
                changed = True
    return changed


@dataclass(slots=True)
class _Held:
    """A finish event kept back until the usage chunk the gateway asked for says its fingerprint."""

    event: bytes  # the event as the engine framed it (fields and comments besides its data)
    obj: dict[str, Any]  # its data, as the client gets it
    chunk: StreamChunk
    changed: bool  # ``obj`` differs from the event's data


@dataclass(slots=True)
class StreamState:
    """One client stream across its decode legs: what the client has, and how to show it to them.

    Every event of the engine reaches the client (rewritten as the request needs), except those with
    no content for it (``wire.stream_chunk``): a usage chunk the gateway asked for, ids-only chat
    events, a resumed leg's role chunk and regenerated tokens the client already has. An event the
    relay cannot read goes through as it came, counted in ``unread``.
    """

    chat: bool
    client_ids: bool  # the client asked for return_token_ids itself
    max_tokens: int | None
    client_usage: bool = False  # the client asked for a usage chunk itself
    # The decode leg was asked for a usage chunk the client did not ask for: it is dropped (and the
    # system fingerprint vLLM moves there goes back to the last token's event).
    forced_usage: bool = False
    cached_tokens: int | None = None  # the usage's prompt_tokens_details.cached_tokens, when seen
    prompt_ids: list[int] | None = None  # the prompt's ids, as the first event said them
    # Output ids of the events the client has, as the engine wrote them (b"17" or b"17,18" per event):
    # relaying only counts them; a resume, if one ever comes, parses them (``ids``).
    id_parts: list[bytes] = field(default_factory=list)
    n_ids: int = 0
    safe: int = 0  # output tokens up to the client's last event with text: where a resume starts
    whole_ids: bool = True  # every event with content carried its ids: ``ids`` is the whole output
    finished: bool = False  # the client has the event with the finish reason
    usage_sent: bool = False  # the client has a usage chunk
    done: bool = False  # the client has [DONE]
    resumes: int = 0
    unread: int = 0  # events passed on as they came because they could not be read
    head: tuple[Any, Any] | None = None  # the first leg's ``id`` and ``created``, every event's
    # --- the current leg ---
    leg_first: bool = True
    skip: int = 0  # tokens this leg regenerates that the client already has
    held: _Held | None = None
    offset: int = 0  # output tokens before this leg's prompt ended (usage is restated with it)
    _framer: EventFramer = field(default_factory=EventFramer)
    _pending: list[bytes] = field(default_factory=list)  # the client's bytes of the chunk being read

    @property
    def ids(self) -> list[int]:
        """The output ids the client has."""
        return _parsed(b",".join(self.id_parts))

    def start_leg(self) -> None:
        """A resumed leg begins: it regenerates from ``safe``."""
        self.resumes += 1
        self.offset = self.safe
        self.skip = self.n_ids - self.safe
        self.leg_first, self.held = True, None
        self._framer.reset()
        self.forced_usage = False  # a resumed leg is the client's own request

    async def relay(self, out: ClientStream, first: bytes, chunks: AsyncIterator[bytes]) -> bool:
        """Relay one leg; True when the client's stream is complete. Raises ``UpstreamError`` when the
        engine breaks off or reports an error mid-stream (the caller resumes or ends the stream).

        What one engine chunk carries goes to the client in one write, however many events it holds;
        the one with [DONE] ends the response in the same write.
        """
        chunk = first
        pending = self._pending
        framer = self._framer
        while True:
            if chunk:
                events = framer.feed(chunk)
                try:
                    if events and self._take(events):
                        return True
                except StreamBroken:
                    self._release_held()  # the client gets what the engine sent before its error
                    raise
                finally:
                    if pending:  # what the client is counted as having, even when the next event broke
                        data = b"".join(pending)
                        pending.clear()
                        await (out.write_eof(data) if self.done else out.write(data))
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                break
        self._release_held()
        if pending:
            data = b"".join(pending)
            pending.clear()
            await out.write(data)
        if framer.partial.strip():  # a partial event at the end: the connection was cut inside it
            raise StreamBroken("ended its stream inside an event", cause="disconnect")
        raise StreamBroken("ended its stream without [DONE]", cause="disconnect")

    def _take(self, events: bytes) -> bool:
        """Take complete events (each ending in a blank line); True at [DONE].

        A run of vLLM's ordinary token events goes through ``_bulk`` at once; the first event of a
        leg, resumed legs, held finish events and everything else go one by one through ``_event``.
        """
        pos, size = 0, len(events)
        while pos < size:
            if not (self.leg_first or self.skip or self.resumes or self.held):
                taken = self._bulk(events, pos)
                if taken > pos:
                    pos = taken
                    continue
            end = events.find(b"\n\n", pos)
            event, pos = events[pos:end], end + 2
            if event and self._event(event):
                return True
        return False

    def _bulk(self, events: bytes, pos: int) -> int:
        """Relay the run of vLLM's ordinary token events at ``pos`` (``_RUNS``); where it ends.

        What ``_event`` would do with each, at a fraction of the work: the events pass on unchanged
        but for nulling the ids the client did not ask for, and their ids are counted, not parsed.
        """
        match = _RUNS[self.chat].match(events, pos)
        if match is None:
            return pos
        run = events[pos : match.end()]
        parts = _TOKEN_IDS_RE.split(run)
        ids = parts[1::2]
        self._pending.append(run if self.client_ids else _NULL_IDS.join(parts[0::2]))
        self.id_parts += ids
        self.n_ids += b",".join(ids).count(b",") + 1  # the pattern admits no empty id list
        self.safe = self.n_ids  # every event of the run has text
        return match.end()

    def _event(self, event: bytes) -> bool:
        """Take one event; what the client gets of it goes to ``_pending``. True at [DONE]."""
        data = data_of(event)
        if data is None:  # a comment or a retry field: nothing to read, nothing to keep back
            self._pending += (event, b"\n\n")
            return False
        if data == b"[DONE]":
            self._release_held()
            self.done = True
            self._pending += (event, b"\n\n")
            return True
        try:
            obj = jsonutil.loads(data)
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            return self._unread(event)
        if is_error(obj):
            raise StreamBroken(f"reported an error mid-stream: {data[:300]!r}", cause="status")
        chunk = read_chunk(obj, chat=self.chat)
        if chunk is None:
            return self._unread(event)
        return self._chunk(event, obj, chunk)

    def _unread(self, event: bytes) -> bool:
        self.unread += 1
        self._pending += (event, b"\n\n")
        return False

    def _chunk(self, event: bytes, obj: dict[str, Any], chunk: StreamChunk) -> bool:
        """One parsed chunk: rewritten as the request needs and passed on (or held, with forced
        usage), or dropped (``_drop``: only what has no content for the client)."""
        if chunk.usage is not None:
            details = chunk.usage.get("prompt_tokens_details")
            cached = details.get("cached_tokens") if isinstance(details, dict) else None
            if type(cached) is int:
                self.cached_tokens = cached
            if self.forced_usage and not chunk.choices:
                self._release_held(obj.get("system_fingerprint"))
                return self._drop(chunk, "the usage the gateway asked for")
        ids = chunk.ids
        n = len(ids) if ids else 0
        if self.leg_first:
            self.leg_first = False
            if self.head is None:
                self.head = (obj.get("id"), obj.get("created"))
                self.prompt_ids = chunk.prompt_ids
            elif self.chat and chunk.role and not (chunk.text or chunk.finished):
                return self._drop(chunk, "a resumed leg's role chunk: the client has one", repeat=True)
        if self.skip and n:
            if n <= self.skip and not (chunk.text or chunk.finished):
                self.skip -= n
                return self._drop(chunk, "regenerated tokens the client has (no text)", repeat=True)
            self.skip = 0
        if ids is None and chunk.choices and (chunk.text or not (chunk.finished or chunk.role)):
            # An event standing for generated tokens without their ids: what the client has is no
            # longer known by id, so no resume can start from it.
            self.whole_ids = False
        changed = bool(self.resumes)
        if changed:
            self._restate(obj)
        if not self.client_ids:
            if n and self.chat and not chunk.content and obj["choices"][0].get("delta") == {}:
                self._add_ids(ids)
                return self._drop(chunk, "vLLM sends a chat event without text only when asked for ids")
            changed = _null_ids(obj) or changed
        if self.forced_usage and chunk.finished:
            self.held = _Held(event, obj, chunk, changed)
            return False
        self._deliver(event, obj if changed else None, chunk)
        return False

    def _drop(self, chunk: StreamChunk, why: str, *, repeat: bool = False) -> bool:
        """Keep an event from the client: the one place that does. Only an event without content for
        the client (``wire.stream_chunk``) may be dropped, the usage the gateway asked for, or (``repeat``)
        a resumed leg's repeat of what the client has, without text or a finish reason."""
        if repeat:
            assert not (chunk.text or chunk.finished), f"a repeat with text would be dropped ({why})"
        else:
            assert not (chunk.content and chunk.choices), f"an event with content would be dropped ({why})"
        return False

    def _restate(self, obj: dict[str, Any]) -> None:
        """A resumed leg's event as the first leg would have written it: its ``id`` and ``created``,
        no prompt ids, and usage counting the whole request."""
        if self.head is not None:
            first_id, created = self.head
            if "id" in obj:
                obj["id"] = first_id
            if "created" in obj:
                obj["created"] = created
        _null_ids(obj, ("prompt_token_ids",))
        usage = obj.get("usage")
        if isinstance(usage, dict) and type(usage.get("completion_tokens")) is int:
            prompt = len(self.prompt_ids or ())
            completion = usage["completion_tokens"] + self.offset
            if "prompt_tokens" in usage:
                usage["prompt_tokens"] = prompt
            if "total_tokens" in usage:
                usage["total_tokens"] = prompt + completion
            usage["completion_tokens"] = completion

    def _add_ids(self, ids: list[int] | None) -> None:
        if ids:
            self.id_parts.append(_raw(ids))
            self.n_ids += len(ids)

    def _deliver(self, event: bytes, obj: dict[str, Any] | None, chunk: StreamChunk) -> None:
        """Pass an event on: as the engine wrote it, or its data rewritten as ``obj``."""
        self._pending += (event if obj is None else with_data(event, jsonutil.dumps(obj)), b"\n\n")
        if chunk.ids:
            self._add_ids(chunk.ids)
            if chunk.text:
                self.safe = self.n_ids
        if chunk.finished:
            self.finished = True
        if chunk.usage is not None and not chunk.choices:
            self.usage_sent = True

    def _release_held(self, fingerprint: Any = None) -> None:
        """Pass on the held finish event, with the fingerprint vLLM moved to the (dropped) usage chunk."""
        held, self.held = self.held, None
        if held is None:
            return
        if fingerprint is not None:
            held.obj["system_fingerprint"] = fingerprint
        changed = held.changed or fingerprint is not None
        self._deliver(held.event, held.obj if changed else None, held.chunk)

    def answered(self) -> bool:
        """Has the client the whole answer but ``[DONE]`` (its finish reason, and the usage it asked
        for)? An engine that dies then has nothing left to say."""
        return self.finished and not self.done and (self.usage_sent or not self.client_usage)

    def can_resume(self) -> bool:
        """Is there a known place to go on from?"""
        return self.prompt_ids is not None and self.whole_ids and not self.done and not self.finished

    def resume_body(self, client: dict[str, Any]) -> dict[str, Any] | None:
        """The next leg's request: the client's, from the prompt and output so far as token ids.
        None when nothing is left to generate."""
        body = dict(client)
        # Parsing removed a client's (``control_fields``); this leg's are the gateway's alone.
        body.pop("kv_transfer_params", None)
        context = [*(self.prompt_ids or ()), *self.ids[: self.safe]]
        limit = self.max_tokens
        if limit is None and not self.chat:
            limit = _COMPLETIONS_DEFAULT_MAX_TOKENS
        if limit is not None:
            left = limit - self.safe
            if left < 1:
                return None
            for name in ("max_tokens", "max_completion_tokens"):
                if name in body or (name == "max_tokens" and not self.chat):
                    body[name] = left
        if isinstance(body.get("min_tokens"), int):
            body["min_tokens"] = max(0, body["min_tokens"] - self.safe)
        if self.chat:
            body["kv_transfer_params"] = {"prompt_token_ids": context}
        else:
            body["prompt"] = context
        body["return_token_ids"] = True
        body["stream"] = True
        return body
