"""Where an HTTP body's image comes from: a data: URL (or Anthropic's and ollama's base64) always; an
http(s) URL only from a host the operator allowed (--allowed-media-domains), a file only under the
directory the operator allowed (--allowed-local-media-path), as vLLM's options do. Anything else, and any
fetch that fails, is a 400 naming the image, before the model is involved."""
from __future__ import annotations

import base64
import binascii
import os
from dataclasses import dataclass
from urllib.parse import unquote, urlparse

import aiohttp

from tandem.frontend.http.errors import APIError

MAX_IMAGE_BYTES = 20 << 20  # an encoded image past this is refused (its decoded size is bounded apart)
FETCH_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class MediaPolicy:
    allowed_domains: tuple[str, ...] = ()
    allowed_local_path: str | None = None
    max_bytes: int = MAX_IMAGE_BYTES


def _bad(why: str) -> APIError:
    return APIError(400, why, "messages", "invalid_image")


def decode_base64(data: str) -> bytes:
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise _bad("the image's base64 data is not valid base64") from None
    if not raw:
        raise _bad("the image is empty")
    return raw


async def load_image(url: str, policy: MediaPolicy) -> bytes:
    """The encoded bytes of the image at `url`."""
    if url.startswith("data:"):
        head, sep, data = url.partition(",")
        if not sep or not head.endswith(";base64"):
            raise _bad("a data: URL image must be base64 (data:image/...;base64,...)")
        raw = decode_base64(data)
    else:
        u = urlparse(url)
        if u.scheme in ("http", "https"):
            raw = await _fetch(url, u.hostname or "", policy)
        elif u.scheme in ("file", ""):
            raw = _read_local(unquote(u.path) if u.scheme == "file" else url, policy)
        else:
            raise _bad(f"image URL scheme {u.scheme!r} is not served (data:, http(s) or file)")
    if len(raw) > policy.max_bytes:
        raise _bad(f"the image is {len(raw)} bytes; the limit is {policy.max_bytes}")
    return raw


async def _fetch(url: str, host: str, policy: MediaPolicy) -> bytes:
    if host.lower() not in policy.allowed_domains:
        raise _bad(f"fetching images from {host!r} is not allowed on this server (--allowed-media-domains)")
    try:
        timeout = aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as s, s.get(url, allow_redirects=False) as r:
            if r.status != 200:
                raise _bad(f"fetching the image gave HTTP {r.status}")
            raw = await r.content.read(policy.max_bytes + 1)
    except (aiohttp.ClientError, TimeoutError) as e:
        raise _bad(f"the image could not be fetched: {type(e).__name__}") from None
    return raw


def _read_local(path: str, policy: MediaPolicy) -> bytes:
    root = policy.allowed_local_path
    if root is None:
        raise _bad("images from local files are not allowed on this server (--allowed-local-media-path)")
    real, base = os.path.realpath(path), os.path.realpath(root)
    if os.path.commonpath([real, base]) != base:
        raise _bad("the image file is outside the allowed directory")
    try:
        with open(real, "rb") as f:
            return f.read(policy.max_bytes + 1)
    except OSError as e:
        raise _bad(f"the image file cannot be read: {e.strerror}") from None
