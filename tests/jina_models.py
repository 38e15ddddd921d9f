"""Tiny random-weight JinaBERT encoders (jina-embeddings-v2's "JinaBertForMaskedLM", whose
modelling code is its hub's remote code: transformers has no JinaBERT) saved as the hub holds
them, and their reference: the model written out here in plain torch from its definition (BERT's
post-norm layers; ALiBi instead of positions, symmetric, with the ALiBi paper's slopes; a GELU
gate over the first half of `gated_layers`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from tests.encoder_models import bert_tokenizer

# ALiBi's slopes written out: four heads 2^-2 .. 2^-8; six heads: four's, then the first and
# third of eight's (2^-1, 2^-3); twelve (jina-embeddings-v2-base's): eight's, then the first
# four odd ones of sixteen's
SLOPES = {
    4: [2**-2, 2**-4, 2**-6, 2**-8],
    6: [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3],
    12: [2**-i for i in range(1, 9)] + [2**-0.5, 2**-1.5, 2**-2.5, 2**-3.5],
}


def build_jina(
    path: str | Path,
    *,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_layers: int = 2,
    prefix: str = "",
    with_mlm_head: bool = True,
    emb_pooler: str | None = "mean",
    seed: int = 0,
    intermediate_size: int | None = None,
    vocab_size: int | None = None,
    scale: float = 0.2,
) -> tuple[Path, dict[str, torch.Tensor], dict]:
    """A JinaBERT folder at `path`: (its path, its tensors by name without `prefix`, its
    config). `prefix`: "bert." as a JinaBertForMaskedLM's save holds them, "" as the hub's
    jina-embeddings-v2 files; `with_mlm_head`: its `cls.` tensors too (never read);
    `intermediate_size` (default twice the hidden size), `vocab_size` (embedding rows past the
    tokenizer's) and the products' weights' `scale` for a real model's shape (benchmarks)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tokenizer = bert_tokenizer()
    h, m = hidden_size, intermediate_size or 2 * hidden_size
    vocab = max(vocab_size or 0, len(tokenizer))

    def rand(*shape, scale=scale, mean=0.0):
        return torch.randn(*shape, generator=g) * scale + mean

    t = {
        "embeddings.word_embeddings.weight": rand(vocab, h),
        "embeddings.token_type_embeddings.weight": rand(2, h),
        "embeddings.LayerNorm.weight": rand(h, scale=0.3, mean=1.0),
        "embeddings.LayerNorm.bias": rand(h, scale=0.3),
    }
    for i in range(num_layers):
        a, p = f"encoder.layer.{i}.attention.", f"encoder.layer.{i}.mlp."
        for name in ("self.query", "self.key", "self.value", "output.dense"):
            t[a + name + ".weight"], t[a + name + ".bias"] = rand(h, h), rand(h)
        t[a + "output.LayerNorm.weight"] = rand(h, scale=0.3, mean=1.0)
        t[a + "output.LayerNorm.bias"] = rand(h, scale=0.3)
        t[p + "gated_layers.weight"] = rand(2 * m, h)
        t[p + "wo.weight"], t[p + "wo.bias"] = rand(h, m), rand(h)
        t[p + "layernorm.weight"] = rand(h, scale=0.3, mean=1.0)
        t[p + "layernorm.bias"] = rand(h, scale=0.3)
    stored = {prefix + k: v for k, v in t.items()}
    if with_mlm_head:
        stored["cls.predictions.transform.dense.weight"] = rand(h, h)
        stored["cls.predictions.bias"] = rand(vocab)
    from safetensors.torch import save_file

    save_file(stored, str(path / "model.safetensors"))
    tokenizer.save_pretrained(path)
    config = {
        "architectures": ["JinaBertForMaskedLM"],
        "model_type": "bert",
        "auto_map": {
            "AutoConfig": "jinaai/jina-bert-implementation--configuration_bert.JinaBertConfig",
            "AutoModel": "jinaai/jina-bert-implementation--modeling_bert.JinaBertModel",
        },
        "vocab_size": vocab,
        "hidden_size": h,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "intermediate_size": m,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.0,
        "max_position_embeddings": 8192,
        "type_vocab_size": 2,
        "initializer_range": 0.02,
        "layer_norm_eps": 1e-12,
        "pad_token_id": 0,
        "position_embedding_type": "alibi",
        "feed_forward_type": "geglu",
        "torch_dtype": "float32",
    }
    if emb_pooler:
        config["emb_pooler"] = emb_pooler
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path, t, config


def jina_reference(t: dict[str, torch.Tensor], config: dict, ids: list[int]) -> torch.Tensor:
    """The final hidden states [tokens, hidden] of one input (token types all 0), in float64."""
    t = {k: v.double() for k, v in t.items()}
    n, h, heads = len(ids), config["hidden_size"], config["num_attention_heads"]
    d, m, eps = h // heads, config["intermediate_size"], config["layer_norm_eps"]

    def norm(x, name):
        return F.layer_norm(x, (h,), t[name + ".weight"], t[name + ".bias"], eps)

    def linear(x, name):
        return x @ t[name + ".weight"].T + t.get(name + ".bias", 0)

    words = t["embeddings.word_embeddings.weight"][ids]
    x = norm(words + t["embeddings.token_type_embeddings.weight"][0], "embeddings.LayerNorm")
    i = torch.arange(n, dtype=torch.float64)
    distance = (i[:, None] - i[None, :]).abs()
    slopes = torch.tensor(SLOPES[heads], dtype=torch.float64)
    for layer in range(config["num_hidden_layers"]):
        a, p = f"encoder.layer.{layer}.attention.", f"encoder.layer.{layer}.mlp."
        q, k, v = (
            linear(x, a + f"self.{w}").view(n, heads, d).transpose(0, 1)
            for w in ("query", "key", "value")
        )
        scores = q @ k.transpose(1, 2) / math.sqrt(d) - slopes[:, None, None] * distance
        o = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, h)
        x = norm(x + linear(o, a + "output.dense"), a + "output.LayerNorm")
        both = x @ t[p + "gated_layers.weight"].T
        gated = F.gelu(both[:, :m]) * both[:, m:]
        x = norm(x + linear(gated, p + "wo"), p + "layernorm")
    return x
