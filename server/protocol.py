"""The OpenAI response bodies as msgspec Structs (and the error object): responses are encoded
from these, and /openapi.json is generated from them. The requests are server/requests.py's."""

from __future__ import annotations

import msgspec


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class CompletionTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    # With a reasoning parser: how many of the completion tokens were reasoning.
    completion_tokens_details: CompletionTokensDetails | msgspec.UnsetType = msgspec.UNSET


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[TokenLogprob]


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(msgspec.Struct):
    logprob: float
    decoded_token: str


# Per prompt position: None for the first token, else token id (as a string) -> its log-prob.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # JSON text


class ToolCallOut(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class DeltaFunction(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    index: int
    function: DeltaFunction
    id: str | None = None
    type: str | None = None


class ResponseMessage(msgspec.Struct):
    role: str
    content: str | None
    # With a reasoning parser: the think text, under vLLM's name and DeepSeek's (which many
    # clients still read); absent otherwise.
    reasoning: str | None | msgspec.UnsetType = msgspec.UNSET
    reasoning_content: str | None | msgspec.UnsetType = msgspec.UNSET
    tool_calls: list[ToolCallOut] | msgspec.UnsetType = msgspec.UNSET


class ChatChoice(msgspec.Struct):
    index: int
    message: ResponseMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or token id that ended it
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET  # vLLM's return_token_ids


class ChatCompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET  # return_token_ids


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET  # the chunk's (return_token_ids)


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    object: str = "chat.completion.chunk"
    usage: Usage | None = None
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET  # on each role chunk


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: PromptLogprobs | None = None
    stop_reason: str | int | None = None
    # vLLM's return_token_ids: the prompt's (a stream's first chunk) and the choice's tokens
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET


class CompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    usage: Usage | None = None


class TokenizeResponse(msgspec.Struct):
    """vLLM's keys: `token_strs` is always present, null unless asked for."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class VersionResponse(msgspec.Struct):
    version: str


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str = "weir"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model, as vLLM lists it
    max_model_len: int | None = None
    object: str = "model"


class LoadLoRAAdapterRequest(msgspec.Struct):
    """vLLM's body of /v1/load_lora_adapter (and, with lora_name alone, of unload)."""

    lora_name: str
    lora_path: str | None = None
    base_model_name: str | None = None


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo
