"""The Responses API's wire format (OpenAI's `openai/types/responses/` are the contract): the
create request, the response object and its output items, and the streamed events. Items are
kept as plain dicts in the store and on the wire (their many shapes are checked in items.py)."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from server.requests import PositiveInt, SamplingFields

# OpenAI's bounds: 16 pairs, keys up to 64 characters, values up to 512.
MetadataMap = Annotated[
    dict[Annotated[str, Meta(max_length=64)], Annotated[str, Meta(max_length=512)]],
    Meta(max_length=16),
]


class ResponsesRequest(SamplingFields, kw_only=True):
    """POST /v1/responses. vLLM's sampling extensions (top_k, seed, structured_outputs, ...)
    are accepted as on chat; `n` must stay 1 (one output per response)."""

    input: str | list[Any] | None = None
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    max_output_tokens: PositiveInt | None = None
    max_tool_calls: Annotated[int, Meta(ge=1)] | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = True
    previous_response_id: str | None = None
    background: bool = False
    prompt_cache_key: str | None = None
    metadata: MetadataMap | None = None
    include: list[str] | None = None  # "message.output_text.logprobs" is the one read
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    truncation: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(msgspec.Struct):
    code: str
    message: str


class IncompleteDetails(msgspec.Struct):
    reason: str


class ResponseObject(msgspec.Struct, kw_only=True):
    """The `response` object; `output_text` is the SDK's property over `output`."""

    id: str
    object: str = "response"
    created_at: int
    status: str  # queued | in_progress | completed | incomplete | failed | cancelled
    background: bool = False
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    model: str
    output: list[dict[str, Any]] = msgspec.field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    prompt_cache_key: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = msgspec.field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[Any] = msgspec.field(default_factory=list)
    top_p: float | None = None
    top_logprobs: int | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    completed_at: int | None = None


class ResponseDeleted(msgspec.Struct):
    id: str
    object: str = "response"
    deleted: bool = True


class ItemList(msgspec.Struct):
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: str = "list"


TERMINAL = ("completed", "incomplete", "failed", "cancelled")
