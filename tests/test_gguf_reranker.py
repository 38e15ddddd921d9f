"""A Qwen3 reranker as a GGUF file, as llama.cpp's converter writes one (pooling_type rank, the LM
head's "yes" and "no" rows as `cls.output`, its prompt as `tokenizer.chat_template.rerank`):
served as a one-label classifier whose score is P("yes") at the last token of the file's prompt
with the pair filled in, which is what llama.cpp's softmax over the two rows gives and what
transformers' causal LM gives on the same weights; /rerank, /score and LLM.score alike;
truncate_prompt_tokens shortens the document, never the prompt; any other head is refused."""

from __future__ import annotations

import httpx
import pytest
import torch

from core.config import CheckpointError, EngineConfig
from gpu.quant.gguf_write import uniform, write_gguf
from tests.conftest import LiveServer

TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements of the Query. Answer "
    'only "yes" or "no".<|im_end|>\n<|im_start|>user\n<Query>: {query}\n<Document>: {document}'
    "<|im_end|>\n<|im_start|>assistant\n"
)
QUERY = "where does the river go"
DOCS = ["the river runs to the sea", "a canyon is a deep valley", "x", "water on stone"]


@pytest.fixture(scope="module")
def files(model_dir, tmp_path_factory):
    """(HF folder, GGUF file) of a tied and an untied Qwen3 (the tiny vocabulary gains "yes")."""
    root = tmp_path_factory.mktemp("gguf-rerank")
    out = {}
    for tie in (True, False):
        hf = model_dir("qwen3", added_tokens=("yes",), tie_word_embeddings=tie)
        out[tie] = hf, write_gguf(hf, root / f"rerank-{tie}.gguf", uniform("f32"), rerank=TEMPLATE)
    return out


def want(hf, docs, query=QUERY, ids=None) -> list[float]:
    """transformers' causal LM: P("yes") against "no" after each filled prompt (or after each
    of `ids`, given)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lm = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(hf)
    yes, no = tok.convert_tokens_to_ids(["yes", "no"])
    if ids is None:
        texts = [TEMPLATE.replace("{query}", query).replace("{document}", d) for d in docs]
        ids = [tok.encode(text, add_special_tokens=False) for text in texts]
    out = []
    for row in ids:
        with torch.no_grad():
            logits = lm(torch.tensor([row])).logits[0, -1]
        out.append(logits[[yes, no]].softmax(-1)[0].item())
    return out


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_llm_score_is_p_yes_of_the_files_prompt(files, tie):
    from weir import LLM

    hf, path = files[tie]
    llm = LLM(str(path), num_kv_blocks=64, max_model_len=256)
    assert llm.score_template == TEMPLATE and llm.engine.runner.num_labels == 1
    got = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
    assert got == pytest.approx(want(hf, DOCS), abs=1e-5)
    llm.engine.close()


def test_served_rerank_score_and_truncation(files):
    hf, path = files[True]
    wanted = want(hf, DOCS)
    config = EngineConfig(model=str(path), num_kv_blocks=64, max_model_len=256)
    s = LiveServer(config, engine_process=True).start()  # the prompt crosses EngineReady
    try:
        assert s.state.score_template == TEMPLATE
        r = httpx.post(s.url + "/v1/rerank", json={"query": QUERY, "documents": DOCS})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == sorted(range(4), key=lambda i: -wanted[i])
        assert [x["relevance_score"] for x in results] == pytest.approx(
            sorted(wanted, reverse=True), abs=1e-5
        )
        r = httpx.post(s.url + "/score", json={"text_1": QUERY, "text_2": DOCS[:2]})
        assert [x["score"] for x in r.json()["data"]] == pytest.approx(wanted[:2], abs=1e-5)
        # the document loses its end; the prompt and the query stay whole
        tok = s.state.tokenizer
        head, _, tail = TEMPLATE.replace("{query}", QUERY).partition("{document}")
        head, tail = (tok.encode(t, add_special_tokens=False) for t in (head, tail))
        doc = tok.encode(DOCS[0], add_special_tokens=False)
        fixed = len(head) + len(tail)
        keep = fixed + 2
        body = {"query": QUERY, "documents": [DOCS[0]], "truncate_prompt_tokens": keep}
        r = httpx.post(s.url + "/rerank", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["total_tokens"] == keep
        (cut,) = want(hf, None, ids=[head + doc[:2] + tail])
        assert r.json()["results"][0]["relevance_score"] == pytest.approx(cut, abs=1e-5)
        r = httpx.post(s.url + "/rerank", json={**body, "truncate_prompt_tokens": fixed - 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"
    finally:
        s.stop()


def test_a_head_of_another_model_is_refused_by_name(model_dir, tmp_path):
    from gpu.launch import load

    hf = model_dir("llama", added_tokens=("yes",))
    path = write_gguf(hf, tmp_path / "llama-rerank.gguf", uniform("f32"), rerank=TEMPLATE)
    with pytest.raises(CheckpointError, match="served for Qwen3 rerankers"):
        load(EngineConfig(model=str(path), num_kv_blocks=16))
