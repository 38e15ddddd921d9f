"""/score and /rerank (vLLM's, with /v1/ and Jina's /v2/rerank): how well texts answer each
other. A sequence classifier of one label (a cross-encoder reranker) reads each pair as one
input, the tokenizer's own pair encoding (text, text_pair), and scores it by its logit's sigmoid;
an embedding model (--enable-embeddings, --runner pooling) embeds each text once and scores a
pair by the cosine of its two vectors."""

from __future__ import annotations

import array
import math
import time
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta
from quart import Blueprint, Response

from core.pooling import CLASSIFY, PoolingParams, activated
from core.score_pairs import PairTooLong, pair_ids
from core.truncation import cut_text
from server.classify import PoolingUsage, logits_of, use_activation
from server.errors import APIError
from server.pooled import pooled, truncate_length
from server.state import ServerState
from server.wire import decode, json_response, state

bp = Blueprint("scores", __name__)


class ScoreRequest(msgspec.Struct, kw_only=True):
    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1)] | None = None
    truncation_side: Literal["left", "right"] | None = None  # (None: "right")
    priority: int = 0
    use_activation: bool | None = None  # a cross-encoder's: false gives the raw logit
    activation: bool | None = None


class ScoreData(msgspec.Struct):
    index: int
    score: float
    object: str = "score"


class ScoreResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage
    object: str = "list"


class RerankRequest(msgspec.Struct, kw_only=True):
    query: str
    documents: list[str]
    model: str | None = None
    top_n: Annotated[int, Meta(ge=0)] = 0  # the best N (0: every document)
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1)] | None = None
    truncation_side: Literal["left", "right"] | None = None  # (None: "right")
    priority: int = 0
    use_activation: bool | None = None
    activation: bool | None = None


class RerankDocument(msgspec.Struct):
    text: str


class RerankResult(msgspec.Struct):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankUsage(msgspec.Struct):
    total_tokens: int


class RerankResponse(msgspec.Struct):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


def _listed(value: str | list[str], field: str) -> list[str]:
    texts = [value] if isinstance(value, str) else value
    if not texts:
        raise APIError(400, f"{field} must not be empty", field, "invalid_value")
    return texts


Pair = tuple[tuple[str, str], tuple[str, str]]  # each side: (its text, the request's name of it)


def _pairs(req: ScoreRequest) -> list[Pair]:
    """One text_1 against each text_2, or text_1[i] against text_2[i]."""
    first, second = _listed(req.text_1, "text_1"), _listed(req.text_2, "text_2")
    one = isinstance(req.text_1, str)
    firsts = [(t, "text_1" if one else f"text_1[{i}]") for i, t in enumerate(first)]
    two = isinstance(req.text_2, str)
    seconds = [(t, "text_2" if two else f"text_2[{i}]") for i, t in enumerate(second)]
    if len(first) == 1:
        return [(firsts[0], s) for s in seconds]
    if len(first) != len(second):
        raise APIError(
            400,
            f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as "
            "many as text_2",
            "text_1",
            "invalid_value",
        )
    return list(zip(firsts, seconds))


async def score_pairs(
    st: ServerState, req: Any, pairs: list[Pair], prefix: str, field: str
) -> tuple[str, str, list[float], int]:
    """(the response's id, the model, each pair's score, the prompt tokens). A text too long is
    named in its 400 (a pair by its second text); `field` names the inputs in the engine's own
    checks."""
    st.ready_engine()  # a 503 while loading, before anything else is checked
    model = st.model_name(req.model)
    keep = None
    side = req.truncation_side or "right"
    if req.truncate_prompt_tokens is not None:
        keep = truncate_length(st, req.truncate_prompt_tokens)
    if "score" in st.tasks:
        if len(st.labels) != 1:
            raise APIError(
                400,
                f"this classifier has {len(st.labels)} labels; scoring needs one (a reranker's): "
                "use /classify",
                "model",
                "invalid_value",
            )
        on = use_activation(req)
        encoded = [_pair_ids(st, a, b, keep, side, name) for (a, _), (b, name) in pairs]
        inputs = [ids for ids, _ in encoded]
        pooling = [PoolingParams(CLASSIFY, False, type_start=start) for _, start in encoded]
        rid, vectors, tokens = await pooled(st, model, prefix, inputs, pooling, req.priority, field)
        fn = st.activations[1]
        return rid, model, [activated(logits_of(v), on, fn)[0] for v in vectors], tokens
    if "embed" not in st.tasks:
        raise APIError(
            400,
            "This server does not score: serve a sequence classifier (a reranker), or an "
            "embedding model with --enable-embeddings or --runner pooling",
            "model",
            "scoring_not_supported",
        )
    if req.use_activation is not None or req.activation is not None:
        name = "use_activation" if req.use_activation is not None else "activation"
        raise APIError(
            400,
            f"{name} applies to a classifier's logits; an embedding model scores by cosine",
            name,
            "invalid_value",
        )
    named = dict(side for pair in reversed(pairs) for side in reversed(pair))  # first names
    texts = list(dict.fromkeys(t for (a, _), (b, _) in pairs for t in (a, b)))  # each once
    inputs = [_text_ids(st, t, keep, side, named[t]) for t in texts]
    pooling = PoolingParams(st.embedding.kind, True)
    rid, vectors, tokens = await pooled(st, model, prefix, inputs, pooling, req.priority, field)
    unit = dict(zip(texts, (array.array("f", v) for v in vectors)))
    cosines = [math.fsum(x * y for x, y in zip(unit[a], unit[b])) for (a, _), (b, _) in pairs]
    return rid, model, cosines, tokens


def _pair_ids(
    st: ServerState, a: str, b: str, keep: int | None, side: str, name: str
) -> tuple[list[int], int | None]:
    """The pair as one input (core/score_pairs.py: the model's rerank prompt, or the tokenizer's
    pair encoding) and where its second text starts, cut to `keep` tokens, or a 400 where it
    is too long."""
    try:
        ids, start = pair_ids(st.tokenizer, a, b, keep, st.score_template, side)
    except PairTooLong as e:
        raise APIError(400, str(e), "truncate_prompt_tokens", "invalid_value") from None
    return (ids if keep is not None else _checked(st, ids, name)), start


def _text_ids(st: ServerState, text: str, keep: int | None, side: str, name: str) -> list[int]:
    if keep is not None:
        return cut_text(st.tokenizer, text, keep, side)
    return _checked(st, st.tokenizer.encode(text), name)


def _checked(st: ServerState, ids: list[int], name: str) -> list[int]:
    if len(ids) > st.max_model_len:
        raise APIError(
            400,
            f"{name} gives {len(ids)} tokens, more than this model's maximum context length "
            f"({st.max_model_len}); shorten it or set truncate_prompt_tokens",
            name,
            "invalid_value",
        )
    return ids


@bp.post("/score")
@bp.post("/v1/score")
async def score() -> Response:
    st = state()
    req = await decode(ScoreRequest)
    pairs = _pairs(req)
    rid, model, scores, tokens = await score_pairs(st, req, pairs, "score", "text_2")
    return json_response(
        ScoreResponse(
            id=rid,
            created=int(time.time()),
            model=model,
            data=[ScoreData(i, s) for i, s in enumerate(scores)],
            usage=PoolingUsage(tokens, tokens),
        )
    )


@bp.post("/rerank")
@bp.post("/v1/rerank")
@bp.post("/v2/rerank")
async def rerank() -> Response:
    st = state()
    req = await decode(RerankRequest)
    docs = _listed(req.documents, "documents")
    pairs = [((req.query, "query"), (d, f"documents[{i}]")) for i, d in enumerate(docs)]
    rid, model, scores, tokens = await score_pairs(st, req, pairs, "rerank", "documents")
    order = sorted(range(len(docs)), key=lambda i: -scores[i])  # stable: ties keep their order
    if req.top_n:
        order = order[: req.top_n]
    return json_response(
        RerankResponse(
            id=rid,
            model=model,
            usage=RerankUsage(tokens),
            results=[RerankResult(i, RerankDocument(docs[i]), scores[i]) for i in order],
        )
    )
