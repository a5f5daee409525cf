"""Body fields a client may not send an engine: what vLLM reads as orders, not as the request.

A completions or chat body reaches an engine in every leg (prefill, decode, colocated, resumed), and
vLLM 0.32 acts on some of its fields as instructions from whoever runs the handoff
(``vllm/entrypoints/openai/completion/protocol.py`` and ``chat_completion/protocol.py``):

- ``kv_transfer_params``: the KV connector's orders. From a client, on a NIXL engine: pull blocks
  from a host, engine id and block ids of its choosing, or hold a prompt's KV for a decode that never
  comes; a chat's ``prompt_token_ids`` in it run instead of the templated messages (and would fool the
  gateway's own tokenization and prefix lookup, ``tokenize.py``). Only the gateway writes it: the
  prefill leg's request, the prefill engine's answer copied to decode, a resumed chat's ids.
- ``ec_transfer_params``: the same for the encoder cache (encoder-disaggregated serving).
- ``request_id``: the engine's request id when no ``X-Request-Id`` header is sent. The gateway always
  sends its own (``request_ids.py``), so it is never needed, and an id the client picks must never be
  one an engine keys anything by.

Left to the client, on purpose: ``priority`` (admission's, ``forward_priority``), ``cache_salt`` (the
client's own isolation of its prefix cache), ``session_id`` and ``vllm_xargs`` (labels and extension
arguments vLLM passes to plugins; no handoff reads them), ``return_token_ids`` and the sampling
fields. The gateway's own fields (``prefill_endpoint``, ``decode_endpoint``) are pins, read and
removed by ``parsing.py``.
"""

from __future__ import annotations

from typing import Any

CONTROL_FIELDS = frozenset({"kv_transfer_params", "ec_transfer_params", "request_id"})


def strip_control(body: dict[str, Any]) -> tuple[str, ...]:
    """Remove the control fields from a client's ``body``; the names removed (sorted), () when none.

    A body without any costs one set test (the common case: its bytes go on unchanged)."""
    if body.keys().isdisjoint(CONTROL_FIELDS):
        return ()
    removed = tuple(sorted(CONTROL_FIELDS.intersection(body)))
    for name in removed:
        del body[name]
    return removed
