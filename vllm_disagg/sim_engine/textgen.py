"""The simulated model: a byte tokenizer, a chat template, and autoregressive output that a test can
know in advance, byte for byte.

Each output token is a function of the whole context before it (prompt and output so far), so a
request whose prompt is ``prompt ids + the first k output ids`` continues with exactly the rest of
the output, as a greedy real model does; that is what a mid-stream resume relies on. The context is
summarised by a polynomial hash modulo a 64-bit prime: one C-level bignum conversion for a whole
prompt, one multiply-add per generated token.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Mapping, Sequence

# The model's vocabulary, tokenizer and chat template live where the gateway's tokenizer can read them.
from vllm_disagg.model.sim import FIRST_WORD_ID as FIRST_WORD_ID
from vllm_disagg.model.sim import VOCAB_SIZE as VOCAB_SIZE
from vllm_disagg.model.sim import WORDS as WORDS
from vllm_disagg.model.sim import apply_chat_template as apply_chat_template
from vllm_disagg.model.sim import tokenize as tokenize

_MASK = (1 << 64) - 1
# A prime near sqrt(2) * 2**63: 2**64 mod it (the hash's base) is a large, irregular number.
_MODULUS = 0xB504F333F9DE6471
# The context's first "digit": without it, leading zero tokens would not change the hash.
_START = 0x9E3779B97F4A7C15
_SWAP = sys.byteorder == "little"


def context_state(token_ids: Sequence[int]) -> int:
    """The model's state after reading ``token_ids``: ``advance`` folded over them, computed in one go."""
    try:
        words = array("Q", [_START, *token_ids])
    except OverflowError:  # ids of 2**64 and above: only their low 64 bits count, as in ``advance``
        words = array("Q", [_START, *(t & _MASK for t in token_ids)])
    if _SWAP:
        words.byteswap()
    return int.from_bytes(words.tobytes(), "big") % _MODULUS


def advance(state: int, token_id: int) -> int:
    """The state after one more token: ``(state * 2**64 + token) mod p``."""
    return ((state << 64) | (token_id & _MASK)) % _MODULUS


def _mix(x: int) -> int:
    # splitmix64 finaliser: the hash is linear in the tokens, so spread it before picking a word.
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def next_token(state: int) -> int:
    """The token the model emits in this state: always a word id (no EOS)."""
    return FIRST_WORD_ID + _mix(state) % len(WORDS)


def token_text(token_id: int) -> str:
    """The text of an output (word) token: the word with a leading space."""
    if not FIRST_WORD_ID <= token_id < VOCAB_SIZE:
        raise ValueError(f"token {token_id} is not an output word")
    return " " + WORDS[token_id - FIRST_WORD_ID]


def generate(state: int, n: int) -> tuple[list[int], int]:
    """``n`` output token ids from this state, and the state after them."""
    out = []
    for _ in range(n):
        token = next_token(state)
        out.append(token)
        state = advance(state, token)
    return out, state


def _ids(prompt: str | Sequence[int]) -> Sequence[int]:
    return tokenize(prompt) if isinstance(prompt, str) else prompt


def output_token_ids(prompt: str | Sequence[int], max_tokens: int) -> list[int]:
    """Exactly the token ids the simulated engine answers for this prompt (text or token ids)."""
    return generate(context_state(_ids(prompt)), max_tokens)[0]


def expected_text(prompt: str | Sequence[int], max_tokens: int) -> str:
    """Exactly what the simulated engine answers for this prompt (text or token ids)."""
    return "".join(token_text(t) for t in output_token_ids(prompt, max_tokens))


def expected_chat_text(messages: Iterable[Mapping[str, object]], max_tokens: int) -> str:
    """Exactly what the simulated engine answers for this chat conversation."""
    return expected_text(apply_chat_template(messages), max_tokens)
