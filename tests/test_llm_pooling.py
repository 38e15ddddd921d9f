"""The offline pooling calls (weir/pooling.py), vLLM's LLM.classify and LLM.score: a classifier's
probabilities and a reranker's scores as transformers gives them on the same weights, the cosine
of an embedding model's vectors, and each misuse refused by name before anything runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer

from core.sampling import InvalidParam
from tests.test_scores import DOCS, LABELS, QUERY, TEXTS, hf_logits, make_classifier
from weir import LLM, PoolingParams


def test_classify_gives_transformers_probabilities_and_labels(model_dir, tmp_path):
    hf = make_classifier(model_dir("qwen3"), tmp_path, LABELS)
    llm = LLM(str(tmp_path), num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=48)
    outs = llm.classify(TEXTS, use_tqdm=False)  # the long text chunked over several steps
    assert len(outs[1].prompt_token_ids) > 48
    for out in outs:
        want = hf_logits(hf, out.prompt_token_ids)
        got = torch.tensor(out.outputs.probs)
        assert out.outputs.num_classes == 3 and out.finished
        assert torch.allclose(got, want.softmax(-1), atol=1e-5), (got, want)
        assert out.outputs.label == LABELS[int(want.argmax())]
    raw = llm.classify(TEXTS[0], PoolingParams(use_activation=False), use_tqdm=False)[0]
    assert torch.allclose(torch.tensor(raw.outputs.probs), hf_logits(hf, raw.prompt_token_ids))
    cut = llm.classify(TEXTS[1], PoolingParams(truncate_prompt_tokens=5), use_tqdm=False)[0]
    assert cut.prompt_token_ids == outs[1].prompt_token_ids[:5]  # vLLM's pooling keeps the first
    left = PoolingParams(truncate_prompt_tokens=5, truncation_side="left")
    cut = llm.classify(TEXTS[1], left, use_tqdm=False)[0]
    assert cut.prompt_token_ids == outs[1].prompt_token_ids[-5:]
    with pytest.raises(InvalidParam, match="one \\(a reranker's\\)"):
        llm.score(QUERY, DOCS)
    with pytest.raises(InvalidParam, match="sequence classifier"):
        llm.embed(TEXTS)
    with pytest.raises(InvalidParam) as bad:
        llm.classify(TEXTS, PoolingParams(truncate_prompt_tokens=0))
    assert bad.value.param == "truncate_prompt_tokens"
    assert llm.engine.kv.num_free_blocks == 64  # nothing refused was admitted


def test_score_is_a_rerankers_sigmoid_over_the_pair_encoding(model_dir, tmp_path):
    hf = make_classifier(model_dir("qwen2"), tmp_path, {0: "LABEL_0"}, std=0.1)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    llm = LLM(str(tmp_path), num_kv_blocks=64, max_model_len=128)
    outs = llm.score(QUERY, DOCS, use_tqdm=False)
    assert len(outs) == len(DOCS)
    for doc, out in zip(DOCS, outs):
        ids = tok(text=QUERY, text_pair=doc)["input_ids"]
        assert out.prompt_token_ids == ids
        want = torch.sigmoid(hf_logits(hf, ids))[0]
        assert abs(out.outputs.score - float(want)) < 1e-5, (out, want)
    pairwise = llm.score(DOCS[:2], DOCS[2:], use_tqdm=False)
    for (a, b), out in zip(zip(DOCS[:2], DOCS[2:]), pairwise):
        ids = tok(text=a, text_pair=b)["input_ids"]
        assert abs(out.outputs.score - float(torch.sigmoid(hf_logits(hf, ids))[0])) < 1e-5
    logit = llm.score(QUERY, DOCS[0], PoolingParams(use_activation=False), use_tqdm=False)[0]
    assert abs(logit.outputs.score - float(hf_logits(hf, outs[0].prompt_token_ids)[0])) < 1e-4
    cut = llm.score(QUERY, DOCS[1], use_tqdm=False, truncate_prompt_tokens=6)[0]
    assert (
        cut.prompt_token_ids
        == tok(text=QUERY, text_pair=DOCS[1], truncation=True, max_length=6)["input_ids"]
    )
    left = PoolingParams(truncation_side="left")
    cut = llm.score(QUERY, DOCS[1], left, use_tqdm=False, truncate_prompt_tokens=6)[0]
    tok.truncation_side = "left"
    want = tok(text=QUERY, text_pair=DOCS[1], truncation=True, max_length=6)["input_ids"]
    assert cut.prompt_token_ids == want and llm.tokenizer.truncation_side == "right"
    with pytest.raises(InvalidParam) as bad:
        llm.score(DOCS[:2], DOCS[:3])
    assert bad.value.param == "data_1"
    with pytest.raises(InvalidParam) as bad:
        llm.score(QUERY, [])
    assert bad.value.param == "data_2"


def test_score_on_an_embedding_model_is_the_cosine(model_dir):
    path = str(model_dir("qwen3"))
    hf = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    llm = LLM(path, num_kv_blocks=64, max_model_len=128)

    def last(text: str) -> torch.Tensor:
        with torch.no_grad():
            return hf(torch.tensor([tok.encode(text)])).last_hidden_state[0, -1]

    outs = llm.score(QUERY, DOCS, use_tqdm=False)
    for doc, out in zip(DOCS, outs):
        want = F.cosine_similarity(last(QUERY), last(doc), dim=0)
        assert abs(out.outputs.score - float(want)) < 1e-5, (out, want)
    with pytest.raises(InvalidParam) as bad:
        llm.score(QUERY, DOCS, PoolingParams(use_activation=False))
    assert bad.value.param == "use_activation"
    with pytest.raises(InvalidParam, match="not a sequence classifier"):
        llm.classify(TEXTS)
    with pytest.raises(InvalidParam) as bad:
        llm.embed(TEXTS, PoolingParams(use_activation=False))
    assert bad.value.param == "use_activation"
