"""The pooling a model names for itself is the default of the server's /v1/embeddings and of
LLM.embed alike: its sentence-transformers files (modules.json and the Pooling module's config),
else a GGUF file's pooling_type (as llama.cpp's converter writes it), else the last token.
Before, LLM.embed always took the last token, and a GGUF file's pooling_type was unread (and its
vector size unknown to the server, so `dimensions` equal to it was refused)."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer

from core.config import EngineConfig
from gpu.quant.gguf_write import uniform, write_gguf
from tests.conftest import LiveServer
from weir import LLM, PoolingParams

TEXT = "the river runs over stone to the sea"


def hf_vectors(hf_dir, ids: list[int]) -> dict[str, torch.Tensor]:
    """transformers' final hidden states of `ids`, pooled each way and normalized."""
    hf = AutoModel.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        states = hf(torch.tensor([ids])).last_hidden_state[0]
    pooled = {"mean": states.mean(0), "last": states[-1], "cls": states[0]}
    return {k: F.normalize(v, dim=0) for k, v in pooled.items()}


def close(got: list[float], want: torch.Tensor) -> bool:
    return torch.allclose(torch.tensor(got), want, atol=1e-4)


@pytest.fixture(scope="module")
def mean_file(model_dir, tmp_path_factory):
    hf = model_dir("qwen3")
    path = tmp_path_factory.mktemp("pooling") / "embed-mean.gguf"
    return hf, write_gguf(hf, path, uniform("f32"), pooling="mean")


def test_llm_embed_takes_a_gguf_files_pooling_type(mean_file):
    hf, path = mean_file
    llm = LLM(str(path), num_kv_blocks=64, max_model_len=256)
    out = llm.embed(TEXT, use_tqdm=False)[0]
    want = hf_vectors(hf, out.prompt_token_ids)
    assert close(out.outputs.embedding, want["mean"])
    last = llm.embed(TEXT, PoolingParams(kind="last"), use_tqdm=False)[0]  # named: as asked
    assert close(last.outputs.embedding, want["last"])
    llm.engine.close()


def test_the_server_takes_a_gguf_files_pooling_type_and_size(mean_file):
    hf, path = mean_file
    config = EngineConfig(model=str(path), num_kv_blocks=64, max_model_len=256)
    s = LiveServer(config, runner="pooling", engine_process=True).start()
    try:
        assert s.state.embedding.kind == "mean"
        size = s.state.embedding.hidden_size
        body = {"input": TEXT, "dimensions": size}  # its own size: always allowed
        r = httpx.post(s.url + "/v1/embeddings", json=body)
        assert r.status_code == 200, r.text
        ids = s.state.tokenizer.encode(TEXT)
        assert close(r.json()["data"][0]["embedding"], hf_vectors(hf, ids)["mean"])
        r = httpx.post(s.url + "/v1/embeddings", json={"input": TEXT, "dimensions": size + 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"
    finally:
        s.stop()


def test_llm_embed_takes_the_sentence_transformers_pooling(model_dir, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(model_dir("qwen3"), path)
    kinds = "sentence_transformers.models."
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": kinds + "Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": kinds + "Pooling"},
    ]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    llm = LLM(str(path), num_kv_blocks=64, max_model_len=256)
    out = llm.embed(TEXT, use_tqdm=False)[0]
    assert out.prompt_token_ids == AutoTokenizer.from_pretrained(path).encode(TEXT)
    assert close(out.outputs.embedding, hf_vectors(path, out.prompt_token_ids)["cls"])
    llm.engine.close()
