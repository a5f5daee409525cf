"""``bench kv``'s real-vLLM parts run on the project's connector, and what they call a load is one:
the engine's own counter says it loaded the blocks, from the pool or its disk tier (the TTFT part),
and from the host's pool or after a loopback move (the handoff part)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.vllm.engine_slots import engine_slots

pytestmark = pytest.mark.timeout(1200)


def test_the_pool_round_loads_the_prefix_s_blocks_instead_of_computing_them(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from vllm_disagg.cli.commands import main

    argv = ["bench", "kv", "--blocks", "2", "--rounds", "1", "--layers", "2", "--layer-block-kib", "16"]
    with engine_slots(1, "bench kv"):  # the TTFT part starts one engine
        assert main([*argv, "--ttft-rounds", "2", "--handoff-rounds", "0", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["ttft_prefix_tokens"] == 384  # three CPU blocks of 128: the tiny model's longest context
    # Each round's pool request loaded every block; the computed and local ones loaded nothing.
    assert result["ttft_pool_loaded_tokens"] == 2 * 384
    assert result["ttft_disk_loaded_tokens"] == 2 * 384  # and each disk request, read back from files
    assert min(result[f"ttft_{kind}_ms"] for kind in ("computed", "pool", "local", "disk")) > 0


def test_the_handoff_rounds_load_every_block_through_the_host_pool_and_after_a_loopback_move(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from vllm_disagg.cli.commands import main

    argv = ["bench", "kv", "--blocks", "2", "--rounds", "1", "--layers", "2", "--layer-block-kib", "16"]
    with engine_slots(2, "bench kv"):  # engine A, and one engine B at a time
        assert main([*argv, "--ttft-rounds", "0", "--handoff-rounds", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["handoff_prompt_tokens"] == 3 * 128
    for path in ("node", "loopback"):
        assert result[f"handoff_{path}_loaded_tokens"] == 2 * 3 * 128, path  # every block, each round
