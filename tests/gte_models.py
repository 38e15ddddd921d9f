"""Tiny random-weight GTE encoders ("NewModel": gte-base-en-v1.5, gte-multilingual-base,
snowflake-arctic-embed-m-v2.0) saved as their hubs hold them (config.json of model_type "new",
whose remote code transformers does not ship; tensors under `encoder.layer.N.attention.qkv_proj`,
`mlp.up_gate_proj` ...), with their reference: transformers' own NomicBERT, the same layer once
given GTE's biases (Q/K/V, output and down products) and its GELU gate, holding the same
weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from tests.encoder_models import bert_tokenizer


def _biased(linear: nn.Linear) -> nn.Linear:
    """`linear` with a random bias (transformers' NomicBERT has none; GTE's products do)."""
    out = nn.Linear(linear.in_features, linear.out_features, bias=True)
    with torch.no_grad():
        out.weight.copy_(linear.weight)
        out.bias.copy_(torch.randn(linear.out_features) * 0.2)
    return out


def ntk_frequencies(head_dim: int, base: float, factor: float) -> torch.Tensor:
    """GTE's fixed NTK-scaled rotation (rope_scaling {"type": "ntk", "factor": f}): the base
    times f, every frequency then over f ** (2 / head_dim)."""
    steps = torch.arange(0, head_dim, 2).float() / head_dim
    return 1.0 / (base * factor) ** steps / factor ** (2 / head_dim)


def build_gte(
    path: str | Path,
    *,
    num_labels: int = 0,
    type_vocab_size: int = 0,
    rope_theta: float = 10000.0,
    ntk_factor: float | None = None,
    architecture: str | None = None,
    prefix: str = "",
    seed: int = 0,
    hidden_size: int = 64,
    num_heads: int = 4,
):
    """A GTE folder at `path` and its reference (transformers' NomicBertModel, or its sequence
    classifier, with GTE's biases and activation; eval mode). `num_labels`: a
    NewForSequenceClassification (its encoder under `new.`, a pooler, a classifier);
    `prefix`: the encoder's tensors' prefix in an embedding model (gte-multilingual's
    checkpoints have none, some saves `new.`)."""
    from transformers import NomicBertConfig, NomicBertForSequenceClassification, NomicBertModel

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    tokenizer = bert_tokenizer()
    hidden, heads, inter, layers = hidden_size, num_heads, 2 * hidden_size, 2
    config = NomicBertConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=inter,
        hidden_act="gelu",
        max_position_embeddings=128,
        type_vocab_size=max(type_vocab_size, 1),
        initializer_range=0.2,
        pad_token_id=tokenizer.pad_token_id,
        layer_norm_eps=1e-12,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
    )
    if num_labels:
        config.num_labels = num_labels
        ref = NomicBertForSequenceClassification(config).eval()
        body = ref.nomic_bert
    else:
        ref = body = NomicBertModel(config).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "LayerNorm" in name or "layernorm" in name:
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if name.endswith("weight") else 0.0))
        if type_vocab_size == 0:  # (no token types: nothing added to the word's row)
            body.embeddings.token_type_embeddings.weight.zero_()
        if ntk_factor:
            body.rotary_emb.inv_freq.copy_(ntk_frequencies(hidden // heads, rope_theta, ntk_factor))
            body.rotary_emb.original_inv_freq = body.rotary_emb.inv_freq.clone()
    for layer in body.layers:
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(attn, name, _biased(getattr(attn, name)))
        layer.mlp.down_proj = _biased(layer.mlp.down_proj)
    ref.eval()
    head = "new." if num_labels else prefix
    tensors = {
        head + "embeddings.word_embeddings.weight": body.embeddings.word_embeddings.weight,
        head + "embeddings.LayerNorm.weight": body.embeddings.LayerNorm.weight,
        head + "embeddings.LayerNorm.bias": body.embeddings.LayerNorm.bias,
    }
    if type_vocab_size:
        rows = body.embeddings.token_type_embeddings.weight[:type_vocab_size]
        tensors[head + "embeddings.token_type_embeddings.weight"] = rows
    for i, layer in enumerate(body.layers):
        at, mlp, stem = layer.self_attn, layer.mlp, f"{head}encoder.layer.{i}."
        for kind in ("weight", "bias"):
            parts = [getattr(getattr(at, f"{x}_proj"), kind) for x in "qkv"]
            tensors[stem + f"attention.qkv_proj.{kind}"] = torch.cat(parts)
            tensors[stem + f"attention.o_proj.{kind}"] = getattr(at.o_proj, kind)
            tensors[stem + f"attn_ln.{kind}"] = getattr(layer.post_attention_layernorm, kind)
            tensors[stem + f"mlp_ln.{kind}"] = getattr(layer.post_mlp_layernorm, kind)
            tensors[stem + f"mlp.down_proj.{kind}"] = getattr(mlp.down_proj, kind)
        tensors[stem + "mlp.up_gate_proj.weight"] = torch.cat(
            [mlp.up_proj.weight, mlp.gate_proj.weight]
        )
    if num_labels:
        tensors["new.pooler.dense.weight"] = body.pooler.dense.weight
        tensors["new.pooler.dense.bias"] = body.pooler.dense.bias
        tensors["classifier.weight"] = ref.classifier.weight
        tensors["classifier.bias"] = ref.classifier.bias
    from safetensors.torch import save_file

    save_file(
        {k: v.detach().contiguous() for k, v in tensors.items()}, str(path / "model.safetensors")
    )
    tokenizer.save_pretrained(path)
    arch = architecture or ("NewForSequenceClassification" if num_labels else "NewModel")
    gte = {
        "architectures": [arch],
        "model_type": "new",
        "auto_map": {
            "AutoConfig": "Alibaba-NLP/new-impl--configuration.NewConfig",
            "AutoModel": "Alibaba-NLP/new-impl--modeling.NewModel",
        },
        "vocab_size": len(tokenizer),
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "intermediate_size": inter,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.0,
        "max_position_embeddings": 128,
        "type_vocab_size": type_vocab_size,
        "initializer_range": 0.02,
        "layer_norm_type": "layer_norm",
        "layer_norm_eps": 1e-12,
        "position_embedding_type": "rope",
        "rope_theta": rope_theta,
        "rope_scaling": {"type": "ntk", "factor": ntk_factor} if ntk_factor else None,
        "classifier_dropout": None,
        "pack_qkv": True,
        "unpad_inputs": False,
        "use_memory_efficient_attention": False,
        "logn_attention_scale": False,
        "logn_attention_clip1": False,
        "pad_token_id": tokenizer.pad_token_id,
        "torch_dtype": "float32",
    }
    if num_labels:
        gte["id2label"] = {str(i): f"LABEL_{i}" for i in range(num_labels)}
        gte["label2id"] = {f"LABEL_{i}": i for i in range(num_labels)}
    (path / "config.json").write_text(json.dumps(gte, indent=1))
    return path, ref
