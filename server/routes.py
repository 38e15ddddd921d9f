"""The non-generation routes: models, health, version, tokenize/detokenize, the OpenAPI document."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from quart import Blueprint, Response

from server import chat
from server.errors import APIError, error_response
from server.wire import decode, json_response, state
from server.openapi import DOCS_HTML, openapi_document
from server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)

bp = Blueprint("routes", __name__)


def weir_version() -> str:
    try:
        return version("weir")
    except PackageNotFoundError:
        return "unknown"


@bp.get("/v1/models")
async def models() -> Response:
    st = state()
    root = str(st.config.model or st.served_names[0]) if st.served_names else None
    return json_response(
        ModelList(
            data=[
                ModelCard(
                    id=name, created=st.created, root=root, max_model_len=st.max_model_len or None
                )
                for name in st.served_names
            ]
        )
    )


@bp.get("/health")
@bp.get("/ping")
async def health() -> Response:
    ok, reason = state().healthy
    if ok:
        return Response(b"", status=200)
    return error_response(503, reason, None, "unhealthy")


@bp.get("/version")
async def version_route() -> Response:
    return json_response(VersionResponse(weir_version()))


@bp.post("/tokenize")
async def tokenize() -> Response:
    st = state()
    req = await decode(TokenizeRequest)
    st.ready_engine()
    st.model_name(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "send exactly one of `prompt` or `messages`", "prompt")
    if req.messages is not None:
        if not req.messages:
            raise APIError(400, "messages must not be empty", "messages")
        text = chat.request_text(st.tokenizer, st.chat_template, req)
        # The template already wrote any BOS it wants; don't let the tokenizer add another.
        ids = st.tokenizer.encode(text, add_special_tokens=False)
    else:
        ids = st.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    strs = st.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return json_response(TokenizeResponse(len(ids), st.max_model_len, ids, strs))


@bp.post("/detokenize")
async def detokenize() -> Response:
    st = state()
    req = await decode(DetokenizeRequest)
    st.ready_engine()
    st.model_name(req.model)
    vocab = len(st.tokenizer)
    bad = sorted({t for t in req.tokens if t >= vocab})
    if bad:
        raise APIError(
            400,
            f"tokens: token ids {bad[:8]} are outside the vocabulary "
            f"(vocab_size={vocab}: ids 0..{vocab - 1})",
            "tokens",
        )
    return json_response(DetokenizeResponse(st.tokenizer.decode(req.tokens)))


@bp.get("/metrics")
async def metrics() -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    m = state().metrics
    return Response(m.render() if m is not None else b"", content_type=CONTENT_TYPE_LATEST)


@bp.get("/openapi.json")
async def openapi() -> Response:
    return json_response(openapi_document(weir_version()))


@bp.get("/docs")
async def docs() -> Response:
    return Response(DOCS_HTML, content_type="text/html; charset=utf-8")
