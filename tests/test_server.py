"""Against a live server on a free port, with the official openai SDK and raw HTTP."""

from __future__ import annotations

import logging

import httpx
import openai
import pytest

from core.config import EngineConfig
from core.engine import Hold
from tests.conftest import LiveServer, aborted, check_engine_died, wait_for

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hello to the river café 🌊"},
]


@pytest.fixture(scope="module")
def client(live_server):
    c = openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused", max_retries=0)
    yield c
    c.close()  # Hypercorn's shutdown waits on idle keep-alive connections


def test_models_list(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["tiny", "tiny-alias"]


def test_chat_non_stream(client):
    r = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=12, temperature=0
    )
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == "tiny"
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_shape_and_equals_non_stream(client):
    kwargs = dict(model="tiny-alias", messages=MESSAGES, max_tokens=20, temperature=0)
    full = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in with_choices[1:])
    finishes = [c.choices[0].finish_reason for c in with_choices if c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]  # exactly once
    assert with_choices[-1].choices[0].finish_reason is not None
    text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert text == full.choices[0].message.content
    assert len({c.id for c in chunks}) == 1
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == full.usage.completion_tokens


def test_stream_ends_with_done(live_server):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 5, "stream": True}
    with httpx.stream("POST", live_server.url + "/v1/chat/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)


def test_completions_text_and_token_prompts(client):
    r = client.completions.create(
        model="tiny", prompt="the river flows", max_tokens=8, temperature=0
    )
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"
    batch = client.completions.create(
        model="tiny", prompt=["the river flows", "hello"], max_tokens=8, temperature=0
    )
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == r.choices[0].text
    tokens = client.completions.create(
        model="tiny", prompt=[11, 12, 13, 14], max_tokens=4, temperature=0
    )
    assert tokens.usage.prompt_tokens == 4
    stream = list(
        client.completions.create(
            model="tiny", prompt="the river flows", max_tokens=8, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in stream) == r.choices[0].text
    assert stream[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_sampling_with_temperature_runs(client):
    r = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=16,
        temperature=0.8,
        top_p=0.9,
        extra_body={"top_k": 20},
    )
    assert r.usage.completion_tokens >= 1


def test_disconnect_aborts_and_frees_blocks(live_server, caplog):
    caplog.set_level(logging.INFO, logger="weir.requests")  # each request's line, on a failure
    engine = live_server.engine
    total = 256  # the live_server fixture's pool
    # Held once it has 4 tokens, the request can only end by the abort the disconnect sends:
    # the tiny model could otherwise finish all 400 tokens before this client reads.
    engine.hold(Hold(at_output_tokens=4))
    aborted_before = aborted(live_server)
    body = {
        "model": "tiny",
        "messages": MESSAGES,
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
        "logprobs": True,  # every output an event, even one that adds no text yet
    }
    try:
        with httpx.stream("POST", live_server.url + "/v1/chat/completions", json=body) as r:
            # The lines' iterator is kept: a for loop's own would be closed at its break, and
            # closing it closes the connection, so the abort raced the check below (it lost
            # when the engine took the abort before this thread looked: 2 runs in 34 here).
            lines, seen = r.iter_lines(), []
            for line in lines:
                seen.append(line)
                if line.startswith("data: ") and '"logprobs":{' in line:
                    break  # some of the stream read, the rest not
            else:
                raise AssertionError(f"the stream ended with no token: {r.status_code} {seen}")
            # it holds blocks while streaming (held: the stats of a step that shows it come
            # after its first event, later on a loaded machine)
            assert wait_for(lambda: engine.last_stats.num_free_blocks < total), (
                engine.last_stats.finished,
                aborted(live_server) - aborted_before,
                len(seen),
                {rid: r.num_output_tokens for rid, r in engine.core.requests.items()},
            )
        # Closing the connection cancels the handler; the held engine takes the abort.
        assert wait_for(lambda: aborted(live_server) > aborted_before)
        assert wait_for(lambda: engine.last_stats.num_free_blocks == total)
        assert not engine.last_stats.num_running and not engine.last_stats.num_waiting
    finally:
        engine.release()


def test_malformed_bodies_and_unknown_routes(live_server):
    # Field-by-field validation is table-driven in test_api.py; these are about the body itself.
    url = live_server.url
    r = httpx.post(
        url + "/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(url + "/v1/chat/completions", content=b"")
    assert r.status_code == 400 and r.json()["error"]["message"]
    r = httpx.post(url + "/v1/chat/completions", content=b"[1, 2]")
    assert r.status_code == 400 and r.json()["error"]["message"]
    assert httpx.get(url + "/v1/nothing-here").status_code == 404
    assert httpx.get(url + "/v1/chat/completions").status_code == 405


def test_server_keeps_serving_after_bad_inputs(client, live_server):
    httpx.post(live_server.url + "/v1/chat/completions", json={"messages": 1})
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)
    assert r.choices[0].message.content is not None
    assert httpx.get(live_server.url + "/health").status_code == 200


def test_unknown_fields_are_ignored(live_server):
    r = httpx.post(
        live_server.url + "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": MESSAGES,
            "max_tokens": 2,
            "some_future_field": {"x": 1},
        },
    )
    assert r.status_code == 200


def break_engine_after(engine, calls: int) -> None:
    """The runner fails from its calls + 1-th step on (the engine submits every step)."""
    real = engine.core.runner.submit
    count = {"n": 0}

    def flaky(out, grammar=None):
        count["n"] += 1
        if count["n"] > calls:
            raise RuntimeError("simulated device failure")
        return real(out, grammar)

    engine.core.runner.submit = flaky


def stream_lines(url: str) -> list[str]:
    body = {"messages": MESSAGES, "max_tokens": 50, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body) as r:
        return [line for line in r.iter_lines() if line]


@pytest.mark.parametrize("exit_on_error", [True, False])
def test_engine_death_fails_requests(model_dir, exit_on_error):
    # On a thread, so the test can break the engine core from here (a killed engine process:
    # tests/test_engine_process.py).
    server = LiveServer(
        EngineConfig(model=str(model_dir("qwen3")), num_kv_blocks=64),
        exit_on_engine_error=exit_on_error,
        engine_process=False,
    ).start()
    try:
        break_engine_after(server.engine, 3)
        check_engine_died(
            server, stream_lines(server.url), "simulated device failure", exit_on_error
        )
    finally:
        server.stop()


def test_many_concurrent_streams_under_preemption_all_complete(model_dir):
    """A pool far too small for the load: requests get chunked and preempted, none is lost, and
    greedy text is the same as when each runs alone."""
    from concurrent.futures import ThreadPoolExecutor

    server = LiveServer(
        EngineConfig(
            model=str(model_dir("qwen3")),
            num_kv_blocks=40,
            block_size=4,
            max_num_batched_tokens=32,
            check_integrity=True,
        )
    ).start()
    try:

        def ask(i: int, stream: bool) -> tuple[str, str]:
            body = {
                "prompt": f"request number {i} " * (1 + i % 4),
                "max_tokens": 24,
                "temperature": 0,
                "ignore_eos": True,
                "stream": stream,
            }
            if not stream:
                r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
                c = r.json()["choices"][0]
                return c["text"], c["finish_reason"]
            text, finish = [], None
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        c = httpx.Response(200, content=line[6:]).json()["choices"][0]
                        text.append(c["text"])
                        finish = c["finish_reason"] or finish
            return "".join(text), finish

        alone = [ask(i, False) for i in range(16)]  # one at a time: no batching, no preemption
        assert server.engine.core.scheduler.num_preemptions == 0
        server.engine.hold(Hold(gather=16))  # all 16 start together: the pool must preempt
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda i: ask(i, True), range(16)))
        assert all(finish == "length" for _, finish in results)
        assert results == alone
        core = server.engine.core
        assert core.scheduler.num_preemptions > 0
        assert wait_for(lambda: server.engine.last_stats.num_free_blocks == core.kv.num_blocks)
    finally:
        server.stop()


def test_usage_reports_cached_prompt_tokens(client, live_server):
    system = {"role": "system", "content": "You are a helpful river guide. " * 30}
    first = client.chat.completions.create(
        model="tiny", messages=[system, {"role": "user", "content": "hi"}], max_tokens=2
    )
    second = client.chat.completions.create(
        model="tiny",
        messages=[system, {"role": "user", "content": "where is the café?"}],
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = list(second)[-1].usage
    bs = live_server.state.config.block_size
    assert first.usage.prompt_tokens > 150
    assert usage.prompt_tokens_details.cached_tokens >= (first.usage.prompt_tokens - 10) // bs * bs
    # A different salt shares nothing.
    salted = client.chat.completions.create(
        model="tiny",
        messages=[system, {"role": "user", "content": "hi"}],
        max_tokens=2,
        extra_body={"cache_salt": "tenant-b"},
    )
    assert salted.usage.prompt_tokens_details.cached_tokens == 0


def test_n_samples_seeded_and_greedy(client, live_server):
    messages = [{"role": "user", "content": "Tell me about the river " * 10}]
    core = live_server.engine.core
    before = core.num_computed_prompt_tokens
    sampled = dict(model="tiny", messages=messages, n=3, temperature=1.0, seed=123, max_tokens=12)
    r = client.chat.completions.create(
        **sampled, extra_body={"ignore_eos": True, "cache_salt": "n3"}
    )
    computed = core.num_computed_prompt_tokens - before
    prompt = r.usage.prompt_tokens
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) == 3
    assert computed < 2 * prompt  # the prompt is computed once; the others hit the cache
    assert r.usage.completion_tokens == 36
    again = client.chat.completions.create(**sampled, extra_body={"ignore_eos": True})
    assert [c.message.content for c in again.choices] == texts

    greedy = client.chat.completions.create(
        model="tiny", messages=messages, n=3, temperature=0, max_tokens=12
    )
    assert len({c.message.content for c in greedy.choices}) == 1

    chunks = list(
        client.chat.completions.create(**sampled, stream=True, extra_body={"ignore_eos": True})
    )
    streamed = ["", "", ""]
    finishes = [0, 0, 0]
    for c in chunks:
        for choice in c.choices:
            streamed[choice.index] += choice.delta.content or ""
            finishes[choice.index] += choice.finish_reason is not None
    assert streamed == texts and finishes == [1, 1, 1]


def test_priority_needs_priority_scheduling(live_server):
    r = httpx.post(
        live_server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "priority": 5}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"


def test_server_runs_on_the_triton_backend(model_dir):
    server = LiveServer(
        EngineConfig(model=str(model_dir("qwen3")), num_kv_blocks=64, attention_backend="triton")
    ).start()
    try:
        assert server.engine.core.runner.model.backend.attention.name == "triton"
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        chunks = list(
            client.chat.completions.create(
                model=server.state.served_names[0],
                messages=MESSAGES,
                max_tokens=6,
                temperature=0,
                stream=True,
            )
        )
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        client.close()
    finally:
        server.stop()
