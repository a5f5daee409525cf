"""``up --log-format json --otlp-traces-endpoint``: the orchestrator, its gateway workers and the agents
write JSON lines; the lines about a request carry its request id and the client's trace id, and its
spans reach the OTLP endpoint, whichever process served it."""

from __future__ import annotations

from pathlib import Path

import aiohttp

from tests.e2e.up_support import Cluster, start_up, stop
from tests.otlp_receiver import ThreadedReceiver
from vllm_disagg import jsonutil

MODEL = "sim-model"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
REQUESTS = 16  # all on one of the two serving processes: 2 in 65,536


async def test_every_process_logs_json_lines_and_traces_and_a_requests_lines_and_spans_carry_its_ids(
    tmp_path: Path,
) -> None:
    traces = ThreadedReceiver()  # on its own thread: ``stop`` blocks this one while spans are flushed
    flags = ("--log-format", "json", "--log-level", "debug", "--gateway-workers", "2")
    try:
        running = start_up(tmp_path, 1, 1, *flags, "--otlp-traces-endpoint", traces.url)
        own = await _serve_and_check(running)
        spans = traces.spans
    finally:
        traces.close()
    served = {s.attributes["vllm_disagg.request_id"] for s in spans if s.name == "POST /v1/completions"}
    assert served == set(own), "every request's span (by the gateway's own id), from both processes"
    assert {s.trace_id for s in spans} == {TRACE_ID}


async def _serve_and_check(running: Cluster) -> list[str]:
    """Serve the requests; the gateway's own id of each (its log lines' and spans' ``request_id``)."""
    own: list[str] = []
    try:
        for i in range(REQUESTS):
            # A connection each: the kernel spreads connections over the processes sharing the port.
            async with aiohttp.ClientSession() as session:
                headers = {"X-Request-Id": f"json-{i}", "traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01"}
                body = {"model": MODEL, "prompt": f"a prompt {i}", "max_tokens": 4}
                async with session.post(running.base + "/v1/completions", json=body, headers=headers) as resp:
                    assert resp.status == 200, await resp.text()
                    own.append(resp.headers["X-Disagg-Request-Id"])
    finally:
        assert stop(running) == 0
    lines = [jsonutil.loads(line) for line in running.log.read_text().splitlines() if line.startswith("{")]
    processes = {line.get("process") for line in lines}
    assert {"orchestrator", "worker-1", "agent prefill-0", "agent decode-0"} <= processes, processes
    text = [line for line in running.log.read_text().splitlines() if " agent decode-0 INFO " in line]
    assert not text, f"text lines from an agent told to write JSON: {text[:3]}"
    for i in range(REQUESTS):
        about = [line for line in lines if line.get("request_id") == own[i]]
        assert about, f"no line about json-{i} ({own[i]})"
        assert {line["trace_id"] for line in about} == {TRACE_ID}
    served_by = {line["process"] for line in lines if line.get("request_id")}
    assert served_by == {"orchestrator", "worker-1"}, "both serving processes logged requests"
    return own
