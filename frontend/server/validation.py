"""Turning a client's GenerateRequest into token ids and checked SamplingParams, or a typed error."""
from __future__ import annotations

from typing import Any

import msgspec

from frontend.prompt_tokens import encode_text, render_chat
from protocol.errors import ErrorCode, InvalidRequestError
from protocol.messages import GenerateRequest
from protocol.model_info import ModelInfo
from protocol.sampling_params import SamplingParams

_params_decoder = msgspec.msgpack.Decoder(SamplingParams)


def decode_params(raw: msgspec.Raw) -> SamplingParams:
    try:
        params = _params_decoder.decode(raw)
    except msgspec.DecodeError as e:  # also ValidationError, its subclass
        raise InvalidRequestError(f"invalid sampling parameters: {e}", ErrorCode.PARAMS) from e
    try:
        params.validate()
    except ValueError as e:
        raise InvalidRequestError(f"invalid sampling parameters: {e}", ErrorCode.PARAMS) from e
    return params


def tokenize_prompt(req: GenerateRequest, tokenizer: Any) -> list[int]:
    given = [x is not None for x in (req.text, req.token_ids, req.messages)]
    if sum(given) != 1:
        raise InvalidRequestError("give exactly one of text, token_ids or messages", ErrorCode.PROMPT)
    if req.text is not None:
        return encode_text(tokenizer, req.text)
    if req.token_ids is not None:
        return list(req.token_ids)
    assert req.messages is not None
    if not req.messages:
        raise InvalidRequestError("messages is empty", ErrorCode.EMPTY_PROMPT)
    return render_chat(tokenizer, [{"role": m.role, "content": m.content} for m in req.messages])


def check_prompt(ids: list[int], params: SamplingParams, info: ModelInfo) -> None:
    if not ids:
        raise InvalidRequestError("the prompt is empty", ErrorCode.EMPTY_PROMPT)
    bad = [t for t in ids if not 0 <= t < info.vocab_size]
    if bad:
        raise InvalidRequestError(
            f"token id {bad[0]} is outside the vocabulary [0, {info.vocab_size})", ErrorCode.TOKEN_ID
        )
    limit = info.max_model_len
    if len(ids) >= limit:
        raise InvalidRequestError(
            f"the prompt has {len(ids)} tokens; the context holds {limit} (room for at least one output needed)",
            ErrorCode.PROMPT_TOO_LONG,
        )
    if params.max_tokens is not None and len(ids) + params.max_tokens > limit:
        raise InvalidRequestError(
            f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context of {limit}",
            ErrorCode.PROMPT_TOO_LONG,
        )
    bad_stop = [t for t in params.stop_token_ids if t >= info.vocab_size]
    if bad_stop:
        raise InvalidRequestError(
            f"stop token id {bad_stop[0]} is outside the vocabulary", ErrorCode.TOKEN_ID
        )
