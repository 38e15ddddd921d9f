"""/v1/embeddings through the OpenAI SDK: float and base64 (the SDK decodes base64 by default)
equal to transformers' vectors, Matryoshka `dimensions`, a batch of inputs split across steps,
chat streams beside embedding requests with greedy output unchanged, the checkpoint's
sentence-transformers pooling, and a 400 naming the field for each bad input."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel

from server.embedding_config import EmbeddingConfig, resolve
from server.options import ServerOptions
from tests.conftest import LiveServer, tiny_config

TEXTS = ["the river runs to the sea", "a canyon is a deep valley", "x"]


@pytest.fixture(scope="module")
def matryoshka_dir(model_dir, tmp_path_factory):
    """The tiny Qwen3 with a config that declares Matryoshka dimensions."""
    path = tmp_path_factory.mktemp("mrl") / "model"
    shutil.copytree(model_dir("qwen3"), path)
    config = json.loads((path / "config.json").read_text())
    config["matryoshka_dimensions"] = [16, 32, config["hidden_size"]]
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def server(matryoshka_dir, model_dir):
    config = tiny_config(model_dir, num_kv_blocks=512, max_num_batched_tokens=256)
    config.model = str(matryoshka_dir)
    s = LiveServer(config, enable_embeddings=True).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def hf(matryoshka_dir):
    return AutoModel.from_pretrained(str(matryoshka_dir), dtype=torch.float32).eval()


def reference(server, hf, text: str, dims: int | None = None) -> torch.Tensor:
    ids = server.state.tokenizer.encode(text)
    with torch.no_grad():
        v = hf(torch.tensor([ids])).last_hidden_state[0, -1].float()
    return F.normalize(v[:dims] if dims else v, dim=0)


def assert_close(got, want: torch.Tensor) -> None:
    got = torch.tensor(got, dtype=torch.float32)
    assert got.shape == want.shape
    assert F.cosine_similarity(got, want, dim=0).item() > 1 - 1e-4


def test_float_and_base64_through_the_sdk(client, server, hf):
    floats = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    packed = client.embeddings.create(model="tiny", input=TEXTS)  # base64, decoded by the SDK
    assert floats.object == "list" and [d.index for d in floats.data] == [0, 1, 2]
    for text, a, b in zip(TEXTS, floats.data, packed.data):
        assert a.object == "embedding"
        assert_close(a.embedding, reference(server, hf, text))
        assert a.embedding == pytest.approx(b.embedding, abs=1e-7)
    n = sum(len(server.state.tokenizer.encode(t)) for t in TEXTS)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == n
    ids = server.state.tokenizer.encode(TEXTS[0])
    by_ids = client.embeddings.create(model="tiny", input=[ids], encoding_format="float")
    assert by_ids.data[0].embedding == pytest.approx(floats.data[0].embedding, abs=1e-6)


def test_dimensions(client, server, hf):
    r = client.embeddings.create(model="tiny", input=TEXTS[:1], dimensions=16)
    assert len(r.data[0].embedding) == 16
    assert_close(r.data[0].embedding, reference(server, hf, TEXTS[0], 16))
    with pytest.raises(Exception, match="allows 16, 32"):
        client.embeddings.create(model="tiny", input="x", dimensions=20)


def test_a_large_batch_is_split_across_steps(client, server):
    core = server.engine.core
    steps = core.num_steps
    texts = [f"input number {i} " * (1 + i % 7) for i in range(300)]
    r = client.embeddings.create(model="tiny", input=texts, encoding_format="float")
    assert len(r.data) == 300 and all(len(d.embedding) == 64 for d in r.data)
    single = client.embeddings.create(model="tiny", input=texts[123], encoding_format="float")
    assert r.data[123].embedding == pytest.approx(single.data[0].embedding, abs=1e-5)
    tokens = r.usage.prompt_tokens
    assert tokens > 4 * 256
    assert core.num_steps - steps >= tokens // 256  # within the step's token budget each time


def test_chat_beside_embeddings_is_unchanged(client, server):
    chat = dict(
        model="tiny",
        messages=[{"role": "user", "content": "Tell me about rivers."}],
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    alone = client.chat.completions.create(**chat).choices[0].message.content

    def stream() -> str:
        parts = client.chat.completions.create(**chat, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in parts if c.choices)

    def embed(i: int) -> int:
        texts = [f"mixed load {i} {j} " * 5 for j in range(20)]
        return len(client.embeddings.create(model="tiny", input=texts).data)

    with ThreadPoolExecutor(8) as pool:
        streams = [pool.submit(stream) for _ in range(4)]
        embeds = [pool.submit(embed, i) for i in range(4)]
        assert [f.result() for f in embeds] == [20] * 4
        assert [f.result() for f in streams] == [alone] * 4


BAD = [
    ({"input": []}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": [1.5]}, "input"),
    ({"input": ["ok", "word " * 600]}, "input[1]"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "dimensions": 999}, "dimensions"),
    ({"input": "x", "truncate_prompt_tokens": 10_000}, "truncate_prompt_tokens"),
    ({"input": [10**9]}, "input"),
    ({"input": ""}, "input"),
    ({"input": ["a", ""]}, "input"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_bad_input(server, body, param):
    r = httpx.post(server.url + "/v1/embeddings", json={"model": "tiny", **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_truncation_keeps_the_last_tokens(server):
    long = "word " * 600
    r = httpx.post(
        server.url + "/v1/embeddings",
        json={"input": long, "truncate_prompt_tokens": 8, "encoding_format": "float"},
        timeout=30,
    ).json()
    assert r["usage"]["prompt_tokens"] == 8


def test_not_enabled_says_how(live_server):
    r = httpx.post(live_server.url + "/v1/embeddings", json={"input": "x"}, timeout=30)
    assert r.status_code == 400 and "--enable-embeddings" in r.json()["error"]["message"]


def test_runner_pooling_serves_embeddings_only():
    assert ServerOptions(runner="pooling").tasks == ("embed",)
    assert ServerOptions(convert="embed").tasks == ("embed",)
    assert ServerOptions(enable_embeddings=True).tasks == ("generate", "embed")
    assert ServerOptions().tasks == ("generate",)


def test_pooling_from_sentence_transformers_files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    assert resolve(tmp_path, None, True).kind == "last"
    (tmp_path / "modules.json").write_text(
        json.dumps(
            [
                {
                    "idx": 0,
                    "name": "0",
                    "path": "",
                    "type": "sentence_transformers.models.Transformer",
                },
                {
                    "idx": 1,
                    "name": "1",
                    "path": "1_Pooling",
                    "type": "sentence_transformers.models.Pooling",
                },
            ]
        )
    )
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False})
    )
    assert resolve(tmp_path, None, True).kind == "mean"
    assert resolve(tmp_path, "cls", False) == EmbeddingConfig("cls", False, 8, [])
    assert "not trained for Matryoshka" in EmbeddingConfig("last", True, 8, []).check_dimensions(4)
    assert EmbeddingConfig("last", True, 8, []).check_dimensions(8) is None


def test_invocations_answers_as_the_route_the_body_names(server):
    """SageMaker's /invocations: each body answered as its own route answers it (chat, also
    streamed; completions; embeddings; score and rerank by cosine), a body naming no route and
    a body that is not JSON each a 400."""
    url = server.url
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    bodies = [
        ("/v1/chat/completions", chat),
        ("/v1/completions", {"prompt": "the river", "max_tokens": 4, "temperature": 0}),
        ("/v1/embeddings", {"input": TEXTS}),
        ("/v1/score", {"text_1": TEXTS[0], "text_2": TEXTS[1:]}),
        ("/v1/rerank", {"query": TEXTS[0], "documents": TEXTS[1:]}),
    ]
    volatile = ("id", "created", "system_fingerprint")
    for path, body in bodies:
        want, got = (httpx.post(url + p, json=body, timeout=60) for p in (path, "/invocations"))
        assert got.status_code == want.status_code == 200, (path, got.text)
        w, g = ({k: v for k, v in r.json().items() if k not in volatile} for r in (want, got))
        assert g == w, path
    with httpx.stream("POST", url + "/invocations", json={**chat, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert (
        lines[-1] == "data: [DONE]"
        and json.loads(lines[0][6:])["object"] == "chat.completion.chunk"
    )
    r = httpx.post(url + "/invocations", json={"model": "x"})
    assert r.status_code == 400 and "messages (a chat completion)" in r.json()["error"]["message"]
    r = httpx.post(url + "/invocations", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(url + "/invocations", json={"messages": "hi"})  # the chat route's own 400
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_pooling_a_conversation(server):
    """vLLM's /pooling with messages: the conversation through the chat template, tokenized as
    a chat request's text, pooled as /v1/embeddings pools those ids."""
    messages = [{"role": "user", "content": "the river runs to the sea"}]
    r = httpx.post(server.url + "/pooling", json={"messages": messages}, timeout=30)
    assert r.status_code == 200, r.text
    tok = server.state.tokenizer
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    ids = tok.encode(text, add_special_tokens=False)
    e = httpx.post(server.url + "/v1/embeddings", json={"input": ids}, timeout=30).json()
    assert r.json()["data"][0]["data"] == pytest.approx(e["data"][0]["embedding"], abs=1e-6)
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
