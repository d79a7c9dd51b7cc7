"""Turning a client's GenerateRequest into token ids and checked SamplingParams, or a typed error."""
from __future__ import annotations

from typing import Any

import msgspec

from tandem.frontend.prompt_tokens import encode_text, render_chat
from tandem.protocol.embed_params import EmbedParams
from tandem.protocol.errors import ErrorCode, InvalidRequestError
from tandem.protocol.messages import EmbedRequest, GenerateRequest
from tandem.protocol.model_info import ModelInfo
from tandem.protocol.sampling_params import SamplingParams

_params_decoder = msgspec.msgpack.Decoder(SamplingParams)
_embed_decoder = msgspec.msgpack.Decoder(EmbedParams)


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


def decode_embed_params(raw: msgspec.Raw) -> EmbedParams:
    try:
        return _embed_decoder.decode(raw)
    except msgspec.DecodeError as e:
        raise InvalidRequestError(f"invalid embedding parameters: {e}", ErrorCode.PARAMS) from e


def tokenize_prompt(req: GenerateRequest | EmbedRequest, tokenizer: Any) -> list[int]:
    messages = getattr(req, "messages", None)
    given = [x is not None for x in (req.text, req.token_ids, messages)]
    if sum(given) != 1:
        what = "text or token_ids" if isinstance(req, EmbedRequest) else "text, token_ids or messages"
        raise InvalidRequestError(f"give exactly one of {what}", ErrorCode.PROMPT)
    if req.text is not None:
        return encode_text(tokenizer, req.text)
    if req.token_ids is not None:
        return list(req.token_ids)
    assert messages is not None
    if not messages:
        raise InvalidRequestError("messages is empty", ErrorCode.EMPTY_PROMPT)
    return render_chat(tokenizer, [{"role": m.role, "content": m.content} for m in messages])


def _check_ids(ids: list[int], info: ModelInfo) -> None:
    if not ids:
        raise InvalidRequestError("the prompt is empty", ErrorCode.EMPTY_PROMPT)
    bad = [t for t in ids if not 0 <= t < info.vocab_size]
    if bad:
        raise InvalidRequestError(
            f"token id {bad[0]} is outside the vocabulary [0, {info.vocab_size})", ErrorCode.TOKEN_ID
        )


def check_embed(ids: list[int], params: EmbedParams, info: ModelInfo) -> None:
    """An embedding's input fills the context at most (no output follows it); `dimensions` only where the
    model was trained for it."""
    _check_ids(ids, info)
    if len(ids) > info.max_model_len:
        raise InvalidRequestError(
            f"the input has {len(ids)} tokens; the context holds {info.max_model_len}",
            ErrorCode.PROMPT_TOO_LONG,
        )
    d = params.dimensions
    if d is None or d == info.hidden_size:
        return
    if not info.is_matryoshka:
        raise InvalidRequestError(
            f"this model's embeddings have {info.hidden_size} dimensions and it is not a Matryoshka model: "
            f"a shorter embedding ({d}) would be a poor one", ErrorCode.DIMENSIONS)
    allowed = info.matryoshka_dimensions
    if d > info.hidden_size or (allowed is not None and d not in allowed):
        raise InvalidRequestError(
            f"dimensions must be one of {allowed}" if allowed is not None else
            f"dimensions must be in [1, {info.hidden_size}], got {d}", ErrorCode.DIMENSIONS)


def check_prompt(ids: list[int], params: SamplingParams, info: ModelInfo) -> None:
    _check_ids(ids, info)
    limit = info.max_model_len
    if len(ids) >= limit:
        raise InvalidRequestError(
            f"the prompt has {len(ids)} tokens; the context holds {limit} "
            "(room for at least one output needed)",
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
