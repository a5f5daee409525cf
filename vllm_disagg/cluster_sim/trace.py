"""A request trace: when each request arrives, how long its prompt and output are, and which prompt
blocks it shares with others.

The shape is Mooncake's (``timestamp``, ``input_length``, ``output_length``, ``hash_ids``): a prompt
is a run of blocks of ``block_tokens`` tokens, each named by an id, and equal ids at the same position
mean a shared prefix (an id names its whole prefix, not only its own tokens). ``prompt_token_ids``
turns the ids into token ids, deterministically, so the orchestrator's prefix index sees two prompts
that share blocks share those tokens exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

_VOCAB = 32_000  # token ids stay below a typical vocabulary


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace."""

    at_s: float  # arrival, seconds since the trace's first request
    input_tokens: int
    output_tokens: int
    # One id per ``block_tokens`` tokens of the prompt (the last block may be partial); equal ids at
    # the same position: a shared prefix.
    block_ids: tuple[int, ...]
    block_tokens: int
    session: str = ""  # a multi-turn conversation's id ("": none)
    priority: int = 0  # vLLM's: lower is sooner (the admission queue's classes, docs/sim.md)
    tenant: str = "default"  # whose request it is (the admission queue's fair share)


@dataclass(frozen=True, slots=True)
class Trace:
    """A named, ordered list of requests (by arrival)."""

    name: str
    requests: Sequence[TraceRequest]
    description: str = ""

    @property
    def duration_s(self) -> float:
        """From the first arrival to the last."""
        return self.requests[-1].at_s - self.requests[0].at_s if self.requests else 0.0


def block_token_ids(block_id: int, n: int) -> list[int]:
    """The ``n`` token ids of block ``block_id``: a function of the id alone, and different for any two
    ids below ``_VOCAB ** 2`` (the first two tokens spell the id), so that blocks of different
    prefixes never look alike to a prefix cache."""
    high, low = divmod(block_id, _VOCAB)
    return [low, high % _VOCAB, *range(low + 1, low + n - 1)][:n]  # a range: built at C speed


_MEMO: dict[tuple[int, int], list[int]] = {}  # shared blocks recur: their ids are made once
_MEMO_MAX = 1 << 19


def prompt_token_ids(request: TraceRequest) -> list[int]:
    """The prompt's token ids: each block's, the last cut to the prompt's length."""
    out: list[int] = []
    size = request.block_tokens
    memo = _MEMO
    for i, block in enumerate(request.block_ids):
        n = min(size, request.input_tokens - i * size)
        if n <= 0:
            break
        ids = memo.get((block, n))
        if ids is None:
            if len(memo) >= _MEMO_MAX:
                memo.clear()
            ids = memo[block, n] = block_token_ids(block, n)
        out += ids
    return out
