"""The Responses API through the OpenAI SDK: single turn whole and streamed (the same text as
chat), two turns by previous_response_id with the prefix cache hit, a function-call round trip,
text.format, background runs polled, cancelled and replayed, input_items pages, the store's
bounds, and a 400 naming the field for each bad input."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.conftest import tools_server
from tests.test_tools import CALLS
from tests.test_tools import TOOLS as CHAT_TOOLS

TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    }
]
# Thinking off in the template, so that a constraint holds from the first token.
NO_THINKING = {"effort": "none"}


@pytest.fixture(scope="module")
def server(model_dir):
    s = tools_server(model_dir, responses_store_max_entries=64)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def blank(server) -> dict[str, float]:
    """Flexible JSON whitespace lets a random model write it forever: push it down."""
    tok = server.state.tokenizer
    return {
        str(i): -100.0
        for i in tok.get_vocab().values()
        if tok.decode([i]) and tok.decode([i]).strip() == ""
    }


def forced(text: str) -> dict:
    return {"guided_choice": [text]}


def test_single_turn_matches_chat(client):
    r = client.responses.create(
        model="tiny",
        input="Tell me about rivers.",
        max_output_tokens=12,
        temperature=0,
        reasoning=NO_THINKING,
    )
    assert r.id.startswith("resp_") and r.object == "response"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in r.output] == ["message"]
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Tell me about rivers."}],
        max_tokens=12,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == 12 and r.usage.total_tokens == r.usage.input_tokens + 12


def test_logprobs_match_chat(client):
    kw = dict(
        model="tiny",
        input="Rivers?",
        max_output_tokens=6,
        temperature=0,
        reasoning=NO_THINKING,
        top_logprobs=2,
        include=["message.output_text.logprobs"],
    )
    r = client.responses.create(**kw)
    lps = r.output[0].content[0].logprobs
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Rivers?"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    want = chat.choices[0].logprobs.content
    assert [lp.token for lp in lps] == [w.token for w in want]
    # Equal on CPU (weir's kernels give the same bits in any batch); on a GPU the second request
    # reuses the first's cached prefix, and products of other shapes round differently.
    assert [lp.logprob for lp in lps] == pytest.approx([w.logprob for w in want], abs=1e-3)
    assert all(len(lp.top_logprobs) == 2 for lp in lps)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [lp.token for lp in streamed] == [lp.token for lp in lps]
    assert (
        not client.responses.create(**{**kw, "top_logprobs": None, "include": None})
        .output[0]
        .content[0]
        .logprobs
    )


def test_logprobs_of_tokens_that_write_part_of_a_character(client):
    """An emoji spelled in byte tokens: the tokens before its last byte write no text yet; their
    log-probs come with the text they complete, one per output token (they had been dropped)."""
    kw = dict(
        model="tiny",
        input="Think?",
        max_output_tokens=40,
        reasoning=NO_THINKING,
        top_logprobs=1,
        include=["message.output_text.logprobs"],
        extra_body=forced("🤔 x 🤔🤔"),
    )
    r = client.responses.create(**kw)
    assert r.output_text == "🤔 x 🤔🤔"
    lps = r.output[0].content[0].logprobs
    assert len(lps) == r.usage.output_tokens  # the end-of-text token too
    assert b"".join(bytes(lp.bytes) for lp in lps).decode() == r.output_text
    with client.responses.stream(**kw) as stream:
        events = list(stream)
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert len(streamed) == stream.get_final_response().usage.output_tokens


def test_streamed_events_build_the_same_response(client):
    kw = dict(
        model="tiny",
        input="Say hello.",
        reasoning=NO_THINKING,
        max_output_tokens=40,
        extra_body=forced("Hello there, friend."),
    )
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    seq = [e.sequence_number for e in events]
    assert seq == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == "Hello there, friend."
    assert final.status == "completed" and final.output[0].status == "completed"
    whole = client.responses.create(**kw)
    assert whole.output_text == final.output_text
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_two_turns_reuse_the_prefix_cache(client):
    question = "Explain, step by step and with care, how a river carves a valley over time. " * 3
    first = client.responses.create(
        model="tiny",
        input=question,
        max_output_tokens=8,
        temperature=0,
        reasoning=NO_THINKING,
        prompt_cache_key="conv-1",
    )
    second = client.responses.create(
        model="tiny",
        previous_response_id=first.id,
        input="And a canyon?",
        max_output_tokens=8,
        temperature=0,
        reasoning=NO_THINKING,
        prompt_cache_key="conv-1",
    )
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    # All but the last blocks of the first prompt (whose empty think block the template drops
    # from earlier turns) come from the cache.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 32
    # The same conversation written out as chat messages gives the same answer.
    chat = client.chat.completions.create(
        model="tiny",
        messages=[
            {"role": "user", "content": question},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And a canyon?"},
        ],
        max_tokens=8,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert second.output_text == chat.choices[0].message.content
    items = client.responses.input_items.list(second.id, order="asc").data
    assert [i.type for i in items] == ["message", "message", "message"]
    assert [getattr(i, "role", None) for i in items] == ["user", "assistant", "user"]


def test_function_call_round_trip(client, blank):
    call = client.responses.create(
        model="tiny",
        input="Weather in Zürich?",
        tools=TOOLS,
        reasoning=NO_THINKING,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=200,
        temperature=1.0,
        extra_body={"logit_bias": blank, "seed": 3},
    )
    assert call.status == "completed", call.output
    fc = call.output[-1]
    assert fc.type == "function_call" and fc.name == "get_weather" and fc.call_id
    jsonschema.validate(json.loads(fc.arguments), TOOLS[0]["parameters"])
    answer = client.responses.create(
        model="tiny",
        previous_response_id=call.id,
        tools=TOOLS,
        reasoning=NO_THINKING,
        input=[{"type": "function_call_output", "call_id": fc.call_id, "output": "sunny, 21 C"}],
        # The answer forced: the strict tool (the Responses default) would let a call in beside
        # it under tool_choice auto.
        tool_choice="none",
        max_output_tokens=40,
        extra_body=forced("It is sunny in Zürich."),
    )
    assert answer.status == "completed" and answer.output_text == "It is sunny in Zürich."
    kinds = [i.type for i in client.responses.input_items.list(answer.id, order="asc").data]
    assert kinds[-2:] == ["function_call", "function_call_output"]


def test_function_call_streamed(client, blank):
    with client.responses.stream(
        model="tiny",
        input="Weather?",
        tools=TOOLS,
        reasoning=NO_THINKING,
        tool_choice="required",
        max_output_tokens=200,
        temperature=1.0,
        extra_body={"logit_bias": blank, "seed": 5},
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    fc = final.output[-1]
    assert fc.type == "function_call" and done and done[0].arguments == args == fc.arguments
    jsonschema.validate(json.loads(fc.arguments), TOOLS[0]["parameters"])


def test_parallel_calls_and_max_tool_calls(client):
    # The calls forced as text: strict tools (the Responses default) would add their own calls'
    # grammar beside it under tool_choice auto, and the sampled first token would choose.
    flat = [{"type": "function", **t["function"], "strict": False} for t in CHAT_TOOLS]
    kw = dict(
        model="tiny",
        input="Weather and time?",
        tools=flat,
        reasoning=NO_THINKING,
        max_output_tokens=200,
        extra_body=forced(CALLS),
    )
    both = client.responses.create(**kw)
    assert [i.type for i in both.output] == ["message", "function_call", "function_call"]
    assert [i.name for i in both.output[1:]] == ["get_weather", "get_time"]
    assert json.loads(both.output[1].arguments) == {"city": "Zürich", "unit": "c"}
    assert len({i.call_id for i in both.output[1:]}) == 2
    one = client.responses.create(**kw, max_tool_calls=1)
    assert [i.type for i in one.output] == ["message", "function_call"]
    single = client.responses.create(**kw, parallel_tool_calls=False)
    assert [(i.type, getattr(i, "name", None)) for i in single.output] == [
        ("message", None),
        ("function_call", "get_weather"),
    ]


def test_text_format_json_schema(client, blank):
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 0, "maximum": 9},
            "ok": {"type": "boolean"},
        },
        "required": ["n", "ok"],
        "additionalProperties": False,
    }
    r = client.responses.create(
        model="tiny",
        input="A number.",
        reasoning=NO_THINKING,
        max_output_tokens=60,
        temperature=1.0,
        text={"format": {"type": "json_schema", "name": "n", "schema": schema}},
        extra_body={"logit_bias": blank, "seed": 1},
    )
    assert r.status == "completed", r.output_text
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_reasoning_items(client, server):
    think = "<think>\nTwo times 21.\n</think>\n\nIt is 42."
    kw = dict(
        model="tiny",
        input="2 x 21?",
        reasoning=NO_THINKING,
        max_output_tokens=80,
        extra_body=forced(think),
    )
    whole = client.responses.create(**kw)
    assert [i.type for i in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == "\nTwo times 21.\n"
    assert whole.output_text == "\n\nIt is 42."
    # the generated tokens up to the one completing </think> (the grammar lets the model spell
    # the text in any tokens): all of them but those writing the answer
    answer = len(server.state.tokenizer.encode("\n\nIt is 42.", add_special_tokens=False))
    want = whole.usage.output_tokens_details.reasoning_tokens
    assert 0 < want <= whole.usage.output_tokens - 1 and want >= answer
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    done = [e.text for e in events if e.type == "response.reasoning_text.done"]
    assert deltas == done[0] == final.output[0].content[0].text == "\nTwo times 21.\n"
    assert final.output_text == whole.output_text
    assert final.usage.output_tokens_details.reasoning_tokens == want
