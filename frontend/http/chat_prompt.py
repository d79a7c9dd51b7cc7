"""An HTTP body's chat messages into the engine's prompt: token ids, or, with images, an ImagePrompt made by
the model's processor in a thread pool (never on the event loop: a text request is not held behind an
image's decoding and resizing)."""
from __future__ import annotations

import asyncio
from typing import Any

from tandem.frontend.http.chat import chat_prompt_ids, image_urls, template_message
from tandem.frontend.http.errors import APIError
from tandem.frontend.http.image_sources import load_image
from tandem.frontend.http.schemas import ChatMessageBody
from tandem.frontend.http.state import ServerState
from tandem.protocol.errors import ErrorCode, InvalidRequestError
from tandem.protocol.image_item import ImagePrompt

TEXT_ONLY = "this model takes text only: it cannot read images"


async def chat_prompt(
    st: ServerState, messages: list[ChatMessageBody], tools: list[dict] | None = None,
    add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None,
) -> list[int] | ImagePrompt:
    urls = image_urls(messages)
    if not urls:
        return chat_prompt_ids(st.tokenizer, messages, tools, add_generation_prompt, template_kwargs)
    if st.prompter is None or not st.prompter.takes_images:
        raise APIError(400, TEXT_ONLY, "messages", "invalid_image")
    if len(urls) > st.prompter.limits.per_prompt:
        why = f"{len(urls)} images in one prompt; this server takes at most {st.prompter.limits.per_prompt}"
        raise APIError(400, why + " (--limit-mm-per-prompt)", "messages", "invalid_image")
    images = [await load_image(u, st.media) for u in urls]
    msgs = [template_message(m, with_images=True) for m in messages]
    loop = asyncio.get_running_loop()
    try:
        ids, items = await loop.run_in_executor(None, st.prompter.prompt, msgs, images, tools,
                                                add_generation_prompt, template_kwargs)
    except InvalidRequestError as e:
        kind = "invalid_image" if e.code == ErrorCode.IMAGE else "invalid_messages"
        raise APIError(400, e.message, "messages", kind) from None
    return ImagePrompt(ids, items)


def prompt_ids(prompt: list[int] | ImagePrompt) -> list[int]:
    return prompt.token_ids if isinstance(prompt, ImagePrompt) else prompt
