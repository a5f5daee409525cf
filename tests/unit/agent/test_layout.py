"""The engine's KV layout as the agent reports it: a launched engine's from its argv and environment, an
attached one's from what its server says."""

from __future__ import annotations

from typing import Any

import pytest

from vllm_disagg.agent.layout import attached_layout, launched_layout
from vllm_disagg.protocol.messages import KvLayout

SERVE = ["python", "-m", "vllm.entrypoints.cli.main", "serve", "/models/m", "--port", "8000"]


@pytest.mark.parametrize(
    ("args", "env", "cpu", "connector", "expected"),
    [
        pytest.param(
            [],
            {},
            False,
            "",
            {"tp_size": 1, "pp_size": 1, "dp_size": 1, "model_path": "/models/m"},
            id="a bare serve is TP 1, PP 1, DP 1 with the positional model and nothing else known",
        ),
        pytest.param(
            [
                "--tensor-parallel-size",
                "4",
                "-pp=2",
                "--data-parallel-size",
                "2",
                "--data-parallel-rank",
                "1",
            ],
            {},
            False,
            "",
            {"tp_size": 4, "pp_size": 2, "dp_size": 2, "dp_rank": 1, "model_path": "/models/m"},
            id="long and short parallel flags, with = or a separate value",
        ),
        pytest.param(
            ["-tp", "2", "--tensor-parallel-size=8"],
            {},
            False,
            "",
            {"tp_size": 8, "pp_size": 1, "dp_size": 1, "model_path": "/models/m"},
            id="the last of repeated flags wins, as with argparse",
        ),
        pytest.param(
            ["--dtype", "bfloat16", "--kv-cache-dtype", "fp8_e4m3", "--max-num-seqs", "32"],
            {"VLLM_ATTENTION_BACKEND": "flashinfer", "VLLM_KV_CACHE_LAYOUT": "HND"},
            False,
            "",
            {
                "tp_size": 1,
                "pp_size": 1,
                "dp_size": 1,
                "dtype": "bfloat16",
                "kv_cache_dtype": "fp8_e4m3",
                "max_num_seqs": 32,
                "attention_backend": "FLASHINFER",
                "kv_layout": "LBHNC",
                "model_path": "/models/m",
            },
            id="dtypes, batch, backend and layout (HND is vLLM's old name of LBHNC)",
        ),
        pytest.param(
            ["--dtype", "float16", "--model", "/other"],
            {},
            False,
            "NixlConnector",
            {
                "tp_size": 1,
                "pp_size": 1,
                "dp_size": 1,
                "dtype": "float16",
                "kv_cache_dtype": "float16",
                "kv_layout": "LBHNC",
                "model_path": "/other",
            },
            id="kv cache dtype auto is the model's; NixlConnector asks for LBHNC; --model overrides",
        ),
        pytest.param(
            ["--dtype", "auto"],
            {"VLLM_ATTENTION_BACKEND": "FLASH_ATTN"},
            True,
            "NixlConnector",
            {
                "tp_size": 1,
                "pp_size": 1,
                "dp_size": 1,
                "attention_backend": "CPU_ATTN",
                "kv_layout": "LBHNC",
                "model_path": "/models/m",
            },
            id="the CPU build runs CPU_ATTN on LBHNC; dtype auto is not known",
        ),
    ],
)
def test_launched_layout(
    args: list[str], env: dict[str, str], cpu: bool, connector: str, expected: dict[str, Any]
) -> None:
    assert launched_layout([*SERVE, *args], env, cpu=cpu, connector=connector) == KvLayout(**expected)


SERVER_INFO = {
    "vllm_config": {
        "model_config": {"model": "/models/m", "dtype": "torch.bfloat16"},
        "cache_config": {"cache_dtype": "auto", "kv_cache_layout": "LBHNC"},
        "parallel_config": {
            "tensor_parallel_size": 2,
            "pipeline_parallel_size": 1,
            "data_parallel_size": 1,
            "rank": 0,
        },
        "scheduler_config": {"max_num_seqs": 256},
        "attention_config": {"backend": "FLASH_ATTN"},
    }
}


@pytest.mark.parametrize(
    ("cache_info", "server_info", "expected"),
    [
        pytest.param(
            None,
            None,
            {"vllm_version": "0.32.0", "model_path": "m-root"},
            id="without stats nor dev mode only the version and the model's root are known",
        ),
        pytest.param(
            {"cache_dtype": "fp8", "kv_cache_layout": "NHD", "block_size": "16"},
            None,
            {"vllm_version": "0.32.0", "model_path": "m-root", "kv_cache_dtype": "fp8", "kv_layout": "LBNHC"},
            id="the cache_config_info labels give the KV cache dtype and layout",
        ),
        pytest.param(
            {"cache_dtype": "auto", "kv_cache_layout": "None"},
            None,
            {"vllm_version": "0.32.0", "model_path": "m-root"},
            id="auto without the model dtype and an unresolved layout stay unknown",
        ),
        pytest.param(
            None,
            SERVER_INFO,
            {
                "tp_size": 2,
                "pp_size": 1,
                "dp_size": 1,
                "dtype": "bfloat16",
                "kv_cache_dtype": "bfloat16",
                "kv_layout": "LBHNC",
                "attention_backend": "FLASH_ATTN",
                "vllm_version": "0.32.0",
                "model_path": "/models/m",
                "max_num_seqs": 256,
            },
            id="dev mode's server_info gives the parallel sizes, dtypes, backend and batch",
        ),
        pytest.param(
            None,
            {"vllm_config": "not a dict"},
            {"vllm_version": "0.32.0", "model_path": "m-root"},
            id="a malformed server_info is ignored",
        ),
    ],
)
def test_attached_layout(
    cache_info: dict[str, str] | None, server_info: Any, expected: dict[str, Any]
) -> None:
    got = attached_layout(root="m-root", version="0.32.0", cache_info=cache_info, server_info=server_info)
    assert got == KvLayout(**expected)
