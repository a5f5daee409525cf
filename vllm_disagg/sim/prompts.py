"""Tokenized prompts and their output words, memoised per engine so repeated prompts cost a lookup.

The gateway benchmark sends the same few prompts many times; tokenizing, hashing blocks and
deriving output words once per prompt keeps the zero-delay engine's cost near the HTTP floor.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from vllm_disagg import jsonutil
from vllm_disagg.sim import textgen
from vllm_disagg.sim.kv import chain_hashes


@dataclass(frozen=True, slots=True)
class PromptInfo:
    """A prompt as the engine sees it: token ids, output seed, chained hashes of its full blocks."""

    token_ids: tuple[int, ...]
    seed: int
    block_hashes: tuple[int, ...]


@dataclass(slots=True)
class _Words:
    texts: list[str]  # output token texts, position by position
    json: list[bytes]  # the same, JSON-encoded for SSE chunks


class PromptTable:
    """Bounded LRU memo of prompts (by text or token ids) and of output words (by seed)."""

    def __init__(self, block_size: int, capacity: int = 1024) -> None:
        self._block_size = block_size
        self._capacity = capacity
        self._prompts: OrderedDict[str | tuple[int, ...], PromptInfo] = OrderedDict()
        self._words: OrderedDict[int, _Words] = OrderedDict()

    def resolve(self, prompt: str | tuple[int, ...]) -> PromptInfo:
        """The ``PromptInfo`` of a text prompt (tokenized) or of token ids."""
        info = self._prompts.get(prompt)
        if info is not None:
            self._prompts.move_to_end(prompt)
            return info
        ids = tuple(textgen.tokenize(prompt)) if isinstance(prompt, str) else prompt
        info = PromptInfo(ids, textgen.prompt_seed(ids), chain_hashes(ids, self._block_size))
        self._prompts[prompt] = info
        if len(self._prompts) > self._capacity:
            self._prompts.popitem(last=False)
        return info

    def _grow(self, seed: int, n: int) -> _Words:
        words = self._words.get(seed)
        if words is None:
            words = _Words([], [])
            self._words[seed] = words
            if len(self._words) > self._capacity:
                self._words.popitem(last=False)
        else:
            self._words.move_to_end(seed)
        for pos in range(len(words.texts), n):
            text = textgen.token_text(seed, pos)
            words.texts.append(text)
            words.json.append(jsonutil.dumps(text))
        return words

    def text(self, info: PromptInfo, n: int) -> str:
        """The first ``n`` output tokens' text: ``textgen.expected_text`` of this prompt."""
        return "".join(self._grow(info.seed, n).texts[:n])

    def json_words(self, info: PromptInfo, n: int) -> list[bytes]:
        """The first ``n`` output tokens, each as a JSON string literal."""
        return self._grow(info.seed, n).json[:n]
