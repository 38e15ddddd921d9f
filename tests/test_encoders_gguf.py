"""GGUF encoders (llama.cpp's "bert"): BERT with its WordPiece vocabulary and XLM-RoBERTa with
its SentencePiece one, written as llama.cpp's converter writes them (tests/encoder_models.py),
tokenize as the model's own tokenizer does (pairs and token types included) and embed as
transformers does, pooled as the file says (CLS where it says nothing); block formats stay
close to transformers on the `gguf` package's dequantization of the file; a classification
head or causal attention is refused by name; served over HTTP."""

from __future__ import annotations

import gguf
import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

from core.config import CheckpointError, EngineConfig
from tests.conftest import LiveServer
from tests.encoder_gguf import write_encoder_gguf
from tests.encoder_models import build_encoder
from weir.llm import LLM

TEXTS = ["the river runs to the sea", "Über naïve café, don't stop!", "x", "  spaced   out  "]
PAIR = ("where does the river go", "to the sea, at last")
# [CLS] ... [SEP] over fixed ids: the tiny tokenizer's training breaks ties differently from run
# to run, so a text's ids (and a block format's largest error over them) would vary with it
FIXED_IDS = [[2, *range(200, 260, 7), 3], [2, *range(20, 400, 37), 3], [2, 1, 3]]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{family: (its folder, its pooling)}, each built once."""
    return {
        family: (build_encoder(tmp_path_factory.mktemp(family), family, pooling=kind), kind)
        for family, kind in (("bert", "mean"), ("xlm-roberta", "cls"))
    }


def pooled(hf, tok, text: str, kind: str) -> torch.Tensor:
    with torch.no_grad():
        h = hf(**tok(text, return_tensors="pt")).last_hidden_state[0]
    return F.normalize(h.mean(0) if kind == "mean" else h[0], dim=0)


@pytest.mark.parametrize("family", ["bert", "xlm-roberta"])
def test_f32_file_tokenizes_and_embeds_as_transformers(folders, family, tmp_path):
    folder, kind = folders[family]
    llm = LLM(str(write_encoder_gguf(folder, tmp_path / "m.gguf")), max_model_len=64)
    tok = AutoTokenizer.from_pretrained(str(folder))
    for text in TEXTS:
        assert llm.tokenizer(text)["input_ids"] == tok(text)["input_ids"], text
    typed = {"return_token_type_ids": True}
    assert llm.tokenizer(*PAIR, **typed) == tok(*PAIR, **typed)
    hf = AutoModel.from_pretrained(str(folder)).eval()
    for text, out in zip(TEXTS, llm.embed(TEXTS, use_tqdm=False)):  # the file's pooling
        got = torch.tensor(out.outputs.embedding)
        assert (got - pooled(hf, tok, text, kind)).abs().max().item() < 1e-5


def reference(path, folder):
    """transformers on the file's weights as the `gguf` package dequantizes them."""
    hf = AutoModel.from_pretrained(str(folder)).eval()
    state = hf.state_dict()
    from gpu.gguf_names import hf_name

    for t in gguf.GGUFReader(path).tensors:
        name = hf_name(t.name, "bert")
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = torch.from_numpy(w.reshape([int(d) for d in reversed(t.shape)]))
        state[name][-w.shape[0] :].copy_(w)  # (RoBERTa's position rows: the file's last ones)
    return hf


@pytest.mark.parametrize("fmt", ["q8_0", "bf16", "q4_0"])
def test_block_formats_against_the_files_own_weights(folders, fmt, tmp_path):
    """Products on weir's block kernels (int8 activations for Q8_0 and Q4_0): within 2% of
    transformers on the dequantized file, each vector; pooled from [CLS], the default of a file
    that names no pooling. Fixed token ids, not texts (FIXED_IDS)."""
    folder, _ = folders["bert"]
    path = write_encoder_gguf(folder, tmp_path / "m.gguf", fmt, pooling=False)
    hf = reference(path, folder)
    llm = LLM(str(path), max_model_len=64, device="cpu")  # (weir's CPU kernels' formats)
    weights = llm.engine.runner.model.backend.resident
    assert fmt in weights  # kept in its format, not dequantized
    for ids, out in zip(FIXED_IDS, llm.embed(FIXED_IDS, use_tqdm=False)):
        with torch.no_grad():
            want = F.normalize(hf(input_ids=torch.tensor([ids])).last_hidden_state[0, 0], dim=0)
        got = torch.tensor(out.outputs.embedding)
        assert F.cosine_similarity(got, want, dim=0).item() > 0.999
        assert (got - want).abs().max().item() < 0.02


def test_heads_and_causal_files_are_refused_by_name(folders, tmp_path):
    folder, _ = folders["bert"]
    path = write_encoder_gguf(folder, tmp_path / "m.gguf")
    reader = gguf.GGUFReader(path)
    for extra, named in (("cls", "classification head"), ("causal", "causal attention")):
        out = tmp_path / f"{extra}.gguf"
        w = gguf.GGUFWriter(str(out), "bert")
        for field in reader.fields.values():
            if field.name.startswith("GGUF.") or field.name == "general.architecture":
                continue
            value = field.contents()
            if field.name == "bert.attention.causal" and extra == "causal":
                value = True
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(field.name, value, vtype, sub_type=sub)
        for t in reader.tensors:
            data = np.asarray(t.data)
            w.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=t.tensor_type)
        if extra == "cls":
            w.add_tensor("cls.output.weight", np.zeros((1, 64), np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with pytest.raises(CheckpointError, match=named):
            LLM(str(out))


def test_served_over_http(folders, tmp_path):
    folder, kind = folders["bert"]
    path = write_encoder_gguf(folder, tmp_path / "m.gguf", "f32")
    s = LiveServer(EngineConfig(model=str(path), max_model_len=64)).start()
    try:
        assert s.state.tasks == ("embed",)
        r = httpx.post(s.url + "/v1/embeddings", json={"input": TEXTS[:2]}, timeout=60)
        assert r.status_code == 200, r.text
        tok = AutoTokenizer.from_pretrained(str(folder))
        hf = AutoModel.from_pretrained(str(folder)).eval()
        for text, d in zip(TEXTS, r.json()["data"]):
            got = torch.tensor(d["embedding"])
            assert (got - pooled(hf, tok, text, kind)).abs().max().item() < 1e-5
    finally:
        s.stop()


def test_an_xlm_roberta_reranker_file_scores_as_transformers(tmp_path):
    """A bge-reranker-shaped file (llama.cpp's `cls` dense and `cls.output` out_proj): served as
    a one-label classifier, /score's sigmoid over the pair encoding equal to transformers'."""
    folder = build_encoder(tmp_path / "ce", "xlm-roberta", num_labels=1)
    llm = LLM(str(write_encoder_gguf(folder, tmp_path / "ce.gguf")), max_model_len=64)
    assert llm.labels == ["LABEL_0"]
    tok = AutoTokenizer.from_pretrained(str(folder))
    hf = AutoModelForSequenceClassification.from_pretrained(str(folder)).eval()
    docs = ["to the sea, at last", "x", "a canyon is a deep valley"]
    for doc, out in zip(docs, llm.score(PAIR[0], docs, use_tqdm=False)):
        with torch.no_grad():
            want = hf(**tok(PAIR[0], doc, return_tensors="pt")).logits[0, 0].sigmoid().item()
        assert out.outputs.score == pytest.approx(want, abs=1e-5)
