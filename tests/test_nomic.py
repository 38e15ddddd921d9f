"""NomicBERT (NomicBertModel: nomic-embed-text; its sequence classifier) served offline: vectors
and pair scores (BERT's token types) equal to transformers' on the same weights, from
transformers 5's config and from nomic's own (the hub's: n_embd, n_layer, ... which
transformers 5 does not read); what weir does not compute refused by name."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

from core.config import CheckpointError
from tests.encoder_models import build_encoder, nomic_hub_layout
from weir.llm import LLM

TEXTS = [
    "the river runs to the sea",
    "a much longer text about valleys, canyons and the slow work of water on stone " * 3,
    "x",
]
QUERY = "where does the river go"


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    return build_encoder(tmp_path_factory.mktemp("nomic"), "nomic", pooling="mean")


def test_vectors_equal_transformers_from_either_config(embedder, tmp_path):
    tok = AutoTokenizer.from_pretrained(str(embedder))
    hf = AutoModel.from_pretrained(str(embedder)).eval()
    hub = nomic_hub_layout(embedder, tmp_path / "hub")
    assert "n_embd" in json.loads((hub / "config.json").read_text())
    for path in (embedder, hub):
        llm = LLM(str(path), max_model_len=128)
        for text, out in zip(TEXTS, llm.embed(TEXTS, use_tqdm=False)):
            with torch.no_grad():
                rows = hf(**tok(text, return_tensors="pt")).last_hidden_state[0]
            got = torch.tensor(out.outputs.embedding)
            assert (got - F.normalize(rows.mean(0), dim=0)).abs().max().item() < 1e-5


def test_pair_scores_equal_transformers(tmp_path):
    path = build_encoder(tmp_path / "ce", "nomic", num_labels=1)
    tok = AutoTokenizer.from_pretrained(str(path))
    hf = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    llm = LLM(str(path), max_model_len=128)
    for doc, out in zip(TEXTS, llm.score(QUERY, TEXTS, use_tqdm=False)):
        enc = tok(QUERY, doc, return_tensors="pt", return_token_type_ids=True)
        with torch.no_grad():
            want = hf(**enc).logits[0, 0].sigmoid().item()
        assert out.outputs.score == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize(
    "key,value",
    [("prenorm", True), ("rotary_emb_fraction", 0.5), ("rotary_scaling_factor", 2.0),
     ("qkv_proj_bias", True), ("activation_function", "gelu"), ("use_rms_norm", True)],
)  # fmt: skip
def test_what_weir_does_not_compute_is_refused_by_name(embedder, tmp_path, key, value):
    hub = nomic_hub_layout(embedder, tmp_path / "hub")
    config = json.loads((hub / "config.json").read_text())
    (hub / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(CheckpointError, match=key):
        LLM(str(hub))


@pytest.mark.parametrize("fmt", ["f32", "q8_0"])
def test_gguf_file_equals_transformers(embedder, fmt, tmp_path):
    """llama.cpp's "nomic-bert" file (nomic-embed-text's GGUF, as Ollama serves it), written as
    its converter writes one: the folder's tokens, and transformers' vectors (F32) or within 2%
    of them (Q8_0, kept in its format: int8 activations per 32)."""
    from tests.encoder_gguf import write_encoder_gguf

    path = write_encoder_gguf(embedder, tmp_path / "m.gguf", fmt)
    llm = LLM(str(path), max_model_len=128, device="cpu")
    assert fmt in llm.engine.runner.model.backend.resident
    tok = AutoTokenizer.from_pretrained(str(embedder))
    hf = AutoModel.from_pretrained(str(embedder)).eval()
    for text, out in zip(TEXTS, llm.embed(TEXTS, use_tqdm=False)):
        assert llm.tokenizer(text)["input_ids"] == tok(text)["input_ids"]
        with torch.no_grad():
            rows = hf(**tok(text, return_tensors="pt")).last_hidden_state[0]
        want, got = F.normalize(rows.mean(0), dim=0), torch.tensor(out.outputs.embedding)
        if fmt == "f32":
            assert (got - want).abs().max().item() < 1e-5
        else:
            assert F.cosine_similarity(got, want, dim=0).item() > 0.99
