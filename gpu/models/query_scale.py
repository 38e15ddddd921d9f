"""Llama 4's attention temperature, as Ministral 3 applies it: each query, once rotated, times
1 + beta * log(1 + floor(position / length)), `length` the rotation's pretrained context
(rope_parameters' original_max_position_embeddings, `llama_4_scaling_beta` the beta). Within
that length the factor is 1; past it the scores of far positions sharpen.

The factor is each step's, by position: `QueryScale.set` computes it once a step from the
positions (in graph-capturable torch ops, on the positions' device) and every layer's attention
multiplies its rotated queries by it; the one-call CPU stack computes it itself from the same
two numbers (forward.cpp)."""

from __future__ import annotations

import torch


class QueryScale:
    def __init__(self, beta: float, length: int) -> None:
        self.beta, self.length = beta, length
        self.value: torch.Tensor | None = None  # [tokens]: this step's factors

    def set(self, positions: torch.Tensor) -> None:
        """The factors of a step's positions, as transformers computes them (float32)."""
        blocks = torch.floor(positions / self.length)
        self.value = 1 + self.beta * torch.log(1 + blocks)

    def apply(self, q: torch.Tensor) -> torch.Tensor:
        """Rotated queries [tokens, heads, head_dim] times their factors."""
        return q * self.value.to(q.dtype)[:, None, None]
