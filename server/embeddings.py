"""/v1/embeddings: inputs (strings or token ids) pooled into vectors by the engine, as the OpenAI
SDK's `client.embeddings.create` sends them: floats, or base64 of little-endian float32."""

from __future__ import annotations

import array
import base64
import time
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta
from quart import Blueprint, Response

from core.pooling import PoolingParams
from server.errors import APIError
from server.pooled import admit, fit_inputs, pooled
from server.wire import decode, json_response, state

bp = Blueprint("embeddings", __name__)


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    input: str | list[Any]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Meta(ge=1)] | None = None
    user: str | None = None
    # vLLM's: cut a longer input to N tokens (-1: the model's length) instead of a 400, its
    # first (truncation_side "right", vLLM's pooling default) or its last ("left")
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    normalize: bool | None = None  # vLLM's: override --normalize for this request
    priority: int = 0


class Embedding(msgspec.Struct):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage
    object: str = "list"


@bp.post("/v1/embeddings")
async def embeddings() -> Response:
    st = state()
    req = await decode(EmbeddingRequest)
    model = admit(st, req.model, "embed")
    config = st.embedding
    if req.dimensions is not None:
        why = config.check_dimensions(req.dimensions)
        if why is not None:
            raise APIError(400, f"dimensions={req.dimensions}: {why}", "dimensions")
    inputs = fit_inputs(st, req.input, req.truncate_prompt_tokens, req.truncation_side)
    normalize = config.normalize if req.normalize is None else req.normalize
    pooling = PoolingParams(config.kind, normalize, req.dimensions)
    rid, vectors, prompt_tokens = await pooled(
        st, model, "embd", inputs, pooling, req.priority, "input"
    )
    if req.encoding_format == "base64":
        data = [Embedding(i, base64.b64encode(v).decode()) for i, v in enumerate(vectors)]
    else:
        data = [Embedding(i, array.array("f", v).tolist()) for i, v in enumerate(vectors)]
    return json_response(
        EmbeddingResponse(
            id=rid,
            created=int(time.time()),
            model=model,
            data=data,
            usage=EmbeddingUsage(prompt_tokens, prompt_tokens),
        )
    )
