"""Where `tandem run` sends a conversation: an engine it owns (through tandem.Client) or a running server's
`POST /v1/chat/completions` (streamed, as server-sent events)."""
from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

from tandem.launch.chat_session import ChatError, ChatOptions, ThinkingText


class EngineTransport:
    """Chat through an engine's client (tandem.Client): a message list goes through its chat template."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def stream(self, messages: list[dict[str, str]], options: ChatOptions) -> Iterator[str]:
        from tandem.protocol.errors import TandemError
        from tandem.protocol.sampling_params import SamplingParams

        given = {"temperature": options.temperature, "max_tokens": options.max_tokens}
        params = SamplingParams(**{k: v for k, v in given.items() if v is not None})
        try:
            # closed with this generator: the client's stream aborts the request when left early
            with contextlib.closing(self.client.stream(messages, params)) as deltas:
                for delta in deltas:
                    yield delta.text
        except TandemError as e:
            raise ChatError(str(e)) from e


class HTTPTransport:
    """Chat through a server's OpenAI route, `POST {base}/v1/chat/completions`, streamed. Closing the
    stream closes the connection: the server aborts the request."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None,
                 timeout_s: float | None = None) -> None:
        self.base_url = normalize_url(base_url)
        self.model, self.api_key, self.timeout_s = model, api_key, timeout_s
        # The environment's proxy, if any, but never for this machine (as Go's and curl's clients do).
        local = urllib.parse.urlsplit(self.base_url).hostname in ("localhost", "127.0.0.1", "::1")
        self.opener = urllib.request.build_opener(*([urllib.request.ProxyHandler({})] if local else []))

    def stream(self, messages: list[dict[str, str]], options: ChatOptions) -> Iterator[str]:
        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": True}
        if options.temperature is not None:
            body["temperature"] = options.temperature
        if options.max_tokens is not None:
            body["max_tokens"] = options.max_tokens
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        url = self.base_url + "/v1/chat/completions"
        req = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
        try:
            resp = self.opener.open(req, timeout=self.timeout_s)
        except urllib.error.HTTPError as e:
            raise ChatError(error_message(e.code, e.read())) from None
        except (urllib.error.URLError, OSError) as e:
            raise ChatError(f"cannot reach {self.base_url}: {getattr(e, 'reason', e)}") from None
        with resp:
            for data in sse_data(resp):
                if data == "[DONE]":
                    return
                try:
                    obj = json.loads(data)
                except ValueError:
                    raise ChatError(f"unreadable event from the server: {data[:200]}") from None
                if obj.get("error"):
                    err = obj["error"]
                    raise ChatError(err.get("message") if isinstance(err, dict) else str(err))
                for choice in obj.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if delta.get("reasoning_content"):
                        yield ThinkingText(delta["reasoning_content"])
                    if delta.get("content"):
                        yield delta["content"]


def normalize_url(url: str) -> str:
    """`host:port` -> `http://host:port`; no trailing `/` or `/v1` (an OpenAI base URL works too)."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def error_message(status: int, body: bytes) -> str:
    """An error response's message: the API's `error.message`, else the status and the body's start."""
    text = body.decode("utf-8", "replace")
    try:
        obj = json.loads(text)
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(obj.get("detail"), str):
            return obj["detail"]
    return f"HTTP {status}" + (f": {text[:300]}" if text else "")


def sse_data(lines: Any) -> Iterator[str]:
    """The `data` of each server-sent event in an iterable of byte lines (a response read line by line)."""
    data: list[str] = []
    for raw in lines:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
            data = []
        elif line.startswith("data:"):
            value = line[len("data:"):]
            data.append(value[1:] if value.startswith(" ") else value)
    # an event the stream ended in the middle of is dropped
