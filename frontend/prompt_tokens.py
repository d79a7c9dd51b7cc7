"""Prompts into token ids, the one way: the frontend process and the HTTP server both tokenize here."""
from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from tandem.protocol.errors import ErrorCode, InvalidRequestError


def encode_text(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def render_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Token ids of the conversation through the model's chat template, the tools passed to the template
    (as the model was trained). `template_kwargs` are variables for the template (`enable_thinking`)."""
    kwargs = dict(template_kwargs or {})
    # A variable may not take over one of apply_chat_template's own arguments (tokenize, messages, ...).
    taken = sorted(set(kwargs) & set(inspect.signature(tokenizer.apply_chat_template).parameters))
    if taken:
        raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(taken)}", ErrorCode.MESSAGES)
    try:
        ids = tokenizer.apply_chat_template(
            list(messages), tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs
        )
    except Exception as e:  # a template error is the request's fault
        raise InvalidRequestError(f"chat template failed: {e}", ErrorCode.MESSAGES) from e
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
