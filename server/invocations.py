"""/invocations (vLLM's, for Amazon SageMaker, which sends every request there and probes
/ping): the body's fields pick the route, which then answers as it answers on its own path
(streaming, errors and all): `messages` a chat completion, `prompt` a completion, `query` with
`documents` a rerank, `text_1` or `text_2` a score, `input` a classification on a classifier's
server and an embedding on any other."""

from __future__ import annotations

import msgspec
from quart import Blueprint, Response, request

from server.classify import classify
from server.embeddings import embeddings
from server.errors import APIError
from server.generate import chat_completions, completions
from server.scores import rerank, score
from server.wire import state

bp = Blueprint("invocations", __name__)

SHAPES = (
    "messages (a chat completion), prompt (a completion), input (embeddings, or a classifier's "
    "classification), query and documents (a rerank), or text_1 and text_2 (a score)"
)


@bp.post("/invocations")
async def invocations() -> Response:
    body = await request.get_data()
    try:
        fields = msgspec.json.decode(body) if body else None
    except msgspec.DecodeError as e:
        raise APIError(400, f"The request body is not valid JSON: {e}", None, "invalid_json")
    if not isinstance(fields, dict):
        raise APIError(
            400, f"/invocations takes a JSON object with one of: {SHAPES}", None, "invalid_json"
        )
    if "messages" in fields:
        return await chat_completions()
    if "prompt" in fields:
        return await completions()
    if "query" in fields and "documents" in fields:
        return await rerank()
    if "text_1" in fields or "text_2" in fields:
        return await score()
    if "input" in fields:
        return await (classify() if "classify" in state().tasks else embeddings())
    raise APIError(
        400,
        f"/invocations could not tell which route the body is for: send {SHAPES}",
        None,
        "invalid_value",
    )
