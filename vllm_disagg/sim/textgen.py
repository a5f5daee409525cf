"""The simulated model: a byte tokenizer, a chat template, and output that is a pure function
of (prompt token ids, position), so a test can know every byte of a response in advance.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence

# Each output token is one word with a leading space; 64 words so text stays readable.
WORDS: tuple[str, ...] = tuple(
    """alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar
    papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu amber basil cedar dune
    ember fern grove heath iris jade kelp lotus maple nectar opal pine quartz reed sage thyme umber
    vale willow yarrow zinnia acorn birch clover daisy elm flax gorse hazel ivy juniper kale larch""".split()
)
_MASK = (1 << 64) - 1


def tokenize(text: str) -> list[int]:
    """The simulated tokenizer: one token per UTF-8 byte (vocabulary of 256)."""
    return list(text.encode("utf-8"))


def apply_chat_template(messages: Iterable[Mapping[str, object]]) -> str:
    """The simulated chat template: each message as ``<|role|>\\ncontent\\n``, then the assistant cue."""
    parts = []
    for m in messages:
        content = m.get("content", "")
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
        parts.append(f"<|{m.get('role', 'user')}|>\n{content}\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)


def prompt_seed(token_ids: Sequence[int]) -> int:
    """A 64-bit digest of the prompt; output depends on the prompt only through it."""
    return int.from_bytes(hashlib.blake2b(_as_bytes(token_ids), digest_size=8).digest(), "big")


def _as_bytes(token_ids: Sequence[int]) -> bytes:
    return b"".join(t.to_bytes(4, "little") for t in token_ids)


def _mix(x: int) -> int:
    # splitmix64 finaliser: cheap, well spread.
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _word_index(seed: int, position: int) -> int:
    return _mix(seed ^ _mix(position)) % len(WORDS)


def token_text(seed: int, position: int) -> str:
    """The text of output token ``position`` (0-based) for a prompt with this seed."""
    return " " + WORDS[_word_index(seed, position)]


def output_token_id(seed: int, position: int) -> int:
    """A stable id for output token ``position``: 256 + the word's index."""
    return 256 + _word_index(seed, position)


def expected_text(prompt: str | Sequence[int], max_tokens: int) -> str:
    """Exactly what the simulated engine answers for this prompt (text or token ids)."""
    ids = tokenize(prompt) if isinstance(prompt, str) else list(prompt)
    seed = prompt_seed(ids)
    return "".join(token_text(seed, i) for i in range(max_tokens))


def expected_chat_text(messages: Iterable[Mapping[str, object]], max_tokens: int) -> str:
    """Exactly what the simulated engine answers for this chat conversation."""
    return expected_text(apply_chat_template(messages), max_tokens)
