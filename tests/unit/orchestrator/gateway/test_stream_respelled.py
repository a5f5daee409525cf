"""Any spelling of a recorded stream reaches the client as the engine meant it, resumed or not.

The recorded streams of four engines (``tests/fixtures/engines``) are written again at random: JSON
spacing, key order, non-ASCII escaped or raw, unknown fields added, the data split over several
``data:`` lines, ``data:`` without its space, CRLF or CR line ends, comments between events, and the
bytes cut into chunks anywhere (events split and merged). The relay (``StreamState``) must give the
client the text, finish reasons, usage, token ids and response ids of the engine's own answer to the
client's request, and of an uninterrupted one when the stream is cut mid-way and resumed on an engine
of the same kind (itself respelled another way).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.engines.dialects import CHAT, CHAT_PROMPT_IDS, CHAT_TOKEN_IDS, COMPLETIONS_TOKEN_IDS, DIALECTS
from tests.engines.reading import Answer, read_answer
from tests.engines.replay import FIXTURES, ReplayEngine
from tests.unit.orchestrator.gateway.stream_support import Out, chunks
from vllm_disagg.errors import UpstreamError
from vllm_disagg.orchestrator.gateway.resume import StreamState


def _lines() -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for dialect in DIALECTS:
        for text in (FIXTURES / f"{dialect}.jsonl").read_text(encoding="utf-8").splitlines():
            line = json.loads(text)
            out[(dialect, line["case"])] = line
    return out


LINES = _lines()
# (dialect, route, usage, content): every streamed case recorded
STREAMS = [
    (dialect, route, usage, content)
    for dialect in DIALECTS
    for route in ("completions", "chat")
    for usage in (False, True)
    for content in ("plain", "stop", "multibyte")
]


def case_name(route: str, usage: bool, content: str, ids: bool) -> str:
    return f"{route}-stream{'-usage' if usage else ''}-{content}{'-ids' if ids else ''}"


def has_ids(dialect: str, route: str) -> bool:
    """Does the gateway ask this engine for ids on this route (its capabilities)?"""
    return (CHAT_TOKEN_IDS if route == "chat" else COMPLETIONS_TOKEN_IDS) in DIALECTS[dialect].capabilities


def resumes(dialect: str, route: str) -> bool:
    """Can an engine of this dialect take over a stream of this route (``EngineCapabilities.resumes``)?"""
    caps = DIALECTS[dialect].capabilities
    return has_ids(dialect, route) and (route != "chat" or CHAT_PROMPT_IDS in caps)


@dataclasses.dataclass(frozen=True)
class Spelling:
    """One way of writing the same events."""

    separators: tuple[str, str]
    ascii: bool
    order_seed: int | None  # None: the keys in the engine's order
    extra: bool  # unknown fields at the top, in choices and in deltas
    multiline: bool  # the JSON pretty-printed, one ``data:`` line per line
    space: bool  # "data: " (else "data:")
    line_end: str
    comments: bool

    def event(self, data: str) -> str:
        if data != "[DONE]":
            obj = json.loads(data)
            if self.extra:
                obj = _extra(obj)
            if self.order_seed is not None:
                obj = _reorder(obj, random.Random(self.order_seed))
            data = json.dumps(
                obj, separators=self.separators, ensure_ascii=self.ascii, indent=1 if self.multiline else None
            )
        prefix = "data: " if self.space else "data:"
        lines = [prefix + part for part in data.split("\n")]
        if self.comments:
            lines.insert(0, ": keep-alive")
        return "".join(line + self.line_end for line in lines) + self.line_end

    def stream(self, events: list[str]) -> bytes:
        out = []
        for event in events:
            assert event.startswith("data: ") and event.endswith("\n\n")
            out.append(self.event(event[6:-2]))
        return "".join(out).encode()


def _extra(obj: Any) -> Any:
    if isinstance(obj, dict):
        out = {k: _extra(v) for k, v in obj.items()}
        if "choices" in obj or "delta" in obj or "index" in obj:
            out["x_vendor"] = {"note": "ünknown", "n": [1, 2.5, None]}
        return out
    if isinstance(obj, list):
        return [_extra(v) for v in obj]
    return obj


def _reorder(obj: Any, rng: random.Random) -> Any:
    if isinstance(obj, dict):
        keys = list(obj)
        rng.shuffle(keys)
        return {k: _reorder(obj[k], rng) for k in keys}
    if isinstance(obj, list):
        return [_reorder(v, rng) for v in obj]
    return obj


spellings = st.builds(
    Spelling,
    separators=st.sampled_from([(",", ":"), (", ", ": "), (" ,", " : "), (",\t", ":  ")]),
    ascii=st.booleans(),
    order_seed=st.one_of(st.none(), st.integers(0, 1 << 16)),
    extra=st.booleans(),
    multiline=st.booleans(),
    space=st.booleans(),
    line_end=st.sampled_from(["\n", "\r\n", "\r"]),
    comments=st.booleans(),
)


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % len(data) for c in cuts} - {0})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


def seen(raw: bytes, route: str, *, client_ids: bool) -> Answer:
    """What the client reads; the prompt's ids only where it asked (vLLM 0.10.2 sends them unasked)."""
    answer = read_answer(raw, stream=True, chat=route == "chat")
    return answer if client_ids else dataclasses.replace(answer, prompt_token_ids=None)


@dataclasses.dataclass(frozen=True)
class Draw:
    dialect: str
    route: str
    usage: bool  # the client asked for a usage chunk
    content: str
    client_ids: bool
    forced_usage: bool  # the gateway asked for usage the client did not

    @property
    def path(self) -> str:
        return CHAT if self.route == "chat" else "/v1/completions"

    def engine_line(self) -> dict[str, Any]:
        """What the engine answers the decode leg: with ids where the gateway asks for them."""
        ids = has_ids(self.dialect, self.route)
        return LINES[
            (self.dialect, case_name(self.route, self.usage or self.forced_usage, self.content, ids))
        ]

    def client_line(self) -> dict[str, Any]:
        """What the engine answers the client's own request."""
        return LINES[(self.dialect, case_name(self.route, self.usage, self.content, self.client_ids))]

    def state(self) -> StreamState:
        return StreamState(
            chat=self.route == "chat",
            client_ids=self.client_ids,
            max_tokens=12,
            client_usage=self.usage,
            forced_usage=self.forced_usage,
        )


@st.composite
def draws(draw: st.DrawFn, resumable_only: bool = False) -> Draw:
    choices = [s for s in STREAMS if not resumable_only or resumes(s[0], s[1])]
    dialect, route, usage, content = draw(st.sampled_from(choices))
    ids = draw(st.booleans()) and has_ids(dialect, route)
    forced = not usage and draw(st.booleans())
    return Draw(dialect, route, usage, content, ids, forced)


async def relay(state: StreamState, parts: list[bytes]) -> tuple[Out, bool]:
    out = Out()
    try:
        complete = await state.relay(out, parts[0], chunks(*parts[1:]))
    except UpstreamError:
        complete = False
    return out, complete


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(draws(), spellings, st.lists(st.integers(0, 1 << 20), max_size=12))
def test_a_respelled_stream_reads_as_the_engines_own_answer(
    d: Draw, spelling: Spelling, cuts: list[int]
) -> None:
    data = spelling.stream(_events(d.engine_line()["body"]))
    out, complete = asyncio.run(relay(d.state(), split(data, cuts)))
    assert complete and out.ended
    want = d.client_line()["body"].encode()
    assert seen(out.data, d.route, client_ids=d.client_ids) == seen(want, d.route, client_ids=d.client_ids)


def _events(body: str) -> list[str]:
    return [part + "\n\n" for part in body.split("\n\n") if part]


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    draws(resumable_only=True),
    spellings,
    spellings,
    st.integers(1, 40),
    st.booleans(),
    st.lists(st.integers(0, 1 << 20), max_size=8),
)
def test_a_respelled_stream_cut_and_resumed_reads_as_an_uninterrupted_run(
    d: Draw, first: Spelling, second: Spelling, cut_at: int, engine_core_died: bool, cuts: list[int]
) -> None:
    engine = d.engine_line()
    events = _events(engine["body"])[:-1]  # no [DONE]: the engine dies before it
    events = events[: 1 + cut_at % max(1, len(events) - 1)]
    if engine_core_died:  # vLLM's way when its engine core dies: an error event, then [DONE]
        events += ['data: {"error": {"message": "EngineCore died", "code": 500}}\n\n', "data: [DONE]\n\n"]
    state = d.state()
    out, complete = asyncio.run(relay(state, split(first.stream(events), cuts)))
    assert not complete
    want = seen(d.client_line()["body"].encode(), d.route, client_ids=d.client_ids)
    if state.answered():  # cut after the last content: the gateway ends the stream with [DONE]
        assert seen(out.data + b"data: [DONE]\n\n", d.route, client_ids=d.client_ids) == want
        return
    if state.finished:  # cut between the finish and the usage chunk: no token is left to generate,
        got = seen(out.data, d.route, client_ids=d.client_ids)  # the gateway ends it with an error
        assert (got.text, got.finish_reasons, got.usage) == (want.text, want.finish_reasons, None)
        return
    assert state.can_resume(), "every recorded stream with ids can resume from its first event on"
    body = state.resume_body(dict(d.client_line()["request"]))
    assert body is not None
    replay = ReplayEngine(d.dialect)
    gen = replay.generation(d.path, body)
    later = replay.dialect.events(d.path, body, gen, "fixture", engine["created"] + 7)  # its own second
    state.start_leg()
    out2, complete = asyncio.run(relay(state, split(second.stream(later), cuts)))
    assert complete
    assert seen(out.data + out2.data, d.route, client_ids=d.client_ids) == want
