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
from core.sampling import SamplingParams
from server.errors import APIError
from server.prompts import token_lists
from server.submit import Submitted, request_id
from server.usage import UsageCounter
from server.wire import decode, json_response, state

bp = Blueprint("embeddings", __name__)


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    input: str | list[Any]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Meta(ge=1)] | None = None
    user: str | None = None
    # vLLM's: keep the last N tokens of a longer input (-1: the model's length) instead of a 400.
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1)] | None = None
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


def _fit(st, inputs: list[list[int]], truncate: int | None) -> list[list[int]]:
    """Inputs within max_model_len: cut to their last tokens when asked, else a 400 naming the
    first input that is too long."""
    limit = st.max_model_len
    if truncate is not None:
        keep = limit if truncate == -1 else truncate
        if keep > limit:
            raise APIError(
                400,
                f"truncate_prompt_tokens ({keep}) is more than max_model_len ({limit})",
                "truncate_prompt_tokens",
                "invalid_value",
            )
        return [ids[-keep:] for ids in inputs]
    for i, ids in enumerate(inputs):
        if len(ids) > limit:
            raise APIError(
                400,
                f"input[{i}] has {len(ids)} tokens, more than this model's maximum context "
                f"length ({limit}); shorten it or set truncate_prompt_tokens",
                f"input[{i}]",
                "invalid_value",
            )
    return inputs


@bp.post("/v1/embeddings")
async def embeddings() -> Response:
    st = state()
    req = await decode(EmbeddingRequest)
    engine = st.ready_engine()
    model = st.model_name(req.model)
    st.check_task("embed")
    config = st.embedding
    if req.dimensions is not None:
        why = config.check_dimensions(req.dimensions)
        if why is not None:
            raise APIError(400, f"dimensions={req.dimensions}: {why}", "dimensions")
    inputs = _fit(st, token_lists(st, req.input, "input"), req.truncate_prompt_tokens)
    normalize = config.normalize if req.normalize is None else req.normalize
    pooling = PoolingParams(config.kind, normalize, req.dimensions)
    sub = Submitted(
        st,
        engine,
        request_id("embd"),
        1,
        False,
        model,
        names={"prompt": "input", "messages": "input"},
    )
    sub.add(inputs, SamplingParams(max_tokens=1), req.priority, None, pooling)
    usage = UsageCounter(1, len(sub.ids))
    vectors: list[bytes | None] = [None] * len(sub.ids)
    try:
        async for i, out in sub.outputs():
            usage.update(i, out)
            if out.finished:
                if out.embedding is None:
                    raise APIError(
                        504,
                        "The request ran past --request-timeout before every input was embedded",
                        None,
                        "timeout",
                    )
                vectors[i] = out.embedding
    finally:
        sub.close()
    if req.encoding_format == "base64":
        data = [Embedding(i, base64.b64encode(v).decode()) for i, v in enumerate(vectors)]
    else:
        data = [Embedding(i, array.array("f", v).tolist()) for i, v in enumerate(vectors)]
    return json_response(
        EmbeddingResponse(
            id=sub.base,
            created=int(time.time()),
            model=model,
            data=data,
            usage=EmbeddingUsage(usage.prompt, usage.prompt),
        )
    )
