"""The Responses API through the OpenAI SDK: single turn whole and streamed (the same text as
chat), two turns by previous_response_id with the prefix cache hit, a function-call round trip,
text.format, background runs polled, cancelled and replayed, input_items pages, the store's
bounds, and a 400 naming the field for each bad input."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from core.engine import Hold
from tests.conftest import LiveServer, tiny_config, wait_for
from tests.test_tools import CALLS, CHATML_TOOLS
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
    config = tiny_config(
        model_dir, max_model_len=1024, num_kv_blocks=512, chat_template=CHATML_TOOLS
    )
    s = LiveServer(config, reasoning_parser="qwen3", responses_store_max_entries=64).start()
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
    assert [(lp.token, lp.logprob) for lp in lps] == [(w.token, w.logprob) for w in want]
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
    flat = [{"type": "function", **t["function"]} for t in CHAT_TOOLS]
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
    part = think[: think.index("</think>") + len("</think>")]
    want = len(server.state.tokenizer.encode(part, add_special_tokens=False))
    assert whole.usage.output_tokens_details.reasoning_tokens == want
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    done = [e.text for e in events if e.type == "response.reasoning_text.done"]
    assert deltas == done[0] == final.output[0].content[0].text == "\nTwo times 21.\n"
    assert final.output_text == whole.output_text
    assert final.usage.output_tokens_details.reasoning_tokens == want


def wait_status(client, rid: str, statuses: tuple[str, ...]) -> str:
    got = {}

    def check() -> bool:
        got["s"] = client.responses.retrieve(rid).status
        return got["s"] in statuses

    assert wait_for(check, timeout=60, interval=0.05), got
    return got["s"]


def test_background_poll_replay_and_cancel(client, server):
    r = client.responses.create(
        model="tiny",
        input="Go on.",
        background=True,
        max_output_tokens=24,
        temperature=0,
        reasoning=NO_THINKING,
        extra_body={"ignore_eos": True},
    )
    assert r.status == "queued" and r.background
    wait_status(client, r.id, ("incomplete",))
    done = client.responses.retrieve(r.id)
    assert done.usage.output_tokens == 24
    events = list(client.responses.retrieve(r.id, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.incomplete"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == done.output_text
    tail = list(client.responses.retrieve(r.id, stream=True, starting_after=5))
    assert [e.sequence_number for e in tail] == list(range(6, len(events)))
    # A long one, cancelled while it runs: held at 3 tokens, it can end only by the cancel.
    server.engine.hold(Hold(at_output_tokens=3))
    try:
        long = client.responses.create(
            model="tiny",
            input="Go on.",
            background=True,
            max_output_tokens=900,
            reasoning=NO_THINKING,
            extra_body={"ignore_eos": True},
        )
        wait_status(client, long.id, ("in_progress",))
        cancelled = client.responses.cancel(long.id)
        assert cancelled.status == "cancelled"
        assert client.responses.retrieve(long.id).status == "cancelled"
        assert client.responses.cancel(long.id).status == "cancelled"  # again: the same answer
    finally:
        server.engine.release()


def test_background_stream_followed_live(client):
    stream = client.responses.create(
        model="tiny",
        input="Hi.",
        background=True,
        stream=True,
        max_output_tokens=40,
        reasoning=NO_THINKING,
        extra_body=forced("Hello from the background."),
    )
    events = list(stream)
    assert events[0].type == "response.created" and events[0].response.status == "queued"
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == "Hello from the background."


def test_input_items_pages(client):
    inputs = [{"role": "user", "content": f"part {i}"} for i in range(5)]
    r = client.responses.create(model="tiny", input=inputs, max_output_tokens=2)
    asc = client.responses.input_items.list(r.id, order="asc", limit=2)
    assert asc.has_more and len(asc.data) == 2
    seen = [item.content[0].text for item in client.responses.input_items.list(r.id, order="asc")]
    assert seen == [f"part {i}" for i in range(5)]
    paged = []  # the SDK's auto-pagination follows `after`
    for item in client.responses.input_items.list(r.id, order="desc", limit=2):
        paged.append(item.content[0].text)
    assert paged == [f"part {i}" for i in reversed(range(5))]


def test_delete(client):
    r = client.responses.create(model="tiny", input="x", max_output_tokens=2)
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)


def test_store_false_keeps_nothing(client):
    r = client.responses.create(model="tiny", input="x", max_output_tokens=2, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


BAD = [
    ({"previous_response_id": "resp_nope"}, 400, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, 400, "tools[0].name"),
    ({"background": True, "store": False}, 400, "background"),
    (
        {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
        400,
        "input[0].call_id",
    ),
    (
        {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
        400,
        "input[0].arguments",
    ),
    ({"input": [{"role": "robot", "content": "hi"}]}, 400, "input[0].role"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        400,
        "input[0].content[0].type",
    ),
    ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "input[0].type"),
    ({"input": [3]}, 400, "input[0]"),
    ({"input": []}, 400, "input"),
    ({"text": {"format": {"type": "yaml"}}}, 400, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format.schema"),
    ({"reasoning": {"effort": "max"}}, 400, "reasoning.effort"),
    ({"tool_choice": {"type": "web_search"}}, 400, "tool_choice"),
    ({"tool_choice": "required"}, 400, "tool_choice"),
    ({"n": 2}, 400, "n"),
    ({"max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"metadata": {"k": "v" * 600}}, 400, "metadata"),
    ({"metadata": {"k" * 65: "v"}}, 400, "metadata"),
]


@pytest.mark.parametrize("fields,status,param", BAD, ids=[b[2] + str(i) for i, b in enumerate(BAD)])
def test_bad_input(server, fields, status, param):
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 4, **fields}
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] is not None and error["param"].startswith(param), error
    assert error["message"] and error["type"]


def test_unknown_ids_are_404(server):
    for method, path in (("GET", ""), ("GET", "/input_items"), ("DELETE", ""), ("POST", "/cancel")):
        r = httpx.request(method, f"{server.url}/v1/responses/resp_missing{path}", timeout=10)
        assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"


def test_cancel_refuses_a_foreground_response(client, server):
    r = client.responses.create(model="tiny", input="x", max_output_tokens=2)
    got = httpx.post(f"{server.url}/v1/responses/{r.id}/cancel", timeout=10)
    assert got.status_code == 400 and "background" in got.json()["error"]["message"]


def test_an_engine_failure_mid_stream_is_an_error_event_then_failed():
    """Run.foreground over outputs that break after the first token (a fake Submitted)."""
    import trio

    from core.request import RequestOutput
    from core.sampling import SamplingParams
    from server.chat_job import ChatJob
    from server.errors import APIError
    from server.responses.protocol import ResponseObject
    from server.responses.registry import Runs
    from server.responses.run import Run
    from server.responses.store import MemoryStore

    class Broken:
        closed = False

        async def outputs(self):
            yield 0, RequestOutput("r", [5], "Hel", num_prompt_tokens=3, num_output_tokens=1)
            raise APIError(500, "The engine failed: boom", None, "engine_error")

        def close(self):
            self.closed = True

    class State:
        responses = Runs(MemoryStore(8, None))

    run = Run(ResponseObject(id="resp_x", created_at=0, status="in_progress", model="m"), [], False)
    job = ChatJob("", [], None, None, SamplingParams(), None)
    sub = Broken()
    State.responses.start(run)

    async def main():
        return [e async for e in run.foreground(State, sub, job)]

    events = [json.loads(e.split(b"data: ", 1)[1]) for e in trio.run(main)]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events][-3:] == [
        "response.output_item.done",
        "error",
        "response.failed",
    ]
    assert [e["type"] for e in events].count("error") == 1
    assert events[-2]["code"] == "engine_error" and "boom" in events[-2]["message"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "engine_error"
    assert failed["output"][0]["content"][0]["text"] == "Hel"
    assert sub.closed and State.responses.store.get("resp_x").status == "failed"
