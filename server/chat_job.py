"""A chat request made ready for the engine: its prompt rendered through the chat template, the
reply's parsers (reasoning, tool calls), its constraint and sampling parameters. Chat
completions and the Responses API (which builds a chat request from its items) share it."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from core.sampling import SamplingParams
from core.structured import Constraint
from server import chat, reasoning, structured, tools
from server.errors import APIError
from server.params import sampling_params, truncate_prompt
from server.requests import ChatCompletionRequest
from server.reasoning import ThinkParser
from server.reply import Reply
from server.state import ServerState
from server.usage import UsageCounter
from server.tool_parsers import ToolParser
from server.tool_parsers.grammar import literal


@dataclass
class ChatJob:
    prompt_text: str  # where a reasoning parser looks for an opened think block (chat.py tail)
    prompt: list[int]
    thinker: type[ThinkParser] | None
    call_parser: ToolParser | None
    params: SamplingParams
    request: ChatCompletionRequest
    named_call: bool = False  # tool_choice named a function (its finish_reason: server/reply.py)

    def reply(self) -> Reply:
        return Reply(self.thinker, self.prompt_text, self.call_parser, self.named_call)

    def reasoning_tokens(
        self,
        st: ServerState,
        reply: Reply,
        usage: UsageCounter,
        index: int,
        text: str | None = None,
    ) -> int:
        """Generated tokens that wrote the reasoning, its markers included: counted among the
        output's tokens, not re-encoded (a re-encoding could exceed the output)."""
        skip = self.params.skip_special_tokens

        def decode(ids: list[int]) -> str:
            return st.tokenizer.decode(ids, skip_special_tokens=skip)

        return usage.tokens_writing(index, len(reply.reasoning_text(text)), decode)


async def prepare_chat(
    st: ServerState, req: ChatCompletionRequest, given: tuple[Constraint, str] | None = None
) -> ChatJob:
    """`given`: a constraint the caller read from its own fields, with the field's name."""
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs to be true", "top_logprobs")
    template = chat.template_for(st, req)  # the request's own, or the server's
    prompt_text = chat.request_text(st.tokenizer, template, req)
    # The template already wrote any BOS it wants; don't let the tokenizer add another.
    prompt = truncate_prompt(st, req, st.tokenizer.encode(prompt_text, add_special_tokens=False))
    thinker = reasoning.PARSERS[st.reasoning_parser] if st.reasoning_parser else None
    call_parser, call_constraint, auto_calls = tools.tool_parser(st, req)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    think, marks = "", None
    tail = prompt_text
    if thinker is not None:  # constraints hold once the reasoning has ended, as in vLLM
        tail = chat.generation_tail(st.tokenizer, template, prompt_text, req)
        reader = thinker(tail)
        think = "open" if reader.in_reasoning else "" if reader.thinking_off else "optional"
        marks = (literal(thinker.start, st.special_ids), literal(thinker.end, st.special_ids))
    try:
        constraint = await structured.request_constraint(
            st, req, call_constraint, think, given, auto_calls, marks
        )
    except APIError as e:
        if e.param != "tools":
            raise
        await tools.name_bad_parameters(st, req)  # raises the tool's own 400
        raise
    params = sampling_params(
        st, req, req.max_completion_tokens or req.max_tokens, len(prompt), logprobs, constraint
    )
    special_calls = call_parser is not None and not st.special_ids.keys().isdisjoint(
        call_parser.markers
    )
    if (getattr(thinker, "special_tokens", False) or special_calls) and params.skip_special_tokens:
        # harmony's markup is special tokens, and a tool parser's may be (Mistral's
        # [TOOL_CALLS]): the reply is read with them, else the calls would be lost in the
        # content (vLLM keeps them for its mistral parser so); the parsers take their markup
        # out of the content
        params = msgspec.structs.replace(params, skip_special_tokens=False)
    named = isinstance(req.tool_choice, dict)
    return ChatJob(tail, prompt, thinker, call_parser, params, req, named)
