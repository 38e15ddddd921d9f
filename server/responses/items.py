"""Responses API items: the request's `input` (a string or a list of items) checked and put in
one stored form, a conversation's items turned into chat messages for the chat template, and
the flat Responses `tools` / `tool_choice` into chat's. Every bad item is a 400 naming it."""

from __future__ import annotations

import json
import uuid
from typing import Any

from server.errors import APIError
from server.requests import ChatMessage

TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
ROLES = ("user", "assistant", "system", "developer")
# Tool types OpenAI hosts and weir does not run.
BUILT_IN = (
    "web_search",
    "web_search_preview",
    "file_search",
    "computer_use_preview",
    "computer_use",
    "code_interpreter",
    "image_generation",
    "mcp",
    "local_shell",
    "shell",
    "apply_patch",
    "custom",
)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param, "invalid_value")


def _text_parts(content: Any, param: str, role: str) -> list[dict[str, Any]]:
    """A message's content (a string or a list of parts) as output_text or input_text parts."""
    kind = "output_text" if role == "assistant" else "input_text"
    if isinstance(content, str):
        parts = [{"type": kind, "text": content}]
    elif isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            where = f"{param}[{j}]"
            if not isinstance(part, dict):
                raise _bad(where, "a content part must be an object")
            ptype = part.get("type")
            if ptype == "refusal" and isinstance(part.get("refusal"), str):
                parts.append({"type": kind, "text": part["refusal"]})
                continue
            if ptype not in TEXT_PARTS:
                raise _bad(
                    f"{where}.type",
                    f"content of type {ptype!r} is not supported; this model takes text only "
                    "(input_text)",
                )
            if not isinstance(part.get("text"), str):
                raise _bad(f"{where}.text", "a text part needs a string `text`")
            parts.append({"type": kind, "text": part["text"]})
    else:
        raise _bad(param, "content must be a string or a list of content parts")
    if kind == "output_text":
        for p in parts:
            p["annotations"] = []
    return parts


def _message(item: dict[str, Any], param: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ROLES:
        raise _bad(f"{param}.role", f"role must be one of {', '.join(ROLES)} (got {role!r})")
    prefix = "msg"
    return {
        "type": "message",
        "id": _id(item, prefix, param),
        "role": role,
        "content": _text_parts(item.get("content"), f"{param}.content", role),
        "status": "completed",
    }


def _id(item: dict[str, Any], prefix: str, param: str) -> str:
    """The item's own id (a string: it names the item in input_items' paging), else a new one."""
    given = item.get("id")
    if given is None or given == "":
        return new_id(prefix)
    if not isinstance(given, str):
        raise _bad(f"{param}.id", f"an item's id must be a string (got {type(given).__name__})")
    return given


def _string(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise _bad(f"{param}.{key}", f"a {item.get('type')} item needs a string `{key}`")
    return value


def _function_call(item: dict[str, Any], param: str) -> dict[str, Any]:
    arguments = item.get("arguments", "")
    if not isinstance(arguments, str):
        raise _bad(f"{param}.arguments", "arguments must be a JSON string")
    try:
        json.loads(arguments or "{}")
    except ValueError:
        raise _bad(f"{param}.arguments", "arguments is not valid JSON") from None
    return {
        "type": "function_call",
        "id": _id(item, "fc", param),
        "call_id": _string(item, "call_id", param),
        "name": _string(item, "name", param),
        "arguments": arguments,
        "status": "completed",
    }


def _function_call_output(item: dict[str, Any], param: str) -> dict[str, Any]:
    output = item.get("output")
    if isinstance(output, list):
        output = "".join(p["text"] for p in _text_parts(output, f"{param}.output", "tool"))
    if not isinstance(output, str):
        raise _bad(f"{param}.output", "output must be a string or a list of text parts")
    return {
        "type": "function_call_output",
        "id": _id(item, "fco", param),
        "call_id": _string(item, "call_id", param),
        "output": output,
        "status": "completed",
    }


def _reasoning(item: dict[str, Any], param: str) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "reasoning", "id": _id(item, "rs", param)}
    for key, kind in (("summary", "summary_text"), ("content", "reasoning_text")):
        parts = item.get(key) or []
        if not isinstance(parts, list):
            raise _bad(f"{param}.{key}", f"{key} must be a list of {kind} parts")
        texts = []
        for j, part in enumerate(parts):
            if not isinstance(part, dict) or not isinstance(part.get("text"), str):
                raise _bad(f"{param}.{key}[{j}]", f"a {kind} part needs a string `text`")
            texts.append({"type": kind, "text": part["text"]})
        out[key] = texts
    return out


KINDS = {
    "message": _message,
    "function_call": _function_call,
    "function_call_output": _function_call_output,
    "reasoning": _reasoning,
}


def input_items(value: str | list[Any] | None) -> list[dict[str, Any]]:
    """The request's `input` in its stored form: every item typed, with an id."""
    if value is None:
        return []
    if isinstance(value, str):
        return [_message({"role": "user", "content": value}, "input")]
    items = []
    for i, item in enumerate(value):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(param, "an input item must be an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind not in KINDS:
            raise _bad(
                f"{param}.type",
                f"item type {kind!r} is not supported; weir takes "
                + ", ".join(KINDS)
                + (" (item_reference: continue with previous_response_id)" if kind else ""),
            )
        items.append(KINDS[kind](item, param))
    return items


def _joined(parts: list[dict[str, Any]]) -> str:
    return "\n".join(p["text"] for p in parts)


def to_messages(items: list[dict[str, Any]], instructions: str | None) -> list[ChatMessage]:
    """A conversation's items as chat messages: calls join the assistant turn they belong to,
    reasoning goes with the assistant turn after it, call outputs are tool messages."""
    messages = [ChatMessage("system", instructions)] if instructions else []
    names: dict[str, str] = {}
    reasoning: str | None = None
    assistant: ChatMessage | None = None  # the assistant turn calls may still join
    for item in items:
        kind = item["type"]
        if kind == "reasoning":
            reasoning = _joined(item["content"]) or _joined(item["summary"])
            continue
        if kind == "message" and item["role"] != "assistant":
            messages.append(ChatMessage(item["role"], _joined(item["content"])))
            assistant = None
        elif kind == "function_call_output":
            name = names.get(item["call_id"])
            messages.append(
                ChatMessage("tool", item["output"], name=name, tool_call_id=item["call_id"])
            )
            assistant = None
        else:  # an assistant message or a call
            if assistant is None or (kind == "message" and assistant.tool_calls):
                assistant = ChatMessage("assistant", "")
                messages.append(assistant)
            if reasoning is not None:
                assistant.reasoning_content, reasoning = reasoning, None
            if kind == "message":
                assistant.content = (assistant.content or "") + _joined(item["content"])
            else:
                names[item["call_id"]] = item["name"]
                call = {
                    "id": item["call_id"],
                    "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]},
                }
                assistant.tool_calls = (assistant.tool_calls or []) + [call]
    return messages


def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Responses function tools ({type, name, description, parameters, strict}) as chat's."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            offered = (
                "it is a built-in OpenAI tool that weir does not offer; "
                if (isinstance(kind, str) and kind.split("_20")[0] in BUILT_IN)
                else ""
            )
            raise _bad(
                f"{param}.type",
                f"tool type {kind!r} is not offered: {offered}weir serves function tools "
                "(type function) only",
            )
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise _bad(f"{param}.name", "a function tool needs a name")
        # strict: the Responses API's default is true (chat's is false): the calls that
        # tool_choice auto lets the model write are held to the parameters (server/tools.py).
        fn = {"name": name, "strict": tool.get("strict") is not False}
        for key in ("description", "parameters"):
            if tool.get(key) is not None:
                fn[key] = tool[key]
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise _bad(f"{param}.parameters", "parameters must be a JSON schema object")
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise _bad("tool_choice", "tool_choice must be none, auto, required or a function")
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise _bad(
            "tool_choice",
            f"tool_choice of type {choice.get('type')!r} is not offered; name a function as "
            '{"type": "function", "name": ...}',
        )
    return {"type": "function", "function": {"name": choice["name"]}}
