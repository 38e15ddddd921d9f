"""The OpenAI request bodies as msgspec Structs (chat, completions, tokenize): requests are
decoded and validated by these, and /openapi.json is generated from them. Unknown request fields
are accepted and ignored (clients send their own); a field weir knows it cannot honour is refused
by name."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from core.sampling import MAX_BAD_WORDS, MAX_LOGIT_BIAS

MAX_N = 64  # parallel samples per prompt
MAX_TOKENS_BOUND = 1 << 20

PositiveInt = Annotated[int, Meta(ge=1, le=MAX_TOKENS_BOUND)]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
# The upper bound is the server's --max-logprobs, checked per request (server/params.py); -1
# (vLLM's) asks for as many as the server allows.
LogprobCount = Annotated[int, Meta(ge=-1)]


class StreamOptions(msgspec.Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    # Any role reaches the chat template, as vLLM passes custom roles; the known ones (system,
    # developer, user, assistant, tool) keep their meaning there and in continue_final_message.
    role: Annotated[str, Meta(min_length=1)]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    # An earlier answer's reasoning (vLLM's `reasoning`, or DeepSeek's `reasoning_content`).
    reasoning: str | None = None
    reasoning_content: str | None = None


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str = "response"
    description: str | None = None
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    """OpenAI's response_format: text (no constraint), json_object, or json_schema."""

    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(msgspec.Struct, kw_only=True):
    """vLLM's structured_outputs: exactly one of json, regex, choice, grammar, json_object."""

    json: str | dict[str, Any] | bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Any = None
    whitespace_pattern: str | None = None  # a regex: the whitespace allowed between JSON tokens
    disable_any_whitespace: bool = False
    # None (unsaid): objects that list properties allow no others; false: any further keys.
    disable_additional_properties: bool | None = None
    disable_fallback: bool = False  # weir never falls back to another backend


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by chat and completion requests (OpenAI plus vLLM's extensions). None means
    unset: the model's generation config default applies, else OpenAI's."""

    model: str | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=2.0)] | None = None
    # n, stream, logprobs and echo may be null (OpenAI's spec types them nullable; the SDK sends
    # None as null): null is the default (__post_init__).
    n: Annotated[int, Meta(ge=1, le=MAX_N)] | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    seed: Annotated[int, Meta(ge=-(1 << 63), le=(1 << 63) - 1)] | None = None
    stop: str | Annotated[list[str], Meta(max_length=16)] | None = None
    stop_token_ids: Annotated[list[Annotated[int, Meta(ge=0)]], Meta(max_length=256)] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: Annotated[int, Meta(ge=0, le=MAX_TOKENS_BOUND)] = 0
    logit_bias: (
        Annotated[
            dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]], Meta(max_length=MAX_LOGIT_BIAS)
        ]
        | None
    ) = None
    prompt_logprobs: LogprobCount | None = None
    allowed_token_ids: list[Annotated[int, Meta(ge=0)]] | None = None  # only these may be drawn
    bad_words: Annotated[list[str], Meta(max_length=MAX_BAD_WORDS)] | None = None
    # vLLM's: keep this many prompt tokens (-1: the context less one), the last ones unless
    # truncation_side is "right"
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    user: str | None = None
    priority: int = 0  # lower first; needs --scheduling-policy priority
    cache_salt: str | None = None  # share cached prefixes only with requests of the same salt
    # Log-prob tokens as "token_id:N" (None: the server's --return-tokens-as-token-ids).
    return_tokens_as_token_ids: bool | None = None
    # Structured outputs (server/structured.py): at most one constraint per request.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: str | dict[str, Any] | bool | None = None  # vLLM's older names, still enforced
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    # Beam search (vLLM's use_beam_search): `n` beams inside the engine, `n` choices returned
    # best first; hypotheses scored cumulative log-prob / length ** length_penalty, and
    # early_stopping as transformers': true, false or "never".
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids too
    request_id: str | None = None  # vLLM's: the response's id (after its prefix); X-Request-Id wins
    # vLLM's fields for what weir does not serve, refused by name when set (not ignored): its
    # custom logits processors and their arguments, disaggregated prefill's KV transfer
    logits_processors: list[Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.n is None:
            self.n = 1
        if self.stream is None:
            self.stream = False


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = False
    top_logprobs: LogprobCount | None = None
    add_generation_prompt: bool | None = None  # None: true unless continue_final_message
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: this request's own template (--trust-request-chat-template), and documents the
    # template is given (as `documents`: retrieval templates); multimodal options are refused
    chat_template: str | None = None
    documents: list[dict[str, Any]] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    # OpenAI's, for reasoning models: given to the chat template as `reasoning_effort` (gpt-oss's
    # reads it), as vLLM gives it
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # none, auto, required, or a named function
    parallel_tool_calls: bool = True
    # vLLM's: the reply starts with the last message's content when that message has the
    # reply's role (the assistant's, or the last message's own without a generation prompt).
    echo: bool | None = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self.logprobs = bool(self.logprobs)
        self.echo = bool(self.echo)


class CompletionRequest(SamplingFields, kw_only=True):
    # A string, a list of strings, a list of token ids, or a list of token-id lists.
    prompt: str | list[Any]
    max_tokens: PositiveInt | None = 16
    logprobs: LogprobCount | None = None
    echo: bool | None = False
    # OpenAI's legacy fields weir does not serve, refused by name (not ignored): suffix (text
    # after the insertion point), best_of above 1 (vLLM refuses both as well).
    suffix: str | None = None
    best_of: Annotated[int, Meta(ge=1)] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.echo = bool(self.echo)


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """Either `prompt` (text) or `messages` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool | None = None  # None: true unless continue_final_message
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # as a chat request's
    documents: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[Annotated[int, Meta(ge=0)]]
    model: str | None = None
