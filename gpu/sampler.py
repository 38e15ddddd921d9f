"""Sampler: greedy, temperature, top-k and top-p over the whole batch in tensors."""

from __future__ import annotations

import torch


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,  # [n, vocab] float32
        temperature: torch.Tensor,  # [n]
        top_k: torch.Tensor,  # [n] int64, 0 = off
        top_p: torch.Tensor,  # [n]
        all_greedy: bool,
        need_top_k: bool,
        need_top_p: bool,
        seeded: list[tuple[int, torch.Generator]] = (),
    ) -> torch.Tensor:
        """`seeded` lists (row, generator) for requests with their own seed: their noise comes
        from their generator alone, so the same seed gives the same tokens whatever the batch."""
        greedy_ids = logits.argmax(dim=-1)
        if all_greedy:
            return greedy_ids
        greedy = temperature < 1e-5
        logits = logits / torch.where(greedy, 1.0, temperature)[:, None]
        if need_top_k or need_top_p:
            logits = _top_k_top_p(logits, top_k, top_p, need_top_k, need_top_p)
        probs = logits.softmax(dim=-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p without a CPU sync.
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, generator in seeded:
            noise[row].exponential_(generator=generator)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy, greedy_ids, sampled)


def _top_k_top_p(logits, top_k, top_p, need_top_k: bool, need_top_p: bool) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if need_top_k:
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        drop |= ranks >= k[:, None]
    if need_top_p:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p; the first always stays.
        before = probs.cumsum(dim=-1) - probs
        drop |= before >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
