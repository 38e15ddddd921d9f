"""The decoder's building blocks on a backend: a product with its optional bias (Linear), the
token embeddings, RMSNorm. Each holds the checkpoint's tensors as the loader gives them until
`prepare`, then only the backend's form of them."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Linear(nn.Module):
    """y = x W^T + b (+ residual) on the backend. Holds the checkpoint's weight as the checkpoint
    gives it (a tensor in its dtype, or a gpu/quant/tensor.py BlockTensor, set by the loader
    through `load`) until `prepare`, then only the backend's form of it."""

    def __init__(self, backend, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.backend = backend
        self.in_features, self.out_features = in_features, out_features
        self.has_bias = bias
        self.weight: Any = None
        self.bias: Any = None
        self.w = None

    def expects(self) -> dict[str, tuple[int, ...]]:
        """The checkpoint tensors this layer loads, by kind, and their shapes."""
        shapes = {"weight": (self.out_features, self.in_features)}
        if self.has_bias:
            shapes["bias"] = (self.out_features,)
        return shapes

    def load(self, kind: str, value: Any) -> None:
        setattr(self, kind, value)

    def take(self) -> tuple[Any, Any]:
        """The loaded (weight, bias), given up: the module keeps only what is prepared from them."""
        weight, bias = self.weight, self.bias
        self.weight = self.bias = None
        return weight, bias

    def prepare(self) -> None:
        self.w = self.backend.prepare_linear(*self.take())

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.backend.linear(x, self.w, residual)


class Embedding(nn.Module):
    """The token embeddings, held as the checkpoint gives them until `prepare`, then in the
    backend's form, which also serves as a tied LM head's weight."""

    def __init__(self, backend, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.backend = backend
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight: Any = None
        self.w = None

    def expects(self) -> dict[str, tuple[int, ...]]:
        return {"weight": (self.num_embeddings, self.embedding_dim)}

    def load(self, kind: str, value: Any) -> None:
        self.weight = value

    def prepare(self) -> None:
        self.w = self.backend.prepare_embedding(self.weight)
        self.weight = self.w if isinstance(self.w, torch.Tensor) else None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.backend.embed(input_ids, self.w)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, backend) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.rms_norm(x, self.weight, self.eps)


class LayerNorm(RMSNorm):
    """A mean-centred layer norm: Cohere's, a weight and no bias (RMSNorm's weight and eps),
    Nemotron's, with a bias too, or OLMo's, with neither (`weightless`: ones)."""

    def __init__(
        self, dim: int, eps: float, backend, bias: bool = False, weightless: bool = False
    ) -> None:
        super().__init__(dim, eps, backend)
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None
        self.weightless = weightless
        if weightless:  # OLMo's: no weight in the checkpoint, ones in its place (`prepare`)
            del self.weight
            self.register_buffer("weight", torch.ones(dim), persistent=False)

    def prepare(self) -> None:
        """After loading: a weightless norm's ones (the model is built without initializing)."""
        if self.weightless:
            with torch.no_grad():
                self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.layer_norm(x, self.weight, self.eps, self.bias)
