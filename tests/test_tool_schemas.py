"""Tool parameters as clients send them: Pydantic models with nested models (`$defs`), draft-07
`definitions`, chained and recursive `$ref`s, `anyOf` with null. instructor's TOOLS mode and
pydantic-ai's structured output force such a call (`tool_choice` required or named); each form
is enforced in chat completions and the Responses API, and the call grammar is checked token by
token against calls written by hand."""

from __future__ import annotations

import json
from typing import Optional

import jsonschema
import pytest
from pydantic import BaseModel, Field

from core.structured import Constraint
from server.tool_parsers.command import CommandParser
from server.tool_parsers.granite import GraniteParser
from server.tool_parsers.hermes import HermesParser
from server.tool_parsers.hunyuan import HunyuanParser
from server.tool_parsers.internlm import InternLMParser
from server.tool_parsers.llama3_json import Llama3JsonParser
from server.tool_parsers.mistral import MistralParser
from server.tool_parsers.phi4_mini import Phi4MiniJsonParser
from server.tool_parsers.pythonic import PythonicParser
from server.tool_parsers.qwen3_coder import Qwen3CoderParser
from tests.conftest import GrammarProbe, tools_server
from tests.test_structured import close_bias, no_whitespace_bias
from tests.test_tools import NO_THINKING, USER


class Item(BaseModel):
    sku: str = Field(max_length=6)
    qty: int = Field(ge=1, le=99)


class Order(BaseModel):  # nested: {"$defs": {"Item": ...}, ... {"$ref": "#/$defs/Item"}}
    id: int = Field(ge=0, le=999)
    items: list[Item] = Field(max_length=2)
    note: Optional[str] = Field(default=None, max_length=8)  # anyOf string | null  # noqa: UP045


class Tree(BaseModel):  # recursive: {"$defs": {"Tree": ...}, "$ref": "#/$defs/Tree"}
    name: str = Field(max_length=6)
    children: list[Tree] = Field(max_length=2)


DRAFT7 = {  # draft-07 "definitions", a chain of references (point -> coord -> number)
    "type": "object",
    "definitions": {
        "coord": {"$ref": "#/definitions/number"},
        "number": {"type": "integer", "minimum": -9, "maximum": 9},
        "point": {
            "type": "object",
            "properties": {"x": {"$ref": "#/definitions/coord"},
                           "y": {"$ref": "#/definitions/coord"}},
            "required": ["x", "y"],
        },
    },
    "properties": {"at": {"$ref": "#/definitions/point"}},
    "required": ["at"],
}  # fmt: skip

SCHEMAS = {
    "make_order": Order.model_json_schema(),
    "grow_tree": Tree.model_json_schema(),
    "place": DRAFT7,
}
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": schema}}
    for name, schema in SCHEMAS.items()
]
VALID = {
    "make_order": {"id": 7, "items": [{"sku": "ab", "qty": 2}], "note": None},
    "grow_tree": {"name": "a", "children": [{"name": "b", "children": []}]},
    "place": {"at": {"x": 1, "y": -2}},
}
INVALID = {  # each breaks a referenced definition, not the top level
    "make_order": {"id": 7, "items": [{"sku": "ab", "qty": 0}], "note": None},
    "grow_tree": {"name": "a", "children": [{"name": "b", "children": [{"name": 3}]}]},
    "place": {"at": {"x": 1, "y": 20}},
}


def test_the_examples_are_what_they_say():
    for name, schema in SCHEMAS.items():
        jsonschema.validate(VALID[name], schema)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(INVALID[name], schema)
    assert "$defs" in SCHEMAS["make_order"] and "$ref" in SCHEMAS["grow_tree"]


# ---------------------------------------------------------------- the grammar, token by token
@pytest.fixture(scope="module")
def grammars(model_dir):
    return GrammarProbe(model_dir)


def accepts(grammars, lark: str, text: str) -> bool:
    return grammars.accepts(Constraint("grammar", lark), text)


MARKUP = {  # each parser's call markup for one call
    HermesParser: lambda name, args: (
        "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"
    ),
    MistralParser: lambda name, args: (
        "[TOOL_CALLS]" + json.dumps([{"name": name, "arguments": args}])
    ),
    Phi4MiniJsonParser: lambda name, args: (
        "functools" + json.dumps([{"name": name, "arguments": args}])
    ),
    GraniteParser: lambda name, args: (
        "<|tool_call|>" + json.dumps([{"name": name, "arguments": args}])
    ),
    CommandParser: lambda name, args: (
        "<|START_ACTION|>"
        + json.dumps([{"tool_call_id": "0", "tool_name": name, "parameters": args}])
        + "<|END_ACTION|>"
    ),
    HunyuanParser: lambda name, args: (
        "<tool_calls>" + json.dumps([{"name": name, "arguments": args}]) + "</tool_calls>"
    ),
    InternLMParser: lambda name, args: (
        "<|action_start|><|plugin|>\n"
        + json.dumps({"name": name, "parameters": args})
        + "<|action_end|>"
    ),
    Llama3JsonParser: lambda name, args: json.dumps({"name": name, "parameters": args}),
    Qwen3CoderParser: lambda name, args: (
        f"<tool_call>\n<function={name}>\n"
        + "".join(
            f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
            for k, v in args.items()
        )
        + "</function>\n</tool_call>"
    ),
    PythonicParser: lambda name, args: (
        f"[{name}(" + ", ".join(f"{k}={json.dumps(v)}" for k, v in args.items()) + ")]"
    ),
}


@pytest.mark.parametrize("parser", list(MARKUP), ids=lambda p: p.name)
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_the_call_grammar_follows_the_references(grammars, parser, name):
    lark = parser().call_grammar(TOOLS, parallel=False)
    write = MARKUP[parser]
    assert accepts(grammars, lark, write(name, VALID[name]))
    assert not accepts(grammars, lark, write(name, INVALID[name]))
    # objects that list properties are closed: no key the schema does not name
    extra = {**VALID[name], "extra": 1}
    assert not accepts(grammars, lark, write(name, extra))


# ---------------------------------------------------------------- through the OpenAI SDK
@pytest.fixture(scope="module")
def server(model_dir):
    s = tools_server(model_dir)
    yield s
    s.stop()


def bias(server) -> dict[str, float]:
    """A random model ends its JSON when closing tokens are favoured and blanks are not."""
    tok = server.state.tokenizer
    return close_bias(tok) | no_whitespace_bias(tok)


@pytest.mark.parametrize("choice", ["required", "named"])
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_chat_completions_enforce_each_form(client, server, name, choice):
    tool_choice = "required" if choice == "required" else {
        "type": "function", "function": {"name": name}
    }  # fmt: skip
    tools = TOOLS if choice == "required" else [t for t in TOOLS if t["function"]["name"] == name]
    r = client.chat.completions.create(
        model="tiny",
        messages=USER,
        tools=tools,
        tool_choice=tool_choice,
        max_tokens=400,
        temperature=1.0,
        seed=1,
        n=2,
        logit_bias=bias(server),
        extra_body=NO_THINKING,
    )
    for c in r.choices:
        # OpenAI's (and vLLM's) finish_reason: "stop" for the call the request named
        assert c.finish_reason == ("stop" if choice == "named" else "tool_calls"), c
        for call in c.message.tool_calls:
            if choice == "named":
                assert call.function.name == name
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("choice", ["required", "named"])
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_the_responses_api_enforces_each_form(client, server, name, choice):
    tools = [
        {"type": "function", "name": n, "parameters": s}
        for n, s in SCHEMAS.items()
        if choice == "required" or n == name
    ]
    tool_choice = "required" if choice == "required" else {"type": "function", "name": name}
    r = client.responses.create(
        model="tiny",
        input="Call one.",
        tools=tools,
        tool_choice=tool_choice,
        max_output_tokens=400,
        temperature=1.0,
        reasoning={"effort": "none"},
        extra_body={"logit_bias": bias(server), "seed": 2},
    )
    calls = [item for item in r.output if item.type == "function_call"]
    assert r.status == "completed" and calls, r.output
    for call in calls:
        if choice == "named":
            assert call.name == name
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


# ---------------------------------------------------------------- Qwen3-Coder's own markup
SEARCH = {  # a text parameter, an enum of strings, an optional integer
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "scope": {"enum": ["code", "docs"]},
                "limit": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["query", "scope"],
        },
    },
}


def xml(name: str, *params: tuple[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_qwen3_coders_grammar_holds_its_xml_calls(grammars):
    """Qwen3-Coder's calls as its template writes them: any text for a string (over lines, with
    tags in it), one of an enum's literals, JSON for the rest; the schema's order, required
    parameters present, optional ones left out or not; with parallel calls, one a line. Under
    auto with strict tools, free text, or text then calls."""
    parser = Qwen3CoderParser([SEARCH])
    one = parser.call_grammar([SEARCH], parallel=False)
    a = xml("search", ("query", "a <b>\nc</parameter d"), ("scope", "code"))
    b = xml("search", ("query", "x"), ("scope", "docs"), ("limit", "3"))
    assert accepts(grammars, one, a) and accepts(grammars, one, b)
    for bad in (
        xml("search", ("query", "x"), ("scope", "web")),  # not in the enum
        xml("search", ("query", "x"), ("scope", "docs"), ("limit", "12")),  # past the maximum
        xml("search", ("scope", "docs"), ("query", "x")),  # out of order
        xml("search", ("query", "x")),  # a required parameter missing
        xml("search", ("query", "x"), ("scope", "docs"), ("extra", "1")),
        xml("find", ("query", "x"), ("scope", "docs")),  # no such tool
        a + "\n" + b,  # a second call, not parallel
    ):
        assert not accepts(grammars, one, bad), bad
    assert accepts(grammars, parser.call_grammar([SEARCH], parallel=True), a + "\n" + b)
    auto = parser.auto_grammar([SEARCH], parallel=True, answer=False)
    assert accepts(grammars, auto, "no call here")
    assert accepts(grammars, auto, "Let me look.\n" + a + "\n" + b)
    assert not accepts(grammars, auto, "Let me look.\n" + xml("search", ("query", "x")))
    # what it wrote parses back typed by the schema (a nullable text's `null`: None)
    nullable = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": ["string", "null"]}}}}}  # fmt: skip
    got = Qwen3CoderParser([SEARCH, nullable]).parse(b + xml("f", ("n", "null")), final=True)
    assert [c.arguments for c in got.calls] == [
        {"query": "x", "scope": "docs", "limit": 3},
        {"n": None},
    ]


def test_a_qwen3_coder_server_enforces_calls_in_its_own_markup(model_dir):
    """tool_choice named with --tool-call-parser qwen3_coder: the model writes Qwen3-Coder's
    XML (its grammar), parsed back into a call whose arguments validate against the tool."""
    import openai

    s = tools_server(model_dir, tool_call_parser="qwen3_coder")
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x")
        r = client.chat.completions.create(
            model="tiny",
            messages=USER,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "place"}},
            max_tokens=300,
            temperature=1.0,
            seed=3,
            n=2,
            logit_bias=bias(s),
            logprobs=True,
            extra_body=NO_THINKING,
        )
        for c in r.choices:
            assert c.finish_reason == "stop" and len(c.message.tool_calls) == 1, c
            written = "".join(t.token for t in c.logprobs.content)
            assert written.startswith("<tool_call>\n<function=place>\n<parameter=at>\n"), written
            call = c.message.tool_calls[0]
            assert call.function.name == "place"
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["place"])
    finally:
        s.stop()


# ---------------------------------------------------------------- Llama's pythonic calls
def test_pythonic_grammar_holds_its_lists_of_calls(grammars):
    """Pythonic calls as Llama 3.2 and 4 write them: keyword arguments in the schema's order,
    ", " between those written (an optional one left out), JSON values (whose true, false and
    null read as Python's); parallel calls in one list."""
    parser = PythonicParser([SEARCH])
    one = parser.call_grammar([SEARCH], parallel=False)
    a = '[search(query="a \\"b\\"", scope="code")]'
    b = '[search(query="x", scope="docs", limit=3)]'
    assert accepts(grammars, one, a) and accepts(grammars, one, b)
    for bad in (
        '[search(query="x", scope="web")]',  # not in the enum
        '[search(query="x", limit=3)]',  # a required parameter missing
        '[search(scope="docs", query="x")]',  # out of order
        '[search(query="x", scope="docs", extra=1)]',
        '[search(query="x",scope="docs")]',  # ", " between arguments
        '[search(query="x", scope="docs"), search(query="y", scope="code")]',  # not parallel
    ):
        assert not accepts(grammars, one, bad), bad
    two = a[:-1] + ", " + b[1:]
    assert accepts(grammars, parser.call_grammar([SEARCH], parallel=True), two)
    auto = parser.auto_grammar([SEARCH], parallel=True, answer=False)
    assert accepts(grammars, auto, "No call: [just text]") and accepts(grammars, auto, two)
    assert not accepts(grammars, auto, '[search(query="x")]')
    flags = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"on": {"type": "boolean"}, "at": {"type": "null"}},
        "required": ["on", "at"]}}}  # fmt: skip
    calls = PythonicParser().parse("[f(on=true, at=null), f(on=False, at=None)]", final=True)
    assert [c.arguments for c in calls.calls] == [{"on": v, "at": None} for v in (True, False)]
    assert accepts(grammars, parser.call_grammar([flags], parallel=False), "[f(on=true, at=null)]")
