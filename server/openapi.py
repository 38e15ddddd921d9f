"""The OpenAPI document, generated from the msgspec Structs that validate requests, so clients,
gateways and fuzzers see exactly what the server accepts."""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

import msgspec

from server.protocol import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    LoadLoRAAdapterRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    VersionResponse,
)
from server.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from server.classify import ClassificationRequest, ClassificationResponse
from server.pooling import PoolingRequest, PoolingResponse
from server.embeddings import EmbeddingRequest, EmbeddingResponse
from server.scores import RerankRequest, RerankResponse, ScoreRequest, ScoreResponse
from server.responses.protocol import ItemList, ResponseDeleted, ResponseObject, ResponsesRequest

# path, method, summary, request body Struct, success Struct, streams SSE
ROUTES: list[tuple[str, str, str, type | None, type, bool]] = [
    (
        "/v1/chat/completions",
        "post",
        "Create a chat completion",
        ChatCompletionRequest,
        ChatCompletionResponse,
        True,
    ),
    (
        "/v1/completions",
        "post",
        "Create a text completion",
        CompletionRequest,
        CompletionResponse,
        True,
    ),
    ("/v1/models", "get", "List the served models", None, ModelList, False),
    ("/v1/models/{model}", "get", "Retrieve one served model", None, ModelCard, False),
    (
        "/tokenize",
        "post",
        "Tokenize a prompt or chat messages",
        TokenizeRequest,
        TokenizeResponse,
        False,
    ),
    (
        "/detokenize",
        "post",
        "Turn token ids back into text",
        DetokenizeRequest,
        DetokenizeResponse,
        False,
    ),
    ("/v1/responses", "post", "Create a response", ResponsesRequest, ResponseObject, True),
    (
        "/v1/embeddings",
        "post",
        "Embed inputs (--enable-embeddings or --runner pooling)",
        EmbeddingRequest,
        EmbeddingResponse,
        False,
    ),
    (
        "/classify",
        "post",
        "Classify inputs (a sequence-classification model)",
        ClassificationRequest,
        ClassificationResponse,
        False,
    ),
    (
        "/pooling",
        "post",
        "Pool inputs as the model does: vectors (task embed) or a classifier's outputs",
        PoolingRequest,
        PoolingResponse,
        False,
    ),
    *(
        (
            path,
            "post",
            "Score text pairs (a one-label classifier: a reranker; or an embedding model)",
            ScoreRequest,
            ScoreResponse,
            False,
        )
        for path in ("/score", "/v1/score")
    ),
    *(
        (
            path,
            "post",
            "Rank documents against a query (a reranker, or an embedding model)",
            RerankRequest,
            RerankResponse,
            False,
        )
        for path in ("/rerank", "/v1/rerank", "/v2/rerank")
    ),
    (
        "/v1/responses/{response_id}",
        "get",
        "Retrieve a stored response (?stream=true&starting_after=N replays a background one)",
        None,
        ResponseObject,
        True,
    ),
    (
        "/v1/responses/{response_id}",
        "delete",
        "Delete a stored response",
        None,
        ResponseDeleted,
        False,
    ),
    (
        "/v1/responses/{response_id}/input_items",
        "get",
        "List a response's input items",
        None,
        ItemList,
        False,
    ),
    (
        "/v1/responses/{response_id}/cancel",
        "post",
        "Cancel a background response",
        None,
        ResponseObject,
        False,
    ),
    ("/version", "get", "The server's version", None, VersionResponse, False),
]


# Query parameters, by (path, method): name, JSON schema, description.
QUERY: dict[tuple[str, str], list[tuple[str, dict[str, Any], str]]] = {
    ("/v1/responses/{response_id}", "get"): [
        ("stream", {"type": "boolean"}, "replay a background response's events as SSE"),
        ("starting_after", {"type": "integer", "minimum": -1}, "the last event already seen"),
    ],
    ("/v1/responses/{response_id}/input_items", "get"): [
        ("limit", {"type": "integer", "minimum": 1, "maximum": 100}, "items per page (20)"),
        ("order", {"enum": ["asc", "desc"]}, "oldest or newest first (desc)"),
        ("after", {"type": "string"}, "the item id to list after"),
    ],
}
PATH_PARAMETER = re.compile(r"\{([^}]+)\}")


def parameters(path: str, method: str) -> list[dict[str, Any]]:
    """The operation's parameters: each {name} of the path, then its query parameters."""
    params: list[dict[str, Any]] = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in PATH_PARAMETER.findall(path)
    ]
    for name, schema, description in QUERY.get((path, method), []):
        params.append(
            {"name": name, "in": "query", "required": False, "schema": schema,
             "description": description}
        )  # fmt: skip
    return params


@lru_cache(maxsize=1)
def _components() -> tuple[dict[str, Any], dict[str, Any]]:
    types = [t for _, _, _, req, resp, _ in ROUTES for t in (req, resp) if t is not None]
    types += [ChatCompletionChunk, ErrorResponse, LoadLoRAAdapterRequest]
    refs, components = msgspec.json.schema_components(
        types, ref_template="#/components/schemas/{name}"
    )
    return dict(zip((t.__name__ for t in types), refs)), components


def openapi_document(version: str) -> dict[str, Any]:
    refs, components = _components()
    error = {
        "description": "An OpenAI-style error",
        "content": {"application/json": {"schema": refs["ErrorResponse"]}},
    }
    paths: dict[str, Any] = {}
    for path, method, summary, req, resp, streams in ROUTES:
        content = {"application/json": {"schema": refs[resp.__name__]}}
        if streams:
            content["text/event-stream"] = {
                "schema": {
                    "type": "string",
                    "description": "`data: {chunk}` lines, then `data: [DONE]` (responses: "
                    "`event: type` and `data: {event}` lines, ending with the response's own "
                    "final event)",
                }
            }
        op: dict[str, Any] = {
            "summary": summary,
            "responses": {
                "200": {"description": "OK", "content": content},
                "400": error,
                "404": error,
                "503": error,
            },
        }
        params = parameters(path, method)
        if params:
            op["parameters"] = params
        if req is not None:
            op["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": refs[req.__name__]}},
            }
        paths.setdefault(path, {})[method] = op
    for path in ("/health", "/ping"):
        paths[path] = {
            "get": {
                "summary": "200 when the engine is loaded and serving",
                "responses": {"200": {"description": "healthy"}, "503": error},
            }
        }
    paths["/metrics"] = {
        "get": {
            "summary": "Prometheus metrics (vLLM's names under --metrics-prefix vllm)",
            "responses": {
                "200": {
                    "description": "the Prometheus text exposition format",
                    "content": {"text/plain": {"schema": {"type": "string"}}},
                }
            },
        }
    }
    for path, summary in (
        ("/v1/load_lora_adapter", "Serve a LoRA adapter (--allow-runtime-lora-updating)"),
        ("/v1/unload_lora_adapter", "Stop serving a LoRA adapter (--allow-runtime-lora-updating)"),
    ):
        paths[path] = {
            "post": {
                "summary": summary,
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": refs["LoadLoRAAdapterRequest"]}},
                },
                "responses": {
                    "200": {
                        "description": "`Success: ...` (vLLM's text)",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    },
                    "400": error,
                    "404": error,
                    "409": error,
                },
            }
        }
    shapes = ("ChatCompletionRequest", "CompletionRequest", "EmbeddingRequest")
    shapes += ("ClassificationRequest", "ScoreRequest", "RerankRequest")
    answers = [refs[n.replace("Request", "Response")] for n in shapes]
    paths["/invocations"] = {
        "post": {
            "summary": "SageMaker's route: the body's fields pick the route that answers it "
            "(messages, prompt, input, query and documents, text_1 and text_2)",
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"anyOf": [refs[n] for n in shapes]}}},
            },
            "responses": {
                "200": {
                    "description": "the chosen route's answer (a chat completion may stream)",
                    "content": {"application/json": {"schema": {"anyOf": answers}}},
                },
                "400": error,
                "503": error,
            },
        }
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "weir",
            "version": version,
            "description": "An OpenAI-compatible LLM inference server.",
        },
        "paths": paths,
        "components": {"schemas": components},
    }


# A self-contained page (no CDN: it works offline) that lists the routes and their schemas.
DOCS_HTML = """<!doctype html>
<html><head><meta charset="utf-8"><title>weir API</title>
<style>body{font:14px system-ui,sans-serif;max-width:960px;margin:2em auto;padding:0 1em}
h2{border-bottom:1px solid #ccc}code,pre{background:#f5f5f5}pre{padding:.5em;overflow:auto}
.m{font-weight:bold;text-transform:uppercase;margin-right:.5em}</style></head>
<body><h1>weir API</h1><p>Generated from <a href="/openapi.json">/openapi.json</a>.</p>
<div id="routes"></div><h2>Schemas</h2><div id="schemas"></div>
<script>
fetch('/openapi.json').then(r => r.json()).then(doc => {
  const esc = s => String(s).replace(/[&<>]/g, c => ({'&':'&amp;','<':'&lt;','>':'&gt;'}[c]));
  let html = '';
  for (const [path, ops] of Object.entries(doc.paths)) {
    for (const [method, op] of Object.entries(ops)) {
      const body = op.requestBody ? op.requestBody.content['application/json'].schema.$ref : '';
      html += `<h2><span class="m">${method}</span><code>${esc(path)}</code></h2>` +
        `<p>${esc(op.summary || '')}</p>` +
        (body ? `<p>Body: <a href="#${body.split('/').pop()}">` +
        `${body.split('/').pop()}</a></p>` : '');
    }
  }
  document.getElementById('routes').innerHTML = html;
  let schemas = '';
  for (const [name, s] of Object.entries(doc.components.schemas)) {
    schemas += `<h3 id="${name}">${name}</h3><pre>${esc(JSON.stringify(s, null, 2))}</pre>`;
  }
  document.getElementById('schemas').innerHTML = schemas;
});
</script></body></html>
"""
