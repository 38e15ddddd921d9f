"""Chat messages -> prompt token ids, through the model's chat template (or --chat-template)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from server.errors import APIError
from server.requests import ChatMessage


def load_template(value: str | None) -> str | None:
    """--chat-template takes a file path or the template text itself; ValueError for neither,
    or for a template Jinja cannot parse (checked at start-up, not at every chat request)."""
    if value is None:
        return None
    try:  # (a template longer than a file name may be: not a file, though is_file raises)
        is_file = Path(value).expanduser().is_file()
    except OSError:
        is_file = False
    if is_file:
        text = Path(value).expanduser().read_text()
    elif "{" not in value:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a template")
    else:
        text = value
    check_template(text)
    return text


def check_template(text: str) -> None:
    """Parse a chat template as transformers will render it (loop controls, and the
    `{% generation %}` blocks of assistant-mask templates); ValueError naming the line."""
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):  # type: ignore[no-untyped-def]
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        extensions=[jinja2.ext.loopcontrols, Generation]
    )
    try:
        env.parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: not a valid template (line {e.lineno}: {e.message})")


def _content(message: ChatMessage, index: int) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type != "text":
            raise APIError(
                400,
                f"messages[{index}]: content part of type {part.type!r} is not supported; "
                "this model takes text only",
                f"messages[{index}].content[{j}].type",
            )
        if part.text is None:
            raise APIError(
                400,
                f"messages[{index}].content[{j}]: a text part needs its text",
                f"messages[{index}].content[{j}].text",
            )
        texts.append(part.text)
    return "\n".join(texts)


def _tool_calls(calls: list[dict[str, Any]], index: int) -> list[dict[str, Any]]:
    """Clients send `function.arguments` as a JSON string; Hugging Face templates expect an
    object (they write it back with `tojson`): parse it, as vLLM does, so the model sees the
    text it was trained on."""
    out = []
    for call in calls:
        fn = call.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                args = json.loads(fn["arguments"]) if fn["arguments"].strip() else {}
            except ValueError:
                raise APIError(
                    400,
                    f"messages[{index}].tool_calls: function.arguments is not valid JSON",
                    f"messages[{index}].tool_calls",
                ) from None
            call = {**call, "function": {**fn, "arguments": args}}
        out.append(call)
    return out


def to_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    out = []
    for i, m in enumerate(messages):
        d: dict[str, Any] = {"role": m.role, "content": _content(m, i)}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls is not None:
            d["tool_calls"] = _tool_calls(m.tool_calls, i)
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if reasoning is not None:
            d["reasoning_content"] = reasoning  # the name Qwen3's and DeepSeek's templates read
        out.append(d)
    return out


def echo_text(req: Any) -> str:
    """What chat's `echo` puts before the reply, as vLLM does: the last message's content when
    its role is the reply's (the assistant's with a generation prompt, else the last message's
    own, as with continue_final_message); otherwise nothing."""
    if not req.echo:
        return ""
    last = req.messages[-1]
    role = "assistant" if adds_generation_prompt(req) else last.role
    return _content(last, len(req.messages) - 1) if last.role == role else ""


def generation_tail(tokenizer: Any, template: str | None, prompt_text: str, req: Any) -> str:
    """Where a reasoning parser looks for a think block the prompt opened or closed: what the
    template wrote after the conversation (its generation prompt: the prompt less the same
    conversation rendered without one), or the continued last message's own text. A marker a
    user wrote inside a message opens nothing. The whole prompt where the two renderings do not
    line up."""
    if req.continue_final_message:
        index = len(req.messages) - 1
        return _content(req.messages[index], index)
    if not adds_generation_prompt(req):
        return ""
    bare = render_text(
        tokenizer,
        template,
        req.messages,
        False,
        False,
        template_kwargs(req),
        req.tools,
        getattr(req, "documents", None),
    )
    return prompt_text[len(bare) :] if prompt_text.startswith(bare) else prompt_text


def adds_generation_prompt(req: Any) -> bool:
    """add_generation_prompt as sent, else (unset) true unless continue_final_message: as vLLM,
    which refuses the two only when both are sent true (render_text)."""
    if req.add_generation_prompt is None:
        return not req.continue_final_message
    return req.add_generation_prompt


def template_kwargs(req: Any) -> dict[str, Any] | None:
    """chat_template_kwargs, with the request's reasoning_effort as the template variable of
    that name (gpt-oss's template reads it; vLLM passes it so), unless the kwargs set it."""
    effort = getattr(req, "reasoning_effort", None)
    if effort is None:
        return req.chat_template_kwargs
    return {"reasoning_effort": effort, **(req.chat_template_kwargs or {})}


def template_for(st: Any, req: Any) -> str | None:
    """The template a chat or tokenize request renders with: its own `chat_template` (vLLM's,
    under --trust-request-chat-template only, as vLLM; checked as the flag's), else the
    server's (None: the tokenizer's)."""
    given = getattr(req, "chat_template", None)
    if given is None:
        return st.chat_template
    if not st.options.trust_request_chat_template:
        raise APIError(
            400,
            "chat_template in a request needs the server started with "
            "--trust-request-chat-template (vLLM refuses an untrusted template too)",
            "chat_template",
        )
    try:
        check_template(given)
    except ValueError as e:
        raise APIError(400, str(e).replace("--chat-template", "chat_template"), "chat_template")
    return given


def request_text(tokenizer: Any, template: str | None, req: Any) -> str:
    """A chat or tokenize request's messages -> the prompt text, with its template options."""
    return render_text(
        tokenizer,
        template,
        req.messages,
        adds_generation_prompt(req),
        req.continue_final_message,
        template_kwargs(req),
        req.tools,
        getattr(req, "documents", None),
    )


def render_text(
    tokenizer: Any,
    template: str | None,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
) -> str:
    """Messages -> the prompt text, through the chat template (`documents`: vLLM's, given to
    it as transformers gives them, for retrieval templates)."""
    template = template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise APIError(
            400,
            "This model has no chat template; use /v1/completions or start the server "
            "with --chat-template",
            "messages",
            "no_chat_template",
        )
    if continue_final_message and add_generation_prompt:
        raise APIError(
            400,
            "continue_final_message and add_generation_prompt cannot both be true",
            "continue_final_message",
        )
    kwargs = dict(template_kwargs or {})
    for reserved in ("conversation", "messages", "chat_template", "tokenize", "tools", "documents"):
        if reserved in kwargs:
            raise APIError(
                400, f"chat_template_kwargs may not set {reserved!r}", "chat_template_kwargs"
            )
    try:
        text = tokenizer.apply_chat_template(
            to_dicts(messages),
            chat_template=template,
            tokenize=False,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **kwargs,
        )
    except APIError:
        raise
    except Exception as e:  # noqa: BLE001 - template errors (raise_exception, bad roles) are the client's
        raise APIError(
            400, f"The chat template could not render these messages: {e}", "messages"
        ) from e
    return text
