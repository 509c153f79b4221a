"""GET /: the playground page (gateway/playground/index.html), one self-contained HTML file.

Not behind the API key: the page holds no data, and it sends the key the user types with each
`/v1` call. The Content-Security-Policy allows only this origin and the page's inline script and
style, so the page can never pull in an external asset.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter(tags=["playground"])

PAGE = Path(__file__).resolve().parent.parent / "playground" / "index.html"
CONTENT_SECURITY_POLICY = ("default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                           "media-src 'self' blob:; img-src 'self' data:; connect-src 'self'; "
                           "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


@lru_cache(maxsize=1)
def page() -> str:
    return PAGE.read_text(encoding="utf-8")


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def playground() -> HTMLResponse:
    return HTMLResponse(page(), headers={"Content-Security-Policy": CONTENT_SECURITY_POLICY,
                                         "Cache-Control": "no-cache"})
