"""Speculative decoding's verification steps replayed as CUDA graphs.

A verification step gives each speculating row its last known token and its k proposals (k+1
query tokens), beside plain decodes (one token) and rows with fewer proposals. Its shapes vary
with that mix, so the graphs are captured over one fixed layout: every row k+1 query tokens, at
each batch size of `capture_sizes`. A step whose rows all fit that layout (at most k+1 new
tokens each: a decode, a verification, a short prompt chunk) is scattered into it: row i's
tokens at i*(k+1) on, the rest of its k+1 places padding that writes no K/V (slot -1) and sits
after the row's real tokens, so causal attention keeps it out of their context. The rows' hidden
states are gathered back into the step's own order, so logits, sampling, prompt log-probs and
pooling read them as from an eager forward.

The graphs run the varlen (prefill) attention kernel with k+1 query rows per sequence: its grid
depends only on the batch size and k+1, fixed at capture; lengths and block tables are read from
device memory. A row needs its padded places within `max_model_len` (their positions and block
table columns exist); a step with a row too close to the end, a longer chunk, more rows than the
largest size, or adapters (these graphs carry no LoRA buffers) runs eagerly.
"""

from __future__ import annotations

import torch

from gpu.attention.backend import AttentionMetadata
from gpu.cuda.graphs import DecodeGraphs


class VerifyGraphs(DecodeGraphs):
    """Made with `query_len` k + 1 (a decode graph's is 1); no LoRA buffers."""

    kind = "verification"

    def can_run(self, meta: AttentionMetadata) -> bool:
        """Steps of rows with at most k+1 new tokens each (some with more than one), every
        row's padded places inside `max_model_len`, no more rows than the largest size."""
        q, limit = self.query_len, self.max_model_len
        lens = meta.query_lens_cpu
        return (
            bool(self.graphs)
            and 0 < meta.num_seqs <= self.max_size
            and max(lens) > 1
            and max(lens) <= q
            and all(s - n + q <= limit for s, n in zip(meta.seq_lens_cpu, lens))
            and meta.block_tables.shape[1] <= self.block_tables.shape[1]
        )

    def run(self, input_ids, positions, meta: AttentionMetadata, lora=None) -> torch.Tensor:
        """The step's hidden states, one row per input token in the step's order."""
        if lora is not None:
            raise ValueError("verification graphs carry no adapters: run the step eagerly")
        n, q = meta.num_seqs, self.query_len
        size = self.padded_size(n)
        # Host side: where each input token goes, and every place's position; the padding rows
        # (n..size) get one harmless context slot each, as the decode graphs' do.
        places, pad_positions, seq_lens = [], [], []
        for i, (seq_len, count) in enumerate(zip(meta.seq_lens_cpu, meta.query_lens_cpu)):
            start = seq_len - count
            places.extend(range(i * q, i * q + count))
            pad_positions.extend(range(start, start + q))
            seq_lens.append(start + q)
        pad_positions.extend([0] * ((size - n) * q))
        seq_lens.extend([q] * (size - n))
        host = torch.tensor(places + pad_positions + seq_lens, dtype=torch.int64)
        if self.device.type == "cuda":
            host = host.pin_memory()
        host = host.to(self.device, non_blocking=True)
        tokens = len(places)
        at = host[:tokens]
        width = meta.block_tables.shape[1]
        self.input_ids.index_copy_(0, at, input_ids)
        self.positions[: size * q].copy_(host[tokens : tokens + size * q])
        self.slot_mapping[: size * q].fill_(-1)
        self.slot_mapping.index_copy_(0, at, meta.slot_mapping)
        self.seq_lens[:size].copy_(host[tokens + size * q :])
        self.block_tables[:n, :width].copy_(meta.block_tables)
        if size > n:
            self.block_tables[n:size, 0].fill_(0)
        self.num_replays += 1
        return self.graphs[size].replay().index_select(0, at)
