"""The reference: what one plain colocated vLLM (no KV connector, greedy) answers, to which
disaggregated serving must be token-identical.

Every real-vLLM module that compares with the reference asks for its cases here, and one engine start
answers them all, once per run: the first test process to need the book fills it (under a lock, in
the run's directory, which pytest-xdist's workers share) and the others read it. A module that adds
reference cases adds them to ``all_reference_cases``.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.vllm.support import (
    BLOCK,
    MODEL,
    Answers,
    Case,
    ask,
    engine_client,
    free_engine_ports,
    prompts_for,
    running_vllm,
)
from vllm_disagg import jsonutil
from vllm_disagg.config import AgentConfig

LONG = 96  # output tokens of the streams the recovery tests cut mid-way (the context is 512)


@dataclass(frozen=True)
class LongCase(Case):
    """A long greedy stream: long enough to be cut in the middle."""

    def body(self) -> dict[str, Any]:
        return {**super().body(), "max_tokens": LONG, "ignore_eos": True}


def routes_and_modes(prompts: list[str]) -> list[Case]:
    """Each prompt on both routes, streamed and not."""
    return [
        Case(
            f"{'chat' if chat else 'completions'}-{'stream' if stream else 'nonstream'}-{i}", chat, stream, p
        )
        for i, p in enumerate(prompts)
        for chat in (False, True)
        for stream in (False, True)
    ]


def shared_prompts(model_dir: Path) -> list[str]:
    """The 1P1D and recovery modules' prompts: sixteen of a little over two blocks."""
    return prompts_for(model_dir, 16, first_tokens=2 * BLOCK + 20)


def concurrent_cases(prompts: list[str]) -> list[Case]:
    return [Case(f"concurrent-{i}", False, False, p) for i, p in enumerate(prompts)]


def long_cases(prompts: list[str]) -> list[LongCase]:
    return [
        LongCase("long-completion", False, True, prompts[6]),
        LongCase("long-chat", True, True, prompts[7]),
    ]


def short_cases(prompts: list[str]) -> list[Case]:
    return [Case(f"short-{i}", False, False, p) for i, p in enumerate(prompts[:4])]


@dataclass(frozen=True)
class PoolPrompts:
    handoff: list[str]  # through the gateway, P to D
    prefix: str  # computed on P alone
    sharing: str  # the same first blocks, another tail: sent to D


def pool_prompts(model_dir: Path) -> PoolPrompts:
    handoff = prompts_for(model_dir, 3, first_tokens=2 * BLOCK + 20)
    # "Request 3: ...": no block in common with the handoff prompts ("Request 0..2: ...").
    long = prompts_for(model_dir, 4, first_tokens=3 * BLOCK + 10)[3]
    return PoolPrompts(handoff, long + " and then the first tail", long + " but a second, other tail")


def pool_cases(prompts: PoolPrompts) -> list[Case]:
    return [
        *routes_and_modes(prompts.handoff),
        Case("prefix", False, False, prompts.prefix),
        Case("sharing", False, False, prompts.sharing),
    ]


def all_reference_cases(model_dir: Path) -> list[Case]:
    """Every module's reference cases (nixl/test_handoff, _recovery, _roles; test_real_vllm_pool)."""
    prompts = shared_prompts(model_dir)
    return [
        *routes_and_modes(prompts[:4]),
        *concurrent_cases(prompts),
        *long_cases(prompts),
        *short_cases(prompts),
        *pool_cases(pool_prompts(model_dir)),
    ]


def _key(case: Case) -> str:
    """A case is its request: two modules' cases of one name may differ, two of one request may not."""
    return jsonutil.dumps({"route": case.route, "body": case.body()}).decode()


class Book:
    """The reference's answers, by request."""

    def __init__(self, texts: dict[str, str], prompt_tokens: dict[str, int]) -> None:
        self._texts = texts
        self._prompt_tokens = prompt_tokens

    def answers(self, cases: list[Case]) -> Answers:
        """The answers to ``cases``, by case name."""
        keys = {c.name: _key(c) for c in cases}
        missing = [name for name, key in keys.items() if key not in self._texts]
        assert not missing, f"not in the reference book (add them to all_reference_cases): {missing}"
        texts = {name: self._texts[key] for name, key in keys.items()}
        tokens = {name: self._prompt_tokens[key] for name, key in keys.items() if key in self._prompt_tokens}
        return Answers(texts, tokens)

    def save(self, path: Path) -> None:
        staging = path.with_suffix(f".{os.getpid()}")
        staging.write_bytes(jsonutil.dumps({"texts": self._texts, "prompt_tokens": self._prompt_tokens}))
        staging.rename(path)  # whole or absent

    @classmethod
    def load(cls, path: Path) -> Book:
        data = jsonutil.loads(path.read_bytes())
        return cls(data["texts"], data["prompt_tokens"])


def _asked(model_dir: Path, cases: list[Case], log: Path) -> Book:
    """Every case asked, one at a time, of one plain vLLM."""
    cfg = AgentConfig(
        agent_id="reference", role="both", engine="vllm", model=MODEL, model_path=str(model_dir),
        engine_port=free_engine_ports(1), kv_connector="",
    )  # fmt: skip
    with running_vllm(cfg, log) as base:

        async def collect() -> Book:
            texts: dict[str, str] = {}
            prompt_tokens: dict[str, int] = {}
            async with engine_client() as session:
                for case in cases:
                    texts[_key(case)], usage, _ = await ask(session, base, case)
                    if usage:
                        prompt_tokens[_key(case)] = usage["prompt_tokens"]
            return Book(texts, prompt_tokens)

        return asyncio.run(collect())


def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory of this run that every xdist worker shares (a worker's own is a child of it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def shared_book(model_dir: Path, directory: Path) -> Book:
    """The run's book: filled by the first process to ask, read by the others."""
    path = directory / "reference.json"
    with (directory / "reference.lock").open("a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the filler holds it for one engine start, under a deadline
        if not path.exists():
            _asked(model_dir, all_reference_cases(model_dir), directory / "reference-vllm.log").save(path)
    return Book.load(path)
