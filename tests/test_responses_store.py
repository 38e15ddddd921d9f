"""The Responses store: bounded (oldest finished first, never a running one, a TTL) in memory
and in SQLite; the SQLite file survives a SIGKILL of the server (GET and previous_response_id
work after a restart, a response cut off mid-run reads as incomplete); a drain stops background
responses as incomplete; --disable-responses-store keeps nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from core.engine import Hold
from server.responses.sqlite_store import SqliteStore
from server.responses.store import MemoryStore, Stored
from tests.conftest import (
    LiveServer,
    engine_process_of,
    free_port,
    http_status,
    tiny_config,
    wait_for,
)


def rec(rid: str, status: str = "completed", created: float | None = None) -> Stored:
    r = Stored(rid, {"id": rid, "status": status, "output": []}, [{"type": "message"}])
    if created is not None:
        r.created = created
    return r


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_bounds_hold_under_ten_thousand_responses(kind, tmp_path):
    limit = 500
    make = {
        "memory": lambda: MemoryStore(limit, ttl=None),
        "sqlite": lambda: SqliteStore(str(tmp_path / "r.db"), limit, ttl=None),
    }[kind]
    store = make()
    store.put(rec("running", "in_progress", created=0.0))  # the oldest, but running
    for i in range(10_000):
        store.put(rec(f"r{i}"))
        assert len(store) <= limit + 1
    assert len(store) == limit
    assert store.get("running") is not None
    assert store.get("r0") is None and store.get(f"r{10_000 - limit}") is None
    assert store.get(f"r{10_000 - limit + 1}") is not None and store.get("r9999") is not None
    store.put(rec("running", "completed", created=0.0))  # finished: now it may go
    store.put(rec("newest"))
    assert store.get("running") is None and len(store) == limit
    assert store.delete("newest") and not store.delete("newest") and store.get("newest") is None
    store.close()


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_ttl_expires_finished_responses(kind, tmp_path):
    store = (
        MemoryStore(100, ttl=60.0)
        if kind == "memory"
        else SqliteStore(str(tmp_path / "t.db"), 100, ttl=60.0)
    )
    old = time.time() - 120
    store.put(rec("old", created=old))
    store.put(rec("old-running", "in_progress", created=old))
    assert store.get("old") is None
    assert store.get("old-running") is not None
    store.put(rec("fresh"))
    assert store.get("fresh") is not None
    store.close()


def test_a_sqlite_file_marks_what_was_running_incomplete(tmp_path):
    path = str(tmp_path / "s.db")
    store = SqliteStore(path, 100, None)
    r = rec("cut", "in_progress")
    r.response["output"] = [{"type": "message", "status": "in_progress", "content": []}]
    store.put(r)
    store.put(rec("done"))
    store.close()
    again = SqliteStore(path, 100, None)
    cut = again.get("cut").response
    assert cut["status"] == "incomplete" and cut["incomplete_details"]["reason"] == "interrupted"
    assert cut["output"][0]["status"] == "incomplete"
    assert again.get("done").status == "completed" and len(again) == 2
    again.close()


def serve(model: str, port: int, db: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "server",
            "serve",
            model,
            "--port",
            str(port),
            "--served-model-name",
            "tiny",
            "--num-kv-blocks",
            "256",
            "--max-model-len",
            "512",
            "--responses-store",
            db,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def test_sqlite_store_survives_sigkill(model_dir, tmp_path):
    model, db, port = str(model_dir("qwen3")), str(tmp_path / "responses.db"), free_port()
    url = f"http://127.0.0.1:{port}"
    proc = serve(model, port, db)
    try:
        assert wait_for(lambda: http_status(url + "/health") == 200, timeout=120)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        first = client.responses.create(
            model="tiny", input="Remember the river.", max_output_tokens=6, temperature=0
        )
        # The engine stopped first: the background response is still running when the server
        # is killed, whatever the machine's speed. Then both go, as in a crash.
        engine = engine_process_of(proc.pid)
        os.kill(engine, signal.SIGSTOP)
        cut = client.responses.create(
            model="tiny",
            input="Go on.",
            background=True,
            max_output_tokens=400,
            extra_body={"ignore_eos": True},
        )
        assert wait_for(lambda: client.responses.retrieve(cut.id).status == "in_progress")
        proc.send_signal(signal.SIGKILL)
        os.kill(engine, signal.SIGKILL)
        proc.wait(30)
        proc = serve(model, port, db)
        assert wait_for(lambda: http_status(url + "/health") == 200, timeout=120)
        again = client.responses.retrieve(first.id)
        assert again.output_text == first.output_text and again.status == first.status
        follow = client.responses.create(
            model="tiny", previous_response_id=first.id, input="And then?", max_output_tokens=4
        )
        assert follow.usage.input_tokens > first.usage.input_tokens
        kinds = [i.type for i in client.responses.input_items.list(follow.id, order="asc")]
        assert kinds == ["message", "message", "message"]
        stopped = client.responses.retrieve(cut.id)
        assert stopped.status == "incomplete" and stopped.incomplete_details.reason == "interrupted"
        client.close()
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0


def test_drain_stops_background_responses_as_incomplete(model_dir):
    s = LiveServer(tiny_config(model_dir, max_model_len=2048), drain_timeout=1.0).start()
    # The long response can only end by the drain: the engine stops stepping once every
    # request in it has written 5 tokens (its commands, the drain's abort and shutdown among
    # them, still run). The short one (3 tokens) ends before the long one starts.
    s.engine.hold(Hold(at_output_tokens=5))
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
    short = client.responses.create(model="tiny", input="x", background=True, max_output_tokens=3)
    done = ("completed", "incomplete")  # 3 tokens: the limit, or an end of text before it
    assert wait_for(lambda: client.responses.retrieve(short.id).status in done)
    long = client.responses.create(
        model="tiny",
        input="x",
        background=True,
        max_output_tokens=2000,
        extra_body={"ignore_eos": True},
    )
    assert wait_for(lambda: client.responses.retrieve(long.id).output_text)
    client.close()
    s.stop()
    store = s.state.responses.store
    assert store.get(short.id).response["incomplete_details"] in (
        None, {"reason": "max_output_tokens"}
    )
    cut = store.get(long.id).response
    assert cut["status"] == "incomplete", cut["status"]
    assert cut["incomplete_details"]["reason"] == "interrupted"
    assert cut["usage"]["output_tokens"] == 5, cut["usage"]


def test_disabled_store_keeps_nothing(model_dir):
    s = LiveServer(tiny_config(model_dir), disable_responses_store=True).start()
    try:
        body = {"model": "tiny", "input": "x", "max_output_tokens": 2}
        r = httpx.post(s.url + "/v1/responses", json=body, timeout=30).json()
        assert r["store"] is False
        got = httpx.get(f"{s.url}/v1/responses/{r['id']}", timeout=10)
        assert (
            got.status_code == 404 and "disable-responses-store" in got.json()["error"]["message"]
        )
        bg = httpx.post(s.url + "/v1/responses", json={**body, "background": True}, timeout=30)
        assert bg.status_code == 400 and bg.json()["error"]["param"] == "background"
    finally:
        s.stop()


def test_evicted_responses_are_404(model_dir):
    s = LiveServer(tiny_config(model_dir), responses_store_max_entries=2).start()
    try:
        ids = [
            httpx.post(
                s.url + "/v1/responses",
                json={"model": "tiny", "input": "x", "max_output_tokens": 2},
                timeout=30,
            ).json()["id"]
            for _ in range(3)
        ]
        assert [httpx.get(f"{s.url}/v1/responses/{i}").status_code for i in ids] == [404, 200, 200]
        cont = httpx.post(
            s.url + "/v1/responses",
            json={"model": "tiny", "input": "x", "previous_response_id": ids[0]},
            timeout=30,
        )
        assert cont.status_code == 400 and cont.json()["error"]["param"] == "previous_response_id"
    finally:
        s.stop()
