"""Mooncake traces (``timestamp``, ``input_length``, ``output_length``, ``hash_ids`` of 512-token
blocks): read one for replay on the simulated model, scaled, and write any trace in that format.

Scaling (``load_mooncake``): each 512-token Mooncake block becomes ``k = round(512 x length_scale /
block_tokens)`` simulated blocks, sub-block ``j`` of hash id ``h`` getting id ``h x k + j``, so sharing
is kept exactly; input lengths scale by ``k x block_tokens / 512`` (``length_scale`` whenever that is a
whole number of blocks) and are capped by ``max_input_tokens``; outputs by ``output_scale``;
timestamps are rebased to the first request and divided by ``time_scale``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_disagg import jsonutil
from vllm_disagg.cluster_sim.trace import Trace, TraceRequest
from vllm_disagg.cluster_sim.traces import DEFAULT_BLOCK_TOKENS, blocks_of, check

MOONCAKE_BLOCK_TOKENS = 512  # the block size of Mooncake's hash_ids


def mooncake_subblocks_of(block_tokens: int, length_scale: float) -> int:
    """How many simulated blocks one 512-token Mooncake block becomes."""
    check(block_tokens >= 1, f"block_tokens must be >= 1, got {block_tokens}")
    check(length_scale > 0, f"length_scale must be > 0, got {length_scale}")
    k = round(MOONCAKE_BLOCK_TOKENS * length_scale / block_tokens)
    check(k >= 1, f"length_scale {length_scale}: a Mooncake block is under one {block_tokens}-token block")
    return k


@dataclass(frozen=True, slots=True)
class _Line:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: list[int]
    session: str


def _int_field(obj: dict[str, Any], key: str, low: int, where: str) -> int:
    value = obj.get(key)
    if type(value) is not int or value < low:
        raise ValueError(f"{where}: {key!r} must be an integer >= {low}, got {value!r}")
    return value


def _parse_line(raw: bytes, where: str) -> _Line:
    try:
        obj = jsonutil.loads(raw)
    except jsonutil.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    timestamp = obj.get("timestamp")
    if isinstance(timestamp, bool) or not isinstance(timestamp, int | float) or not 0 <= timestamp < math.inf:
        raise ValueError(f"{where}: 'timestamp' must be a number of ms >= 0, got {timestamp!r}")
    input_length = _int_field(obj, "input_length", 1, where)
    output_length = _int_field(obj, "output_length", 0, where)
    hash_ids = obj.get("hash_ids")
    if not isinstance(hash_ids, list) or not all(type(h) is int for h in hash_ids):
        raise ValueError(f"{where}: 'hash_ids' must be a list of integers")
    if len(hash_ids) * MOONCAKE_BLOCK_TOKENS < input_length:
        raise ValueError(
            f"{where}: input_length {input_length} needs {blocks_of(input_length, MOONCAKE_BLOCK_TOKENS)} "
            f"blocks of {MOONCAKE_BLOCK_TOKENS} tokens, hash_ids has {len(hash_ids)}"
        )
    session = obj.get("session", "")
    if not isinstance(session, str):
        raise ValueError(f"{where}: 'session' must be a string, got {session!r}")
    return _Line(float(timestamp), input_length, output_length, hash_ids, session)


def load_mooncake(
    path: str | Path,
    *,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    length_scale: float = 1.0,
    max_input_tokens: int | None = None,
    time_scale: float = 1.0,
    output_scale: float = 1.0,
    limit: int | None = None,
) -> Trace:
    """A Mooncake JSONL trace, scaled to the simulated model.

    Each line holds ``timestamp`` (ms), ``input_length``, ``output_length`` and ``hash_ids`` (one id per
    512-token block; an optional ``session`` string, which ``dump_mooncake`` writes, is kept). Scaling:

    - Blocks: each Mooncake block becomes ``k = round(512 * length_scale / block_tokens)`` simulated
      blocks (``k >= 1`` or ``ValueError``); sub-block ``j`` of Mooncake id ``h`` gets id ``h * k + j``,
      which is injective, so two prompts share a simulated id at a position exactly when they share the
      Mooncake id it comes from.
    - Input: lengths scale by the effective ``k * block_tokens / 512`` (``length_scale`` rounded so a
      Mooncake block is a whole number of simulated blocks; exact when ``512 * length_scale`` is a
      multiple of ``block_tokens``), at least 1 token, then are cut to ``max_input_tokens``; the
      prompt keeps the ``ceil(input_tokens / block_tokens)`` first block ids (surplus ids are dropped).
    - Output: ``max(1, round(output_length * output_scale))``; kept as is by default, as decode length
      does not depend on the model's size the way a document's does.
    - Time: ``at_s = (timestamp - first timestamp) / 1000 / time_scale`` (``time_scale`` 2 replays twice
      as fast); lines are ordered by timestamp, ties kept in file order.

    ``limit`` keeps the first ``limit`` lines. A malformed line raises ``ValueError`` naming its number.
    """
    k = mooncake_subblocks_of(block_tokens, length_scale)
    check(time_scale > 0, f"time_scale must be > 0, got {time_scale}")
    check(output_scale > 0, f"output_scale must be > 0, got {output_scale}")
    check(max_input_tokens is None or max_input_tokens >= 1, f"max_input_tokens < 1: {max_input_tokens}")
    check(limit is None or limit >= 0, f"limit must be >= 0, got {limit}")
    path = Path(path)
    lines = _read_lines(path, limit)
    scale = k * block_tokens / MOONCAKE_BLOCK_TOKENS
    cap = max_input_tokens if max_input_tokens is not None else math.inf
    start_ms = lines[0].timestamp_ms if lines else 0.0
    requests: list[TraceRequest] = []
    for line in lines:
        input_tokens = int(min(cap, max(1, round(line.input_length * scale))))
        n_blocks = blocks_of(input_tokens, block_tokens)
        blocks = tuple(h * k + j for h in line.hash_ids[: blocks_of(n_blocks, k)] for j in range(k))
        at_s = (line.timestamp_ms - start_ms) / 1000 / time_scale
        output_tokens = max(1, round(line.output_length * output_scale))
        requests.append(
            TraceRequest(at_s, input_tokens, output_tokens, blocks[:n_blocks], block_tokens, line.session)
        )
    description = (
        f"{path.name}: {k} blocks of {block_tokens} tokens per Mooncake block (length x{scale:g}), "
        f"time /{time_scale:g}, output x{output_scale:g}, input cap {max_input_tokens}"
    )
    return Trace(f"mooncake:{path.stem}", requests, description)


def _read_lines(path: Path, limit: int | None) -> list[_Line]:
    """The first ``limit`` non-blank lines of a trace file, ordered by timestamp (ties in file order)."""
    lines: list[_Line] = []
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            if limit is not None and len(lines) >= limit:
                break
            if raw.strip():
                lines.append(_parse_line(raw, f"{path}, line {number}"))
    lines.sort(key=lambda line: line.timestamp_ms)
    return lines


def dump_mooncake(trace: Trace, path: str | Path) -> None:
    """Write ``trace`` as Mooncake JSONL, one 512-token Mooncake block per simulated block (lengths
    scaled up by ``512 / block_tokens``), sessions kept in a ``session`` key. For ``block_tokens``
    B <= 512, ``load_mooncake(path, block_tokens=B, length_scale=B / 512)`` gives the requests back
    (timestamps to float rounding)."""
    sizes = {r.block_tokens for r in trace.requests}
    check(len(sizes) <= 1, f"dump_mooncake: one block size per trace, got {sorted(sizes)}")
    start_s = trace.requests[0].at_s if trace.requests else 0.0
    with Path(path).open("wb") as f:
        for r in trace.requests:
            row: dict[str, Any] = {
                "timestamp": (r.at_s - start_s) * 1000,
                "input_length": round(r.input_tokens * MOONCAKE_BLOCK_TOKENS / r.block_tokens),
                "output_length": r.output_tokens,
                "hash_ids": list(r.block_ids),
            }
            if r.session:
                row["session"] = r.session
            f.write(jsonutil.dumps(row) + b"\n")
