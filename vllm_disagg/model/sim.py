"""The simulated model's vocabulary, tokenizer and chat template: what simulated engines run
(``vllm_disagg.sim_engine.textgen`` generates from them) and what the gateway's tokenizer applies to a prompt
for a simulated model, as it applies a Hugging Face tokenizer for a real one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

# Each output token is one word with a leading space; 64 words so text stays readable.
WORDS: tuple[str, ...] = tuple(
    """alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar
    papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu amber basil cedar dune
    ember fern grove heath iris jade kelp lotus maple nectar opal pine quartz reed sage thyme umber
    vale willow yarrow zinnia acorn birch clover daisy elm flax gorse hazel ivy juniper kale larch""".split()
)
FIRST_WORD_ID = 256  # ids 0..255 are the UTF-8 bytes; word i is token 256 + i
VOCAB_SIZE = FIRST_WORD_ID + len(WORDS)


def tokenize(text: str) -> list[int]:
    """The simulated tokenizer: one token per UTF-8 byte (ids 0..255)."""
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
