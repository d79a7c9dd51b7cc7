"""Turning a client's GenerateRequest into token ids and checked SamplingParams, or a typed error."""
from __future__ import annotations

from typing import Any

import msgspec

from protocol.errors import InvalidRequestError
from protocol.messages import GenerateRequest
from protocol.model_info import ModelInfo
from protocol.sampling_params import SamplingParams

_params_decoder = msgspec.msgpack.Decoder(SamplingParams)


def decode_params(raw: msgspec.Raw) -> SamplingParams:
    try:
        params = _params_decoder.decode(raw)
    except msgspec.DecodeError as e:  # also ValidationError, its subclass
        raise InvalidRequestError(f"invalid sampling parameters: {e}", "invalid_request.params") from e
    try:
        params.validate()
    except ValueError as e:
        raise InvalidRequestError(f"invalid sampling parameters: {e}", "invalid_request.params") from e
    return params


def tokenize_prompt(req: GenerateRequest, tokenizer: Any) -> list[int]:
    given = [x is not None for x in (req.text, req.token_ids, req.messages)]
    if sum(given) != 1:
        raise InvalidRequestError("give exactly one of text, token_ids or messages", "invalid_request.prompt")
    if req.text is not None:
        return list(tokenizer.encode(req.text, add_special_tokens=True))
    if req.token_ids is not None:
        return list(req.token_ids)
    assert req.messages is not None
    if not req.messages:
        raise InvalidRequestError("messages is empty", "invalid_request.empty_prompt")
    msgs = [{"role": m.role, "content": m.content} for m in req.messages]
    try:
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    except Exception as e:  # a template error is the request's fault
        raise InvalidRequestError(f"chat template failed: {e}", "invalid_request.messages") from e
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def check_prompt(ids: list[int], params: SamplingParams, info: ModelInfo) -> None:
    if not ids:
        raise InvalidRequestError("the prompt is empty", "invalid_request.empty_prompt")
    bad = [t for t in ids if not 0 <= t < info.vocab_size]
    if bad:
        raise InvalidRequestError(
            f"token id {bad[0]} is outside the vocabulary [0, {info.vocab_size})", "invalid_request.token_id"
        )
    limit = info.max_model_len
    if len(ids) >= limit:
        raise InvalidRequestError(
            f"the prompt has {len(ids)} tokens; the context holds {limit} (room for at least one output needed)",
            "invalid_request.prompt_too_long",
        )
    if params.max_tokens is not None and len(ids) + params.max_tokens > limit:
        raise InvalidRequestError(
            f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context of {limit}",
            "invalid_request.prompt_too_long",
        )
    bad_stop = [t for t in params.stop_token_ids if t >= info.vocab_size]
    if bad_stop:
        raise InvalidRequestError(
            f"stop token id {bad_stop[0]} is outside the vocabulary", "invalid_request.token_id"
        )
