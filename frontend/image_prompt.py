"""Chat messages with images into the prompt's token ids and its ImageItems, through the model's own
processor (transformers' AutoProcessor: its chat template, its resizing and normalizing, its placeholder
expansion), so each image gets exactly the tokens the model was trained with.

This is CPU work (decoding, resizing): callers run it off their event loop, the HTTP server in a thread
pool, the Python client in the caller's thread, so a text request is never stuck behind an image. Every
way an image can be bad is a typed InvalidRequestError (ErrorCode.IMAGE) before the model sees it.
"""
from __future__ import annotations

import functools
import io
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tandem.protocol.errors import ErrorCode, InvalidRequestError
from tandem.protocol.image_item import ImageItem
from tandem.protocol.model_config import ModelConfig, metadata_dir, read_hf_config
from tandem.protocol.model_info import served_image_token

MAX_IMAGE_PIXELS = 40_000_000  # a decoded image past this is refused (a small file can decode huge)
MAX_IMAGES_PER_PROMPT = 8  # --limit-mm-per-prompt's default


@dataclass(frozen=True)
class ImageLimits:
    per_prompt: int = MAX_IMAGES_PER_PROMPT
    pixels: int = MAX_IMAGE_PIXELS


def open_image(data: bytes | Any) -> Any:
    """bytes (any format Pillow reads), a path or a PIL image -> an RGB PIL image; a typed error for what
    is not one, is cut short or is too large."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(data, Image.Image):
        return data.convert("RGB")
    try:
        if isinstance(data, (bytes, bytearray, memoryview)):
            im = Image.open(io.BytesIO(bytes(data)))
        else:
            im = Image.open(data)
        if im.width * im.height > MAX_IMAGE_PIXELS:
            raise InvalidRequestError(f"the image is {im.width}x{im.height}: over {MAX_IMAGE_PIXELS} pixels",
                                      ErrorCode.IMAGE)
        im.load()  # a truncated file fails here, not later in the processor
        return im.convert("RGB")
    except (UnidentifiedImageError, Image.DecompressionBombError) as e:
        raise InvalidRequestError(f"not an image Pillow can read: {e}", ErrorCode.IMAGE) from None
    except (OSError, ValueError, SyntaxError) as e:
        raise InvalidRequestError(f"the image cannot be decoded (truncated or corrupt): {e}",
                                  ErrorCode.IMAGE) from None


class ImagePrompter:
    """A model's processor, loaded on first use (thread-safe)."""

    def __init__(self, model: str, limits: ImageLimits = ImageLimits()) -> None:
        self.model, self.limits = model, limits
        cfg = ModelConfig.from_hf(read_hf_config(model))
        self.vision, self.image_token_id = cfg.vision, served_image_token(cfg)
        self._lock = threading.Lock()

    @property
    def takes_images(self) -> bool:
        return self.image_token_id is not None

    @functools.cached_property
    def processor(self) -> Any:
        from transformers import AutoProcessor

        with self._lock:
            return AutoProcessor.from_pretrained(str(metadata_dir(self.model)))

    def prompt(self, messages: Sequence[Mapping[str, Any]], images: Sequence[Any],
               tools: list[dict] | None = None, add_generation_prompt: bool = True,
               template_kwargs: Mapping[str, Any] | None = None) -> tuple[list[int], list[ImageItem]]:
        """messages as the chat template reads them, each image a `{"type": "image"}` content part, in
        order with `images` (bytes, paths or PIL images) -> (token ids, their ImageItems)."""
        if not self.takes_images:
            raise InvalidRequestError("this model takes text only: it cannot read images", ErrorCode.IMAGE)
        if len(images) > self.limits.per_prompt:
            raise InvalidRequestError(f"{len(images)} images in one prompt; the limit is "
                                      f"{self.limits.per_prompt} (--limit-mm-per-prompt)", ErrorCode.IMAGE)
        pil = [open_image(x) for x in images]
        for im in pil:
            if im.width * im.height > self.limits.pixels:
                raise InvalidRequestError(f"an image is {im.width}x{im.height}: over the limit of "
                                          f"{self.limits.pixels} pixels", ErrorCode.IMAGE)
        if self.vision is not None and self.vision.dynamic:
            return self._dynamic(messages, pil, tools, add_generation_prompt, template_kwargs)
        proc = self.processor
        try:
            text = proc.apply_chat_template(list(messages), tools=tools, tokenize=False,
                                            add_generation_prompt=add_generation_prompt,
                                            **dict(template_kwargs or {}))
        except Exception as e:  # a template error is the request's fault
            raise InvalidRequestError(f"chat template failed: {e}", ErrorCode.MESSAGES) from e
        try:
            out = proc(text=text, images=pil or None, return_tensors="np", add_special_tokens=False)
        except ValueError as e:  # the processor's checks: images and their places in the messages
            raise InvalidRequestError(f"the images do not fit the messages: {e}", ErrorCode.IMAGE) from None
        ids = [int(t) for t in out["input_ids"][0]]
        return ids, self._items(ids, out, len(pil))

    @functools.cached_property
    def parts(self) -> tuple[Any, Any]:
        """A dynamic-resolution model's tokenizer and image processor (its whole processor would need
        torchvision for a video processor never used here)."""
        from transformers import AutoImageProcessor

        from tandem.protocol.tokenizer_loader import load_tokenizer

        with self._lock:
            meta = str(metadata_dir(self.model))
            return load_tokenizer(self.model), AutoImageProcessor.from_pretrained(meta)

    def _dynamic(self, messages: Sequence[Mapping[str, Any]], pil: list[Any], tools: list[dict] | None,
                 add_generation_prompt: bool, template_kwargs: Mapping[str, Any] | None,
                 ) -> tuple[list[int], list[ImageItem]]:
        """Qwen2.5-VL's processor's way: each image's one placeholder in the rendered template becomes
        grid_t * grid_h * grid_w / merge^2 of them, its pixels the image processor's rows for it."""
        tok, images = self.parts
        try:
            text = tok.apply_chat_template(list(messages), tools=tools, tokenize=False,
                                           add_generation_prompt=add_generation_prompt,
                                           **dict(template_kwargs or {}))
        except Exception as e:  # a template error is the request's fault
            raise InvalidRequestError(f"chat template failed: {e}", ErrorCode.MESSAGES) from e
        pad = tok.convert_ids_to_tokens(self.image_token_id)
        pieces = text.split(pad)
        if len(pieces) - 1 != len(pil):
            raise InvalidRequestError(f"the images do not fit the messages: {len(pil)} images, "
                                      f"{len(pieces) - 1} image places", ErrorCode.IMAGE)
        out: dict[str, Any] = {}
        if pil:
            out = dict(images(images=pil, return_tensors="np"))
            grids = [list(map(int, g)) for g in out["image_grid_thw"]]
            merge = self.vision.spatial_merge_size  # type: ignore[union-attr]
            text = pieces[0] + "".join(pad * (t * h * w // merge**2) + p
                                       for (t, h, w), p in zip(grids, pieces[1:], strict=True))
        ids = list(tok.encode(text, add_special_tokens=False))
        if not pil:
            return ids, []
        items, row = [], 0
        pixels = np.ascontiguousarray(out["pixel_values"], dtype="<f4")
        for (a, b), grid in zip(_runs(ids, self.image_token_id), grids, strict=True):
            n = grid[0] * grid[1] * grid[2]
            mine = pixels[row : row + n]
            items.append(ImageItem(a, b - a, list(mine.shape), mine.tobytes(), grid=grid))
            row += n
        return ids, items

    def _items(self, ids: list[int], out: Mapping[str, Any], n: int) -> list[ImageItem]:
        runs = _runs(ids, self.image_token_id)
        if len(runs) != n:
            raise InvalidRequestError(f"{n} images given, {len(runs)} image places in the messages",
                                      ErrorCode.IMAGE)
        if not n:
            return []
        pixels = np.ascontiguousarray(out["pixel_values"], dtype="<f4")
        return [ImageItem(a, b - a, list(pixels[i].shape), pixels[i].tobytes())
                for i, (a, b) in enumerate(runs)]


def _runs(ids: list[int], token: int | None) -> list[tuple[int, int]]:
    """The [start, end) runs of `token` in ids."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t == token:
            if runs and runs[-1][1] == i:
                runs[-1] = (runs[-1][0], i + 1)
            else:
                runs.append((i, i + 1))
    return runs
