"""Chat input through the API (roles, content parts, templates and their overrides, the
generation config's defaults) and the plain endpoints: tokenize, version, OpenAPI, body limits."""

from __future__ import annotations

import json

import httpx
import pytest

from core.config import EngineConfig
from tests.conftest import LiveServer, api_server


USER = [{"role": "user", "content": "Tell me about the river café 🌊 and the stone bridge"}]


@pytest.fixture(scope="module")
def server(model_dir):
    s = api_server(model_dir)
    yield s
    s.stop()


def chat(client, **kw):
    kw.setdefault("model", "tiny")
    kw.setdefault("messages", USER)
    return client.chat.completions.create(**kw)


# ---------------------------------------------------------------- chat input
def test_chat_inputs(client, server):
    history = [
        {"role": "developer", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}],
            "name": "ann",
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "look", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
        {"role": "assistant", "content": "The answer is"},
    ]
    r = chat(
        client,
        messages=history,
        max_tokens=3,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert r.choices[0].message.content is not None
    tokens = httpx.post(
        server.url + "/tokenize",
        json={"messages": history, "continue_final_message": True, "add_generation_prompt": False},
    )
    assert tokens.json()["count"] == r.usage.prompt_tokens
    # a user's last message continued (as vLLM and transformers allow: the prompt ends inside it)
    open_user = [{"role": "user", "content": "Complete this: the river"}]
    kw = {"continue_final_message": True, "add_generation_prompt": False}
    r = chat(client, messages=open_user, max_tokens=2, extra_body=kw)
    assert r.choices[0].finish_reason is not None
    rendered = httpx.post(
        server.url + "/tokenize", json={"messages": open_user, **kw, "return_token_strs": True}
    ).json()
    assert "".join(rendered["token_strs"]).replace("Ġ", " ").endswith("the river")
    r = chat(client, max_tokens=2, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].finish_reason is not None


def test_chat_template_override_and_missing_template(model_dir, tmp_path):
    import shutil

    src = model_dir("qwen3")
    bare = tmp_path / "bare"
    shutil.copytree(src, bare)
    (bare / "chat_template.jinja").unlink()
    cfg = json.loads((bare / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(cfg))
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}")
    for tpl, status in ((None, 400), (str(template), 200)):
        s = LiveServer(EngineConfig(model=str(bare), num_kv_blocks=32, chat_template=tpl)).start()
        try:
            r = httpx.post(
                s.url + "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            )
            assert r.status_code == status, r.text
            if status == 400:
                assert r.json()["error"]["code"] == "no_chat_template"
            else:
                count = httpx.post(
                    s.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}
                ).json()["count"]
                assert count == len(s.state.tokenizer.encode("<<hi>>", add_special_tokens=False))
        finally:
            s.stop()


def test_a_requests_own_template_documents_and_the_vllm_fields_weir_refuses(server, model_dir):
    """vLLM's chat_template field is rendered only under --trust-request-chat-template (else a
    400 that names the flag, as vLLM refuses it); `documents` reach the template; the vLLM
    fields for what weir does not serve are refused by name when set, never ignored."""
    from tests.conftest import tiny_config

    hi = [{"role": "user", "content": "hi"}]
    body = {"messages": hi, "max_tokens": 2}
    docs_then_hi = "{% for d in documents %}{{ d.text }}|{% endfor %}{{ messages[0].content }}!"
    own = {"chat_template": docs_then_hi}
    docs = {"documents": [{"text": "a"}, {"text": "b"}]}
    r = httpx.post(server.url + "/v1/chat/completions", json=body | own | docs)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
    assert "--trust-request-chat-template" in r.json()["error"]["message"]
    unserved = {
        "logits_processors": ["my.Processor"],
        "vllm_xargs": {"a": 1},
        "kv_transfer_params": {"do_remote_prefill": True},
        "mm_processor_kwargs": {"fps": 1},
    }
    for name, value in unserved.items():
        r = httpx.post(server.url + "/v1/chat/completions", json=body | {name: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == name, (name, r.text)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "vllm_xargs": {"a": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "vllm_xargs"
    unset = {"logits_processors": None, "vllm_xargs": {}, "kv_transfer_params": None}
    r = httpx.post(server.url + "/v1/chat/completions", json=body | unset | docs)
    assert r.status_code == 200, r.text
    trusted = LiveServer(tiny_config(model_dir, num_kv_blocks=32), trust_request_chat_template=True)
    trusted.start()
    try:
        want = trusted.state.tokenizer.encode("a|b|hi!", add_special_tokens=False)
        r = httpx.post(trusted.url + "/tokenize", json={"messages": hi} | own | docs)
        assert r.json()["tokens"] == want, r.text
        r = httpx.post(trusted.url + "/v1/chat/completions", json=body | own | docs)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(want), r.text
        bad = {"chat_template": "{% for m in messages %}{{ m.content }}"}
        r = httpx.post(trusted.url + "/v1/chat/completions", json=body | bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
    finally:
        trusted.stop()


def test_return_token_ids_gives_the_prompts_and_each_choices_tokens(server):
    """vLLM's return_token_ids: the prompt's token ids (chat: the response's; completions: each
    choice's) and each choice's generated ids, whole and streamed (every id sent once, the
    prompt's on a choice's first chunk); without it the keys are absent."""
    hi = [{"role": "user", "content": "hi"}]
    greedy = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "n": 2}
    prompt = httpx.post(server.url + "/tokenize", json={"messages": hi}).json()["tokens"]
    chat = {"messages": hi, **greedy, "return_token_ids": True}
    body = httpx.post(server.url + "/v1/chat/completions", json=chat).json()
    assert body["prompt_token_ids"] == prompt
    ids = [c["token_ids"] for c in body["choices"]]
    assert [len(x) for x in ids] == [6, 6] and body["usage"]["completion_tokens"] == 12
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", json=chat | {"stream": True}
    ) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    streamed, prompts = [[], []], []
    for c in chunks:
        if "prompt_token_ids" in c:
            prompts.append(c["prompt_token_ids"])
        for choice in c["choices"]:
            streamed[choice["index"]] += choice["token_ids"]
    assert streamed == ids and prompts == [prompt, prompt]
    text = {"prompt": "the river", **greedy, "return_token_ids": True}
    done = httpx.post(server.url + "/v1/completions", json=text).json()
    want = httpx.post(server.url + "/tokenize", json={"prompt": "the river"}).json()["tokens"]
    assert [c["prompt_token_ids"] for c in done["choices"]] == [want, want]
    ids = [c["token_ids"] for c in done["choices"]]
    assert [len(x) for x in ids] == [6, 6]
    with httpx.stream("POST", server.url + "/v1/completions", json=text | {"stream": True}) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    streamed, prompts = [[], []], [[], []]
    for c in chunks:
        for choice in c["choices"]:
            streamed[choice["index"]] += choice["token_ids"]
            prompts[choice["index"]] += choice.get("prompt_token_ids", [])
    assert streamed == ids and prompts == [want, want]
    plain = httpx.post(server.url + "/v1/chat/completions", json={"messages": hi, **greedy})
    assert "prompt_token_ids" not in plain.json() and "token_ids" not in plain.json()["choices"][0]


def test_generation_config_defaults_apply_when_unset(model_dir, tmp_path):
    import shutil

    path = tmp_path / "gen"
    shutil.copytree(model_dir("qwen3"), path)
    gen = json.loads((path / "generation_config.json").read_text())
    gen.update({"temperature": 0.0, "max_new_tokens": 7})
    (path / "generation_config.json").write_text(json.dumps(gen))
    s = LiveServer(EngineConfig(model=str(path), num_kv_blocks=64)).start()
    try:
        body = {"messages": USER, "ignore_eos": True}
        a = httpx.post(s.url + "/v1/chat/completions", json=body).json()
        b = httpx.post(s.url + "/v1/chat/completions", json=body).json()
        assert a["usage"]["completion_tokens"] == 7  # max_new_tokens became the default
        assert a["choices"][0]["message"] == b["choices"][0]["message"]  # temperature 0: greedy
        c = httpx.post(s.url + "/v1/chat/completions", json={**body, "max_tokens": 3}).json()
        assert c["usage"]["completion_tokens"] == 3  # the request's own value wins
    finally:
        s.stop()


# ---------------------------------------------------------------- endpoints
def test_tokenize_detokenize_round_trip(server, client):
    text = "café naïve 你好 😀 the river"
    t = httpx.post(server.url + "/tokenize", json={"prompt": text}).json()
    assert t["count"] == len(t["tokens"]) and t["max_model_len"] == 512
    d = httpx.post(server.url + "/detokenize", json={"tokens": t["tokens"]}).json()
    assert d["prompt"] == text
    m = httpx.post(server.url + "/tokenize", json={"messages": USER}).json()
    r = chat(client, max_tokens=1)
    assert m["count"] == r.usage.prompt_tokens
    strs = httpx.post(
        server.url + "/tokenize", json={"prompt": "hi there", "return_token_strs": True}
    ).json()
    assert len(strs["token_strs"]) == strs["count"]


def test_version_openapi_docs_and_request_id(server):
    assert httpx.get(server.url + "/version").json()["version"]
    doc = httpx.get(server.url + "/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"):
        assert path in doc["paths"]
    schema = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert "messages" in schema["required"] and "top_logprobs" in schema["properties"]
    assert "openapi.json" in httpx.get(server.url + "/docs").text
    r = httpx.post(
        server.url + "/v1/chat/completions",
        headers={"X-Request-Id": "my-id-123"},
        json={"messages": USER, "max_tokens": 2},
    )
    assert r.headers["X-Request-Id"] == "my-id-123" and r.json()["id"] == "my-id-123"
    # vLLM's body field: the id after the route's prefix; the header wins over it
    body = {"prompt": "hi", "max_tokens": 2, "request_id": "job-7"}
    r = httpx.post(server.url + "/v1/completions", json=body)
    assert r.json()["id"] == "cmpl-job-7"
    r = httpx.post(server.url + "/v1/completions", json=body, headers={"X-Request-Id": "h"})
    assert r.json()["id"] == "h"
    r = httpx.post(server.url + "/v1/completions", json=body | {"request_id": "x" * 300})
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id"
    assert httpx.get(server.url + "/ping").status_code == 200


def test_oversized_body_gets_413(model_dir):
    s = LiveServer(
        EngineConfig(model=str(model_dir("qwen3")), num_kv_blocks=32), max_body_bytes=2048
    ).start()
    try:
        r = httpx.post(
            s.url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x" * 5000}]},
        )
        assert r.status_code == 413 and r.json()["error"]["message"]
        assert httpx.get(s.url + "/health").status_code == 200
    finally:
        s.stop()
