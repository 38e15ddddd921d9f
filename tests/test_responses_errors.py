"""The Responses API's errors: bad input is a 4xx naming the field, unknown ids are 404, a
foreground response cannot be cancelled, an engine failure mid-stream ends as `failed`."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import tools_server


@pytest.fixture(scope="module")
def server(model_dir):
    s = tools_server(model_dir, responses_store_max_entries=64)
    yield s
    s.stop()


BAD = [
    ({"previous_response_id": "resp_nope"}, 400, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, 400, "tools[0].name"),
    (
        {
            "tools": [{"type": "function", "name": "f", "parameters": {"not": {}}}],
            "tool_choice": "required",
        },
        400,
        "tools[0].parameters",
    ),
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
    # the context's limits, named by this API's fields (they had been chat's)
    ({"input": "word " * 5000}, 400, "input"),
    ({"max_output_tokens": 10**6}, 400, "max_output_tokens"),
    ({"truncation": "sometimes"}, 400, "truncation"),
    ({"input": [{"role": "user", "content": "hi", "id": 123}]}, 400, "input[0].id"),
]


@pytest.mark.parametrize("fields,status,param", BAD, ids=[b[2] + str(i) for i, b in enumerate(BAD)])
def test_bad_input(server, fields, status, param):
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 4, **fields}
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] is not None and error["param"].startswith(param), error
    assert error["message"] and error["type"] and "max_tokens" not in error["message"]


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


def test_truncation_auto_drops_the_oldest_items(server):
    """A conversation past the context: refused with truncation disabled (the default), served
    with "auto" less its oldest items, and the response says which truncation it had."""
    long = [
        {"role": "user", "content": "word " * 5000},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "and now?"},
    ]
    body = {"model": "tiny", "input": long, "max_output_tokens": 4}
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
    r = httpx.post(server.url + "/v1/responses", json=body | {"truncation": "auto"}, timeout=30)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["truncation"] == "auto" and got["status"] in ("completed", "incomplete")
    assert got["usage"]["input_tokens"] < 100  # the 5000 words left out
    plain = {"model": "tiny", "input": "hi", "max_output_tokens": 2}
    assert httpx.post(server.url + "/v1/responses", json=plain).json()["truncation"] == "disabled"
