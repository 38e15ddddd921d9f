"""Prompts run for their pooled vectors, nothing generated: what /v1/embeddings, /classify,
/score and /rerank share. Each token list is one engine request with the same PoolingParams;
the vectors (little-endian float32 bytes: an embedding, or a classifier's logits) come back in
the inputs' order, with the prompt tokens counted."""

from __future__ import annotations

from typing import Any

from core.pooling import PoolingParams
from core.sampling import SamplingParams
from server.errors import APIError
from server.prompts import token_lists
from server.state import ServerState
from server.submit import Submitted, request_id
from server.usage import UsageCounter


def admit(st: ServerState, requested: str | None, task: str) -> str:
    """The model a pooling route's request names, once the server is ready (a 503 while it
    loads, before anything else is checked) and serves `task`."""
    st.ready_engine()
    model = st.model_name(requested)
    st.check_task(task)
    return model


async def pooled(
    st: ServerState,
    model: str,
    prefix: str,
    inputs: list[list[int]],
    pooling: PoolingParams | list[PoolingParams],
    priority: int,
    field: str,
) -> tuple[str, list[bytes], int]:
    """(the response's id, one vector an input, the prompt tokens). `pooling`: every input's,
    or each input's own (a pair's token types); `field`: the request's name for its inputs,
    which the engine's checks then name."""
    sub = Submitted(
        st,
        st.ready_engine(),
        request_id(prefix),
        1,
        False,
        model,
        names={"prompt": field, "messages": field, "input": field},
    )
    sub.add(inputs, SamplingParams(max_tokens=1), priority, None, pooling)
    usage = UsageCounter(1, len(sub.ids))
    vectors: list[bytes | None] = [None] * len(sub.ids)
    try:
        async for i, out in sub.outputs():
            usage.update(i, out)
            if out.finished:
                if out.embedding is None:
                    raise APIError(
                        504,
                        "The request ran past --request-timeout before every input was pooled",
                        None,
                        "timeout",
                    )
                vectors[i] = out.embedding
    finally:
        sub.close()
    return sub.base, vectors, usage.prompt


def fit_inputs(
    st: ServerState,
    value: str | list[Any],
    truncate: int | None,
    side: str | None = None,
    field: str = "input",
) -> list[list[int]]:
    """A request's inputs (texts or token ids: server/prompts.py) as token lists within
    max_model_len: cut when asked (vLLM's truncate_prompt_tokens, -1: the model's length; its
    first tokens kept, or its last with truncation_side "left"; a text's special tokens kept),
    else a 400 naming the first input that is too long."""
    limit = st.max_model_len
    if truncate is not None:
        return token_lists(st, value, field, truncate_length(st, truncate), side or "right")
    inputs = token_lists(st, value, field)
    for i, ids in enumerate(inputs):
        if len(ids) > limit:
            raise APIError(
                400,
                f"{field}[{i}] has {len(ids)} tokens, more than this model's maximum context "
                f"length ({limit}); shorten it or set truncate_prompt_tokens",
                f"{field}[{i}]",
                "invalid_value",
            )
    return inputs


def truncate_length(st: ServerState, truncate: int) -> int:
    """The tokens truncate_prompt_tokens keeps (-1: max_model_len; 0 or more than it: a 400)."""
    if truncate == 0:
        raise APIError(
            400,
            "truncate_prompt_tokens must be -1 (the model's length) or at least 1",
            "truncate_prompt_tokens",
            "invalid_value",
        )
    keep = st.max_model_len if truncate == -1 else truncate
    if keep > st.max_model_len:
        raise APIError(
            400,
            f"truncate_prompt_tokens ({keep}) is more than max_model_len ({st.max_model_len})",
            "truncate_prompt_tokens",
            "invalid_value",
        )
    return keep
