"""Strict tools under tool_choice auto (OpenAI's `strict: true`): the reply may still be text,
but a call the model opens is held to the tool's parameters by a grammar; beside a response
format the text is that format's answer. The tiny Qwen3 here has `<tool_call>` as one token (as
Qwen's vocabulary does), so a logit bias can make the untrained model open a call at once."""

from __future__ import annotations

import copy
import json

import httpx
import jsonschema
import pytest

from server.responses.items import chat_tools
from server.tool_parsers import PARSERS
from server.tool_parsers.grammar import strict_only
from tests.conftest import LiveServer, tiny_config
from tests.test_structured import close_bias, no_whitespace_bias
from tests.test_tools import BOUNDED, CHATML_TOOLS, NO_THINKING, SET, USER

STRICT = [{**t, "function": {**t["function"], "strict": True}} for t in BOUNDED]
ANSWER = {  # a response format the random model can finish
    "type": "object",
    "properties": {"mood": {"enum": ["calm", "wild"]}},
    "required": ["mood"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(model_dir):
    config = tiny_config(
        model_dir, max_model_len=2048, num_kv_blocks=512, chat_template=CHATML_TOOLS
    )
    config.model = str(model_dir("qwen3", added_tokens=("<tool_call>", "</tool_call>")))
    s = LiveServer(config, reasoning_parser="qwen3").start()
    yield s
    s.stop()


def chat(server, **body) -> httpx.Response:
    body = {"messages": USER, "max_tokens": 300, **NO_THINKING, **body}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)


def opening(server) -> dict[str, float]:
    """The bias that makes the model open a call with its first token, and end its strings."""
    tok = server.state.tokenizer
    call = tok.convert_tokens_to_ids("<tool_call>")
    return {str(call): 30.0} | close_bias(tok) | no_whitespace_bias(tok)


@pytest.mark.parametrize("response_format", [False, True])
def test_strict_calls_under_auto_hold_to_their_parameters(server, response_format):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in STRICT}
    body = {
        "tools": STRICT,
        "temperature": 1.0,
        "n": 4,
        "parallel_tool_calls": False,
        "logit_bias": opening(server),
    }
    if response_format:
        body["response_format"] = {"type": "json_schema", "json_schema": {"schema": ANSWER}}
    seen = 0
    for seed in range(4):
        r = chat(server, **body, seed=seed)
        assert r.status_code == 200, r.text
        for c in r.json()["choices"]:
            calls = c["message"]["tool_calls"]
            assert c["finish_reason"] == "tool_calls" and len(calls) == 1, c
            args = json.loads(calls[0]["function"]["arguments"])
            jsonschema.validate(args, schemas[calls[0]["function"]["name"]])
            seen += 1
    assert seen == 16
    # Unenforced (strict unsaid), the same bias gives no call: the model repeats the marker.
    r = chat(server, **body | {"tools": BOUNDED, "max_tokens": 24}, seed=0)
    assert all(not c["message"]["tool_calls"] for c in r.json()["choices"]), r.text


def no_marker(tok) -> dict[str, float]:
    """A bias against every token that could begin the call marker."""
    return {str(i): -100.0 for piece, i in tok.get_vocab().items() if piece.startswith("<")}


def whole_characters(server) -> dict[str, float]:
    """A bias against the tokens that are no whole UTF-8 text alone (byte pieces): a grammar's
    text is whole characters, which a trained model writes anyway and this one need not."""
    from core.structured import byte_level_alphabet

    tok = server.state.tokenizer
    byte_of = {c: b for b, c in byte_level_alphabet().items()}
    out = {}
    for piece, i in tok.get_vocab().items():
        try:
            bytes(byte_of[c] for c in piece).decode("utf-8")
        except (KeyError, UnicodeDecodeError):
            out[str(i)] = -100.0
    return out


def test_text_stays_free_beside_strict_tools(server):
    """Without the bias the reply is text: greedy, the very text the model writes unconstrained
    (the grammar refuses only the call marker: kept from it here, as from byte pieces)."""
    bias = whole_characters(server) | no_marker(server.state.tokenizer)
    kw = {"max_tokens": 24, "temperature": 0.0, "logit_bias": bias}
    # The same prompt (the template writes the tools): their calls not asked for, or enforced.
    free = chat(server, tools=STRICT, tool_choice="none", **kw).json()["choices"][0]
    held = chat(server, tools=STRICT, **kw).json()["choices"][0]
    assert held["message"]["content"] == free["message"]["content"]
    assert held["message"]["content"] and not held["message"]["tool_calls"]


def test_a_response_format_holds_the_text_beside_strict_tools(server):
    """Kept from every token that could open the marker, the model answers, in the format."""
    tok = server.state.tokenizer
    bias = close_bias(tok) | no_whitespace_bias(tok) | no_marker(tok)
    fmt = {"type": "json_schema", "json_schema": {"schema": ANSWER}}
    r = chat(server, tools=STRICT, response_format=fmt, logit_bias=bias, n=4, seed=0)
    for c in r.json()["choices"]:
        assert not c["message"]["tool_calls"] and c["finish_reason"] == "stop", c
        jsonschema.validate(json.loads(c["message"]["content"]), ANSWER)


def test_only_strict_tools_are_enforced(server):
    bad = {"type": "function", "function": {"name": "f", "parameters": SET}}
    r = chat(server, tools=[*STRICT, bad], max_tokens=2)
    assert r.status_code == 200, r.text  # f is not strict: its parameters are not compiled
    strict_bad = {"type": "function", "function": {**bad["function"], "strict": True}}
    r = chat(server, tools=[*STRICT, strict_bad], max_tokens=2)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[2].function.parameters"
    # A broken response format is named by its own field, not as the tools'.
    fmt = {"type": "json_schema", "json_schema": {"schema": {"not": {}}}}
    r = chat(server, tools=STRICT, response_format=fmt, max_tokens=2)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text


def test_the_responses_api_makes_tools_strict_unless_told():
    tools = [
        {"type": "function", "name": "a", "parameters": {"type": "object"}},
        {"type": "function", "name": "b", "strict": None},
        {"type": "function", "name": "c", "strict": False},
    ]
    assert [t["function"]["strict"] for t in chat_tools(tools)] == [True, True, False]


def test_non_strict_tools_take_any_object_and_the_input_is_left_alone():
    tools = copy.deepcopy([*STRICT, *BOUNDED])
    out = strict_only(tools)
    assert tools == copy.deepcopy([*STRICT, *BOUNDED])
    assert [t["function"]["parameters"] for t in out[2:]] == [{"type": "object"}] * 2
    assert out[:2] == STRICT
    # every markup's grammar: text (harmony's: its messages) or calls
    for name, parser in PARSERS.items():
        grammar = parser(tools).auto_grammar(out, True, False)
        assert grammar.startswith("start: msg*" if name == "openai" else "start: TEXT"), name
