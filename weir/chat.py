"""LLM.chat's prompts: each conversation (OpenAI-format messages, as vLLM's LLM.chat takes them)
rendered by the model's chat template exactly as the server renders a /v1/chat/completions
request (server/chat.py: content parts joined, tool-call arguments given to the template as
objects, earlier reasoning as `reasoning_content`), then tokenized without further special
tokens (the template writes its own)."""

from __future__ import annotations

from typing import Any

import msgspec

from core.sampling import InvalidParam


def conversations(messages: list) -> list[list[Any]]:
    """One conversation (a list of messages) or a list of them -> a list of them."""
    if not isinstance(messages, list) or not messages:
        raise InvalidParam("messages", "messages must be a non-empty list of messages")
    if all(isinstance(m, list) for m in messages):
        if not all(messages):
            raise InvalidParam("messages", "every conversation needs at least one message")
        return messages
    return [messages]


def template_of(chat_template: str | None) -> str | None:
    """A chat template given as its text or a file's path (None: the tokenizer's own)."""
    from server.chat import load_template

    try:
        return load_template(chat_template)
    except ValueError as e:
        raise InvalidParam("chat_template", str(e)) from None


def prompt_ids(
    tokenizer: Any,
    template: str | None,
    conversation: list[Any],
    index: int,
    add_generation_prompt: bool,
    continue_final_message: bool,
    tools: list[dict[str, Any]] | None,
    chat_template_kwargs: dict[str, Any] | None,
) -> tuple[str, list[int]]:
    """(the prompt text, its token ids) of one conversation; InvalidParam naming the field (a
    message by its place: messages[i] of conversation `index`) for what cannot be rendered."""
    from server.chat import render_text
    from server.errors import APIError
    from server.requests import ChatMessage

    try:
        parsed = msgspec.convert(conversation, list[ChatMessage])
    except msgspec.ValidationError as e:
        where = str(e).rpartition(" - at `$")[2].rstrip("`")
        raise InvalidParam(
            f"messages{where}" if where != str(e) else "messages",
            f"conversation {index}: {e}",
        ) from None
    try:
        text = render_text(
            tokenizer,
            template,
            parsed,
            add_generation_prompt,
            continue_final_message,
            chat_template_kwargs,
            tools,
        )
    except APIError as e:
        raise InvalidParam(e.param, f"conversation {index}: {e.message}") from None
    return text, tokenizer.encode(text, add_special_tokens=False)
