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
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from vllm_disagg.errors import UpstreamError
from vllm_disagg.orchestrator.gateway.server import ClientStream

_DONE = b"data: [DONE]"
_ERROR = b'data: {"error"'
_PROMPT_IDS = b'"prompt_token_ids":['
_TOKEN_IDS = b'"token_ids":['
_MODEL = b'"model":'
_EMPTY_TEXT = re.compile(rb'"text":"",|"delta":\{"content":""\}|"delta":\{\}')  # one scan
_ROLE = b'"delta":{"role":'
_UNFINISHED = b'"finish_reason":null'
_NO_CHOICES = b'"choices":[]'
_FINGERPRINT = b',"system_fingerprint":'
_CACHED = re.compile(rb'"cached_tokens":(\d+)')
# ``_bulk``'s shape checks: an event with one of these has no text (a token ending inside a UTF-8
# character; chat's role, ids-only and empty events) and goes through ``_event``.
_NO_TEXT_COMPLETION = b'"text":"",'
_NO_TEXT_CHAT = re.compile(rb'"delta":\{(?!"content":"[^"])')
_TOKEN_IDS_RE = re.compile(rb'"token_ids":\[([\d,]*)\]')
_NULL_IDS = b'"token_ids":null'
_NO_IDS = b'"token_ids":[]'
_FINISHED = b'"finish_reason":"'
_USAGE = re.compile(rb'"usage":\{"prompt_tokens":(\d+),"total_tokens":(\d+),"completion_tokens":(\d+)')
# Fields that make a resumed leg differ from an uninterrupted one (offsets, several choices, tool-call
# parser state, echoed prompts): such requests are not resumed.
_NOT_RESUMABLE = ("logprobs", "top_logprobs", "echo", "best_of", "use_beam_search", "tools", "suffix")
_COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # vLLM's default for /v1/completions


class StreamBroken(UpstreamError):
    """The engine's stream broke off or reported an error after its first event."""


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


def _has_text(event: bytes) -> bool:
    return _EMPTY_TEXT.search(event) is None


def _raw_ids_at(event: bytes, key: bytes) -> bytes | None:
    """The ids of ``key``'s list as written (``b"1,2,3"``); None without one."""
    i = event.find(key)
    if i < 0:
        return None
    start = i + len(key)
    return event[start : event.find(b"]", start)]


def _parsed(raw: bytes) -> list[int]:
    """``b"1,2,3"`` -> ``[1, 2, 3]``."""
    return [int(t) for t in raw.split(b",") if t]


def _count(raw: bytes) -> int:
    """How many ids ``b"1,2,3"`` holds, without parsing them."""
    return raw.count(b",") + 1 if raw else 0


def _nulled(event: bytes, key: bytes) -> bytes:
    """``"key":[...]`` -> ``"key":null``."""
    i = event.find(key)
    if i < 0:
        return event
    end = event.find(b"]", i + len(key))
    return event[: i + len(key) - 1] + b"null" + event[end + 1 :]


@dataclass(slots=True)
class StreamState:
    """One client stream across its decode legs: what the client has, and how to show it to them."""

    chat: bool
    client_ids: bool  # the client asked for return_token_ids itself
    max_tokens: int | None
    # The decode leg was asked for a usage chunk the client did not ask for: it is dropped (and the
    # system fingerprint vLLM moves there goes back to the last token's event).
    forced_usage: bool = False
    cached_tokens: int | None = None  # the usage's prompt_tokens_details.cached_tokens, when seen
    # The prompt's ids as the first event wrote them (b"1,2,3"), None until seen: parsed only by a
    # resume (``prompt_ids``).
    prompt_raw: bytes | None = None
    # Output ids of the events the client has, as the engine wrote them (b"17" or b"17,18" per event):
    # relaying only counts them; a resume, if one ever comes, parses them (``ids``).
    id_parts: list[bytes] = field(default_factory=list)
    n_ids: int = 0
    safe: int = 0  # output tokens up to the client's last event with text: where a resume starts
    finished: bool = False  # the client has the event with the finish reason
    done: bool = False  # the client has [DONE]
    resumes: int = 0
    head: bytes = b""  # the first leg's b'data: {"id":...,"created":N,' every event starts with
    # --- the current leg ---
    leg_head: bytes = b""
    leg_first: bool = True
    skip: int = 0  # tokens this leg regenerates that the client already has
    held: bytes = b""  # with forced usage: the finish event, until the usage chunk says its fingerprint
    held_ids: bytes = b""
    held_text: bool = False
    offset: int = 0  # output tokens before this leg's prompt ended (usage is restated with it)
    _buffer: bytes = b""
    _pending: list[bytes] = field(default_factory=list)  # the client's bytes of the chunk being read

    @property
    def prompt_ids(self) -> list[int] | None:
        """The prompt's ids, once the first event said them."""
        return None if self.prompt_raw is None else _parsed(self.prompt_raw)

    @property
    def ids(self) -> list[int]:
        """The output ids the client has."""
        return _parsed(b",".join(self.id_parts))

    def start_leg(self) -> None:
        """A resumed leg begins: it regenerates from ``safe``."""
        self.resumes += 1
        self.offset = self.safe
        self.skip = self.n_ids - self.safe
        self.leg_head, self.leg_first, self._buffer, self.held = b"", True, b"", b""
        self.forced_usage = False  # a resumed leg is the client's own request

    async def relay(self, out: ClientStream, first: bytes, chunks: AsyncIterator[bytes]) -> bool:
        """Relay one leg; True when the client's stream is complete. Raises ``UpstreamError`` when the
        engine breaks off or reports an error mid-stream (the caller resumes or ends the stream).

        What one engine chunk carries goes to the client in one write, however many events it holds;
        the one with [DONE] ends the response in the same write.
        """
        chunk = first
        pending = self._pending
        while True:
            if chunk:
                data = self._buffer + chunk if self._buffer else chunk
                end = data.rfind(b"\n\n") + 2  # complete events end there
                self._buffer = data[end:] if end > 1 else data
                try:
                    if end > 1 and self._take(data[:end] if end < len(data) else data):
                        return True
                finally:
                    if pending:  # what the client is counted as having, even when the next event broke
                        data = b"".join(pending)
                        pending.clear()
                        await (out.write_eof(data) if self.done else out.write(data))
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                break
        if self._buffer.strip():  # a partial event at the end: the connection was cut inside it
            raise StreamBroken("ended its stream inside an event", cause="disconnect")
        raise StreamBroken("ended its stream without [DONE]", cause="disconnect")

    def _take(self, events: bytes) -> bool:
        """Take complete events (each ending in a blank line); True at [DONE].

        A run of ordinary token events (one, or many in a chunk) goes through ``_bulk`` at once; the
        first event of a leg, resumed legs, held finish events and whatever ``_bulk`` refuses go one
        by one through ``_event``. After one refusal the rest of the chunk goes one by one: retrying
        at every event would scan the chunk again each time.
        """
        pos, size = 0, len(events)
        bulk = True
        while pos < size:
            end = events.find(b"\n\n", pos)
            if bulk and not (self.leg_first or self.skip or self.resumes or self.forced_usage or self.held):
                taken = self._bulk(events, pos)
                if taken > pos:
                    pos = taken
                    continue
                bulk = taken == pos  # -1: refused
            event, pos = events[pos:end], end + 2
            if event and self._event(event):
                return True
        return False

    def _bulk(self, events: bytes, pos: int) -> int:
        """Relay the ordinary events from ``pos`` on, up to the first finish reason; where it stopped
        (``pos`` when the event there has a finish reason), or -1 when the run is not all ordinary.

        Ordinary: one choice with text and token ids, a null finish reason, no prompt ids: what
        ``_event`` would pass on unchanged but for nulling the ids the client did not ask for. Each
        check is one scan of the whole run (JSON has no raw newlines, so a run of n events has 2n);
        a run that fails one goes event by event. Same bytes and state as ``_event``, about a third
        of the work on a run of many events.
        """
        cut = events.find(_FINISHED, pos)
        cut = len(events) if cut < 0 else events.rfind(b"\n\n", pos, cut) + 2
        if cut < pos + 2:
            return pos  # the event at pos finishes the choice
        run = events[pos:cut]
        parts = _TOKEN_IDS_RE.split(run)
        ids = parts[1::2]
        n = len(ids)
        if (
            run.count(b"\n") != 2 * n
            or run.count(_UNFINISHED) != n  # [DONE], errors and usage-only events have none
            or _PROMPT_IDS in run
            or _NO_IDS in run
            or (_NO_TEXT_CHAT.search(run) is not None if self.chat else _NO_TEXT_COMPLETION in run)
        ):
            return -1
        self._pending.append(run if self.client_ids else _NULL_IDS.join(parts[0::2]))
        self.id_parts += ids
        self.n_ids += b",".join(ids).count(b",") + 1  # no id list is empty (_NO_IDS)
        self.safe = self.n_ids  # every event of the run has text
        return cut

    def _event(self, event: bytes) -> bool:
        """Take one event; what the client gets of it goes to ``_pending``. True at [DONE]."""
        if event.startswith(_DONE):
            if self.held:
                self._deliver(self.held, b"")
            self.done = True
            self._pending.append(event + b"\n\n")
            return True
        if _NO_CHOICES in event and b'"usage":{' in event:
            m = _CACHED.search(event)
            if m:
                self.cached_tokens = int(m.group(1))
            if self.forced_usage:
                fingerprint = event[event.find(_FINGERPRINT) : -1] if _FINGERPRINT in event else b""
                if self.held:
                    self._deliver(self.held, fingerprint)
                return False
        if event.startswith(_ERROR):
            raise StreamBroken(f"reported an error mid-stream: {event[6:306]!r}", cause="status")
        # The event's token ids, counted but not parsed: the hot path of every stream.
        at = event.find(_TOKEN_IDS)
        start = at + len(_TOKEN_IDS)
        end = event.find(b"]", start) if at >= 0 else -1
        ids = event[start:end] if at >= 0 else b""
        n = _count(ids)
        if self.leg_first:
            self.leg_first = False
            model_at = event.find(_MODEL)
            self.leg_head = event[:model_at] if model_at > 0 else b""
            if not self.head:
                self.head = self.leg_head
                self.prompt_raw = _raw_ids_at(event, _PROMPT_IDS)
            elif self.chat and _ROLE in event:
                return False  # the resumed leg's role chunk: the client has one
        if self.skip and n:
            if n <= self.skip:  # the client has these tokens (their text was empty)
                self.skip -= n
                return False
            self.skip = 0
        out_event = event
        if self.resumes:
            if self.leg_head and self.leg_head != self.head and event.startswith(self.leg_head):
                out_event = self.head + event[len(self.leg_head) :]
            out_event = _nulled(out_event, _PROMPT_IDS)
            if b'"usage":{' in out_event:
                out_event = self._restated_usage(out_event)
        if not self.client_ids:
            if n and self.chat and b'"delta":{},' in event and _UNFINISHED in event:
                self._add_ids(ids, n)  # sent only because we asked for ids: not the client's to see
                return False
            if out_event is event and at >= 0:  # the ids found above, still where they were
                out_event = _nulled(event[: start - 1] + b"null" + event[end + 1 :], _PROMPT_IDS)
            else:
                out_event = _nulled(_nulled(out_event, _PROMPT_IDS), _TOKEN_IDS)
        if self.forced_usage and _UNFINISHED not in event and _NO_CHOICES not in event:
            self.held, self.held_ids, self.held_text = out_event, ids, _has_text(event)
            return False
        self._pending += (out_event, b"\n\n")
        self._delivered(event, ids, n, bool(n) and _has_text(event))
        return False

    def _add_ids(self, ids: bytes, n: int) -> None:
        self.id_parts.append(ids)
        self.n_ids += n

    def _delivered(self, event: bytes, ids: bytes, n: int, text: bool) -> None:
        if n:
            self._add_ids(ids, n)
            if text:
                self.safe = self.n_ids
        if _UNFINISHED not in event and _NO_CHOICES not in event:
            self.finished = True

    def _deliver(self, held: bytes, fingerprint: bytes) -> None:
        """The held finish event, with the fingerprint vLLM moved to the (dropped) usage chunk."""
        self.held = b""
        event = held[:-1] + fingerprint + b"}" if fingerprint else held
        self._pending.append(event + b"\n\n")
        self._delivered(held, self.held_ids, _count(self.held_ids), self.held_text)

    def _restated_usage(self, event: bytes) -> bytes:
        prompt = _count(self.prompt_raw or b"")

        def restate(m: re.Match[bytes]) -> bytes:
            completion = int(m.group(3)) + self.offset
            return b'"usage":{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d' % (
                prompt,
                prompt + completion,
                completion,
            )

        return _USAGE.sub(restate, event)

    def can_resume(self) -> bool:
        """Is there a known place to go on from?"""
        return self.prompt_raw is not None and not self.done and not self.finished

    def resume_body(self, client: dict[str, Any]) -> dict[str, Any] | None:
        """The next leg's request: the client's, from the prompt and output so far as token ids.
        None when nothing is left to generate."""
        body = dict(client)
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
