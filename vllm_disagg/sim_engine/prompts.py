"""Tokenized prompts and their output tokens, memoised per engine so repeated prompts cost a lookup.

The gateway benchmark sends the same few prompts many times; tokenizing, hashing blocks and
generating output once per prompt keeps the zero-delay engine's cost near the HTTP floor.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from vllm_disagg import jsonutil
from vllm_disagg.sim_engine import textgen
from vllm_disagg.sim_engine.kv import chain_hashes


@dataclass(frozen=True, slots=True)
class PromptInfo:
    """A prompt as the engine sees it: token ids, the model state after them, chained block hashes."""

    token_ids: tuple[int, ...]
    state: int
    block_hashes: tuple[int, ...]


@dataclass(slots=True)
class _Output:
    ids: list[int]  # output token ids, position by position
    texts: list[str]  # their texts
    json: list[bytes]  # the texts JSON-encoded, for SSE chunks
    state: int  # the model state after the last of them, to generate more


class PromptTable:
    """Bounded LRU memo of prompts (by text or token ids) and of their output (by model state)."""

    def __init__(self, block_size: int, capacity: int = 1024) -> None:
        self._block_size = block_size
        self._capacity = capacity
        self._prompts: OrderedDict[str | tuple[int, ...], PromptInfo] = OrderedDict()
        self._outputs: OrderedDict[int, _Output] = OrderedDict()

    def resolve(self, prompt: str | tuple[int, ...]) -> PromptInfo:
        """The ``PromptInfo`` of a text prompt (tokenized) or of token ids."""
        info = self._prompts.get(prompt)
        if info is not None:
            self._prompts.move_to_end(prompt)
            return info
        ids = tuple(textgen.tokenize(prompt)) if isinstance(prompt, str) else prompt
        info = PromptInfo(ids, textgen.context_state(ids), chain_hashes(ids, self._block_size))
        self._prompts[prompt] = info
        if len(self._prompts) > self._capacity:
            self._prompts.popitem(last=False)
        return info

    def _grow(self, state: int, n: int) -> _Output:
        out = self._outputs.get(state)
        if out is None:
            out = _Output([], [], [], state)
            self._outputs[state] = out
            if len(self._outputs) > self._capacity:
                self._outputs.popitem(last=False)
        else:
            self._outputs.move_to_end(state)
        if len(out.ids) < n:
            ids, out.state = textgen.generate(out.state, n - len(out.ids))
            for token in ids:
                text = textgen.token_text(token)
                out.ids.append(token)
                out.texts.append(text)
                out.json.append(jsonutil.dumps(text))
        return out

    def text(self, info: PromptInfo, n: int) -> str:
        """The first ``n`` output tokens' text: ``textgen.expected_text`` of this prompt."""
        return "".join(self._grow(info.state, n).texts[:n])

    def json_words(self, info: PromptInfo, n: int) -> list[bytes]:
        """The first ``n`` output tokens, each as a JSON string literal."""
        return self._grow(info.state, n).json[:n]

    def output_ids(self, info: PromptInfo, n: int) -> list[int]:
        """The first ``n`` output token ids: ``textgen.output_token_ids`` of this prompt."""
        return self._grow(info.state, n).ids[:n]
