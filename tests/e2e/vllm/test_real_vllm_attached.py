"""Agents attached to real vLLM engines someone else started.

``connect`` asks a running vLLM what it is (served model, block size, context length, KV connector, its
KV-events endpoint, and in dev mode its ``kv_role``), refuses what cannot work, and registers it as it
really is. Below that, silent degradation: a decode engine whose KV pulls fail computes each prompt
itself, and the orchestrator finds it from the engine's counters.

Real vLLM 0.32 engines: P (``kv_producer``) and D (``kv_consumer`` with ``kv_load_failure_policy:
recompute``), each followed by a real agent in attach mode, and a real orchestrator. P is attached
through a proxy that points every KV handle at a port where no NIXL side channel listens (with a fresh
engine id, so D never reuses a handshake): D's handshake times out (5 s in vLLM 0.32) and D computes
the prompt itself. The answers stay right and nothing errors; D's own ``cached_tokens`` only echoes P's
figure. The KV audit sees D's ``prompt_tokens_by_source`` counters fall short, names the request,
counts each case against the P→D link, opens it, and the next request runs colocated.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from tests.e2e.vllm.support import JSON, MODEL, engine_client, free_engine_ports, running_vllms
from tests.helpers import (
    ADMIN,
    cli_argv,
    eventually,
    free_port,
    metric_sum,
    parse_prometheus,
    stop_process_group,
)
from tests.integration.orchestrator_support import orch_config
from vllm_disagg import jsonutil
from vllm_disagg.config import AgentConfig
from vllm_disagg.orchestrator.app import OrchestratorServer, start_orchestrator
from vllm_disagg.protocol.messages import VLLM_CAPABILITIES, Role, default_agent_id

pytestmark = pytest.mark.timeout(1800)
PROMPT = "The decode engine could not reach the prefill engine's side channel, so it computed: "


@pytest.fixture(scope="module")
def engines(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    base = free_engine_ports(2)
    logs = tmp_path_factory.mktemp("engines")

    def engine(role: Role, index: int, failure_policy: str = "") -> AgentConfig:
        # A core each, as ``up`` binds them: two engines spinning on every core stall this box for minutes.
        return AgentConfig(
            agent_id=f"{role}-0", role=role, engine="vllm", model=MODEL,
            model_path=str(tiny_model), engine_port=base + index,
            omp_threads_bind=str(index % (os.cpu_count() or 1)), kv_load_failure_policy=failure_policy,
        )  # fmt: skip

    # D in vLLM's dev mode (its whole config at /server_info); P as engines usually run.
    with running_vllms([
        (engine("prefill", 0), logs / "prefill.log"),
        (engine("decode", 1, failure_policy="recompute"), logs / "decode.log"),
    ], env={"decode-0": {"VLLM_SERVER_DEV_MODE": "1"}}) as (p, d):  # fmt: skip
        yield p, d


@contextlib.contextmanager
def running(argvs: list[list[str]], log: Path) -> Iterator[None]:
    """One process per command line, all writing to ``log``; each process group stopped on exit."""
    procs = []
    with log.open("wb") as out:
        for argv in argvs:
            procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
    try:
        yield
    finally:
        for proc in procs:
            stop_process_group(proc, timeout=30)


def connected(
    endpoint: str, engines: list[tuple[str, ...]], log: Path
) -> contextlib.AbstractContextManager[None]:
    """``vllm-disagg connect`` running for each ``(url, *flags)``."""
    return running(
        [cli_argv("connect", "--orchestrator", endpoint, "--url", url, *flags) for url, *flags in engines],
        log,
    )


async def connect(*args: str) -> tuple[int, str]:
    """``vllm-disagg connect`` as a process (for the refusals: it exits before it runs an agent, and one
    that fails to refuse is killed at a deadline); its exit code and stderr."""
    proc = await asyncio.create_subprocess_exec(
        *cli_argv("connect", *args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        _, err = await asyncio.wait_for(proc.communicate(), timeout=300)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError(f"connect {args} neither refused nor exited within 300 s") from None
    assert proc.returncode is not None
    return proc.returncode, err.decode(errors="replace")


async def test_connect_registers_a_running_vllm_as_it_is_and_refuses_a_role_it_cannot_serve(
    engines: tuple[str, str], tmp_path: Path
) -> None:
    p, d = engines
    server = await start_orchestrator(orch_config(heartbeat_timeout_s=60.0), shutdown_timeout_s=5.0)
    try:
        endpoint = server.zmq_endpoint
        # P hides its kv_role (no dev mode): with a connector and no --role, connect cannot tell.
        code, err = await connect("--orchestrator", endpoint, "--url", p)
        assert code == 2 and "does not say its kv_role" in err and "--role" in err, err
        # D's dev mode says kv_consumer: it may not be registered as a prefill instance.
        code, err = await connect("--orchestrator", endpoint, "--url", d, "--role", "prefill")
        assert code == 2 and "kv_consumer: it can serve as decode, not prefill" in err, err
        code, err = await connect("--orchestrator", endpoint, "--url", f"http://127.0.0.1:{free_port()}")
        assert code == 2 and "unreachable" in err, err
        assert server.registry.snapshot().instances == ()

        log = tmp_path / "connect.log"
        # D's role comes from its kv_role (dev mode); P's must be given.
        with connected(endpoint, [(p, "--role", "prefill"), (d,)], log):
            p_id, d_id = default_agent_id("prefill", p), default_agent_id("decode", d)

            def registered() -> bool:
                views = {v.agent_id: v for v in server.registry.snapshot().instances}
                return all(i in views and views[i].state == "ready" for i in (p_id, d_id))

            await eventually(registered, timeout=120, what=f"both connected: {log}")
            pv, dv = server.registry.get(p_id), server.registry.get(d_id)
            assert pv is not None and dv is not None
            for view in (pv, dv):  # what the engines run with (vllm_command: CPU block size 128)
                info = view.info
                assert (info.model, info.engine, info.block_size) == (MODEL, "vllm", 128), info
                assert (info.max_model_len, info.kv_connector) == (512, "NixlConnector"), info
            assert (pv.info.role, dv.info.role) == ("prefill", "decode")
            assert dv.info.tensor_parallel_size == 1 and pv.info.tensor_parallel_size == 0, (
                "dev mode tells TP"
            )
            text = log.read_text()
            assert "kv_role kv_consumer" in text and "kv_role unknown" in text, text
            # The KV-events endpoint came from P's /kv_event_sources: its prompts reach the index. The
            # prompt fills a 128-token block (191 tokens): only full blocks are cached.
            body = {"model": MODEL, "prompt": prompt("connected"), "max_tokens": 4, "temperature": 0}
            async with (
                aiohttp.ClientSession() as session,
                session.post(f"{server.url}/v1/completions", json=body, headers=JSON) as resp,
            ):
                assert resp.status == 200, await resp.text()
            await eventually(
                lambda: len(server.kv_index.engine_blocks(p_id)) > 0, timeout=60, what="P's KV events indexed"
            )
    finally:
        await server.close()


@contextlib.asynccontextmanager
async def unreachable_handles(prefill: str) -> AsyncIterator[str]:
    """``prefill`` behind a proxy whose KV handles name a side channel nobody listens on; its URL."""
    dead_port = free_port()

    async def forward(request: web.Request) -> web.Response:
        async with (
            aiohttp.ClientSession() as s,
            s.request(
                request.method, prefill + request.path_qs, data=await request.read(), headers=JSON
            ) as r,
        ):
            body, status, kind = await r.read(), r.status, r.content_type
        if request.method == "POST" and status == 200:
            answer = jsonutil.loads(body)
            params = answer.get("kv_transfer_params")
            if isinstance(params, dict):
                params.update(remote_port=dead_port, remote_engine_id=uuid.uuid4().hex)
                body = jsonutil.dumps(answer)
        return web.Response(body=body, status=status, content_type=kind)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", forward)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def attached_agents(
    server: OrchestratorServer, engines: dict[str, str], log: Path
) -> contextlib.AbstractContextManager[None]:
    """A real agent process in attach mode for each ``role -> engine URL``."""
    flags = ["--model", MODEL, "--engine", "vllm", "--orchestrator", server.zmq_endpoint]
    flags += ["--health-timeout-s", "20"]
    argvs = [
        cli_argv("agent", "--agent-id", f"{role}-0", "--role", role, "--attach", url, *flags)
        for role, url in engines.items()
    ]
    return running(argvs, log)


def prompt(request_id: str) -> str:
    """About 190 tokens: over a 128-token block (vLLM's on CPU), the least shortfall the audit judges."""
    return f"{request_id}: {PROMPT * 6}"


async def complete(session: aiohttp.ClientSession, base: str, request_id: str) -> tuple[str, dict[str, str]]:
    body = {"model": MODEL, "prompt": prompt(request_id), "max_tokens": 8, "temperature": 0}
    headers = {**JSON, "X-Request-Id": request_id}
    async with session.post(f"{base}/v1/completions", json=body, headers=headers) as resp:
        raw = await resp.read()
        assert resp.status == 200, raw
        return jsonutil.loads(raw)["choices"][0]["text"], dict(resp.headers)


async def test_a_decode_engine_that_recomputes_is_found_by_its_counters_and_its_link_avoided(
    engines: tuple[str, str], tmp_path: Path
) -> None:
    p, d = engines
    # This machine stalls for seconds during NIXL work: nothing here is about detection speed. The link
    # breaker stays open 30 s (not 1 s before a probe): long enough to see it open and avoided.
    config = orch_config(
        heartbeat_timeout_s=60.0, idle_timeout_s=120.0, connect_timeout_s=60.0, breaker_open_s=30.0
    )
    server = await start_orchestrator(config, shutdown_timeout_s=5.0)
    try:
        async with unreachable_handles(p) as proxy, engine_client() as session:
            log = tmp_path / "agents.log"
            with attached_agents(server, {"prefill": proxy, "decode": d}, log):
                try:
                    await _recomputes_are_found(server, session, d)
                except AssertionError as exc:  # what the agents saw is most of the story
                    tail = log.read_text(errors="replace")[-6000:]
                    raise AssertionError(f"{exc}\n--- the agents' log, its end:\n{tail}") from exc
    finally:
        await server.close()


async def _recomputes_are_found(server: OrchestratorServer, session: aiohttp.ClientSession, d: str) -> None:

    def ready() -> bool:
        view = server.registry.get("decode-0")
        snap = server.registry.snapshot()
        return (
            len(snap.ready_prefill.get(MODEL, ())) == 1
            and view is not None
            and view.state == "ready"
            and view.metrics.prompt_tokens_transferred is not None
        )

    await eventually(ready, timeout=300, what="1P1D ready, D's counters reported")
    view = server.registry.get("decode-0")
    assert view is not None and view.info.capabilities == VLLM_CAPABILITIES, (
        "its agent asked the real vLLM 0.32: its streams say their token ids, its chats take ids"
    )

    async def reference(request_id: str) -> str:
        """What D answers by itself, which a recomputed prompt must match. Asked after every leg is
        judged: before, D would have the prompt cached and compute too little of it to judge; between
        legs, its cache hits would count as loaded for the next leg."""
        body = {"model": MODEL, "prompt": prompt(request_id), "max_tokens": 8, "temperature": 0}
        async with session.post(f"{d}/v1/completions", json=body) as resp:
            return str((await resp.json())["choices"][0]["text"])

    async def audited(n: int) -> bool:
        async with session.get(f"{server.url}/metrics") as resp:
            samples = parse_prometheus(await resp.text())
        return (
            metric_sum(samples, "vllm_disagg_kv_audited_legs_total", decode="decode-0", outcome="recomputed")
            >= n
        )

    answers = {}
    for n in range(3):
        request_id = f"slow-{n}"
        answers[request_id], headers = await complete(session, server.url, request_id)
        if headers["X-Disagg-Mode"] != "disaggregated":  # the pair is made until the audit says
            async with session.get(f"{server.url}/admin/v1/requests/{request_id}", headers=ADMIN) as resp:
                raise AssertionError(f"{request_id} was not disaggregated: {await resp.text()}")
        await eventually(functools.partial(audited, n + 1), timeout=180, what=f"verdict {n + 1}")

    async with session.get(f"{server.url}/admin/v1/requests/slow-0", headers=ADMIN) as resp:
        record = await resp.json()
    assert "decode instance 'decode-0' computed" in record["kv_check"], record
    async with session.get(f"{server.url}/metrics") as resp:
        samples = parse_prometheus(await resp.text())
    pair = {"prefill": "prefill-0", "decode": "decode-0"}
    assert metric_sum(samples, "vllm_disagg_kv_recomputed_total", **pair) == 3
    assert metric_sum(samples, "vllm_disagg_kv_recomputed_tokens_total", **pair) >= 3 * 128
    assert metric_sum(samples, "vllm_disagg_link_breaker_open", **pair) == 1
    _, headers = await complete(session, server.url, "after")
    assert headers["X-Disagg-Mode"] == "colocated", "the link is avoided"
    for request_id, text in answers.items():
        assert text == await reference(request_id), "a recomputed prompt still gives the right answer"
