"""sentence-transformers' Dense modules (modules.json: Transformer, Pooling, Dense, Normalize, as
LaBSE's tanh projection or stella's 1,024-wide one): the pooled vector goes through each Dense
layer before truncation and normalization, as sentence-transformers computes it; the served size
is the last layer's; an activation weir does not have is refused by name, never skipped."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel

from core.config import CheckpointError, EngineConfig
from core.sampling import InvalidParam
from tests.conftest import LiveServer
from tests.encoder_models import build_encoder
from weir import LLM, PoolingParams

TEXTS = ["the river runs to the sea", "a canyon is a deep valley made by water on stone", "x"]


def with_dense(path, layers: list[tuple[int, int, str]], seed: int = 1):
    """`path`'s modules.json with Dense modules after its Pooling one (in, out, activation
    each), their weights saved as sentence-transformers saves them; returns the layers."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    modules = json.loads((path / "modules.json").read_text())
    pooling = next(i for i, m in enumerate(modules) if m["type"].endswith("Pooling"))
    made = []
    for j, (n_in, n_out, act) in enumerate(layers):
        folder = path / f"{2 + j}_Dense"
        folder.mkdir()
        w, b = torch.randn(n_out, n_in, generator=g) * 0.3, torch.randn(n_out, generator=g) * 0.1
        save_file({"linear.weight": w, "linear.bias": b}, str(folder / "model.safetensors"))
        config = {"in_features": n_in, "out_features": n_out, "bias": True,
                  "activation_function": f"torch.nn.modules.activation.{act}"}  # fmt: skip
        (folder / "config.json").write_text(json.dumps(config))
        module = {"idx": 0, "name": folder.name, "path": folder.name,
                  "type": "sentence_transformers.models.Dense"}  # fmt: skip
        modules.insert(pooling + 1 + j, module)
        made.append((w, b, act))
    for i, m in enumerate(modules):
        m["idx"] = i
    (path / "modules.json").write_text(json.dumps(modules))
    return made


def projected(vector: torch.Tensor, layers) -> torch.Tensor:
    acts = {"Tanh": torch.tanh, "Identity": lambda x: x}
    for w, b, act in layers:
        vector = acts[act](vector @ w.T + b)
    return vector


def test_dense_modules_project_the_pooled_vector(tmp_path):
    path = build_encoder(tmp_path, "bert", pooling="cls")  # (LaBSE's: CLS, Dense, Normalize)
    layers = with_dense(path, [(64, 48, "Tanh"), (48, 32, "Identity")])
    hf = AutoModel.from_pretrained(str(path)).eval()
    llm = LLM(str(path), max_model_len=128)
    for out in llm.embed(TEXTS, use_tqdm=False):
        with torch.no_grad():
            hidden = hf(torch.tensor([out.prompt_token_ids])).last_hidden_state[0]
        want = F.normalize(projected(hidden[0], layers), dim=0)
        assert len(out.outputs.embedding) == 32
        assert torch.allclose(torch.tensor(out.outputs.embedding), want, atol=1e-5)
    # vLLM's token_embed projects every row
    out = llm.encode(TEXTS[1], pooling_task="token_embed", use_tqdm=False)[0]
    with torch.no_grad():
        hidden = hf(torch.tensor([out.prompt_token_ids])).last_hidden_state[0]
    want = F.normalize(projected(hidden, layers), dim=-1)
    assert torch.allclose(torch.tensor(out.outputs.data), want, atol=1e-5)
    with pytest.raises(InvalidParam) as bad:  # (the served size is the projection's)
        llm.embed(TEXTS[0], PoolingParams(dimensions=64), use_tqdm=False)
    assert bad.value.param == "dimensions"


def test_dense_modules_over_http_and_an_unknown_activation_refused(tmp_path):
    path = build_encoder(tmp_path / "a", "bert", pooling="mean")
    layers = with_dense(path, [(64, 16, "Tanh")])
    hf = AutoModel.from_pretrained(str(path)).eval()
    s = LiveServer(EngineConfig(model=str(path), served_model_name=["st"])).start()
    try:
        r = httpx.post(s.url + "/v1/embeddings", json={"input": TEXTS}, timeout=60)
        assert r.status_code == 200, r.text
        for text, d in zip(TEXTS, r.json()["data"]):
            ids = s.state.tokenizer(text)["input_ids"]
            with torch.no_grad():
                hidden = hf(torch.tensor([ids])).last_hidden_state[0]
            want = F.normalize(projected(hidden.mean(0), layers), dim=0)
            assert torch.allclose(torch.tensor(d["embedding"]), want, atol=1e-5)
        r = httpx.post(s.url + "/v1/embeddings", json={"input": "x", "dimensions": 64})
        assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions", r.text
    finally:
        s.stop()
    other = build_encoder(tmp_path / "b", "bert", pooling="mean")
    with_dense(other, [(64, 16, "Softplus")])
    with pytest.raises(CheckpointError, match="Softplus"):
        LLM(str(other))


def test_a_pooling_mode_weir_lacks_is_refused_unless_one_is_chosen(tmp_path):
    """sentence-transformers' max pooling (or two modes at once): no silent fallback to CLS;
    `--pooling` (offline: PoolingParams' kind) chooses one."""
    path = build_encoder(tmp_path, "bert", pooling="mean")
    pooling = path / "1_Pooling" / "config.json"
    config = json.loads(pooling.read_text())
    pooling.write_text(json.dumps({**config, "pooling_mode_mean_tokens": False,
                                   "pooling_mode_max_tokens": True}))  # fmt: skip
    llm = LLM(str(path), max_model_len=128)
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        llm.embed(TEXTS[0], use_tqdm=False)
    assert len(llm.embed(TEXTS[0], PoolingParams("mean"), use_tqdm=False)[0].outputs.embedding)
    s = LiveServer(EngineConfig(model=str(path)))
    with pytest.raises(Exception):  # noqa: B017 - the start fails, naming the mode
        s.start()
    assert "pooling_mode_max_tokens" in (s.state.reason or "")
    assert s.wait_exit() == 2  # (bad input, as any model it cannot serve)
    s = LiveServer(EngineConfig(model=str(path)), pooling="mean").start()
    try:
        r = httpx.post(s.url + "/v1/embeddings", json={"input": "x"}, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        s.stop()
