"""A step as the engine schedules it (`ScheduledStep`: the requests themselves, in row order),
and the same step told to the model runner (core/runner_step.py): what changed since the runner
last saw each request."""

from __future__ import annotations

import msgspec

from core.request import Request
from core.runner_step import Fork, NewRequest, ScheduledRequest, SchedulerOutput


class ScheduledSeq(msgspec.Struct, gc=False):
    """One request's share of a step: which tokens to compute, where they go, whether to sample."""

    request: Request
    start: int  # position of the first new token
    num_new_tokens: int
    block_table: list[int]
    # The chunk reaches the end of the known tokens: its last row gives logits (a pooling
    # request is never sampled: the runner pools its rows instead).
    sample: bool
    # Of the new tokens, how many are speculative proposals (the chunk's last ones): every
    # row from the last known token on gives logits, and the sampler verifies them.
    num_draft: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.request.all_token_ids[self.start : self.start + self.num_new_tokens]


class ScheduledStep(msgspec.Struct, gc=False):
    """One step as the engine sees it: the scheduled requests themselves (`seqs`, row order),
    and `output`, the same step for the model runner (core/runner_step.py)."""

    seqs: list[ScheduledSeq]
    preempted: list[str]
    output: SchedulerOutput

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)


def runner_output(
    seqs: list[ScheduledSeq],
    finished: list[str],
    preempted: list[str],
    forks: list[Fork],
    copies: list,
) -> SchedulerOutput:
    """The runner's step for `seqs`: new requests in full, resumed ones' tables over, and of
    each the token and block ids it has not been given (counted on the request)."""
    new, resumed, entries = [], [], []
    for s in seqs:
        r = s.request
        if not r.shown:
            r.shown = True
            new.append(
                NewRequest(r.request_id, r.prompt_token_ids, r.sampling_params, r.pooling, r.lora)
            )
            r.runner_tokens = r.num_prompt_tokens
        elif r.runner_blocks == 0:
            resumed.append(r.request_id)
        tokens = r.all_token_ids
        table = s.block_table
        entries.append(
            ScheduledRequest(
                r.request_id,
                s.start,
                s.num_new_tokens,
                s.sample,
                tokens[r.runner_tokens :] if r.runner_tokens < len(tokens) else [],
                table[r.runner_blocks :],
                r.num_pending > 0,
                r.spec_token_ids[: s.num_draft],
            )
        )
        r.runner_tokens, r.runner_blocks = len(tokens), len(table)
    return SchedulerOutput(finished, new, preempted, resumed, entries, forks, copies)
