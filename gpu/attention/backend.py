"""The attention backend interface and the per-step metadata every backend reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from gpu.block_tables import StepTables


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
    # Sequences split by kind: one new token (decode) or several (prefill chunk).
    decode_seq_ids: torch.Tensor  # [num_decodes] int32
    prefill_seq_ids: torch.Tensor  # [num_prefills] int32
    decode_seq_ids_cpu: list[int]
    prefill_seq_ids_cpu: list[int]
    max_decode_seq_len: int
    max_prefill_query_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @classmethod
    def build(
        cls,
        slot_mapping: list[int],
        block_tables: StepTables | list[list[int]],
        query_lens: list[int],
        seq_lens: list[int],
        to_device,
    ) -> AttentionMetadata:
        """From host lists; `to_device(data, dtype)` makes a tensor on the model's device. The
        int32 tensors are views of one: a step pays for one host buffer (and one copy to a GPU)
        instead of five."""
        if not isinstance(block_tables, StepTables):
            block_tables = StepTables.from_lists(block_tables)
        query_start = [0]
        for q in query_lens:
            query_start.append(query_start[-1] + q)
        decodes = [i for i, q in enumerate(query_lens) if q == 1]
        prefills = [i for i, q in enumerate(query_lens) if q != 1]
        n, width = block_tables.num_rows, block_tables.width
        ints = block_tables.flat  # a step's own buffer: the rest is appended to it
        ints.extend(query_start)
        ints.extend(seq_lens)
        ints.extend(decodes)
        ints.extend(prefills)
        ints = to_device(ints, torch.int32)
        tables, query_start_t, seq_lens_t, decodes_t, prefills_t = ints.split(
            [n * width, n + 1, len(seq_lens), len(decodes), len(prefills)]
        )
        return cls(
            slot_mapping=to_device(slot_mapping, torch.int64),
            block_tables=tables.view(n, width),
            query_start_loc=query_start_t,
            seq_lens=seq_lens_t,
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            decode_seq_ids=decodes_t,
            prefill_seq_ids=prefills_t,
            decode_seq_ids_cpu=decodes,
            prefill_seq_ids_cpu=prefills,
            max_decode_seq_len=max((seq_lens[i] for i in decodes), default=0),
            max_prefill_query_len=max((query_lens[i] for i in prefills), default=0),
        )


class AttentionBackend(Protocol):
    name: str
    graph_safe: bool  # no host syncs in write_kv/forward: decode steps may be CUDA-graph captured

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
        sliding_window: int = 0,  # 0: none; else a query sees only its last `sliding_window` keys
        softcap: float = 0.0,  # Gemma 2's: each score becomes softcap * tanh(score / softcap)
        # gpt-oss's [num_heads] logits: each joins its head's softmax sum and gives no value
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor: ...  # [num_tokens, num_heads, head_dim]
