"""`GET /`: a chat page in the browser (as llama-server ships one). One self-contained file, package data
(static/chat.html: HTML, CSS and vanilla JS, nothing fetched from elsewhere) that talks to this server's own
`/v1/models` and `/v1/chat/completions` (streamed), with the API key the user types in, if any. The page
itself needs no key: it holds nothing but the page."""
from __future__ import annotations

from functools import cache
from importlib.resources import files

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

PAGE = "static/chat.html"
# The page's script and style are inline, and it talks to this server only: nothing else may load or be sent
# elsewhere, and no other site may frame it.
HEADERS = {
    "Cache-Control": "no-cache",  # a browser revalidates, so an upgraded server's page is the one shown
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
}


@cache
def page_html() -> str:
    return files("tandem.frontend.http").joinpath(PAGE).read_text(encoding="utf-8")


def add_chat_page(app: FastAPI) -> None:
    # HEAD too: ollama's clients probe `HEAD /` for a running server
    @app.api_route("/", methods=["GET", "HEAD"], response_class=HTMLResponse, include_in_schema=False)
    async def chat_page() -> HTMLResponse:
        return HTMLResponse(page_html(), headers=HEADERS)
