"""Server-sent events: one `data:` line per JSON payload, encoded with msgspec."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
from quart import Response

_encoder = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"


def event(payload: msgspec.Struct) -> bytes:
    return b"data: " + _encoder.encode(payload) + b"\n\n"


def response(body: AsyncIterator[bytes]) -> Response:
    """An event stream, not buffered by proxies, ended by its body rather than a clock."""
    out = Response(
        body,
        content_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
    out.timeout = None
    return out
