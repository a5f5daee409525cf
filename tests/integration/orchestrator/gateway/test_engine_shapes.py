"""Every recorded engine shape through the gateway: the client reads what the engine answered.

Four engines (``tests/fixtures/engines``): vLLM 0.10.1.1 (before ``return_token_ids``), 0.10.2 (which
introduced it), 0.32 (recorded from the real engine) and SGLang 0.5.23, each replayed on a real port
(``tests.engines.replay``) as a prefill and a decode instance, each with a real agent attached to it
that asks the engine what its answers carry when it registers. Every recorded case (completions and
chat; streamed with and without usage, and whole; plain, stopped by a stop string, and with a token
that ends inside a UTF-8 character; with and without ``return_token_ids``) goes through the gateway.

What the client gets: vLLM 0.32's bytes exactly; from an engine the gateway asks nothing of (no ids for
that route), the engine's bytes exactly; otherwise the same text, finish reasons, usage, ids and
errors. One difference is by design: a client that did not ask for ids gets none, where vLLM 0.10.2
writes the prompt's ids in a completion's first chunk unasked.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from tests.engines.dialects import CHAT, CHAT_PROMPT_IDS, CHAT_TOKEN_IDS, COMPLETIONS_TOKEN_IDS, DIALECTS
from tests.engines.reading import Answer, read_answer
from tests.engines.replay import FIXTURES, ReplayEngine
from tests.helpers import ADMIN, eventually
from tests.integration.orchestrator_support import orch_config
from vllm_disagg import jsonutil
from vllm_disagg.agent.main import serve
from vllm_disagg.config import AgentConfig
from vllm_disagg.orchestrator.app import OrchestratorServer, start_orchestrator
from vllm_disagg.protocol.messages import Role

MODEL = "tiny"
REQUEST_ID = "fixture"  # the recordings' X-Request-Id: vLLM's response ids were ``cmpl-fixture``


def lines(dialect: str) -> list[dict[str, Any]]:
    text = (FIXTURES / f"{dialect}.jsonl").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line]


@dataclasses.dataclass
class Shapes:
    """An orchestrator, and replayed engines of one dialect with their (real, in-process) agents."""

    server: OrchestratorServer
    engines: dict[str, ReplayEngine]
    http: aiohttp.ClientSession

    async def ask(
        self, path: str, body: dict[str, Any], created: int, prefill: str = ""
    ) -> tuple[int, bytes, dict[str, str]]:
        """``prefill``: pin the request's prefill instance (it then runs P/D whatever its length)."""
        for engine in self.engines.values():
            engine.clock = lambda: created  # the recording's second: vLLM's bytes can match exactly
        headers = {"X-Request-Id": REQUEST_ID, **({"X-Disagg-Prefill": prefill} if prefill else {})}
        async with self.http.post(self.server.url + path, data=jsonutil.dumps(body), headers=headers) as resp:
            raw = await resp.read()
            # Engines now get the gateway's own id, never the client's (gateway/request_ids.py): put the
            # recordings' back where the engine wrote it, so the rest can be held to them byte for byte.
            own = resp.headers["X-Disagg-Request-Id"]
            dialect = next(iter(self.engines.values())).dialect
            theirs, recorded = dialect.response_id(path, own), dialect.response_id(path, REQUEST_ID)
            return resp.status, raw.replace(theirs.encode(), recorded.encode()), dict(resp.headers)

    async def record(self) -> dict[str, Any]:
        async with self.http.get(f"{self.server.url}/admin/v1/requests/{REQUEST_ID}", headers=ADMIN) as r:
            return dict(await r.json())

    async def instances(self) -> dict[str, dict[str, Any]]:
        async with self.http.get(f"{self.server.url}/admin/v1/instances", headers=ADMIN) as resp:
            return {i["agent_id"]: i for i in (await resp.json())["instances"]}


@contextlib.asynccontextmanager
async def shapes(dialect: str, roles: dict[str, Role]) -> AsyncIterator[Shapes]:
    """``roles``: agent id -> role, one replayed engine of ``dialect`` each."""
    server = await start_orchestrator(orch_config(), shutdown_timeout_s=1.0)
    stop = asyncio.Event()
    engines: dict[str, ReplayEngine] = {}
    agents: list[asyncio.Task[int]] = []
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(server.close)
        http = await stack.enter_async_context(aiohttp.ClientSession())
        for agent_id, role in roles.items():
            engine = engines[agent_id] = await ReplayEngine(dialect, model=MODEL).start()
            stack.push_async_callback(engine.close)
            cfg = AgentConfig(
                agent_id=agent_id,
                role=role,
                orchestrator=server.zmq_endpoint,
                engine="vllm",
                model=MODEL,
                attach_url=engine.url,
                health_timeout_s=2.0,
            )
            agents.append(asyncio.create_task(serve(cfg, stop)))

        async def wait_agents() -> None:
            stop.set()
            await asyncio.gather(*agents, return_exceptions=True)

        stack.push_async_callback(wait_agents)

        def ready() -> bool:
            snap = server.registry.snapshot()
            return sum(len(v) for v in snap.ready_prefill.values()) + sum(
                len(v) for v in snap.ready_decode.values()
            ) >= len(roles)

        await eventually(ready, what=f"{dialect}'s instances ready")
        yield Shapes(server, engines, http)


def client_reads(raw: bytes, line: dict[str, Any], *, asked_ids: bool) -> Answer:
    answer = read_answer(raw, stream=line["request"].get("stream", False), chat=line["path"] == CHAT)
    if asked_ids:
        return answer
    return dataclasses.replace(answer, prompt_token_ids=None)  # 0.10.2 sends them unasked (module doc)


def capable(dialect: str, path: str) -> bool:
    """Does the gateway ask this dialect's engine for token ids on ``path``?"""
    return (CHAT_TOKEN_IDS if path == CHAT else COMPLETIONS_TOKEN_IDS) in DIALECTS[dialect].capabilities


@pytest.mark.parametrize("dialect", list(DIALECTS))
async def test_every_recorded_case_reaches_the_client_as_the_engine_answered_it(dialect: str) -> None:
    misread = []
    async with shapes(dialect, {"p0": "prefill", "d0": "decode"}) as cluster:
        said = (await cluster.instances())["d0"]["capabilities"]
        caps = DIALECTS[dialect].capabilities
        assert said == {
            "known": True,
            "completions_token_ids": COMPLETIONS_TOKEN_IDS in caps,
            "chat_token_ids": CHAT_TOKEN_IDS in caps,
            "chat_prompt_ids": CHAT_PROMPT_IDS in caps,
        }, "the agent found out what its engine's answers carry when it registered"
        for line in lines(dialect):
            status, raw, headers = await cluster.ask(line["path"], line["request"], line["created"], "p0")
            want = line["body"].encode()
            stream = line["request"].get("stream", False)
            asked_ids = line["request"].get("return_token_ids") is True
            relayed_as_is = not stream or not capable(dialect, line["path"]) or dialect == "vllm-0.32"
            if status != line["status"]:
                misread.append(f"{line['case']}: status {status}, the engine's {line['status']}")
            elif relayed_as_is and raw != want:
                misread.append(f"{line['case']}: not the engine's bytes:\n{raw!r}\n{want!r}")
            elif status == 200 and client_reads(raw, line, asked_ids=asked_ids) != client_reads(
                want, line, asked_ids=asked_ids
            ):
                misread.append(f"{line['case']}: read otherwise:\n{raw!r}\n{want!r}")
            elif status == 200 and headers.get("X-Disagg-Mode") != "disaggregated":
                misread.append(f"{line['case']}: ran {headers.get('X-Disagg-Mode')}, not P/D")
    assert not misread, "\n".join(misread)


RESUMES = [
    pytest.param("vllm-0.32", "completions", True, id="vllm-0.32-completion-resumes"),
    pytest.param("vllm-0.32", "chat", True, id="vllm-0.32-chat-resumes"),
    pytest.param("vllm-0.10.2", "completions", True, id="vllm-0.10.2-completion-resumes"),
    pytest.param("vllm-0.10.2", "chat", False, id="vllm-0.10.2-chat-cannot-take-its-prompt-as-ids"),
    pytest.param("sglang", "completions", True, id="sglang-completion-resumes"),
    pytest.param("sglang", "chat", False, id="sglang-chat-says-no-ids-in-a-stream"),
    pytest.param("vllm-0.10.1.1", "completions", False, id="vllm-0.10.1.1-says-no-ids-at-all"),
]


@pytest.mark.parametrize("content", ["plain", "multibyte", "stop"])
@pytest.mark.parametrize(("dialect", "route", "resumes"), RESUMES)
async def test_a_stream_cut_mid_way_resumes_where_the_engines_allow_it_else_ends_with_an_error(
    dialect: str, route: str, resumes: bool, content: str
) -> None:
    case = f"{route}-stream-usage-{content}"
    line = next(li for li in lines(dialect) if li["case"] == case)
    async with shapes(dialect, {"d0": "decode", "d1": "decode"}) as cluster:
        legs: list[str] = []

        def first_leg_dies(path: str, body: dict[str, Any]) -> tuple[int, str] | None:
            if body.get("max_tokens") != line["request"]["max_tokens"]:
                return None  # not the test's request: its agent's probes
            legs.append(path)  # whichever engine the first leg went to, it dies after its first token
            return (2 if route == "chat" else 1, "disconnect") if len(legs) == 1 else None

        for engine in cluster.engines.values():
            engine.cut = first_leg_dies
        status, raw, _ = await cluster.ask(line["path"], line["request"], line["created"])
        rec = await cluster.record()
    got = read_answer(raw, stream=True, chat=route == "chat")
    want = read_answer(line["body"].encode(), stream=True, chat=route == "chat")
    assert status == 200
    if resumes:
        assert dataclasses.replace(got, prompt_token_ids=None) == dataclasses.replace(
            want, prompt_token_ids=None
        )
        assert rec["resumes"] == 1 and rec["status"] == 200
    else:
        assert got.errors and got.done, "an honest end, not a silent one"
        assert want.text.startswith(got.text), "what came before the cut reached the client"
        assert rec["resumes"] == 0 and rec["status"] == 502 and rec["relay"].startswith("not resumable")


@pytest.mark.parametrize("route", ["completions", "chat"])
async def test_a_stream_cut_after_its_last_content_is_ended_with_done_not_an_error(route: str) -> None:
    # The finish reason and the usage reached the client; only [DONE] was missing when the engine died.
    line = next(li for li in lines("vllm-0.32") if li["case"] == f"{route}-stream-usage-plain")
    events = line["body"].count("\n\n")
    async with shapes("vllm-0.32", {"d0": "decode"}) as cluster:
        cluster.engines["d0"].cut = lambda path, body: (
            (events - 1, "disconnect") if body["max_tokens"] == 12 else None
        )
        status, raw, _ = await cluster.ask(line["path"], line["request"], line["created"])
        rec = await cluster.record()
    assert status == 200 and raw == line["body"].encode(), "the engine's whole answer, then [DONE]"
    assert rec["status"] == 200 and rec["resumes"] == 0
    assert [(a["leg"], a["outcome"]) for a in rec["attempts"]] == [("decode", "disconnect")]
