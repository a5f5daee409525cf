"""The parts of an OpenAI request body that decide what a vLLM engine runs: the completion's prompt
and the chat's messages, validated with vLLM's refusals. The simulated engine parses requests with
them, and the gateway's tokenizer reads prompts with them as the engine will.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm_disagg.errors import BadRequest


def prompt_of(body: Mapping[str, Any]) -> str | tuple[int, ...]:
    """A completion's one prompt: text or token ids (a batch of one is the same request). A batch of
    several is refused: nothing here runs one."""
    prompt = body.get("prompt")
    if prompt is None:
        raise BadRequest("'prompt' is required", param="prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt cannot be empty", param="prompt")
        return prompt
    if isinstance(prompt, list):
        if not prompt:
            raise BadRequest("prompt cannot be empty", param="prompt")
        if all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            return tuple(prompt)
        if all(isinstance(p, str | list) for p in prompt):
            raise BadRequest("batched prompts are not supported by the simulated engine", param="prompt")
        raise BadRequest("'prompt' must be a string or a list of non-negative token ids", param="prompt")
    raise BadRequest("'prompt' must be a string or a list of token ids", param="prompt")


def messages_of(body: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """A chat's messages: a non-empty list of objects with a ``role``."""
    messages = body.get("messages")
    if messages is None:
        raise BadRequest("'messages' is required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", param="messages")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest("each message must be an object with a 'role'", param="messages")
    return messages


def check_vocab(ids: tuple[int, ...], vocab_size: int, param: str | None) -> None:
    """vLLM's refusal of a token id the model does not have."""
    top = max(ids)
    if top >= vocab_size:
        raise BadRequest(f"Token id {top} is out of vocabulary", param=param)


def has_non_text_content(messages: list[Any]) -> bool:
    """Whether a chat message has content parts other than text (images, audio...)."""
    for m in messages:
        content = m.get("content")
        if isinstance(content, list) and any(
            isinstance(p, dict) and p.get("type", "text") not in ("text", "input_text") for p in content
        ):
            return True
    return False
