"""NomicBERT (NomicBertModel: nomic-embed-text v1 and v1.5; and its sequence classifier) on a
backend: an encoder as gpu/models/encoder.py's (each input whole in one step, attending to the
whole of itself, no KV cache; it embeds and classifies, never generates), with its own layer:

- no position table: Q and K rotate (every element of a head, base 1,000);
- the input is the token's embedding plus its segment's, normed;
- norms after each block, as BERT's: LayerNorm(x + attention(x)), then LayerNorm(x + mlp(x));
- the MLP is gated (SwiGLU: act(gate) * up), no biases anywhere but the norms'.

GTE (gpu/models/encoder_spec.py's "gte" family) is the same layer with biases on Q/K/V, the
output and the down product, a GELU gate, token types only where it has them, and a rotation
that may be NTK-scaled. A classifier reads its first row through BERT's pooler (dense, tanh)
and `classifier`.
Module and parameter names follow transformers 5's; a checkpoint in nomic's own layout (the
hub's: `encoder.layers.N.attn.Wqkv`, `mlp.fc11` ...) is read into them by
gpu/encoder_loader.py."""

from __future__ import annotations

import torch
from torch import nn

from gpu.attention.backend import AttentionMetadata
from gpu.models.encoder import Encoding, Pooler, bidirectional
from gpu.models.encoder_spec import EncoderSpec
from gpu.models.layers import Embedding, Linear
from gpu.models.modernbert import rotated


class Embeddings(nn.Module):
    def __init__(self, spec: EncoderSpec, backend) -> None:
        super().__init__()
        self.word_embeddings = Embedding(backend, spec.vocab_size, spec.hidden_size)
        types = spec.type_vocab_size
        self.token_type_embeddings = nn.Embedding(types, spec.hidden_size) if types else None
        self.LayerNorm = nn.LayerNorm(spec.hidden_size, spec.layer_norm_eps)


class Attention(nn.Module):
    def __init__(self, spec: EncoderSpec, backend) -> None:
        super().__init__()
        h = spec.hidden_size
        self.backend = backend
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self, name, Linear(backend, h, h, spec.attention_bias))
        self.num_heads = spec.num_heads
        self.qkv = None

    def prepare(self) -> None:
        parts = [p.take() for p in (self.q_proj, self.k_proj, self.v_proj)]
        self.qkv = self.backend.prepare_stacked(parts)
        del self.q_proj, self.k_proj, self.v_proj
        self.o_proj.prepare()

    def forward(self, x, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        """x + attention(x)."""
        t = x.shape[0]
        q, k, v = self.backend.linear(x, self.qkv).view(t, 3, self.num_heads, -1).unbind(1)
        q, k = rotated(q, cos, sin), rotated(k, cos, sin)
        o = bidirectional(q, k, v, meta.query_lens_cpu)
        return self.o_proj(o.reshape(t, -1), x)


class MLP(nn.Module):
    def __init__(self, spec: EncoderSpec, backend) -> None:
        super().__init__()
        h, m = spec.hidden_size, spec.intermediate_size
        self.backend = backend
        gated_bias = spec.mlp_bias and spec.gated_bias
        self.gate_proj = Linear(backend, h, m, gated_bias)
        self.up_proj = Linear(backend, h, m, gated_bias)
        self.down_proj = Linear(backend, m, h, spec.mlp_bias)
        self.act = spec.hidden_act
        self.gated = self.down = None

    def prepare(self) -> None:
        self.gated, self.down = self.backend.prepare_mlp(
            self.gate_proj.take(), self.up_proj.take(), self.down_proj.take(), self.act
        )
        del self.gate_proj, self.up_proj, self.down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x + mlp(x)."""
        return self.backend.linear(self.backend.gated(x, self.gated), self.down, x)


class Layer(nn.Module):
    def __init__(self, spec: EncoderSpec, backend) -> None:
        super().__init__()
        self.self_attn = Attention(spec, backend)
        self.post_attention_layernorm = nn.LayerNorm(spec.hidden_size, spec.layer_norm_eps)
        self.mlp = MLP(spec, backend)
        self.post_mlp_layernorm = nn.LayerNorm(spec.hidden_size, spec.layer_norm_eps)

    def forward(self, x, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        x = self.post_attention_layernorm(self.self_attn(x, cos, sin, meta))
        return self.post_mlp_layernorm(self.mlp(x))


def frequencies(spec: EncoderSpec) -> torch.Tensor:
    """The rotation's frequencies, one a pair of a head's elements: base ** -(2i / d); under
    GTE's NTK scaling by factor f, the base times f and each frequency over f ** (2 / d) (its
    mixed variant: over exp(a * (i + 1) ** b), a = log f / (d / 2) ** b, the base unscaled)."""
    d, f, b = spec.head_dim, spec.rope_ntk, spec.rope_mixed_b
    steps = torch.arange(0, d, 2).float() / d
    if not f:
        return spec.rope_theta**-steps
    if b is None:
        return (spec.rope_theta * f) ** -steps / f ** (2 / d)
    a = torch.tensor(f).log() / (d / 2) ** b
    return spec.rope_theta**-steps / (a * torch.arange(1, d // 2 + 1).float() ** b).exp()


class NomicBertModel(Encoding):
    """NomicBERT or GTE on `backend`; with a head (spec.head "bert"), a sequence classifier
    ("token": a token classifier)."""

    def __init__(self, spec: EncoderSpec, backend) -> None:
        super().__init__(spec, backend)
        self.embeddings = Embeddings(spec, backend)
        self.layers = nn.ModuleList(Layer(spec, backend) for _ in range(spec.num_layers))
        self.pooler = Pooler(spec) if spec.head == "bert" else None
        classifier = spec.head in ("bert", "token")
        self.classifier = nn.Linear(spec.hidden_size, spec.num_labels) if classifier else None
        self.freq: torch.Tensor | None = None  # the rotation's frequencies (made in prepare)

    def prepare(self) -> None:
        """After loading: each product in the backend's form; the head in float32; the
        rotation's frequencies, on the model's device (it is built on "meta")."""
        device = self.embeddings.LayerNorm.weight.device
        self.freq = frequencies(self.spec).to(device)
        self.embeddings.word_embeddings.prepare()
        for layer in self.layers:
            layer.self_attn.prepare()
            layer.mlp.prepare()
        for head in (self.pooler, self.classifier):
            if head is not None:
                head.float()

    def encode(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        type_starts: list[int | None] | None = None,
    ) -> torch.Tensor:
        """The final hidden states [tokens, hidden] of the step's inputs, each whole (its
        positions from 0); `type_starts`: where each input's second segment starts."""
        self.check_whole(meta)
        e = self.embeddings
        x = e.word_embeddings(input_ids).to(e.LayerNorm.weight.dtype)
        types = self.segments(meta, type_starts, input_ids.device)
        if e.token_type_embeddings is None:  # (GTE's with none)
            pass
        elif types is None:
            x = x + e.token_type_embeddings.weight[0]
        else:
            x = x + e.token_type_embeddings(types)
        x = e.LayerNorm(x)
        angles = positions.float()[:, None] * self.freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, meta)
        return x

    def classify(self, rows: torch.Tensor) -> torch.Tensor:
        """A classifier's raw logits [labels] for one input's final rows: its first row
        through BERT's pooler and `classifier`, in float32; a token classifier's [tokens,
        labels], every row through `classifier`."""
        if self.pooler is None:
            return self.classifier(rows.float())
        return self.classifier(torch.tanh(self.pooler.dense(rows[0].float())))
