"""A request passed on to one model's own server, and its answer passed back as it comes (streams chunk by
chunk). The model's server binds to localhost behind a key only the router holds, so nothing reaches it
around the router's own key."""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import aiohttp
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

# Hop-by-hop headers, the client's credentials (the router checked them; the engine gets its own key) and
# what the body's length and encoding become on the way.
_DROP_IN = {"host", "content-length", "authorization", "x-api-key", "connection", "keep-alive",
            "transfer-encoding", "te", "upgrade", "proxy-authorization"}
_DROP_OUT = {"content-length", "connection", "keep-alive", "transfer-encoding", "server", "date"}
_STREAMED = ("text/event-stream", "application/x-ndjson")


class EngineUnreachable(ConnectionError):
    pass


class Proxy:
    def __init__(self, key: str) -> None:
        self.key = key
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:  # made inside the running loop
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10), auto_decompress=False)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def forward(self, request: Request, body: bytes, base_url: str,
                      done: Callable[[], None]) -> Response:
        """REQUEST (whose BODY was read already) to BASE_URL; DONE() runs once when its answer is over (sent
        whole, streamed to the end, or the client gone)."""
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP_IN}
        headers["authorization"] = f"Bearer {self.key}"
        url = base_url + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        try:
            resp = await self._client().request(request.method, url, data=body, headers=headers,
                                                allow_redirects=False)
        except (aiohttp.ClientError, OSError) as e:
            done()
            raise EngineUnreachable(str(e) or type(e).__name__) from e
        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in _DROP_OUT}
        if not resp.content_type.startswith(_STREAMED):
            try:
                data = await resp.read()
            except (aiohttp.ClientError, OSError) as e:
                raise EngineUnreachable(str(e) or type(e).__name__) from e
            finally:
                resp.release()
                done()
            return Response(data, status_code=resp.status, headers=out_headers)

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.content.iter_any():
                    yield chunk
            except (aiohttp.ClientError, OSError):
                return  # the engine went away mid-stream: the stream ends short, as the engine's would
            finally:  # the end, or the client gone (cancelled): closing the connection stops the request
                resp.close()
                done()

        return StreamingResponse(chunks(), status_code=resp.status, headers=out_headers)
