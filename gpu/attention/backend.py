"""The attention backend interface and the per-step metadata every backend reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    """Flat description of one mixed batch (prefill chunks and decodes), built once per step.

    Sequence i owns query rows query_start_loc[i]:query_start_loc[i+1]; its context (cached plus
    new tokens) is seq_lens[i] long and lives in the blocks listed in block_tables[i].
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = padding (write nothing)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    # The same on the host, for backends that loop in Python.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend(Protocol):
    name: str

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...  # [num_tokens, num_heads, head_dim]


def get_backend(name: str, device: torch.device) -> AttentionBackend:
    from gpu.attention.torch_ref import TorchAttention

    if name in ("auto", "torch"):
        return TorchAttention()
    raise ValueError(f"unknown attention backend {name!r} (choose auto or torch)")
