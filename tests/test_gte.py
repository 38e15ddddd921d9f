"""GTE encoders (the "new" remote code: gte-base-en-v1.5, gte-multilingual-base and its
reranker, snowflake-arctic-embed-m-v2.0), whose config class transformers does not ship: weir
reads their config.json itself and serves them as NomicBERT's layer with GTE's biases, GELU
gate, token types and NTK-scaled rotation. Their vectors, hidden states and a reranker's scores
equal the reference's (transformers' NomicBERT given GTE's biases and holding the same weights),
offline and over HTTP; what weir does not compute is refused by name."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
import torch.nn.functional as F

from core.config import CheckpointError, EngineConfig
from tests.conftest import LiveServer
from tests.gte_models import build_gte
from weir import LLM

TEXTS = ["the river runs to the sea", "a canyon is a deep valley made by water on stone", "x"]


def hidden_of(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).last_hidden_state[0]


@pytest.mark.parametrize(
    "options",
    [
        dict(),  # gte-base-en-v1.5's kind: no token types
        dict(type_vocab_size=1, rope_theta=500000.0, architecture="GteNewModel"),
        dict(ntk_factor=2.0, prefix="new."),  # gte-large-en-v1.5's scaled rotation
        dict(type_vocab_size=2, architecture="GteModel"),  # snowflake's name
    ],
)
def test_gte_hidden_states_equal_the_reference(tmp_path, options):
    path, ref = build_gte(tmp_path, **options)
    llm = LLM(str(path), max_model_len=128)
    for out in llm.encode(TEXTS, pooling_task="token_embed", use_tqdm=False):
        want = F.normalize(hidden_of(ref, out.prompt_token_ids), dim=-1)
        got = torch.tensor(out.outputs.data)
        assert torch.allclose(got, want, atol=1e-5), (options, (got - want).abs().max())
    # its default pooling: CLS (vLLM's for an encoder with no sentence-transformers files)
    out = llm.embed(TEXTS[1], use_tqdm=False)[0]
    want = F.normalize(hidden_of(ref, out.prompt_token_ids)[0], dim=0)
    assert torch.allclose(torch.tensor(out.outputs.embedding), want, atol=1e-5)


def test_gte_reranker_scores_equal_the_reference(tmp_path):
    path, ref = build_gte(tmp_path, num_labels=1, type_vocab_size=1)
    tok = __import__("transformers").AutoTokenizer.from_pretrained(str(path))
    llm = LLM(str(path), max_model_len=128)
    for doc, out in zip(TEXTS, llm.score("where does the river go", TEXTS, use_tqdm=False)):
        ids = tok(text="where does the river go", text_pair=doc)["input_ids"]
        with torch.no_grad():
            logit = ref(torch.tensor([ids])).logits[0, 0]
        assert abs(out.outputs.score - torch.sigmoid(logit).item()) < 1e-5


@pytest.mark.parametrize(
    "change, named",
    [
        ({"layer_norm_type": "rms_norm"}, "layer_norm_type"),
        ({"position_embedding_type": "absolute"}, "position_embedding_type"),
        ({"rope_scaling": {"type": "yarn", "factor": 2.0}}, "rope_scaling"),
        ({"logn_attention_scale": True, "max_position_embeddings": 16384}, "logn_attention_scale"),
    ],
)
def test_what_weir_does_not_compute_is_refused_by_name(tmp_path, change, named):
    path, _ = build_gte(tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **change}))
    from gpu.launch import load

    with pytest.raises(CheckpointError, match=named):
        load(EngineConfig(model=str(path)))


def test_gte_served_over_http(tmp_path):
    path, ref = build_gte(tmp_path)
    config = EngineConfig(model=str(path), served_model_name=["gte"], check_integrity=True)
    s = LiveServer(config).start()
    try:
        assert s.state.tasks == ("embed",)
        r = httpx.post(s.url + "/v1/embeddings", json={"input": TEXTS}, timeout=60)
        assert r.status_code == 200, r.text
        for text, d in zip(TEXTS, r.json()["data"]):
            ids = s.state.tokenizer(text)["input_ids"]
            want = F.normalize(hidden_of(ref, ids)[0], dim=0)
            assert torch.allclose(torch.tensor(d["embedding"]), want, atol=1e-5)
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x"}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    finally:
        s.stop()


def test_remote_code_is_never_run_nor_asked_for(tmp_path, monkeypatch):
    """A folder whose config names local remote code (auto_map): weir reads config.json
    itself, and transformers is told not to trust the code, so it neither runs it nor asks on
    stdin whether to (its prompt waits 15 s on a terminal)."""
    import builtins

    path, ref = build_gte(tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration.NewConfig"}
    (path / "config.json").write_text(json.dumps(config))
    (path / "configuration.py").write_text("raise RuntimeError('remote code ran')\n")

    prompts = []

    def asked(*args, **kwargs):  # (transformers swallows what this raises: recorded too)
        prompts.append(args)
        raise EOFError

    monkeypatch.setattr(builtins, "input", asked)
    out = LLM(str(path), max_model_len=128).embed(TEXTS[0], use_tqdm=False)[0]
    assert prompts == []
    want = F.normalize(hidden_of(ref, out.prompt_token_ids)[0], dim=0)
    assert torch.allclose(torch.tensor(out.outputs.embedding), want, atol=1e-5)
