"""Encoders served over HTTP: a BERT embedding model (its engine in its own process) answers
/v1/embeddings with transformers' vectors, keeps [CLS] and [SEP] when it truncates, scores by
cosine and refuses generation with a 400 naming the model; a BERT cross-encoder's /score,
/rerank and /classify give transformers' sigmoid over the pair encoding, its second text of
token type 1."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoModelForSequenceClassification

from core.config import EngineConfig
from tests.conftest import LiveServer
from tests.encoder_models import build_encoder

TEXTS = ["the river runs to the sea", "a canyon is a deep valley made by water on stone", "x"]
QUERY = "where does the river go"
DOCS = ["the river runs to the sea", "a canyon is a deep valley", "x", "water on stone"]


def serve(path, **options) -> LiveServer:
    config = EngineConfig(model=str(path), served_model_name=["enc"], check_integrity=True)
    return LiveServer(config, **options).start()


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    path = build_encoder(tmp_path_factory.mktemp("bert-embed"), "bert", pooling="mean")
    s = serve(path, engine_process=True)
    yield s, AutoModel.from_pretrained(str(path)).eval()
    s.stop()


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    path = build_encoder(tmp_path_factory.mktemp("bert-ce"), "bert", num_labels=1)
    s = serve(path)
    yield s, AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    s.stop()


def mean_vector(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return F.normalize(hf(torch.tensor([ids])).last_hidden_state[0].mean(0), dim=0)


def test_embeddings_equal_transformers_and_generation_is_refused(embedder):
    s, hf = embedder
    tok = s.state.tokenizer
    assert s.state.tasks == ("embed",)
    r = httpx.post(s.url + "/v1/embeddings", json={"input": TEXTS, "model": "enc"}, timeout=60)
    assert r.status_code == 200, r.text
    for text, d in zip(TEXTS, r.json()["data"]):
        want = mean_vector(hf, tok(text)["input_ids"])
        assert (torch.tensor(d["embedding"]) - want).abs().max().item() < 1e-5
    assert r.json()["usage"]["prompt_tokens"] == sum(len(tok(t)["input_ids"]) for t in TEXTS)
    for path, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi"}),
    ):
        r = httpx.post(s.url + path, json={"model": "enc", **body}, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "model" and error["code"] == "generation_not_supported"
        assert "encoder" in error["message"]


@pytest.mark.parametrize("side", [None, "right", "left"])
def test_truncation_keeps_cls_and_sep(embedder, side):
    """truncate_prompt_tokens=6: [CLS], the text's first four tokens (vLLM's pooling default,
    truncation_side "right") or its last four ("left"), [SEP]: never [CLS] cut off."""
    s, hf = embedder
    ids = s.state.tokenizer(TEXTS[1])["input_ids"]
    kept = ids[:1] + ids[-5:] if side == "left" else ids[:5] + ids[-1:]
    body = {"input": TEXTS[1], "truncate_prompt_tokens": 6, "truncation_side": side}
    r = httpx.post(s.url + "/v1/embeddings", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 6
    got = torch.tensor(r.json()["data"][0]["embedding"])
    assert (got - mean_vector(hf, kept)).abs().max().item() < 1e-5


def test_an_embedding_encoder_scores_by_cosine(embedder):
    s, hf = embedder
    tok = s.state.tokenizer
    r = httpx.post(s.url + "/score", json={"text_1": QUERY, "text_2": DOCS[:2]}, timeout=60)
    assert r.status_code == 200, r.text
    q = mean_vector(hf, tok(QUERY)["input_ids"])
    want = [float(q @ mean_vector(hf, tok(d)["input_ids"])) for d in DOCS[:2]]
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(want, abs=1e-5)


def test_cross_encoder_scores_and_ranks_as_transformers(cross_encoder):
    s, hf = cross_encoder
    tok = s.state.tokenizer
    assert s.state.tasks == ("classify", "score")

    def want(a: str, b: str) -> float:
        enc = tok(a, b, return_tensors="pt", return_token_type_ids=True)
        with torch.no_grad():
            return hf(**enc).logits[0, 0].sigmoid().item()

    r = httpx.post(s.url + "/v1/score", json={"text_1": QUERY, "text_2": DOCS}, timeout=60)
    assert r.status_code == 200, r.text
    scores = [d["score"] for d in r.json()["data"]]
    assert scores == pytest.approx([want(QUERY, d) for d in DOCS], abs=1e-5)
    best = sorted(range(len(DOCS)), key=lambda i: -scores[i])
    r = httpx.post(s.url + "/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 2})
    assert r.status_code == 200, r.text
    assert [x["index"] for x in r.json()["results"]] == best[:2]
    r = httpx.post(s.url + "/classify", json={"input": TEXTS[0]}, timeout=60)
    with torch.no_grad():
        p = hf(**tok(TEXTS[0], return_tensors="pt")).logits[0, 0].sigmoid().item()
    assert r.json()["data"][0]["probs"] == pytest.approx([p], abs=1e-5)
    r = httpx.post(s.url + "/v1/embeddings", json={"input": "a"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_pooling_route_gives_the_models_own_outputs(embedder, cross_encoder):
    """vLLM's /pooling: an embedder's vectors as /v1/embeddings gives them (use_activation
    false: not normalized; base64 too), a classifier's probabilities as /classify gives them
    (use_activation false: the raw logit); what it does not take, a 400 naming it."""
    s, hf = embedder
    r = httpx.post(s.url + "/pooling", json={"input": TEXTS}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["id"].startswith("pool")
    embedded = httpx.post(s.url + "/v1/embeddings", json={"input": TEXTS}, timeout=60).json()
    for d, e in zip(body["data"], embedded["data"]):
        assert d["object"] == "pooling" and d["data"] == pytest.approx(e["embedding"], abs=1e-6)
    raw = httpx.post(s.url + "/pooling", json={"input": TEXTS[0], "use_activation": False}).json()
    ids = s.state.tokenizer(TEXTS[0])["input_ids"]
    with torch.no_grad():
        mean = hf(torch.tensor([ids])).last_hidden_state[0].mean(0)
    assert torch.tensor(raw["data"][0]["data"]) == pytest.approx(mean, abs=1e-5)
    b64 = httpx.post(s.url + "/pooling", json={"input": TEXTS[0], "encoding_format": "base64"})
    vector = np.frombuffer(base64.b64decode(b64.json()["data"][0]["data"]), "<f4")
    assert vector.tolist() == pytest.approx(body["data"][0]["data"], abs=1e-7)
    for bad, param in (
        ({"input": "a", "dimensions": 8}, "dimensions"),
        ({}, "input"),
        ({"input": "a", "task": "classify"}, "model"),
        ({"messages": [{"role": "user", "content": "a"}]}, "messages"),  # no chat template
    ):
        r = httpx.post(s.url + "/pooling", json=bad, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)
    c, _ = cross_encoder
    classified = httpx.post(c.url + "/classify", json={"input": TEXTS}, timeout=60).json()
    pooled = httpx.post(c.url + "/pooling", json={"input": TEXTS}, timeout=60).json()
    for p, k in zip(pooled["data"], classified["data"]):
        assert p["data"] == pytest.approx(k["probs"], abs=1e-7)
    raw = httpx.post(c.url + "/pooling", json={"input": TEXTS[0], "use_activation": False})
    p = classified["data"][0]["probs"][0]
    assert raw.json()["data"][0]["data"][0] == pytest.approx(np.log(p / (1 - p)), abs=1e-4)
