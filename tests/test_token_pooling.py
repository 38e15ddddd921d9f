"""vLLM's token-level pooling tasks: "token_embed" (every token's final hidden state, each
normalized) from any embedding model, an encoder's or a decoder's over chunked steps, and
"token_classify" (a *ForTokenClassification's probabilities, or logits, for every token) from
BERT's, RoBERTa's, MPNet's, NomicBERT's and ModernBERT's token classifiers: equal to transformers
on the same weights, offline (LLM.encode) and over HTTP (/pooling), each misuse refused by
name."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoModelForTokenClassification

from core.config import EngineConfig
from core.sampling import InvalidParam
from tests.conftest import LiveServer
from tests.encoder_models import build_encoder
from weir import LLM, PoolingParams

TEXTS = ["the river runs to the sea", "a canyon is a deep valley made by water on stone", "x"]


def rows_of(out) -> torch.Tensor:
    return torch.tensor(out.outputs.data)


@pytest.mark.parametrize("family", ["bert", "xlm-roberta", "mpnet", "nomic", "modernbert"])
def test_token_classify_equals_transformers(tmp_path, family):
    path = build_encoder(tmp_path, family, num_labels=3, per_token=True, pooling=None)
    hf = AutoModelForTokenClassification.from_pretrained(str(path)).eval()
    llm = LLM(str(path))
    outs = llm.encode(TEXTS, use_tqdm=False)  # the model's own task: token_classify
    raw = llm.encode(TEXTS, PoolingParams(use_activation=False), use_tqdm=False)
    for out, logits in zip(outs, raw):
        ids = out.prompt_token_ids
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0]
        assert rows_of(out).shape == (len(ids), 3)
        assert torch.allclose(rows_of(logits), want, atol=1e-4), family
        assert torch.allclose(rows_of(out), want.softmax(-1), atol=1e-5), family
    for call, name in ((llm.classify, "token classifier"), (llm.embed, "token classifier")):
        with pytest.raises(InvalidParam, match=name):
            call(TEXTS)
    with pytest.raises(InvalidParam, match="token_classify"):
        llm.encode(TEXTS, pooling_task="rank")


def test_token_embed_from_an_encoder_and_a_decoder_over_chunks(tmp_path, model_dir):
    path = build_encoder(tmp_path / "bert", "bert", pooling="mean")
    hf = AutoModel.from_pretrained(str(path)).eval()
    llm = LLM(str(path))
    outs = llm.encode(TEXTS, use_tqdm=False, pooling_task="token_embed")
    bare = llm.encode(TEXTS[1], PoolingParams(use_activation=False), pooling_task="token_embed")
    with torch.no_grad():
        hidden = [hf(torch.tensor([o.prompt_token_ids])).last_hidden_state[0] for o in outs]
    for out, h in zip(outs, hidden):
        assert torch.allclose(rows_of(out), F.normalize(h, dim=-1), atol=1e-5)
    assert torch.allclose(rows_of(bare[0]), hidden[1], atol=1e-4)
    with pytest.raises(InvalidParam, match="not a token classifier"):
        llm.encode(TEXTS, pooling_task="token_classify")
    # a decoder: its prompt run in chunks of 8 tokens, every chunk's rows kept
    decoder = model_dir("qwen3")
    hf = AutoModel.from_pretrained(decoder, dtype=torch.float32).eval()
    llm = LLM(decoder, num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=8)
    out = llm.encode(TEXTS[1], pooling_task="token_embed", use_tqdm=False)[0]
    ids = out.prompt_token_ids
    assert len(ids) > 8
    with torch.no_grad():
        want = F.normalize(hf(torch.tensor([ids])).last_hidden_state[0], dim=-1)
    assert torch.allclose(rows_of(out), want, atol=1e-4)
    again = llm.encode(TEXTS[1], pooling_task="token_embed", use_tqdm=False)[0]  # (no cache)
    assert again.num_cached_tokens == 0 and again.outputs.data == out.outputs.data


@pytest.fixture(scope="module")
def token_classifier(tmp_path_factory):
    path = build_encoder(tmp_path_factory.mktemp("bert-ner"), "bert", num_labels=4, per_token=True)
    config = EngineConfig(model=str(path), served_model_name=["ner"], check_integrity=True)
    s = LiveServer(config).start()
    yield s, AutoModelForTokenClassification.from_pretrained(str(path)).eval()
    s.stop()


def test_pooling_route_labels_every_token(token_classifier):
    s, hf = token_classifier
    tok = s.state.tokenizer
    assert s.state.tasks == ("token_classify",)
    r = httpx.post(s.url + "/pooling", json={"input": TEXTS[:2]}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == sum(len(tok(t)["input_ids"]) for t in TEXTS[:2])
    for text, d in zip(TEXTS, body["data"]):
        ids = tok(text)["input_ids"]
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0].softmax(-1)
        assert torch.allclose(torch.tensor(d["data"]), want, atol=1e-5)
    r = httpx.post(
        s.url + "/pooling",
        json={"input": TEXTS[0], "task": "token_classify", "use_activation": False,
              "encoding_format": "base64"},
        timeout=60,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    flat = np.frombuffer(base64.b64decode(r.json()["data"][0]["data"]), dtype="<f4")
    with torch.no_grad():
        want = hf(torch.tensor([tok(TEXTS[0])["input_ids"]])).logits[0]
    assert torch.allclose(torch.from_numpy(flat.copy()).view(-1, 4), want, atol=1e-4)
    for route, body, field in (
        ("/classify", {"input": "x"}, "model"),
        ("/v1/embeddings", {"input": "x"}, "model"),
        ("/pooling", {"input": "x", "task": "embed"}, "model"),
        ("/pooling", {"input": "x", "task": "token_embed"}, "model"),
        ("/pooling", {"input": "x", "task": "rank"}, "task"),
        ("/v1/completions", {"prompt": "x"}, "model"),
    ):
        r = httpx.post(s.url + route, json=body, timeout=60)
        assert r.status_code == 400, (route, body, r.text)
        assert field in (r.json()["error"]["param"] or ""), (route, r.text)


def test_pooling_route_token_embed(tmp_path):
    path = build_encoder(tmp_path, "bert", pooling="cls")
    hf = AutoModel.from_pretrained(str(path)).eval()
    config = EngineConfig(model=str(path), served_model_name=["enc"], check_integrity=True)
    s = LiveServer(config).start()
    try:
        r = httpx.post(s.url + "/pooling", json={"input": TEXTS, "task": "token_embed"}, timeout=60)
        assert r.status_code == 200, r.text
        for text, d in zip(TEXTS, r.json()["data"]):
            ids = s.state.tokenizer(text)["input_ids"]
            with torch.no_grad():
                want = F.normalize(hf(torch.tensor([ids])).last_hidden_state[0], dim=-1)
            assert torch.allclose(torch.tensor(d["data"]), want, atol=1e-5)
        r = httpx.post(s.url + "/pooling", json={"input": "x", "task": "token_classify"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
        assert "not a token classifier" in r.json()["error"]["message"]
    finally:
        s.stop()
