"""LoRA over HTTP: a request's `model` names an adapter or the base (completions, chat,
Responses, embeddings); /v1/models lists adapters with parent and root as vLLM does; runtime
load and unload (vLLM's endpoints, under auth); an unknown name is a 404 model_not_found; bad
adapters and bad updates are clear 4xx; metrics."""

from __future__ import annotations

import json
import shutil
import threading
import time

import httpx
import pytest
import torch

from core.config import EngineConfig
from core.engine_messages import Hold
from tests.conftest import LiveServer
from tests.lora_adapters import make_adapter, peft_greedy, peft_hidden

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "the model is a server"


@pytest.fixture(scope="module")
def lora_server(model_dir, tmp_path_factory):
    base = model_dir("llama")
    out = tmp_path_factory.mktemp("lora-http")
    adapters = {n: make_adapter(base, out / n, n, seed=i) for i, n in enumerate(["qv8", "mlp4"])}
    config = EngineConfig(
        model=str(base),
        served_model_name=["base"],
        dtype="float32",
        num_kv_blocks=128,
        check_integrity=True,
        enable_lora=True,
        max_loras=2,
        lora_modules=[
            f"qv8={adapters['qv8']}",
            json.dumps({"name": "mlp", "path": str(adapters["mlp4"]), "base_model_name": "b"}),
        ],
    )
    server = LiveServer(
        config, api_key=KEY, allow_runtime_lora_updating=True, enable_embeddings=True
    ).start()
    yield server, base, adapters, out
    server.stop()


def complete(server, model, prompt=PROMPT, max_tokens=12):
    r = httpx.post(
        server.url + "/v1/completions",
        headers=AUTH,
        json={
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        },
        timeout=60,
    )
    return r


def test_model_names_an_adapter(lora_server):
    server, base, adapters, _ = lora_server
    tok = server.state.tokenizer
    ids = tok.encode(PROMPT)
    for model, adapter in (("base", None), ("qv8", adapters["qv8"]), ("mlp", adapters["mlp4"])):
        r = complete(server, model)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        want = peft_greedy(base, adapter, [ids], 12)[0]
        assert r.json()["choices"][0]["text"] == tok.decode(want), model
    r = httpx.post(
        server.url + "/v1/chat/completions",
        headers=AUTH,
        json={"model": "qv8", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    )
    assert r.status_code == 200 and r.json()["model"] == "qv8"
    r = httpx.post(
        server.url + "/v1/responses",
        headers=AUTH,
        json={"model": "mlp", "input": "hi", "max_output_tokens": 4},
    )
    assert r.status_code == 200, r.text
    for model, adapter in (("base", None), ("qv8", adapters["qv8"])):  # last-token pooling
        r = httpx.post(
            server.url + "/v1/embeddings",
            headers=AUTH,
            json={"model": model, "input": PROMPT, "normalize": False},
        )
        assert r.status_code == 200 and r.json()["model"] == model, r.text
        want = peft_hidden(base, adapter, [ids])[0][-1]
        got = torch.tensor(r.json()["data"][0]["embedding"])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    metrics = httpx.get(server.url + "/metrics").text
    assert 'lora_requests_total{lora_name="qv8",model_name="base"}' in metrics
    assert "lora_requests_info{" in metrics and 'max_lora="2"' in metrics


def test_models_lists_adapters_with_parent_and_root(lora_server):
    server, base, adapters, _ = lora_server
    data = httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"]
    cards = {c["id"]: c for c in data}
    assert cards["base"]["parent"] is None
    assert cards["qv8"]["parent"] == "base" and cards["qv8"]["root"] == str(adapters["qv8"])
    assert cards["mlp"]["parent"] == "b"
    # one card by name (OpenAI's retrieve: the SDK's models.retrieve), a 404 for another
    for name in ("base", "qv8"):
        one = httpx.get(server.url + f"/v1/models/{name}", headers=AUTH)
        assert one.status_code == 200 and one.json() == cards[name]
    gone = httpx.get(server.url + "/v1/models/nope", headers=AUTH)
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "model"
    assert httpx.get(server.url + "/v1/models/base").status_code == 401


def test_unknown_model_is_a_404(lora_server):
    server = lora_server[0]
    r = complete(server, "nope")
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert "nope" in err["message"]


def test_runtime_load_and_unload(lora_server):
    server, base, adapters, out = lora_server
    url = server.url
    body = {"lora_name": "late", "lora_path": str(adapters["mlp4"])}
    assert httpx.post(url + "/v1/load_lora_adapter", json=body).status_code == 401
    r = httpx.post(url + "/v1/load_lora_adapter", json=body, headers=AUTH)
    assert r.status_code == 200 and "late" in r.text
    assert complete(server, "late").status_code == 200
    assert "late" in [c["id"] for c in httpx.get(url + "/v1/models", headers=AUTH).json()["data"]]
    again = httpx.post(url + "/v1/load_lora_adapter", json=body, headers=AUTH)
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    assert again.json()["error"]["param"] == "lora_name"
    # refused whole, naming it: a rank above --max-lora-rank (16 by default), DoRA
    big = out / "big"
    shutil.copytree(adapters["mlp4"], big)
    config = json.loads((big / "adapter_config.json").read_text())
    (big / "adapter_config.json").write_text(json.dumps(config | {"use_dora": True}))
    r = httpx.post(
        url + "/v1/load_lora_adapter",
        json={"lora_name": "dora", "lora_path": str(big)},
        headers=AUTH,
    )
    assert r.status_code == 400 and "'dora'" in r.json()["error"]["message"]
    assert "DoRA" in r.json()["error"]["message"]
    assert "dora" not in server.state.lora.adapters
    assert complete(server, "dora").status_code == 404
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "late"}, headers=AUTH)
    assert r.status_code == 200
    assert complete(server, "late").status_code == 404
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "late"}, headers=AUTH)
    assert r.status_code == 404


def test_unloading_an_adapter_in_use_is_refused(lora_server):
    server = lora_server[0]
    engine = server.engine
    engine.hold(Hold(paused=True))
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("r", complete(server, "qv8")))
    t.start()
    try:
        deadline = time.monotonic() + 30
        while not server.state.lora.in_use["qv8"]:
            assert time.monotonic() < deadline, "the request never arrived"
            time.sleep(0.01)
        r = httpx.post(
            server.url + "/v1/unload_lora_adapter", json={"lora_name": "qv8"}, headers=AUTH
        )
        assert r.status_code == 409 and r.json()["error"]["code"] == "adapter_in_use"
    finally:
        engine.release()
        t.join(60)
    assert result["r"].status_code == 200
    assert "qv8" in server.state.lora.adapters


def test_engine_process_serves_adapters_and_bad_modules_stop_start(lora_server):
    """Across the engine process (the product default): an adapter's tokens; a --lora-modules
    entry that does not fit refuses to start, naming it."""
    server, base, adapters, out = lora_server
    config = EngineConfig(
        model=str(base),
        dtype="float32",
        num_kv_blocks=64,
        enable_lora=True,
        lora_modules=[f"qv8={adapters['qv8']}"],
    )
    child = LiveServer(config, engine_process=True).start()
    try:
        r = httpx.post(
            child.url + "/v1/completions",
            json={"model": "qv8", "prompt": PROMPT, "max_tokens": 12, "temperature": 0},
            timeout=60,
        )
        assert r.json()["choices"][0]["text"] == server.state.tokenizer.decode(
            peft_greedy(base, adapters["qv8"], [server.state.tokenizer.encode(PROMPT)], 12)[0]
        )
    finally:
        child.stop()
    bad = EngineConfig(
        model=str(base),
        dtype="float32",
        num_kv_blocks=64,
        enable_lora=True,
        max_lora_rank=4,
        lora_modules=[f"big={adapters['qv8']}"],
    )
    with pytest.raises(RuntimeError, match="'big' has rank 8, more than --max-lora-rank 4"):
        LiveServer(bad).start()


def test_llm_generate_takes_a_lora_request(lora_server):
    from weir import LLM, LoRARequest, SamplingParams

    _, base, adapters, _ = lora_server
    llm = LLM(str(base), dtype="float32", num_kv_blocks=64, enable_lora=True, max_loras=2)
    prompts = [llm.tokenizer.encode(PROMPT), llm.tokenizer.encode("hello")]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    qv8 = LoRARequest("qv8", 1, str(adapters["qv8"]))
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=[qv8, None])
    assert outs[0].outputs[0].token_ids == peft_greedy(base, adapters["qv8"], prompts[:1], 8)[0]
    assert outs[1].outputs[0].token_ids == peft_greedy(base, None, prompts[1:], 8)[0]
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(str(base), dtype="float32", num_kv_blocks=16).generate(
            prompts[:1], params, use_tqdm=False, lora_request=qv8
        )
