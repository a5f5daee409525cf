"""Add an instance by URL: the orchestrator starts ``vllm-disagg connect`` for a running engine.

``POST /admin/v1/instances {"url": ...}`` is the admin API's way to put an engine someone started under
the orchestrator without logging in to its host: the orchestrator runs the attach agent itself, as
its own child (it dies with the orchestrator). ``connect`` discovers the engine (model, block size,
connector, role) and refuses what cannot work; its one-line reason becomes the API's answer.

With agent keys the spawned agent needs a key the orchestrator admits: a keypair is made for it in a
private directory (0700) and its public key admitted at runtime, so adding an instance never means
handing out keys by hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from vllm_disagg.orchestrator.control.plane import ControlPlane
from vllm_disagg.orchestrator.state.registry import Registry
from vllm_disagg.protocol.curve import load_public, make_keypair, write_public
from vllm_disagg.protocol.engine_urls import endpoint_host
from vllm_disagg.runtime import SELF_ARGV, child_env, die_with_parent, signal_group

log = logging.getLogger(__name__)

REGISTER_WAIT_S = 30.0  # how long the API waits for the agent's Hello before answering "pending"


@dataclass(frozen=True, slots=True)
class Spawned:
    """How adding an instance went: ``registered`` (the agent said Hello), ``pending`` (still starting),
    or ``failed`` (connect exited; ``reason`` is its last line)."""

    outcome: str
    agent_id: str
    pid: int
    reason: str = ""


class AgentSpawner:
    """Owns the attach agents the admin API started; stops them when the orchestrator stops."""

    def __init__(self, control: ControlPlane, registry: Registry) -> None:
        self._control = control
        self._registry = registry
        self._children: dict[str, asyncio.subprocess.Process] = {}
        self._readers: dict[str, asyncio.Task[None]] = {}
        self._keys_dir: Path | None = None

    def _endpoint(self) -> str:
        # The agent runs on this host: a wildcard bind is reached over loopback.
        return re.sub(r"^tcp://(\*|0\.0\.0\.0)", "tcp://127.0.0.1", self._control.endpoint)

    def _key_flags(self, agent_id: str) -> list[str]:
        server_public = self._control.public_key
        if server_public is None:
            return []
        if self._keys_dir is None:
            self._keys_dir = Path(tempfile.mkdtemp(prefix="vllm-disagg-spawned-keys-"))  # 0700
            write_public(self._keys_dir / "orchestrator.key", server_public)
        public, secret = make_keypair(self._keys_dir, agent_id)
        self._control.admit(load_public(str(public)), agent_id)
        return [
            "--curve-secret-key",
            str(secret),
            "--orchestrator-key",
            str(self._keys_dir / "orchestrator.key"),
        ]

    async def add(self, url: str, role: str | None, agent_id: str, model: str) -> Spawned:
        """Start ``connect`` for ``url`` and wait (bounded) until its agent registers or it exits."""
        endpoint = self._endpoint()
        # Its Hello would be refused for the URL (the agent connects from this host): say so now.
        problem = self._control.engine_url_problem(url, endpoint_host(endpoint))
        if problem is not None:
            return Spawned("failed", agent_id, 0, problem)
        argv = [
            *SELF_ARGV,
            "connect",
            "--orchestrator",
            endpoint,
            "--url",
            url,
            "--agent-id",
            agent_id,
        ]
        if role:
            argv += ["--role", role]
        if model:
            argv += ["--model", model]
        argv += self._key_flags(agent_id)
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            preexec_fn=die_with_parent,
            env=child_env(),  # not the admin token: the agent has no use for it
        )
        self._children[agent_id] = proc
        log.info("spawned connect for %s as %s (pid %d)", url, agent_id, proc.pid)
        return await self._outcome(proc, agent_id)

    async def _outcome(self, proc: asyncio.subprocess.Process, agent_id: str) -> Spawned:
        assert proc.stderr is not None
        errors: list[bytes] = []

        async def read_errors() -> None:
            assert proc.stderr is not None
            while line := await proc.stderr.readline():
                errors.append(line)
                del errors[:-20]  # the last lines say why it stopped

        reader = asyncio.create_task(read_errors())
        deadline = time.monotonic() + REGISTER_WAIT_S
        try:
            while time.monotonic() < deadline:
                if self._registry.is_live(agent_id):
                    return Spawned("registered", agent_id, proc.pid)
                if proc.returncode is not None:
                    await asyncio.wait_for(reader, 5)
                    self._children.pop(agent_id, None)
                    last = next(
                        (e.decode(errors="replace").strip() for e in reversed(errors) if e.strip()), ""
                    )
                    return Spawned(
                        "failed", agent_id, proc.pid, last or f"connect exited with {proc.returncode}"
                    )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(proc.wait()), 0.1)
            return Spawned("pending", agent_id, proc.pid)
        finally:
            if proc.returncode is None:
                self._readers[agent_id] = reader  # it drains the agent's stderr, so the pipe never fills
            else:
                reader.cancel()

    def pids(self) -> dict[str, int]:
        """The agents started and still running, by agent id."""
        return {a: p.pid for a, p in self._children.items() if p.returncode is None}

    async def close(self, grace_s: float = 10.0) -> None:
        """Stop every spawned agent (SIGTERM: it says Goodbye; SIGKILL after ``grace_s``)."""
        procs = [p for p in self._children.values() if p.returncode is None]
        for proc in procs:
            signal_group(proc.pid, signal.SIGTERM)
        if procs:
            await asyncio.wait([asyncio.ensure_future(p.wait()) for p in procs], timeout=grace_s)
        for proc in procs:
            signal_group(proc.pid, signal.SIGKILL)
        self._children.clear()
        for reader in self._readers.values():
            reader.cancel()
        self._readers.clear()
        if self._keys_dir is not None:
            shutil.rmtree(self._keys_dir, ignore_errors=True)
            self._keys_dir = None
