"""JinaBERT encoders (jina-embeddings-v2: ALiBi instead of positions, a GELU-gated MLP; their
modelling code is remote code weir never runs): hidden states and pooled vectors equal the
model written out in plain torch (tests/jina_models.py; its conventions, the gate's half and
the slopes' order, were checked by hand against llama.cpp's jina-bert-v2 on the same weights:
cosine 0.9999999), offline and over HTTP, for a long input too; what weir does not compute is
refused by name."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
import torch.nn.functional as F

from core.config import CheckpointError, EngineConfig
from tests.conftest import LiveServer
from tests.jina_models import build_jina, jina_reference
from weir import LLM

TEXTS = ["the river runs to the sea", "a canyon is a deep valley made by water on stone", "x"]
# [CLS] ... [SEP] over the tiny vocabulary of 600, the same every run
FIXED_IDS = [[2, *range(200, 260, 7), 3], [2, *range(20, 400, 37), 3], [2, 1, 3]]


@pytest.mark.parametrize(
    "options",
    [
        dict(),  # jina-embeddings-v2's own files: no prefix, the MLM head beside
        dict(num_heads=6, hidden_size=96, prefix="bert."),  # six heads: the slopes' other rule
        dict(with_mlm_head=False, emb_pooler=None),
    ],
)
def test_jina_equals_its_definition(tmp_path, options):
    path, t, config = build_jina(tmp_path, **options)
    llm = LLM(str(path), max_model_len=256)
    for out in llm.encode(TEXTS, pooling_task="token_embed", use_tqdm=False):
        want = F.normalize(jina_reference(t, config, out.prompt_token_ids), dim=-1).float()
        assert torch.allclose(torch.tensor(out.outputs.data), want, atol=1e-5), options
    # its default pooling: its config's emb_pooler (mean), else an encoder's CLS
    for out in llm.embed(TEXTS, use_tqdm=False):
        hidden = jina_reference(t, config, out.prompt_token_ids)
        pooled = hidden.mean(0) if config.get("emb_pooler") else hidden[0]
        want = F.normalize(pooled, dim=0).float()
        assert torch.allclose(torch.tensor(out.outputs.embedding), want, atol=1e-5)


def test_a_long_input_attends_in_blocks(tmp_path):
    """Past 1,024 tokens the ALiBi bias is built a block of queries at a time."""
    path, t, config = build_jina(tmp_path)
    llm = LLM(str(path), max_model_len=2048, max_num_batched_tokens=2048)
    ids = [(7 * i) % 590 + 5 for i in range(1500)]
    out = llm.encode([ids], pooling_task="token_embed", use_tqdm=False)[0]
    want = F.normalize(jina_reference(t, config, ids), dim=-1).float()
    assert torch.allclose(torch.tensor(out.outputs.data), want, atol=1e-5)


@pytest.mark.parametrize(
    "change, named",
    [
        ({"feed_forward_type": "reglu"}, "feed_forward_type"),
        ({"position_embedding_type": "absolute"}, "position_embedding_type"),
    ],
)
def test_what_weir_does_not_compute_is_refused_by_name(tmp_path, change, named):
    path, _, config = build_jina(tmp_path)
    (path / "config.json").write_text(json.dumps({**config, **change}))
    from gpu.launch import load

    with pytest.raises(CheckpointError, match=named):
        load(EngineConfig(model=str(path)))


def test_jina_served_over_http(tmp_path):
    path, t, config = build_jina(tmp_path)
    s = LiveServer(EngineConfig(model=str(path), served_model_name=["jina"])).start()
    try:
        r = httpx.post(s.url + "/v1/embeddings", json={"input": TEXTS}, timeout=60)
        assert r.status_code == 200, r.text
        for text, d in zip(TEXTS, r.json()["data"]):
            ids = s.state.tokenizer(text)["input_ids"]
            want = F.normalize(jina_reference(t, config, ids).mean(0), dim=0).float()
            assert torch.allclose(torch.tensor(d["embedding"]), want, atol=1e-5)
    finally:
        s.stop()


def file_weights(path) -> dict[str, torch.Tensor]:
    """A jina-bert-v2 file's tensors as the `gguf` package dequantizes them, by the
    checkpoint's names (its fused ffn_up as gated_layers, ffn_down as wo)."""
    import gguf
    import numpy as np

    from gpu.gguf_names import hf_name

    out = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        name = hf_name(t.name, "jina-bert-v2").replace("mlp.down_proj", "mlp.wo")
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        out[name] = torch.from_numpy(w.reshape([int(d) for d in reversed(t.shape)]))
    return out


@pytest.mark.parametrize("fmt", ["f32", "q8_0"])
def test_a_jina_bert_v2_file_equals_its_own_weights(tmp_path, fmt):
    """A GGUF file as llama.cpp's converter writes it ("jina-bert-v2"), its products in `fmt`
    (Q8_0 on weir's block kernels, int8 activations): within 2% of the definition on the
    file's own weights (the `gguf` package's dequantization), F32 equal to it. The inputs are
    token ids, not texts: the tiny tokenizer's training breaks ties differently from run to run,
    so a text's ids (and Q8_0's largest error over them, 0.009 to 0.024 seen) varied with it."""
    from tests.encoder_gguf import write_encoder_gguf

    path, _, config = build_jina(tmp_path / "folder", prefix="bert.")
    gguf_path = write_encoder_gguf(path, tmp_path / "m.gguf", fmt)
    t = file_weights(gguf_path)
    llm = LLM(str(gguf_path), max_model_len=256, device="cpu")
    assert fmt == "f32" or fmt in llm.engine.runner.model.backend.resident
    for out in llm.encode(FIXED_IDS, pooling_task="token_embed", use_tqdm=False):
        want = F.normalize(jina_reference(t, config, out.prompt_token_ids), dim=-1).float()
        got = torch.tensor(out.outputs.data)
        assert (got - want).abs().max().item() < (1e-5 if fmt == "f32" else 0.02), fmt


def test_jina_bert_v2_variants_weir_does_not_compute_are_refused(tmp_path):
    import gguf

    from tests.encoder_gguf import write_encoder_gguf

    path, _, _ = build_jina(tmp_path / "folder")
    good = write_encoder_gguf(path, tmp_path / "m.gguf")
    reader = gguf.GGUFReader(str(good))
    w = gguf.GGUFWriter(str(tmp_path / "code.gguf"), "jina-bert-v2")
    for field in reader.fields.values():  # (the same metadata, a Q norm more)
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, value, kind, sub_type=sub)
    for t in reader.tensors:
        w.add_tensor(t.name, t.data)
    w.add_tensor("blk.0.attn_q_norm.weight", reader.tensors[0].data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="attn_q_norm"):
        LLM(str(tmp_path / "code.gguf"))
