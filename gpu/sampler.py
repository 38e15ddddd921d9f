"""Sampler: logits processing and sampling for the whole batch, in tensors.

Order, as vLLM applies it: the structured-output grammar's mask, allowed_token_ids, logit bias,
min_tokens bans, repetition/frequency/presence penalties, temperature, top-k/top-p/min-p
filtering, then sampling (greedy rows take the argmax). Log-probs are, as vLLM's default
(`--logprobs-mode raw_logprobs`) and OpenAI's, the model's own distribution: before any of the
above, whatever the temperature or filters. `processed_logprobs` gives those of the distribution
actually sampled from (after all of the above; greedy rows at temperature 1; filtered tokens
-inf), and `raw_logits` / `processed_logits` the logits themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from core.config import LOGPROBS_MODES


@dataclass
class SamplingMetadata:
    """Per-step sampling inputs, one row per sampled sequence (built by the model runner)."""

    all_greedy: bool
    # None when every row is greedy and nobody asked for log-probs: only the argmax is taken,
    # and neither temperature nor the filters move it (the most likely token always stays).
    temperature: torch.Tensor | None = None  # [n] float32
    top_k: torch.Tensor | None = None  # [n] int64, 0 = off
    top_p: torch.Tensor | None = None  # [n] float32
    min_p: torch.Tensor | None = None  # [n] float32
    need_top_k: bool = False
    need_top_p: bool = False
    need_min_p: bool = False
    # (row, generator) for requests with their own seed.
    seeded: list[tuple[int, torch.Generator]] = field(default_factory=list)
    # allowed_token_ids: (rows [k], keep [k, vocab] bool); the rest of a row's tokens -inf.
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None
    # Sparse additions: logits[rows, tokens] += values.
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # Tokens banned (EOS and stop tokens before min_tokens): logits[rows, tokens] = -inf.
    ban: tuple[torch.Tensor, torch.Tensor] | None = None
    # Penalties: output token counts, prompt token presence, and the three factors per row.
    output_counts: torch.Tensor | None = None  # [n, vocab] float32
    prompt_mask: torch.Tensor | None = None  # [n, vocab] bool
    presence: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    repetition: torch.Tensor | None = None
    max_logprobs: int | None = None  # largest top-logprobs count asked for; None: nobody asked
    # Structured outputs: (rows [k], bitmask [k, words] int32) of the constrained rows.
    grammar: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [n]
    logprobs: torch.Tensor | None = None  # [n] log-prob of each sampled token
    top_ids: torch.Tensor | None = None  # [n, k]
    top_logprobs: torch.Tensor | None = None  # [n, k]


def apply_penalties(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """Repetition (on tokens seen in prompt or output: positive logits divided, negative
    multiplied), then frequency (minus count times the factor) and presence (minus the factor
    once) on output tokens."""
    seen = prompt_mask | (output_counts > 0)
    rep = repetition[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - frequency[:, None] * output_counts
    return logits - presence[:, None] * (output_counts > 0).to(logits.dtype)


def filter_logits(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    need_top_k: bool,
    need_top_p: bool,
    need_min_p: bool,
) -> torch.Tensor:
    """Set to -inf every token outside top-k, outside the top-p nucleus, or below min_p times the
    most likely token's probability. The most likely token always stays."""
    if need_min_p:
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if not (need_top_k or need_top_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if need_top_k:
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        drop |= torch.arange(vocab, device=logits.device)[None, :] >= k[:, None]
    if need_top_p:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p.
        before = probs.cumsum(dim=-1) - probs
        drop |= before >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


class Sampler:
    def __init__(
        self, seed: int, device: torch.device, backend, logprobs_mode: str = "raw_logprobs"
    ) -> None:
        """`backend` (gpu/backend.py) runs the argmax and applies the grammar's bitmask."""
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs mode {logprobs_mode!r}: one of {', '.join(LOGPROBS_MODES)}")
        self.backend = backend
        self.processed = logprobs_mode.startswith("processed")
        self.normalized = logprobs_mode.endswith("logprobs")
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def _draw(self, probs: torch.Tensor, seeded: list[tuple[int, torch.Generator]]) -> torch.Tensor:
        """One token per row from `probs` by inverse CDF: one uniform number per row, found in
        the row's running sum. Needs no CPU sync and draws one random number per row, not one
        per vocabulary entry (the exponential race, argmax(p / E), did: on CPU its per-element
        `exponential_` cost about ten times this; figures: docs/benchmarks.md). A request with
        its own seed draws its number from its own generator, so its tokens do not depend on
        the rest of the batch."""
        cdf = probs.cumsum(dim=-1)
        u = torch.rand(probs.shape[0], 1, generator=self.generator, device=probs.device)
        for row, generator in seeded:
            u[row] = torch.rand(1, generator=generator, device=probs.device)
        # First index whose running sum exceeds u * total: a token with probability 0 adds an
        # empty interval and is never drawn. The clamp guards against rounding at the top end.
        ids = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
        return ids.squeeze(1).clamp_(max=probs.shape[1] - 1)

    def __call__(self, logits: torch.Tensor, m: SamplingMetadata) -> SamplerOutput:
        """logits: [n, vocab] float32, one row per sampled sequence."""
        raw = logits
        logits, greedy = self._process(logits, m)
        ids = self.backend.argmax(logits)
        if not m.all_greedy:
            ids = torch.where(greedy, ids, self._draw(logits.softmax(dim=-1), m.seeded))
        return self._with_logprobs(SamplerOutput(token_ids=ids), raw, logits, m)

    def verify(self, logits: torch.Tensor, m: SamplingMetadata, drafts: torch.Tensor):
        """Speculative rows: row i of a request's run scores the position after its i-th input
        and `drafts[i]` is the proposal there (-1 on a run's last row, which only ever gives
        the token after the run). Returns (SamplerOutput, accepted [n] bool): each row's token
        is the proposal where accepted, else the token the run ends with there. A run keeps its
        rows up to and including its first unaccepted one.

        Greedy rows accept a proposal equal to their argmax. Sampled rows accept it with the
        probability the model gives it (the proposal is certain, so min(1, p / q) is p) and
        otherwise draw from the model's distribution without it: the token after a run of
        accepted proposals has exactly the model's distribution (rejection sampling)."""
        raw = logits
        logits, greedy = self._process(logits, m)
        ids = self.backend.argmax(logits)
        has = drafts >= 0
        target = drafts.clamp(min=0)
        accepted = has & (ids == target)
        if not m.all_greedy:
            probs = logits.softmax(dim=-1)
            u = torch.rand(probs.shape[0], generator=self.generator, device=probs.device)
            for row, generator in m.seeded:
                u[row] = torch.rand(1, generator=generator, device=probs.device)[0]
            p_draft = probs.gather(1, target[:, None]).squeeze(1)
            sampled_accept = has & (u < p_draft)
            # the fallback draw: the distribution without the rejected proposal
            residual = probs.scatter(1, target[:, None], 0.0)
            residual = torch.where(has[:, None], residual, probs)
            drawn = self._draw(residual, m.seeded)
            ids = torch.where(greedy, ids, drawn)
            accepted = torch.where(greedy, accepted, sampled_accept)
        ids = torch.where(accepted, target, ids)
        return self._with_logprobs(SamplerOutput(token_ids=ids), raw, logits, m), accepted

    def _with_logprobs(
        self, out: SamplerOutput, raw: torch.Tensor, processed: torch.Tensor, m: SamplingMetadata
    ) -> SamplerOutput:
        if m.max_logprobs is not None:
            logprobs = processed if self.processed else raw
            if self.normalized:
                logprobs = logprobs.log_softmax(dim=-1)
            out.logprobs = logprobs.gather(1, out.token_ids[:, None]).squeeze(1)
            if m.max_logprobs > 0:
                out.top_logprobs, out.top_ids = logprobs.topk(m.max_logprobs, dim=-1)
        return out

    def _process(self, logits: torch.Tensor, m: SamplingMetadata):
        """The logits every row is sampled from (grammar, bias, bans, penalties, temperature,
        filters), and which rows are greedy (None when all are)."""
        grammar_only = None
        if m.grammar is not None:
            g_rows, g_mask = m.grammar
            logits = self.backend.apply_token_bitmask(logits, g_rows, g_mask)
            if m.bias is not None or m.ban is not None or m.allowed is not None:
                grammar_only = logits.index_select(0, g_rows)
        if m.allowed is not None:
            a_rows, keep = m.allowed
            kept = logits.index_select(0, a_rows).masked_fill(~keep, float("-inf"))
            logits = logits.index_copy(0, a_rows, kept)
        if m.bias is not None:
            rows, tokens, values = m.bias
            logits = logits.index_put((rows, tokens), values, accumulate=True)
        if m.ban is not None:
            logits = logits.index_put(m.ban, torch.tensor(float("-inf"), device=logits.device))
        if grammar_only is not None:
            # A bias, allowed_token_ids or a min_tokens ban can leave a constrained row nothing
            # the grammar allows
            # (EOS banned where the grammar must end): the grammar wins, the row goes back to
            # its grammar-masked logits. No host sync: a where over the constrained rows.
            sub = logits.index_select(0, g_rows)
            dead = sub.amax(dim=-1, keepdim=True) == float("-inf")
            logits = logits.index_copy(0, g_rows, torch.where(dead, grammar_only, sub))
        if m.output_counts is not None:
            logits = apply_penalties(
                logits, m.output_counts, m.prompt_mask, m.presence, m.frequency, m.repetition
            )
        greedy = None
        if not m.all_greedy:
            greedy = m.temperature < 1e-5
            logits = logits / torch.where(greedy, 1.0, m.temperature)[:, None]
        if m.need_top_k or m.need_top_p or m.need_min_p:
            logits = filter_logits(
                logits, m.top_k, m.top_p, m.min_p, m.need_top_k, m.need_top_p, m.need_min_p
            )
        return logits, greedy
