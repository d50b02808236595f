"""GET /: a chat page for the served model, like llama.cpp server's.

The page is a static file of the package (static/chat.html: HTML, CSS and JavaScript in
one file, no build step, nothing fetched from elsewhere). It streams answers from
/v1/chat/completions and polls /v1/loads for its status line. The page itself holds no
secret, so it is served without the API key (openai/router.py's OPEN_GET_PATHS); with
--api-key it asks for the key and sends it with every API call.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

CHAT_PAGE_PATH = "/"

# Scripts and styles only inline, requests only to this server: the browser enforces
# that the page loads nothing from elsewhere (and that no other site frames it).
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    ),
    "Cache-Control": "no-cache",
}


def chat_page_html() -> str:
    return resources.files("tandem.entrypoints").joinpath("static").joinpath("chat.html").read_text(encoding="utf-8")


def chat_page_router() -> APIRouter:
    """GET / : the chat page."""
    router = APIRouter()
    html = chat_page_html()  # read once

    @router.get(CHAT_PAGE_PATH, include_in_schema=False)
    async def chat_page() -> HTMLResponse:
        return HTMLResponse(html, headers=_HEADERS)

    return router
