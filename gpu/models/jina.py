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
from gpu.models.encoder import Attention, Embeddings, Encoding, alibi_slopes, token_types
from gpu.models.encoder_spec import EncoderSpec
from gpu.models.layers import Linear


class MLP(nn.Module):
    def __init__(self, spec: EncoderSpec, backend) -> None:
        super().__init__()
        h, m = spec.hidden_size, spec.intermediate_size
        self.backend, self.act = backend, spec.hidden_act
        self.gate_proj = Linear(backend, h, m, False)
        self.up_proj = Linear(backend, h, m, False)
        self.down_proj = Linear(backend, m, h, True)
        self.layernorm = nn.LayerNorm(h, spec.layer_norm_eps)
        self.gated = self.down = None

    def prepare(self) -> None:
        self.gated, self.down = self.backend.prepare_mlp(
            self.gate_proj.take(), self.up_proj.take(), self.down_proj.take(), self.act
        )
        del self.gate_proj, self.up_proj, self.down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """LayerNorm(x + mlp(x))."""
        return self.layernorm(self.backend.linear(self.backend.gated(x, self.gated), self.down, x))


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
        types = None
        if type_starts is not None and self.spec.type_vocab_size > 1:
            types = token_types(meta.query_lens_cpu, type_starts)
            if types is not None:
                types = torch.tensor(types, dtype=torch.int64, device=input_ids.device)
        x = self.embeddings(input_ids, positions, meta, types)
        for layer in self.encoder.layer:
            x = layer(x, meta, self.slopes)
        return x
