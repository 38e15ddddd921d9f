"""Request bodies into msgspec Structs (a 400 naming the field when they do not fit), Structs
into JSON responses, and the server state every route reads."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
from quart import Response, current_app, request

from server.errors import APIError, from_validation
from server.state import ServerState

_encoder = msgspec.json.Encoder()
T = TypeVar("T")


def state() -> ServerState:
    return current_app.weir_state


def json_response(payload: Any, status: int = 200) -> Response:
    return Response(_encoder.encode(payload), status=status, content_type="application/json")


async def decode(body_type: type[T]) -> T:
    body = await request.get_data()
    if not body:
        raise APIError(400, "The request body is empty; send a JSON object", None, "invalid_json")
    try:
        return msgspec.json.decode(body, type=body_type)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise from_validation(e) from None
