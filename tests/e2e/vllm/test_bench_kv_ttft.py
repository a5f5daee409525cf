"""``bench kv``'s TTFT part runs real vLLM on the project's connector, and what it calls a load from
the pool (or from its disk tier) is one: the engine's own counter says it loaded the repeated prefix's
two blocks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.vllm.engine_slots import engine_slots

pytestmark = pytest.mark.timeout(1200)


def test_the_pool_round_loads_the_two_blocks_instead_of_computing_them(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from vllm_disagg.cli.commands import main

    argv = ["bench", "kv", "--blocks", "2", "--rounds", "1", "--layers", "2", "--layer-block-kib", "16"]
    with engine_slots(1, "bench kv"):  # the TTFT part starts one engine
        assert main([*argv, "--ttft-rounds", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["ttft_prefix_tokens"] == 256  # two CPU blocks of 128
    # Each round's pool request loaded both blocks; the computed and local ones loaded nothing.
    assert result["ttft_pool_loaded_tokens"] == 2 * 256
    assert result["ttft_disk_loaded_tokens"] == 2 * 256  # and each disk request, read back from files
    assert min(result[f"ttft_{kind}_ms"] for kind in ("computed", "pool", "local", "disk")) > 0
