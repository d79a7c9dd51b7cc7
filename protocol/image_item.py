"""One image of a prompt, as it crosses the sockets: preprocessed pixels and where its tokens sit.

A prompt with images holds, for each image, a run of placeholder tokens (the model's image token) that the
worker fills with the image's encoder output. The pixels travel once, with the request (and again only
when a retracted request comes back); `digest` names them: the encoder cache and the prefix cache key the
image by it, so the same image reuses its encoding and its KV, and a different image never does. The
frontend computes the digest itself from the pixels, never trusting a client's.
"""
from __future__ import annotations

import hashlib
from typing import Annotated

import msgspec

from tandem.protocol.errors import ErrorCode, InvalidRequestError

Dim = Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]


class ImageItem(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    offset: Annotated[int, msgspec.Meta(ge=0)]  # its first placeholder token in the prompt
    length: Annotated[int, msgspec.Meta(ge=1)]  # placeholder tokens it fills
    shape: list[Dim]  # of the pixels, float32: [3, H, W] (or the model's patch layout)
    pixels: bytes  # little-endian float32, C order
    # Dynamic-resolution models: the (t, h, w) patch grid the encoder and the positions follow; else [].
    grid: list[Dim] = []
    digest: str = ""  # set by the frontend: blake2b of shape, grid and pixels


class ImagePrompt(msgspec.Struct, forbid_unknown_fields=True):
    """A prompt with images, as frontend/image_prompt.py makes it: a client sends it as token_ids + images."""

    token_ids: list[int]
    images: list[ImageItem]


def image_digest(item: ImageItem) -> str:
    h = hashlib.blake2b(digest_size=16)  # hashlib lets go of the GIL over large buffers
    h.update(msgspec.json.encode([item.shape, item.grid]))
    h.update(item.pixels)
    return h.hexdigest()


def key_token(digest: str) -> int:
    """The prefix cache's key for each of an image's placeholder tokens: negative, so never a real token
    id, and one value per image."""
    return -1 - int(digest[:15], 16)


def check_images(ids: list[int], images: list[ImageItem], image_token_id: int | None) -> list[ImageItem]:
    """The images of a prompt, checked against it and given their digests: each image's placeholders are
    the model's image token, images in order and apart, every image token of the prompt covered, pixels of
    their shape's size."""
    if not images:
        if image_token_id is not None and image_token_id in ids:
            raise InvalidRequestError("the prompt holds image tokens but no image came with it",
                                      ErrorCode.IMAGE)
        return images
    if image_token_id is None:
        raise InvalidRequestError("this model takes text only: it cannot read images", ErrorCode.IMAGE)
    end = 0
    out = []
    for i, im in enumerate(images):
        n = 4
        for d in im.shape:
            n *= d
        if len(im.pixels) != n:
            raise InvalidRequestError(f"image {i}: {len(im.pixels)} bytes of pixels for shape {im.shape}",
                                      ErrorCode.IMAGE)
        if im.offset < end or im.offset + im.length > len(ids):
            raise InvalidRequestError(f"image {i}: its tokens at {im.offset}..{im.offset + im.length} are "
                                      "out of order or outside the prompt", ErrorCode.IMAGE)
        if any(t != image_token_id for t in ids[im.offset : im.offset + im.length]):
            raise InvalidRequestError(f"image {i}: its tokens are not all the image token {image_token_id}",
                                      ErrorCode.IMAGE)
        end = im.offset + im.length
        out.append(msgspec.structs.replace(im, digest=image_digest(im)))
    if sum(1 for t in ids if t == image_token_id) != sum(im.length for im in images):
        raise InvalidRequestError("the prompt's image tokens and its images' do not match", ErrorCode.IMAGE)
    return out
