"""ModernBERT (ModernBertModel and its sequence classifier) on a backend: an encoder as
gpu/models/encoder.py's (each input whole in one step, attending to the whole of itself, no KV
cache; it embeds and classifies, never generates), with a newer layer:

- positions rotate Q and K (no position table), global layers at one base (160,000) and local
  ones at another (10,000);
- every third layer (`layer_types`) is global; the others are local: a token sees those at
  most local_attention / 2 positions away either way;
- norms before each block (LayerNorm, bias-free by default; none before the first layer's
  attention) and after the last layer; no token types;
- the MLP is gated: its one input product `Wi` gives act(first half) * (second half).

A classifier pools its final rows (the CLS row, or their mean: `classifier_pooling`), puts them
through `head` (dense, activation, norm) and then `classifier`. Products run on the backend
(the gated MLP as a decoder's gate and up); norms, rotation and attention are torch's.
Module and parameter names follow transformers' (after a classifier's `model.` prefix).
"""

from __future__ import annotations

import torch
from torch import nn

from gpu.attention.backend import AttentionMetadata
from gpu.backend import PLAIN_ACTIVATIONS
from gpu.models.encoder import Encoding, bidirectional
from gpu.models.encoder_spec import EncoderSpec
from gpu.models.layers import Embedding, Linear


def _norm(spec: EncoderSpec) -> nn.LayerNorm:
    return nn.LayerNorm(spec.hidden_size, spec.layer_norm_eps, bias=spec.norm_bias)


class Embeddings(nn.Module):
    def __init__(self, spec: EncoderSpec, backend) -> None:
        super().__init__()
        self.tok_embeddings = Embedding(backend, spec.vocab_size, spec.hidden_size)
        self.norm = _norm(spec)


class Attention(nn.Module):
    def __init__(self, spec: EncoderSpec, backend, local: bool) -> None:
        super().__init__()
        h = spec.hidden_size
        self.backend = backend
        self.Wqkv = Linear(backend, h, 3 * h, spec.attention_bias)
        self.Wo = Linear(backend, h, h, spec.attention_bias)
        self.num_heads = spec.num_heads
        self.window = spec.window if local else 0

    def prepare(self) -> None:
        self.Wqkv.prepare()
        self.Wo.prepare()

    def forward(self, h, x, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        """x + attention(h)."""
        t = h.shape[0]
        q, k, v = self.Wqkv(h).view(t, 3, self.num_heads, -1).unbind(1)
        q, k = rotated(q, cos, sin), rotated(k, cos, sin)
        o = bidirectional(q, k, v, meta.query_lens_cpu, self.window)
        return self.Wo(o.reshape(t, -1), x)


class MLP(nn.Module):
    def __init__(self, spec: EncoderSpec, backend) -> None:
        super().__init__()
        h, m = spec.hidden_size, spec.intermediate_size
        self.backend = backend
        self.Wi = Linear(backend, h, 2 * m, spec.mlp_bias)
        self.Wo = Linear(backend, m, h, spec.mlp_bias)
        self.width, self.act = m, spec.hidden_act
        self.gated = self.down = None

    def prepare(self) -> None:
        """Wi's halves as a decoder's gate and up (one gated product where the backend has it)."""
        weight, bias = self.Wi.take()
        m = self.width
        if isinstance(weight, torch.Tensor):
            gate, up = (weight[:m], None if bias is None else bias[:m]), (weight[m:], None)
            if bias is not None:
                up = (weight[m:], bias[m:])
        else:  # a block-format tensor: its rows taken whole
            import numpy as np

            gate = (weight.take_rows(np.arange(m)), None if bias is None else bias[:m])
            up = (weight.take_rows(np.arange(m, 2 * m)), None if bias is None else bias[m:])
        self.gated, self.down = self.backend.prepare_mlp(gate, up, self.Wo.take(), self.act)
        del self.Wi, self.Wo

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x + mlp(h)."""
        return self.backend.linear(self.backend.gated(h, self.gated), self.down, x)


class Layer(nn.Module):
    def __init__(self, spec: EncoderSpec, backend, index: int) -> None:
        super().__init__()
        self.local = spec.local_layers[index]
        # the first layer has no norm before its attention (the embeddings' norm is it)
        self.attn_norm = nn.Identity() if index == 0 else _norm(spec)
        self.attn = Attention(spec, backend, self.local)
        self.mlp_norm = _norm(spec)
        self.mlp = MLP(spec, backend)

    def forward(self, x, rotations, meta: AttentionMetadata) -> torch.Tensor:
        cos, sin = rotations[self.local]
        x = self.attn(self.attn_norm(x), x, cos, sin, meta)
        return self.mlp(self.mlp_norm(x), x)


class Head(nn.Module):  # a classifier's: dense, activation, norm over the pooled row
    def __init__(self, spec: EncoderSpec) -> None:
        super().__init__()
        self.dense = nn.Linear(spec.hidden_size, spec.hidden_size, spec.classifier_bias)
        self.norm = _norm(spec)
        self.act = PLAIN_ACTIVATIONS[spec.classifier_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.dense(x)))


def rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[tokens, heads, head_dim] turned as transformers turns it (each head's two halves pair)."""
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + turned * sin[:, None, :]


class ModernBertModel(Encoding):
    """ModernBERT on `backend`; with a head (spec.head), a sequence or token classifier."""

    def __init__(self, spec: EncoderSpec, backend) -> None:
        super().__init__(spec, backend)
        self.embeddings = Embeddings(spec, backend)
        self.layers = nn.ModuleList(Layer(spec, backend, i) for i in range(spec.num_layers))
        self.final_norm = _norm(spec)
        classifier = spec.head in ("modernbert", "modernbert_token")
        self.head = Head(spec) if classifier else None
        self.classifier = nn.Linear(spec.hidden_size, spec.num_labels) if classifier else None
        self.freqs: dict[bool, torch.Tensor] = {}  # local or not -> the rotation's frequencies

    def prepare(self) -> None:
        """After loading: each product in the backend's form; the head in float32; the
        rotation's frequencies (made here, on the model's device: it is built on "meta")."""
        d, device = self.spec.head_dim, self.final_norm.weight.device
        for local, base in ((False, self.spec.rope_theta), (True, self.spec.local_rope_theta)):
            self.freqs[local] = base ** -(torch.arange(0, d, 2, device=device).float() / d)
        self.embeddings.tok_embeddings.prepare()
        for layer in self.layers:
            layer.attn.prepare()
            layer.mlp.prepare()
        for head in (self.head, self.classifier):
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
        positions from 0); ModernBERT has no token types (`type_starts` is not read)."""
        self.check_whole(meta)
        norm = self.embeddings.norm
        x = norm(self.embeddings.tok_embeddings(input_ids).to(norm.weight.dtype))
        rotations = {}
        for local, freq in self.freqs.items():
            angles = positions.float()[:, None] * freq[None, :]
            angles = torch.cat([angles, angles], dim=-1)
            rotations[local] = (angles.cos().to(x.dtype), angles.sin().to(x.dtype))
        for layer in self.layers:
            x = layer(x, rotations, meta)
        return self.final_norm(x)

    def classify(self, rows: torch.Tensor) -> torch.Tensor:
        """A classifier's raw logits [labels] for one input's final rows: its CLS row or their
        mean (`classifier_pooling`) through the head, in float32; a token classifier's [tokens,
        labels], every row through the head."""
        if self.spec.head == "modernbert_token":
            return self.classifier(self.head(rows.float()))
        pooled = rows[0] if self.spec.classifier_pooling == "cls" else rows.mean(0)
        return self.classifier(self.head(pooled.float()))
