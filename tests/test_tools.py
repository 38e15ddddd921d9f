"""Tool calling through the server and the OpenAI SDK: a random model forced (by a one-member
choice constraint) to write hermes markup, read back as tool_calls whole and streamed (n=2),
with reasoning before the calls, the multi-turn round trip, and the 400s for bad tool input."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.conftest import LiveServer, tiny_config, tools_server

# ChatML with Qwen's hermes tool markup (a shortened Qwen2.5 template).
CHATML_TOOLS = (
    "{%- if tools %}<|im_start|>system\nYou may call functions: <tools>"
    "{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\nAnswer with "
    '<tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>\n{% endif %}'
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{%- for tc in m.tool_calls or [] %}<tool_call>\n"
    '{{ {"name": tc.function.name, "arguments": tc.function.arguments} | tojson }}'
    "\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
# The random model is forced (or enforced) from the first token: thinking off in the template.
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}

CALLS = (
    "Checking.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}}'
    "\n</tool_call>\n<tool_call>\n"
    '{"name": "get_time", "arguments": {}}'
    "\n</tool_call>"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
USER = [{"role": "user", "content": "Weather and time in Zürich?"}]
# Parameters weir cannot enforce (pydantic writes uniqueItems for a set).
SET = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}


@pytest.fixture(scope="module")
def server(model_dir):
    s = tools_server(model_dir)
    yield s
    s.stop()


def ask(client, text: str = CALLS, **kw):
    kw.setdefault("tools", TOOLS)
    extra = {"guided_choice": [text], **NO_THINKING} | kw.pop("extra_body", {})
    return client.chat.completions.create(
        model="tiny", messages=kw.pop("messages", USER), max_tokens=200, extra_body=extra, **kw
    )


def test_the_template_selects_the_hermes_parser(server):
    assert server.state.tool_parser == "hermes"


def test_tool_calls_whole_and_streamed(client):
    r = ask(client, n=2, temperature=1.0)
    want = [("get_weather", {"city": "Zürich", "unit": "c"}), ("get_time", {})]
    for choice in r.choices:
        calls = choice.message.tool_calls
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == want
        assert all(c.id.startswith("call_") and c.type == "function" for c in calls)
        assert len({c.id for c in calls}) == 2
        assert choice.message.content == "Checking.\n" and choice.finish_reason == "tool_calls"
    whole_args = [c.function.arguments for c in r.choices[0].message.tool_calls]
    chunks = list(ask(client, n=2, stream=True))
    for i in range(2):
        choices = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        calls: dict[int, list[str]] = {}
        for ch in choices:
            for d in ch.delta.tool_calls or []:
                if d.id:
                    calls[d.index] = [d.id, d.function.name, ""]
                calls[d.index][2] += d.function.arguments or ""
        assert [(name, args) for _, name, args in calls.values()] == list(
            zip(["get_weather", "get_time"], whole_args)
        )
        text = "".join(ch.delta.content or "" for ch in choices)
        assert text == "Checking.\n" and "<tool_call>" not in text
        assert choices[-1].finish_reason == "tool_calls"


def test_one_call_when_not_parallel_and_none_when_told(client):
    r = ask(client, parallel_tool_calls=False)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]
    r = ask(client, tool_choice="none")
    assert r.choices[0].message.content == CALLS and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


def test_reasoning_then_calls(client):
    r = ask(client, "<think>\nneeds a tool\n</think>\n\n" + CALLS)
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == "\nneeds a tool\n"
    assert [c.function.name for c in msg.tool_calls] == ["get_weather", "get_time"]
    assert msg.content == "\n\nChecking.\n"


def test_round_trip(client):
    first = ask(client)
    assistant = first.choices[0].message
    messages = USER + [
        {
            "role": "assistant",
            "content": assistant.content,
            "tool_calls": [c.model_dump() for c in assistant.tool_calls],
        },
        {"role": "tool", "tool_call_id": assistant.tool_calls[0].id, "content": "12 C, sunny"},
        {"role": "tool", "tool_call_id": assistant.tool_calls[1].id, "content": "14:05"},
    ]
    r = ask(client, "It is sunny and 14:05.", messages=messages)
    assert r.choices[0].message.content == "It is sunny and 14:05."
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "stop"


BOUNDED = [  # a random model must be able to finish these
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "unit": {"enum": ["c", "f"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["UTC", "CET"]}},
                "additionalProperties": False,
            },
        },
    },
]


@pytest.mark.parametrize("choice", ["required", "named"])
def test_required_and_named_calls_are_enforced(server, choice):
    """The untrained model writes valid calls in its own (hermes) markup: 20 samples each."""
    from tests.test_structured import close_bias, no_whitespace_bias

    tok = server.state.tokenizer
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in BOUNDED}
    tool_choice = (
        "required"
        if choice == "required"
        else {"type": "function", "function": {"name": "get_time"}}
    )
    body = {
        "messages": USER,
        "tools": BOUNDED,
        "tool_choice": tool_choice,
        "max_tokens": 300,
        "temperature": 1.0,
        "n": 4,
        "logit_bias": close_bias(tok) | no_whitespace_bias(tok),
        **NO_THINKING,
    }
    seen = 0
    for seed in range(5):
        r = httpx.post(server.url + "/v1/chat/completions", json=body | {"seed": seed}, timeout=60)
        assert r.status_code == 200, r.text
        for c in r.json()["choices"]:
            calls = c["message"]["tool_calls"]
            # OpenAI's (and vLLM's) finish_reason: "stop" for the call the request named
            assert c["finish_reason"] == ("stop" if choice == "named" else "tool_calls"), c
            assert calls, c
            if choice == "named":
                assert [call["function"]["name"] for call in calls] == ["get_time"]
            for call in calls:
                args = json.loads(call["function"]["arguments"])
                jsonschema.validate(args, schemas[call["function"]["name"]])
            seen += 1
    assert seen == 20
    # streamed, the last chunk says the same
    stream = body | {"seed": 0, "n": 1, "stream": True}
    r = httpx.post(server.url + "/v1/chat/completions", json=stream, timeout=60)
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line[6:7] == "{"]
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    assert any(d["delta"].get("tool_calls") for d in deltas)
    assert deltas[-1]["finish_reason"] == ("stop" if choice == "named" else "tool_calls")


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_short_is_no_call(server, stream):
    """max_tokens ends a required call inside its arguments: no tool_calls with arguments the
    model never wrote ("{}" had been invented); its text comes back as content, finish length."""
    body = {
        "messages": USER,
        "tools": BOUNDED,
        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        "max_tokens": 6,
        "stream": stream,
        **NO_THINKING,
    }
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    if stream:
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line[6:7] == "{"]
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
        content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        # the call's start was streamed as it came; its text follows as content at the end
        assert finish == "length" and content.startswith("<tool_call>")
        return
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and not choice["message"]["tool_calls"]
    assert choice["message"]["content"].startswith("<tool_call>")


BAD = [
    ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "guided_regex"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    # the tool to blame is named (it had been "tools", with the whole call grammar's text)
    ({"tools": [*TOOLS, {"type": "function", "function": {"name": "f", "parameters": SET}}],
      "tool_choice": "required"}, "tools[2].function.parameters"),
    ({"tools": [*TOOLS, {"type": "function", "function": {"name": "f", "parameters": SET}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tools[2].function.parameters"),
]  # fmt: skip


@pytest.mark.parametrize("fields,param", BAD)
def test_bad_tool_input(server, fields, param):
    r = httpx.post(
        server.url + "/v1/chat/completions", json={"messages": USER, "max_tokens": 2, **fields}
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert "<tool_call>" not in r.json()["error"]["message"]


def test_a_bad_tool_that_is_not_chosen_is_not_enforced(server):
    bad = {"type": "function", "function": {"name": "f", "parameters": SET}}
    named = {"type": "function", "function": {"name": "get_time"}}
    body = {"messages": USER, "max_tokens": 2, "tools": [*TOOLS, bad], "tool_choice": named}
    assert httpx.post(server.url + "/v1/chat/completions", json=body).status_code == 200


def test_auto_without_a_parser_is_a_400(model_dir):
    s = LiveServer(tiny_config(model_dir, num_kv_blocks=32)).start()  # ChatML: no tool markup
    try:
        assert s.state.tool_parser is None
        body = {"messages": USER, "max_tokens": 2, "tools": TOOLS}
        r = httpx.post(s.url + "/v1/chat/completions", json=body | {"tool_choice": "auto"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        assert "--tool-call-parser" in r.json()["error"]["message"]
        # Unasked, tools go to the template and the reply is text, as before.
        assert httpx.post(s.url + "/v1/chat/completions", json=body).status_code == 200
        # A named function is still enforced, in hermes markup, and read back as a call.
        # (the biases end the random model's strings and whitespace, whatever its arithmetic)
        from tests.test_structured import close_bias, no_whitespace_bias

        tok = s.state.tokenizer
        named = {"type": "function", "function": {"name": "get_time"}}
        bias = close_bias(tok) | no_whitespace_bias(tok)
        body |= {"tools": BOUNDED, "tool_choice": named, "max_tokens": 300, "seed": 1}
        r = httpx.post(s.url + "/v1/chat/completions", json=body | {"logit_bias": bias}).json()
        assert r["choices"][0]["finish_reason"] == "stop", r
        assert r["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_time"
    finally:
        s.stop()


def test_markup_that_is_a_special_token_reaches_the_parser(model_dir):
    """Mistral's [TOOL_CALLS] is a special token in its tokenizers: a reply to a request with
    tools is decoded with special tokens kept (as vLLM does for its mistral parser), or the
    marker, and the calls after it, would vanish from the text the parser reads. Here the
    marker alone (one token, forced by a bias) is no whole call, so it comes back as content;
    without tools, or with tool_choice none, special tokens are skipped as asked. An enforced
    call writes the marker as that one token, not spelled out in text tokens (llguidance never
    matches quoted grammar text against a special token), with or without parallel calls."""
    from core.config import EngineConfig
    from tests.test_structured import close_bias, no_whitespace_bias

    path = model_dir("qwen3", special_tokens=("[TOOL_CALLS]",))
    config = EngineConfig(model=str(path), num_kv_blocks=32, max_model_len=256)
    s = LiveServer(config, tool_call_parser="mistral").start()
    try:
        assert "[TOOL_CALLS]" in s.state.special_ids
        tok = s.state.tokenizer
        mark = tok.convert_tokens_to_ids("[TOOL_CALLS]")
        body = {"messages": USER, "max_tokens": 1, "logit_bias": {str(mark): 100}}
        for extra, content in (
            ({"tools": TOOLS}, "[TOOL_CALLS]"),
            ({"tools": TOOLS, "tool_choice": "none"}, ""),
            ({}, ""),
        ):
            r = httpx.post(s.url + "/v1/chat/completions", json=body | extra)
            assert r.status_code == 200, r.text
            message = r.json()["choices"][0]["message"]
            assert message["content"] == content and not message.get("tool_calls"), (extra, r.text)
        bias = close_bias(tok) | no_whitespace_bias(tok) | {str(mark): -100}
        for parallel in (True, False):
            body = {
                "messages": USER,
                "tools": TOOLS,
                "tool_choice": "required",
                "parallel_tool_calls": parallel,
                "max_tokens": 200,
                "temperature": 1.0,
                "seed": 1,  # sampled reproducibly; the biases end the random model's JSON
                "logit_bias": bias,  # the marker pushed down: the grammar still forces it
                "return_token_ids": True,
            }
            r = httpx.post(s.url + "/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["token_ids"][0] == mark, tok.decode(choice["token_ids"][:4])
            assert choice["finish_reason"] == "tool_calls", choice
            assert choice["message"]["tool_calls"] and not choice["message"]["content"], choice
    finally:
        s.stop()
