"""A chat request's `tools` and `tool_choice`: checked (a 400 naming the field), and turned into
what the reply does with the model's output: `none` (text only), `auto` (the model's own call
markup parsed into `tool_calls` by the server's tool-call parser; with a `strict` tool, its
calls enforced by a grammar that still lets the reply be text), or `required` / a named
function (the same, with the markup enforced by a structured-output grammar)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from core.structured import Constraint
from server import structured
from server.errors import APIError
from server.requests import ChatCompletionRequest
from server.state import ServerState
from server.tool_parsers import PARSERS, Parsed, ToolParser
from server.tool_parsers.grammar import strict_only


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param, "invalid_value")


def tool_names(tools: list[dict[str, Any]]) -> list[str]:
    names = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise _bad(f"tools[{i}].type", f"tools[{i}]: only type function is offered")
        fn = tool.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise _bad(f"tools[{i}].function.name", f"tools[{i}]: a function needs a name")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise _bad(
                f"tools[{i}].function.parameters",
                f"tools[{i}]: parameters must be a JSON schema object",
            )
        names.append(name)
    return names


class FirstCall(ToolParser):
    """parallel_tool_calls false: the first call only (the first `limit`: max_tool_calls)."""

    def __init__(self, inner: ToolParser, limit: int = 1) -> None:
        super().__init__(special=inner.special)
        self.inner = inner
        self.limit = limit
        self.markers = inner.markers  # what the reply is read for (chat_job's special tokens)

    def parse(self, text: str, final: bool = False) -> Parsed:
        parsed = self.inner.parse(text, final)
        parsed.calls = parsed.calls[: self.limit]
        return parsed


# tool_choice auto with strict tools: the reply's grammar, given whether a response format's
# grammar (@answer) is the text beside the calls (ToolParser.auto_grammar; None: this markup
# has none, the calls are parsed but not enforced).
AutoCalls = Callable[[bool], str | None]


def tool_parser(
    st: ServerState, req: ChatCompletionRequest
) -> tuple[ToolParser | None, Constraint | None, AutoCalls | None]:
    """The parser for this request's reply (None: the reply is text only); for tool_choice
    required or a named function, the constraint that makes the model write calls: its own
    call markup (the server's parser's; hermes where the template shows none) holding JSON that
    validates against the chosen tools' parameters; for auto (or no choice) with a tool whose
    `strict` is true, as OpenAI enforces it, the grammar that holds the model's calls to the
    same while the reply may still be text (where the parser's markup has a grammar: hermes,
    mistral, llama3_json)."""
    tools = req.tools or []
    names = tool_names(tools)
    choice = req.tool_choice
    chosen = tools
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type", "function") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            raise _bad("tool_choice", f"tool_choice names {name!r}, which is not among the tools")
        chosen = [tools[names.index(name)]]
        choice = "named"
    elif choice not in (None, "none", "auto", "required"):
        raise _bad("tool_choice", "tool_choice must be none, auto, required or a named function")
    if choice in ("required", "named"):
        if not names:
            raise _bad("tool_choice", f"tool_choice {req.tool_choice!r} needs tools")
        parser = PARSERS[st.tool_parser or "hermes"](tools, st.special_ids)
        parallel = req.parallel_tool_calls and choice == "required"
        grammar = parser.call_grammar(chosen, parallel)
        if grammar is None:  # no grammar for this markup (pythonic, XML): hermes's
            parser = PARSERS["hermes"](tools, st.special_ids)
            grammar = parser.call_grammar(chosen, parallel)
        return (parser if parallel else FirstCall(parser)), Constraint("grammar", grammar), None
    if not names or choice == "none":
        return None, None, None
    if st.tool_parser is None:
        if choice == "auto":
            raise _bad(
                "tool_choice",
                "tool_choice auto needs a tool-call parser: this model's chat template shows "
                "no markup weir knows; start the server with --tool-call-parser NAME "
                f"({', '.join(PARSERS)})",
            )
        return None, None, None  # tools left to the template, the reply returned as text
    parser = PARSERS[st.tool_parser](tools, st.special_ids)
    auto = None
    if any(tool["function"].get("strict") is True for tool in tools):
        auto = partial(parser.auto_grammar, strict_only(tools), req.parallel_tool_calls)
    return (parser if req.parallel_tool_calls else FirstCall(parser)), None, auto


async def name_bad_parameters(st: ServerState, req: ChatCompletionRequest) -> None:
    """For an enforced call's grammar that does not compile: a 400 naming the tool whose
    `parameters` are to blame, with the schema compiler's message alone (not the call
    grammar's text), from checking each chosen tool's schema as response_format's would be.
    Returns when no tool alone fails (nothing to name)."""
    choice = req.tool_choice
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    auto = choice in (None, "auto")  # strict tools' parameters only
    for i, tool in enumerate(req.tools or []):
        fn = tool["function"]
        if fn.get("parameters") is None or named not in (None, fn["name"]):
            continue
        if auto and fn.get("strict") is not True:
            continue
        field = f"tools[{i}].function.parameters"
        schema = structured.schema_text(field, fn["parameters"])
        await structured.check(st, Constraint("json", schema), field)
