"""OpenAI-style error responses: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import re

import msgspec
from quart import Response

from server.protocol import ErrorInfo, ErrorResponse

_encoder = msgspec.json.Encoder()

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None):
    info = ErrorInfo(
        message=message, type=_TYPES.get(status, "invalid_request_error"), param=param, code=code
    )
    return ErrorResponse(error=info)


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    body = _encoder.encode(error_body(status, message, param, code))
    return Response(body, status=status, content_type="application/json", headers=headers)


_PATH = re.compile(r"(?:at|in) `\$\.?([^`]*)`")  # "in" for a dict key: "at `key` in `$.x`"


def from_validation(e: msgspec.ValidationError | msgspec.DecodeError) -> APIError:
    """Turn msgspec's message ("Expected `int`, got `str` - at `$.max_tokens`") into a 400 that
    names the parameter, nested ones as a path (`messages[0].role`)."""
    text = str(e)
    if isinstance(e, msgspec.DecodeError) and not isinstance(e, msgspec.ValidationError):
        return APIError(400, f"The request body is not valid JSON: {text}", None, "invalid_json")
    m = _PATH.search(text)
    param = m.group(1) if m and m.group(1) else None
    missing = re.search(r"missing required field `([^`]+)`", text)
    if missing:
        param = f"{param}.{missing.group(1)}" if param else missing.group(1)
    return APIError(400, f"Invalid request: {text}", param, "invalid_value")
