"""/classify (vLLM's): inputs (strings or token ids) through a sequence-classification model's
head, each answered with its labels' probabilities (softmax over the labels; a sigmoid where
there is one) and the most likely label's name from the checkpoint's id2label."""

from __future__ import annotations

import array
import time
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta
from quart import Blueprint, Response

from core.pooling import CLASSIFY, PoolingParams, activated
from server.errors import APIError
from server.pooled import admit, fit_inputs, pooled
from server.wire import decode, json_response, state

bp = Blueprint("classify", __name__)


class ClassificationRequest(msgspec.Struct, kw_only=True):
    input: str | list[Any]
    model: str | None = None
    user: str | None = None
    # vLLM's: cut a longer input to N tokens (-1: the model's length) instead of a 400, its
    # first (truncation_side "right", vLLM's pooling default) or its last ("left")
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    priority: int = 0
    # vLLM's (its older name: activation): false gives the raw logits instead of probabilities
    use_activation: bool | None = None
    activation: bool | None = None


class ClassificationData(msgspec.Struct):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class PoolingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class ClassificationResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    data: list[ClassificationData]
    usage: PoolingUsage
    object: str = "list"


def use_activation(req: Any) -> bool:
    """use_activation, or its older name activation (both: they must agree); true unless set."""
    new, old = req.use_activation, req.activation
    if new is not None and old is not None and new != old:
        raise APIError(
            400, "use_activation and activation (its older name) disagree", "use_activation"
        )
    return next((v for v in (new, old) if v is not None), True)


def logits_of(vector: bytes) -> list[float]:
    return array.array("f", vector).tolist()


@bp.post("/classify")
async def classify() -> Response:
    st = state()
    req = await decode(ClassificationRequest)
    model = admit(st, req.model, "classify")
    on = use_activation(req)
    inputs = fit_inputs(st, req.input, req.truncate_prompt_tokens, req.truncation_side)
    rid, vectors, prompt_tokens = await pooled(
        st, model, "classify", inputs, PoolingParams(CLASSIFY, False), req.priority, "input"
    )
    labels = st.labels
    data = []
    for i, v in enumerate(vectors):
        logits = logits_of(v)
        best = max(range(len(logits)), key=logits.__getitem__)
        probs = activated(logits, on, st.activations[0])
        data.append(ClassificationData(i, labels[best], probs, len(logits)))
    return json_response(
        ClassificationResponse(
            id=rid,
            created=int(time.time()),
            model=model,
            data=data,
            usage=PoolingUsage(prompt_tokens, prompt_tokens),
        )
    )
