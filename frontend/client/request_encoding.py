"""Client side of the wire: a prompt and parameters into a GenerateRequest."""
from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from tandem.protocol.embed_params import EmbedParams
from tandem.protocol.errors import ErrorCode, InvalidRequestError
from tandem.protocol.image_item import ImagePrompt
from tandem.protocol.messages import ChatMessage, EmbedRequest, GenerateRequest, SessionParams
from tandem.protocol.sampling_params import SamplingParams

# Chat messages may hold images as content parts ({"type": "image", "image": bytes, a path or a PIL image}):
# the client turns them into an ImagePrompt through the model's processor (split_images, ImagePrompter).
Prompt = str | Sequence[int] | Sequence[Mapping[str, Any]] | Sequence[ChatMessage] | ImagePrompt
Params = SamplingParams | Mapping[str, Any] | None


def new_rid() -> str:
    return uuid.uuid4().hex


def _packed(params: object) -> msgspec.Raw:
    try:
        return msgspec.Raw(msgspec.msgpack.encode(params))
    except (OverflowError, TypeError, msgspec.EncodeError) as e:  # e.g. a stop token id past 64 bits
        raise InvalidRequestError(f"the parameters cannot be encoded: {e}", ErrorCode.PARAMS) from None


def build_request(prompt: Prompt, params: Params, rid: str | None = None, priority: int = 0,
                  session: SessionParams | None = None) -> GenerateRequest:
    req = _build(prompt, params, rid or new_rid())
    req.priority, req.session_params = priority, session
    return req


def _build(prompt: Prompt, params: Params, rid: str) -> GenerateRequest:
    # Parameters travel raw: the frontend decodes and validates them, so bad ones are one typed error.
    raw = _packed(params if params is not None else {})
    if isinstance(prompt, str):
        return GenerateRequest(rid, text=prompt, params=raw)
    if isinstance(prompt, ImagePrompt):
        return GenerateRequest(rid, token_ids=prompt.token_ids, params=raw, images=prompt.images)
    if not isinstance(prompt, Sequence):
        raise InvalidRequestError(
            f"prompt must be a string, token ids or chat messages, not {type(prompt).__name__}"
        )
    items = list(prompt)
    if all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        return GenerateRequest(rid, token_ids=items, params=raw)
    if all(isinstance(m, ChatMessage) for m in items):
        return GenerateRequest(rid, messages=items, params=raw)
    if all(isinstance(m, Mapping) for m in items):
        try:
            msgs = [ChatMessage(str(m["role"]), str(m["content"])) for m in items]
        except KeyError as e:
            raise InvalidRequestError(f"chat message without {e.args[0]!r}", ErrorCode.MESSAGES) from e
        return GenerateRequest(rid, messages=msgs, params=raw)
    raise InvalidRequestError("prompt list must hold only token ids or only chat messages", ErrorCode.PROMPT)


def split_images(prompt: Prompt) -> tuple[list[dict[str, Any]], list[Any]] | None:
    """Chat messages with content parts: (the messages as the chat template reads them, each image a
    `{"type": "image"}` part, and the images in order); None for any other prompt."""
    if isinstance(prompt, (str, ImagePrompt)) or not isinstance(prompt, Sequence):
        return None
    if not any(isinstance(m, Mapping) and isinstance(m.get("content"), list) for m in prompt):
        return None
    messages, images = [], []
    for m in prompt:
        if not isinstance(m, Mapping) or "role" not in m:
            raise InvalidRequestError("a chat message is a mapping with a role", ErrorCode.MESSAGES)
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for p in content:
                kind = p.get("type") if isinstance(p, Mapping) else None
                if kind == "text":
                    parts.append({"type": "text", "text": str(p.get("text", ""))})
                elif kind == "image" and p.get("image") is not None:
                    parts.append({"type": "image"})
                    images.append(p["image"])
                else:
                    raise InvalidRequestError('a content part is {"type": "text", "text": ...} or '
                                              '{"type": "image", "image": bytes, a path or a PIL image}',
                                              ErrorCode.MESSAGES)
            content = parts
        messages.append({**m, "content": content})
    return messages, images


def build_embed_request(input: str | Sequence[int], params: EmbedParams, rid: str | None = None,
                        priority: int = 0) -> EmbedRequest:
    rid = rid or new_rid()
    raw = _packed(params)
    if isinstance(input, str):
        return EmbedRequest(rid, text=input, params=raw, priority=priority)
    if isinstance(input, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in input):
        return EmbedRequest(rid, token_ids=list(input), params=raw, priority=priority)
    raise InvalidRequestError("an embedding's input must be a string or token ids", ErrorCode.PROMPT)


def params_per_prompt(prompts: Sequence[Prompt], params: Params | Sequence[Params]) -> list[Params]:
    """One parameter set for all prompts, or one per prompt."""
    plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    if len(plist) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(plist)} parameter sets")
    return plist
