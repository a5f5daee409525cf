"""The engine's ``KvLayout``: read from a launched engine's command line and environment, or from what
an attached one's server says. Unknown stays 0 or "" (never held against a pair: docs/agent.md).

Where vLLM 0.32 decides each field is cited in docs/vllm-kv-layout-facts.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from vllm_disagg.protocol.messages import KvLayout

# vLLM's legacy names for its KV layouts (vllm/config/cache.py ``_LAYOUT_COMPAT_ALIASES``).
LAYOUT_ALIASES: Mapping[str, str] = {"NHD": "LBNHC", "HND": "LBHNC"}
CPU_ATTENTION_BACKEND = "CPU_ATTN"  # vllm/v1/attention/backends/cpu_attn.py: the CPU build's only one
CPU_KV_LAYOUT = "LBHNC"  # ... whose only supported layout this is
# Connectors whose ``get_required_kvcache_layout`` asks for LBHNC (non-MLA models).
LBHNC_CONNECTORS = frozenset({"NixlConnector", "NixlPushConnector", "MooncakeConnector"})

_FLAGS: Mapping[str, tuple[str, ...]] = {
    "tp_size": ("--tensor-parallel-size", "-tp"),
    "pp_size": ("--pipeline-parallel-size", "-pp"),
    "dp_size": ("--data-parallel-size", "-dp"),
    "dp_rank": ("--data-parallel-rank", "-dpn"),
    "max_num_seqs": ("--max-num-seqs",),
}


def layout_name(name: str) -> str:
    """A KV layout in vLLM's current naming (``HND`` is ``LBHNC``); "" stays ""."""
    upper = name.strip().upper()
    return LAYOUT_ALIASES.get(upper, upper)


def dtype_name(name: str) -> str:
    """``torch.bfloat16`` -> ``bfloat16``; ``auto`` (decided by the model's config) -> "" (unknown)."""
    short = name.strip().removeprefix("torch.")
    return "" if short in ("", "auto", "None") else short


def argv_value(argv: Sequence[str], flags: Sequence[str]) -> str | None:
    """The last value any of ``flags`` is given (``--flag V`` or ``--flag=V``); None if absent."""
    value: str | None = None
    for i, arg in enumerate(argv):
        for flag in flags:
            if arg == flag and i + 1 < len(argv):
                value = argv[i + 1]
            elif arg.startswith(flag + "="):
                value = arg[len(flag) + 1 :]
    return value


def _int(text: str | None) -> int:
    return int(text) if text is not None and text.isdigit() else 0


def _model(argv: Sequence[str]) -> str:
    flag = argv_value(argv, ("--model",))
    if flag is not None:
        return flag
    if "serve" in argv:  # ``vllm serve MODEL``: the model is positional
        i = argv.index("serve")
        if i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            return argv[i + 1]
    return ""


def launched_layout(argv: Sequence[str], env: Mapping[str, str], *, cpu: bool, connector: str) -> KvLayout:
    """The layout of the engine ``argv`` and ``env`` launch (``cpu``: vLLM's CPU build)."""
    ints = {field: _int(argv_value(argv, flags)) for field, flags in _FLAGS.items()}
    backend = env.get("VLLM_ATTENTION_BACKEND", "")
    layout = layout_name(env.get("VLLM_KV_CACHE_LAYOUT", ""))
    if cpu:
        backend, layout = CPU_ATTENTION_BACKEND, CPU_KV_LAYOUT
    elif not layout and connector in LBHNC_CONNECTORS:
        layout = "LBHNC"
    dtype = dtype_name(argv_value(argv, ("--dtype",)) or "")
    kv_dtype = argv_value(argv, ("--kv-cache-dtype",)) or ""
    return KvLayout(
        # vLLM's defaults where the flag is absent: one rank of each (a bare ``serve`` is TP 1, PP 1).
        tp_size=ints["tp_size"] or 1,
        pp_size=ints["pp_size"] or 1,
        dp_size=ints["dp_size"] or 1,
        dp_rank=ints["dp_rank"],
        dtype=dtype,
        kv_cache_dtype=dtype if kv_dtype in ("", "auto") else dtype_name(kv_dtype),
        kv_layout=layout,
        attention_backend=backend.upper(),
        model_path=_model(argv),
        max_num_seqs=ints["max_num_seqs"],
    )


def _section(config: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = config.get(name)
    return value if isinstance(value, dict) else {}


def _get_int(section: Mapping[str, Any], key: str) -> int:
    value = section.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _get_str(section: Mapping[str, Any], key: str) -> str:
    value = section.get(key)
    return value if isinstance(value, str) else ""


def attached_layout(
    *,
    root: str,
    version: str,
    cache_info: Mapping[str, str] | None,
    server_info: Any,
) -> KvLayout:
    """What an attached engine says: ``/v1/models`` ``root``, ``/version``, the ``vllm:cache_config_info``
    labels (any vLLM with stats on) and dev mode's ``/server_info?config_format=json`` (or None)."""
    info = cache_info or {}
    config = server_info.get("vllm_config") if isinstance(server_info, dict) else None
    config = config if isinstance(config, dict) else {}
    model, cache = _section(config, "model_config"), _section(config, "cache_config")
    parallel, scheduler = _section(config, "parallel_config"), _section(config, "scheduler_config")
    attention = _section(config, "attention_config")
    dtype = dtype_name(_get_str(model, "dtype"))
    kv_dtype = _get_str(cache, "cache_dtype") or info.get("cache_dtype", "")
    layout = _get_str(cache, "kv_cache_layout") or info.get("kv_cache_layout", "")
    return KvLayout(
        tp_size=_get_int(parallel, "tensor_parallel_size"),
        tp_rank=_get_int(parallel, "rank"),
        pp_size=_get_int(parallel, "pipeline_parallel_size"),
        dp_size=_get_int(parallel, "data_parallel_size"),
        dp_rank=_get_int(parallel, "data_parallel_rank"),
        dtype=dtype,
        kv_cache_dtype=dtype if kv_dtype in ("", "auto") else dtype_name(kv_dtype),
        kv_layout=layout_name("" if layout == "None" else layout),
        attention_backend=_get_str(attention, "backend").upper().removeprefix("ATTENTIONBACKENDENUM."),
        vllm_version=version,
        model_path=_get_str(model, "model") or root,
        max_num_seqs=_get_int(scheduler, "max_num_seqs"),
    )
