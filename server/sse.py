"""Server-sent events: one `data:` line per JSON payload, encoded with msgspec."""

from __future__ import annotations

import msgspec

_encoder = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"


def event(payload: msgspec.Struct) -> bytes:
    return b"data: " + _encoder.encode(payload) + b"\n\n"
