"""ModernBERT (ModernBertModel, ModernBertForSequenceClassification) served offline: vectors and
classifier logits (its CLS row or its mean through the head) equal to transformers' on the same
weights, inputs longer than the local layers' window among them, on weir's CPU backend and the
CUDA backend (compiled on a GPU, else in Triton's interpreter)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

from tests.encoder_models import build_encoder
from weir.llm import LLM

TEXTS = [
    "the river runs to the sea",
    "a much longer text about valleys, canyons and the slow work of water on stone " * 2,
    "x",
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    made = {}

    def get(labels: int = 0, pooling: str = "mean"):
        if (labels, pooling) not in made:
            path = tmp_path_factory.mktemp(f"modernbert-{labels}-{pooling}")
            made[labels, pooling] = build_encoder(
                path, "modernbert", num_labels=labels, pooling=pooling, num_layers=3
            )
        return made[labels, pooling]

    return get


def test_embeddings_equal_transformers_and_the_window_counts(folders):
    """Three layers, the first global and two local (4 tokens either way): an 81-token input
    and two short ones in one step, each vector transformers' (mean pooling, the folder's
    sentence-transformers files); the same weights with no window give other vectors."""
    path = folders()
    llm = LLM(str(path), max_model_len=128)
    tok = AutoTokenizer.from_pretrained(str(path))
    hf = AutoModel.from_pretrained(str(path)).eval()
    unwindowed = AutoModel.from_pretrained(str(path), local_attention=1024).eval()
    for text, out in zip(TEXTS, llm.embed(TEXTS, use_tqdm=False)):
        enc = tok(text, return_tensors="pt")
        with torch.no_grad():
            want = F.normalize(hf(**enc).last_hidden_state[0].mean(0), dim=0)
            other = F.normalize(unwindowed(**enc).last_hidden_state[0].mean(0), dim=0)
        got = torch.tensor(out.outputs.embedding)
        assert (got - want).abs().max().item() < 1e-5
        if len(enc["input_ids"][0]) > 9:  # the window cuts this one's attention
            assert (other - want).abs().max().item() > 1e-3


@pytest.mark.parametrize("pooling", ["cls", "mean"])
@pytest.mark.parametrize("backend", ["cpu", "cuda-backend"])
def test_classifier_equals_transformers(folders, pooling, backend, monkeypatch):
    path = folders(labels=3, pooling=pooling)
    kw = {}
    if backend == "cuda-backend":
        from tests.test_phi3 import use_cuda_backend

        kw = use_cuda_backend(monkeypatch)
    llm = LLM(str(path), max_model_len=128, **kw)
    tok = AutoTokenizer.from_pretrained(str(path))
    hf = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    for text, out in zip(TEXTS, llm.classify(TEXTS, use_tqdm=False)):
        with torch.no_grad():
            want = hf(**tok(text, return_tensors="pt")).logits[0].softmax(-1)
        assert (torch.tensor(out.outputs.probs) - want).abs().max().item() < 1e-4


def test_older_configs_name_the_pattern_and_bases_their_own_way():
    """A hub config.json (and transformers before 5) names global_attn_every_n_layers and
    global/local_rope_theta; transformers 5 makes them layer_types and rope_parameters: the
    spec reads either alike."""
    from types import SimpleNamespace

    from transformers import ModernBertConfig

    from gpu.models.encoder_spec import EncoderSpec

    raw = dict(
        architectures=["ModernBertModel"], hidden_size=64, num_attention_heads=4,
        num_hidden_layers=5, intermediate_size=96, vocab_size=300, global_attn_every_n_layers=2,
        global_rope_theta=5000.0, local_rope_theta=500.0, local_attention=16,
    )  # fmt: skip
    old = EncoderSpec.from_hf_config(SimpleNamespace(**raw, max_position_embeddings=512))
    new = EncoderSpec.from_hf_config(ModernBertConfig(**raw))
    assert old.local_layers == new.local_layers == (False, True, False, True, False)
    assert (old.rope_theta, old.local_rope_theta) == (new.rope_theta, new.local_rope_theta)
    assert (new.rope_theta, new.local_rope_theta, new.window) == (5000.0, 500.0, 8)


@pytest.mark.parametrize("labels,pooling", [(0, "mean"), (3, "cls"), (3, "mean")])
def test_gguf_file_equals_transformers(folders, labels, pooling, tmp_path):
    """llama.cpp's "modern-bert" file (written as its converter writes one: its names and keys,
    the BPE vocabulary with [CLS] and [SEP] as BOS and EOS): tokens and pairs as the folder's
    tokenizer gives them, and transformers' vectors or probabilities."""
    from tests.encoder_gguf import write_modernbert_gguf

    path = folders(labels=labels, pooling=pooling)
    llm = LLM(str(write_modernbert_gguf(path, tmp_path / "m.gguf")), max_model_len=128)
    tok = AutoTokenizer.from_pretrained(str(path))
    for text in TEXTS:
        assert llm.tokenizer(text)["input_ids"] == tok(text)["input_ids"]
    typed = {"return_token_type_ids": True}
    assert llm.tokenizer("a b", "c d", **typed) == tok("a b", "c d", **typed)
    if labels:
        hf = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
        for text, out in zip(TEXTS, llm.classify(TEXTS, use_tqdm=False)):
            with torch.no_grad():
                want = hf(**tok(text, return_tensors="pt")).logits[0].softmax(-1)
            assert (torch.tensor(out.outputs.probs) - want).abs().max().item() < 1e-5
        return
    hf = AutoModel.from_pretrained(str(path)).eval()
    for text, out in zip(TEXTS, llm.embed(TEXTS, use_tqdm=False)):
        with torch.no_grad():
            rows = hf(**tok(text, return_tensors="pt")).last_hidden_state[0]
        want = F.normalize(rows.mean(0), dim=0)
        assert (torch.tensor(out.outputs.embedding) - want).abs().max().item() < 1e-5
