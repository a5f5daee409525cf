"""``vllm-disagg sim-engine``: flags that reproduce a config, and the command as a real subprocess."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from tests.helpers import eventually, free_port
from vllm_disagg import jsonutil
from vllm_disagg.cli.commands import main
from vllm_disagg.config import SimEngineConfig, SimTiming
from vllm_disagg.sim_engine import textgen
from vllm_disagg.sim_engine.cli import add_arguments, config_from_args, sim_engine_argv

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def test_sim_engine_argv_reproduces_the_config() -> None:
    config = SimEngineConfig(
        model="m",
        host="127.0.0.2",
        port=9123,
        engine_id="e-1",
        max_model_len=1024,
        default_max_tokens=7,
        kv_lease_s=2.5,
        kv_events_port=9200,
        timing=SimTiming(
            prefill_s_per_token=0.0001,
            decode_step_s=0.01,
            decode_step_s_per_seq=0.001,
            kv_transfer_s_per_token=1e-6,
            max_num_seqs=3,
            num_blocks=100,
            block_size=8,
            kv_bytes_per_token=4096,
        ),
    )
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args(sim_engine_argv(config))) == config
    assert config_from_args(parser.parse_args([])) == SimEngineConfig()
    assert config_from_args(parser.parse_args(sim_engine_argv(SimEngineConfig()))) == SimEngineConfig()


def test_sim_engine_refuses_an_impossible_config_with_exit_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim-engine", "--block-size", "0"]) == 2
    assert "block_size" in capsys.readouterr().err


async def test_sim_engine_command_serves_and_exits_0_on_sigterm(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    port = free_port()
    config = SimEngineConfig(port=port, model="sim-model", timing=SimTiming(decode_step_s=0.001))
    log = (tmp_path / "engine.log").open("wb")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "from vllm_disagg.cli.commands import main; raise SystemExit(main())",
        "sim-engine",
        *sim_engine_argv(config),
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=log,
    )
    try:
        url = f"http://127.0.0.1:{port}"

        async def healthy() -> bool:
            async with http.get(url + "/health") as r:
                return r.status == 200

        await eventually(healthy, timeout=60, what="the sim engine to start")
        body = {"model": "sim-model", "prompt": "cli", "max_tokens": 3}
        async with http.post(url + "/v1/completions", data=jsonutil.dumps(body)) as r:
            assert r.status == 200
            payload = jsonutil.loads(await r.read())
        assert payload["choices"][0]["text"] == textgen.expected_text("cli", 3)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), timeout=30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        log.close()
    assert "serving at" in (tmp_path / "engine.log").read_text()
