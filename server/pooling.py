"""/pooling (vLLM's general pooling route): inputs (strings, token ids, or a conversation through
the chat template) pooled as the served model pools them, its `task` named or left to the
model: an embedding model's vectors ("embed": its pooling, normalized unless use_activation is
false or the server runs --no-normalize) or a classifier's outputs ("classify": its
probabilities, or the raw logits under use_activation false); or one row for every token
(vLLM's token tasks: "token_embed", each token's hidden state, normalized as "embed" is;
"token_classify", a token classifier's probabilities or logits for each token). Each answer is
{"index", "object": "pooling", "data"}: floats (a list of them a token for the token tasks) or
base64 of little-endian float32 (the rows one after another)."""

from __future__ import annotations

import array
import base64
import time
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta
from quart import Blueprint, Response

from core.pooling import CLASSIFY, TOKEN_CLASSIFY, TOKEN_EMBED, PoolingParams, activated, token_rows
from server.chat import render_text
from server.classify import PoolingUsage
from server.errors import APIError
from server.pooled import admit, fit_inputs, pooled
from server.requests import ChatMessage
from server.wire import decode, json_response, state

bp = Blueprint("pooling", __name__)


class PoolingRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    input: str | list[Any] | None = None
    messages: list[ChatMessage] | None = None  # (instead of input) one conversation
    # None: the model's own (a token classifier's token_classify)
    task: Literal["embed", "classify", "token_embed", "token_classify"] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    # embed: normalize (vLLM's use_activation, the name it gave `normalize`); classify: the
    # probabilities, not the raw logits
    use_activation: bool | None = None
    dimensions: int | None = None  # refused by name, as vLLM refuses it here
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    add_generation_prompt: bool = False  # messages': the template's assistant turn
    user: str | None = None
    priority: int = 0


class PoolingData(msgspec.Struct):
    index: int
    data: list[Any] | str  # floats; a list of floats a token for the token tasks; base64
    object: str = "pooling"


class PoolingResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    data: list[PoolingData]
    usage: PoolingUsage
    object: str = "list"


@bp.post("/pooling")
async def pooling() -> Response:
    st = state()
    req = await decode(PoolingRequest)
    own = [t for t in ("embed", "classify", "token_classify") if t in st.tasks]
    task = req.task or (own[0] if own else "embed")  # (a generator: the 400 embed's check says)
    model = admit(st, req.model, task)
    if req.dimensions is not None:
        raise APIError(400, "dimensions is not taken by /pooling: use /v1/embeddings", "dimensions")
    if (req.input is None) == (req.messages is None):
        raise APIError(400, "give input or messages (one of them)", "input", "invalid_value")
    value = req.input
    if req.messages is not None:  # tokenized as a chat request's text: the template's tokens
        text = render_text(st.tokenizer, st.chat_template, req.messages, req.add_generation_prompt)
        value = [st.tokenizer.encode(text, add_special_tokens=False)]
    field = "input" if req.messages is None else "messages"
    inputs = fit_inputs(st, value, req.truncate_prompt_tokens, req.truncation_side, field)
    on = req.use_activation is not False
    if task == "classify":
        params = PoolingParams(CLASSIFY, False)
    elif task == "token_classify":
        params = PoolingParams(TOKEN_CLASSIFY, False)
    elif task == "token_embed":
        params = PoolingParams(TOKEN_EMBED, on and st.embedding.normalize)
    else:
        params = PoolingParams(st.embedding.kind, on and st.embedding.normalize)
    rid, vectors, tokens = await pooled(st, model, "pool", inputs, params, req.priority, field)
    data = []
    for i, v in enumerate(vectors):
        values = array.array("f", v).tolist()
        if task.startswith("token_"):  # (the rows one after another: one a token)
            rows = token_rows(values, inputs[i], task, st.pooling_facts)
        else:
            rows = values
        if task.endswith("classify"):
            fn = st.activations[0]
            flat = rows and not isinstance(rows[0], list)  # (one float a token: BGE-M3's)
            if task == "classify" or flat:
                rows = activated(rows, on, fn)
            else:
                rows = [activated(r, on, fn) for r in rows]
        if req.encoding_format == "base64":
            flat = [x for r in rows for x in r] if rows and isinstance(rows[0], list) else rows
            data.append(PoolingData(i, base64.b64encode(array.array("f", flat).tobytes()).decode()))
        else:
            data.append(PoolingData(i, rows))
    return json_response(
        PoolingResponse(rid, int(time.time()), model, data, PoolingUsage(tokens, tokens))
    )
