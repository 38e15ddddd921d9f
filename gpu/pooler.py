"""Pooling a step's final hidden states into embedding vectors (core/pooling.py's kinds): the last
token's row, the mean of all rows (summed across a prompt's chunks), or the first (CLS) row;
then Matryoshka truncation and unit normalisation. A sequence classifier's request (CLASSIFY)
puts its rows through the model's head instead (a decoder's last token's row, an encoder's
first): one raw logit a label. The token-level kinds give a row for every prompt token (its
hidden state, each normalized; or a token classifier's logits), the rows one after another. A
vector leaves as little-endian float32."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from core.pooling import CLASSIFY, TOKEN_CLASSIFY, TOKEN_EMBED
from core.runner_step import SchedulerOutput
from gpu.runner_state import RunnerRequest


def pool(
    out: SchedulerOutput,
    scheduled: list[RunnerRequest],
    hidden: torch.Tensor,
    classify: Callable[[torch.Tensor], torch.Tensor] | None = None,
    project: Any = None,
) -> dict[str, bytes]:
    """The vectors of the pooling requests whose prompt this step finished (`classify`: a
    classifier's raw logits from the rows of an input's last chunk: a decoder's from its last
    row, an encoder's from its first, the whole input being one chunk). Partial state (a
    running sum, the CLS row) is kept with the runner's request between chunks; a recompute
    after a preemption starts again from position 0 and starts the state again too.
    `project`: gpu/st_dense.py's Projection (sentence-transformers' Dense modules; BGE-M3's
    ColBERT head) put over an embedding or token_embed's rows before Matryoshka truncation
    and normalization."""
    pooled: dict[str, bytes] = {}
    row = 0
    for s, r in zip(out.scheduled, scheduled):
        n = s.num_new_tokens
        p = r.pooling
        if p is not None:
            rows = hidden[row : row + n]
            if p.kind == "mean":
                part = rows.float().sum(0)
                r.pool_state = part if s.start == 0 else r.pool_state + part
            elif p.kind == "cls" and s.start == 0:
                r.pool_state = rows[0].float()
            elif p.kind == TOKEN_EMBED:  # (every chunk's rows, kept until the last)
                part = [rows.float()]
                r.pool_state = part if s.start == 0 else r.pool_state + part
            if s.start + n == r.num_tokens:
                if p.kind in (CLASSIFY, TOKEN_CLASSIFY):  # (the engine takes them with a head)
                    vector = classify(rows)
                elif p.kind == TOKEN_EMBED:
                    vector = torch.cat(r.pool_state)
                elif p.kind == "last":
                    vector = rows[-1].float()
                elif p.kind == "mean":
                    vector = r.pool_state / r.num_tokens
                else:
                    vector = r.pool_state
                head = None
                if project is not None and p.kind not in (CLASSIFY, TOKEN_CLASSIFY):
                    head = project.tokens if p.kind == TOKEN_EMBED else project.pooled
                if head is not None:
                    vector = head(vector)
                if p.dimensions is not None:
                    vector = vector[..., : p.dimensions]
                if p.normalize:
                    vector = F.normalize(vector, dim=-1)
                pooled[r.request_id] = vector.cpu().numpy().astype("<f4").tobytes()
                r.pool_state = None
        row += n
    return pooled
