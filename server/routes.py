"""The non-generation routes: models, health, version, tokenize/detokenize, the OpenAPI document."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import logging

import trio
from quart import Blueprint, Response, request

from core.lora import LoraError
from server.lora import bad_adapter

from server import chat
from server.errors import APIError, error_response
from server.wire import decode, json_response, state
from server.openapi import DOCS_HTML, openapi_document
from server.protocol import (
    DetokenizeResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeResponse,
    VersionResponse,
)
from server.requests import DetokenizeRequest, TokenizeRequest

bp = Blueprint("routes", __name__)
log = logging.getLogger("weir.server")


def weir_version() -> str:
    try:
        return version("weir")
    except PackageNotFoundError:
        return "unknown"


@bp.get("/v1/models")
async def models() -> Response:
    return json_response(ModelList(data=_cards(state())))


@bp.get("/v1/models/<path:name>")
async def model(name: str) -> Response:
    """OpenAI's retrieve (the SDK's `models.retrieve`): one card, 404 naming an unknown one."""
    for card in _cards(state()):
        if card.id == name:
            return json_response(card)
    raise APIError(404, f"The model `{name}` does not exist.", "model", "model_not_found")


def _cards(st) -> list[ModelCard]:
    if not st.served_names:  # loading (or failed to): no model to list yet
        raise APIError(
            503, f"The server is not ready: {st.reason or st.status}", None, "service_unavailable"
        )
    root = str(st.config.model or st.served_names[0]) if st.served_names else None
    cards = [
        ModelCard(id=name, created=st.created, root=root, max_model_len=st.max_model_len or None)
        for name in st.served_names
    ]
    if st.lora is not None:  # as vLLM lists them: root the adapter's folder, parent the base
        cards += [
            ModelCard(
                id=name,
                created=a.created,
                root=a.ref.path,
                parent=a.base_model_name or st.served_names[0],
                max_model_len=st.max_model_len or None,
            )
            for name, a in st.lora.adapters.items()
        ]
    return cards


def _runtime_lora(st):
    if st.lora is None or not st.options.allow_runtime_lora_updating:
        raise APIError(
            404,
            "Runtime LoRA updates are off: start the server with --enable-lora and "
            "--allow-runtime-lora-updating (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)",
            None,
            "not_found",
        )
    return st.lora


@bp.post("/v1/load_lora_adapter")
async def load_lora_adapter() -> Response:
    """vLLM's: check the adapter in `lora_path` and serve it as `lora_name` (400 naming what
    is wrong: a name already served, a rank above --max-lora-rank, shapes that do not fit)."""
    st = state()
    registry = _runtime_lora(st)
    req = await decode(LoadLoRAAdapterRequest)
    if not req.lora_path:
        raise APIError(400, "lora_path is required", "lora_path")
    if req.lora_name in st.served_names:
        raise APIError(400, f"`{req.lora_name}` is the base model's name", "lora_name")
    try:
        info = await trio.to_thread.run_sync(registry.check, req.lora_name, req.lora_path)
        registry.add(info, req.base_model_name)
    except LoraError as e:
        raise bad_adapter(e) from None
    log.info("LoRA adapter %s loaded from %s", req.lora_name, req.lora_path)
    return Response(f"Success: LoRA adapter '{req.lora_name}' added successfully.", 200)


@bp.post("/v1/unload_lora_adapter")
async def unload_lora_adapter() -> Response:
    """vLLM's: stop serving `lora_name` (404 if unknown, 409 while requests use it)."""
    st = state()
    registry = _runtime_lora(st)
    req = await decode(LoadLoRAAdapterRequest)
    registry.unload(req.lora_name)
    log.info("LoRA adapter %s unloaded", req.lora_name)
    return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.", 200)


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
        text = chat.request_text(st.tokenizer, chat.template_for(st, req), req)
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
    """Prometheus text or OpenMetrics as the Accept header asks, gzipped where the scraper takes
    it (as prometheus_client's own handler, and so vLLM's /metrics, answer)."""
    import gzip

    from prometheus_client import CONTENT_TYPE_LATEST

    m = state().metrics
    if m is None:
        return Response(b"", content_type=CONTENT_TYPE_LATEST)
    body, content_type = m.render(request.headers.get("Accept", ""))
    headers = {}
    if "gzip" in request.headers.get("Accept-Encoding", ""):
        body, headers["Content-Encoding"] = gzip.compress(body, compresslevel=1), "gzip"
    return Response(body, content_type=content_type, headers=headers)


@bp.get("/openapi.json")
async def openapi() -> Response:
    return json_response(openapi_document(weir_version()))


@bp.get("/docs")
async def docs() -> Response:
    return Response(DOCS_HTML, content_type="text/html; charset=utf-8")
