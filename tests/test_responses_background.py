"""Background responses: polled, replayed from any event, followed live, cancelled; input items
paged; deleted; store false keeps nothing."""

from __future__ import annotations

import openai
import pytest

from core.engine import Hold
from tests.conftest import tools_server, wait_for


@pytest.fixture(scope="module")
def server(model_dir):
    s = tools_server(model_dir, responses_store_max_entries=64)
    yield s
    s.stop()


NO_THINKING = {"effort": "none"}


def forced(text: str) -> dict:
    return {"guided_choice": [text]}


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
