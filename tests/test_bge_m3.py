"""BGE-M3's three outputs, as vLLM serves them under `--hf-overrides '{"architectures":
["BgeM3EmbeddingModel"]}'`: the dense vector (XLM-RoBERTa's CLS row, normalized: "embed"), the
sparse weights (ReLU of `sparse_linear.pt` over each token's row, BOS and EOS left out, one float
a token: "token_classify") and the ColBERT vectors (`colbert_linear.pt` over each row but the
BOS's, normalized: "token_embed"); equal to transformers' XLM-RoBERTa with the two heads put over
it, offline and over HTTP."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel

from core.config import CheckpointError, EngineConfig
from tests.conftest import LiveServer
from tests.encoder_models import build_encoder
from weir import LLM, PoolingParams

TEXTS = ["the river runs to the sea", "a canyon is a deep valley made by water on stone", "x"]
M3 = {"architectures": ["BgeM3EmbeddingModel"]}


def build_m3(path):
    """An XLM-RoBERTa embedder (CLS pooling, as bge-m3's) with bge-m3's two head files."""
    build_encoder(path, "xlm-roberta", pooling="cls")
    g = torch.Generator().manual_seed(3)
    h = 64
    heads = {
        "sparse_linear": {"weight": torch.randn(1, h, generator=g) * 0.3,
                          "bias": torch.randn(1, generator=g) * 0.1},
        "colbert_linear": {"weight": torch.randn(h, h, generator=g) * 0.3,
                           "bias": torch.randn(h, generator=g) * 0.1},
    }  # fmt: skip
    for name, state in heads.items():
        torch.save(state, path / f"{name}.pt")
    return heads, AutoModel.from_pretrained(str(path)).eval()


def hidden_of(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).last_hidden_state[0]


def test_dense_sparse_and_colbert_offline(tmp_path):
    heads, hf = build_m3(tmp_path)
    llm = LLM(str(tmp_path), max_model_len=128, hf_overrides=M3)
    sp, cb = heads["sparse_linear"], heads["colbert_linear"]
    dense = llm.encode(TEXTS, use_tqdm=False)  # (its own task: embed)
    sparse = llm.encode(TEXTS, pooling_task="token_classify", use_tqdm=False)
    raw = llm.encode(TEXTS, PoolingParams(use_activation=False), pooling_task="token_classify")
    colbert = llm.encode(TEXTS, pooling_task="token_embed", use_tqdm=False)
    for d, s, r, c in zip(dense, sparse, raw, colbert):
        ids = d.prompt_token_ids
        h = hidden_of(hf, ids)
        assert torch.allclose(torch.tensor(d.outputs.data), F.normalize(h[0], dim=0), atol=1e-5)
        logits = (h @ sp["weight"].T + sp["bias"])[1:-1, 0]  # (BOS and EOS left out)
        assert len(s.outputs.data) == len(ids) - 2
        assert torch.allclose(torch.tensor(s.outputs.data), torch.relu(logits), atol=1e-5)
        assert torch.allclose(torch.tensor(r.outputs.data), logits, atol=1e-5)
        want = F.normalize((h @ cb["weight"].T + cb["bias"])[1:], dim=-1)  # (BOS left out)
        assert torch.allclose(torch.tensor(c.outputs.data), want, atol=1e-5)


def test_served_over_http(tmp_path):
    heads, hf = build_m3(tmp_path)
    config = EngineConfig(model=str(tmp_path), served_model_name=["m3"], hf_overrides=M3)
    s = LiveServer(config).start()
    try:
        assert s.state.tasks == ("embed", "token_classify")
        tok = s.state.tokenizer
        body = {"input": TEXTS[:2], "task": "token_classify"}
        r = httpx.post(s.url + "/pooling", json=body, timeout=60)
        assert r.status_code == 200, r.text
        sp = heads["sparse_linear"]
        for text, d in zip(TEXTS, r.json()["data"]):
            h = hidden_of(hf, tok(text)["input_ids"])
            want = torch.relu(h @ sp["weight"].T + sp["bias"])[1:-1, 0]
            assert torch.allclose(torch.tensor(d["data"]), want, atol=1e-5)
        r = httpx.post(s.url + "/pooling", json={**body, "encoding_format": "base64"}, timeout=60)
        flat = np.frombuffer(base64.b64decode(r.json()["data"][0]["data"]), dtype="<f4")
        assert len(flat) == len(tok(TEXTS[0])["input_ids"]) - 2
        r = httpx.post(s.url + "/pooling", json={"input": TEXTS[0]}, timeout=60)  # (embed)
        h = hidden_of(hf, tok(TEXTS[0])["input_ids"])
        got = torch.tensor(r.json()["data"][0]["data"])
        assert torch.allclose(got, F.normalize(h[0], dim=0), atol=1e-5)
        r = httpx.post(s.url + "/v1/embeddings", json={"input": TEXTS[0]}, timeout=60)
        assert torch.allclose(torch.tensor(r.json()["data"][0]["embedding"]), got, atol=1e-6)
        r = httpx.post(s.url + "/classify", json={"input": "x"}, timeout=60)
        assert r.status_code == 400, r.text
    finally:
        s.stop()


def test_the_head_files_are_required(tmp_path):
    build_m3(tmp_path)
    (tmp_path / "colbert_linear.pt").unlink()
    with pytest.raises(CheckpointError, match="colbert_linear.pt"):
        LLM(str(tmp_path), hf_overrides=M3)
