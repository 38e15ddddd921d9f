"""JinaBERT (jina-embeddings-v2: JinaBertForMaskedLM, JinaBertModel) on a backend: BERT's encoder
(gpu/models/encoder.py: each input whole in one step, attending to the whole of itself, no KV
cache; it embeds, never generates) with two changes:

- no position table: each head's scaled scores are less its ALiBi slope times the two tokens'
  distance, either way (encoder.py `alibi_slopes`, `bidirectional`);
- a gated MLP: LayerNorm(x + wo(gelu(gate) * up)), gate and up the first and second halves of
  its `gated_layers` (cut as it is read, gpu/encoder_loader.py), no bias on either.

Module names follow the checkpoint's (`encoder.layer.N.attention.self.query`, ...; `mlp.wo` is
read as `mlp.down_proj`)."""

from __future__ import annotations

import torch
from torch import nn

from gpu.attention.backend import AttentionMetadata
from gpu.models.encoder import Attention, Embeddings, Encoding, alibi_slopes
from gpu.models.encoder_spec import EncoderSpec
from gpu.models.nomic import MLP as GatedMLP


class MLP(GatedMLP):
    """NomicBERT's gated MLP (biases as the spec says: the down product's only), its norm
    inside (the checkpoint's `mlp.layernorm`)."""

    def __init__(self, spec: EncoderSpec, backend) -> None:
        super().__init__(spec, backend)
        self.layernorm = nn.LayerNorm(spec.hidden_size, spec.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """LayerNorm(x + mlp(x))."""
        return self.layernorm(super().forward(x))


class Layer(nn.Module):
    def __init__(self, spec: EncoderSpec, backend) -> None:
        super().__init__()
        self.attention = Attention(spec, backend)
        self.mlp = MLP(spec, backend)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, slopes) -> torch.Tensor:
        return self.mlp(self.attention(x, meta, alibi=slopes))


class Encoder(nn.Module):
    def __init__(self, spec: EncoderSpec, backend) -> None:
        super().__init__()
        self.layer = nn.ModuleList(Layer(spec, backend) for _ in range(spec.num_layers))


class JinaBertModel(Encoding):
    """JinaBERT on `backend`: an embedding model (no classifier head is served)."""

    def __init__(self, spec: EncoderSpec, backend) -> None:
        super().__init__(spec, backend)
        self.embeddings = Embeddings(spec, backend)
        self.encoder = Encoder(spec, backend)
        self.classifier = None
        self.slopes: torch.Tensor | None = None  # ALiBi's, a head each (made in prepare)

    def prepare(self) -> None:
        """After loading: each product in the backend's form; the slopes on the model's device
        (it is built on "meta")."""
        self.slopes = alibi_slopes(self.spec.num_heads).to(self.embeddings.LayerNorm.weight.device)
        self.embeddings.word_embeddings.prepare()
        for layer in self.encoder.layer:
            layer.attention.prepare()
            layer.mlp.prepare()

    def encode(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        type_starts: list[int | None] | None = None,
    ) -> torch.Tensor:
        """The final hidden states [tokens, hidden] of the step's inputs, each whole;
        `type_starts`: where each input's second segment starts (None: one text)."""
        self.check_whole(meta)
        types = self.segments(meta, type_starts, input_ids.device)
        x = self.embeddings(input_ids, positions, meta, types)
        for layer in self.encoder.layer:
            x = layer(x, meta, self.slopes)
        return x
