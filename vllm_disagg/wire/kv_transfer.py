"""``kv_transfer_params``: how a request asks vLLM's NixlConnector for a P/D handoff, and the handle a
prefill engine answers with (vLLM 0.32, ``nixl/pull_scheduler.py``).

- The gateway's **prefill leg** asks the engine to keep the prompt's KV for a remote decode
  (``PREFILL_LEG``).
- The prefill engine's answer carries the **handle** (``producer_handle``): where its blocks wait.
- The **decode leg** forwards that handle unchanged; the decode engine reads it (``remote_prefill``)
  and pulls the blocks before it decodes.
- A resumed chat sends ``prompt_token_ids`` instead, which vLLM runs in place of the template
  (``reused_prompt_ids``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_disagg.errors import BadRequest
from vllm_disagg.wire.openai import check_vocab, has_non_text_content

# The prefill leg's ``kv_transfer_params``, exactly as vLLM's own toy proxy sends them.
PREFILL_LEG: Mapping[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """Where a decode request's KV waits: the prefill engine's handle, as the decode engine reads it."""

    engine_id: str
    host: str
    port: int
    block_ids: tuple[int, ...]
    request_id: str | None
    prefill_cached_tokens: int | None = None  # vLLM 0.32's remote_prefill_cached_tokens: D reports it


def producer_handle(
    *,
    block_ids: list[int],
    engine_id: str,
    host: str,
    port: int,
    request_id: str,
    prefill_cached_tokens: int | None = None,
) -> dict[str, Any]:
    """The ``kv_transfer_params`` a prefill engine answers with: what its decoder must pull, and where."""
    handle: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": block_ids,
        "remote_engine_id": engine_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
        "remote_request_id": request_id,
    }
    if prefill_cached_tokens is not None:
        handle["remote_prefill_cached_tokens"] = prefill_cached_tokens
    return handle


def _bad(what: str) -> BadRequest:
    return BadRequest(f"kv_transfer_params.{what}", param="kv_transfer_params")


def remote_prefill(params: Mapping[str, Any]) -> RemotePrefill:
    """The handle of a decode request (``do_remote_prefill``), validated: ``BadRequest`` names the field."""
    host = params.get("remote_host")
    port = params.get("remote_port")
    block_ids = params.get("remote_block_ids") or []
    engine_id = params.get("remote_engine_id")
    request_id = params.get("remote_request_id")
    if not isinstance(host, str) or not host:
        raise _bad("remote_host is required to pull KV")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise _bad("remote_port must be a TCP port")
    if not isinstance(block_ids, list) or not all(
        isinstance(b, int) and not isinstance(b, bool) for b in block_ids
    ):
        raise _bad("remote_block_ids must be a list of ints")
    if not isinstance(engine_id, str):
        raise _bad("remote_engine_id must be a string")
    if request_id is not None and not isinstance(request_id, str):
        raise _bad("remote_request_id must be a string")
    cached = params.get("remote_prefill_cached_tokens")
    if not isinstance(cached, int):
        cached = None  # vLLM ignores a figure that is not an int
    return RemotePrefill(engine_id, host, port, tuple(block_ids), request_id, cached)


def reused_prompt_ids(
    body: Mapping[str, Any], params: Mapping[str, Any] | None, vocab_size: int
) -> tuple[int, ...] | None:
    """Chat's ``kv_transfer_params.prompt_token_ids``: vLLM 0.32 runs these ids instead of the template
    (None when absent, or when a message has media, which vLLM renders then)."""
    ids = params.get("prompt_token_ids") if params else None
    if ids is None or has_non_text_content(body["messages"]):
        return None
    if not isinstance(ids, list) or not ids or any(type(t) is not int or t < 0 for t in ids):
        raise BadRequest(
            "`kv_transfer_params['prompt_token_ids']` must be a non-empty list of non-negative integers.",
            param="kv_transfer_params.prompt_token_ids",
        )
    reused = tuple(ids)
    check_vocab(reused, vocab_size, "kv_transfer_params.prompt_token_ids")
    return reused
