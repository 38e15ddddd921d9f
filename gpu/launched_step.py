"""A step the runner has launched (gpu/runner.py `submit`): its sampled ids, log-probs and
speculative verdicts on their way to the host, and the StepResult made of them."""

from __future__ import annotations

import torch

from core.request import Logprob, StepResult
from gpu.runner_state import RunnerRequest


class LaunchedStep:
    """A step whose sampled ids (and log-probs) are on their way to the host: copies queued
    behind the step's kernels, into pinned memory, and an event recorded after them; `result()`
    waits for that event alone, so the work queued after it keeps running."""

    def __init__(
        self,
        requests: list[RunnerRequest],
        sampled,
        prompt_lp=None,
        pooled=None,
        runs: list[tuple[RunnerRequest, int]] | None = None,
        accepted: torch.Tensor | None = None,
    ):
        self.requests = requests  # one per sampled row
        self.runs = runs if accepted is not None else None  # (request, rows) when speculating
        self.prompt_lp, self.pooled = prompt_lp or {}, pooled or {}
        self.event = None
        self.host: list[torch.Tensor | None] = []
        # Beam rows' candidates (ids, top log-probs, per-row counts), set by the runner.
        self.beams = None
        if sampled is None:
            return
        parts = [sampled.token_ids, sampled.logprobs, sampled.top_ids, sampled.top_logprobs]
        parts.append(accepted)
        if sampled.token_ids.is_cuda:
            parts = [p.to("cpu", non_blocking=True) if p is not None else None for p in parts]
            self.event = torch.cuda.Event()
            self.event.record()
        self.host = parts

    def result(self) -> StepResult:
        if self.event is not None:
            self.event.synchronize()
        if not self.host:
            return StepResult([], [], self.prompt_lp, self.pooled)
        ids_t, chosen_t, top_ids_t, top_lps_t, accepted_t = self.host
        ids = ids_t.tolist()
        logprobs: list[Logprob | None] = [None] * len(ids)
        if chosen_t is not None:
            chosen = chosen_t.tolist()
            top_ids = top_ids_t.tolist() if top_ids_t is not None else None
            top_lps = top_lps_t.tolist() if top_ids_t is not None else None
            for i, r in enumerate(self.requests):
                k = r.sampling_params.logprobs
                if k is not None:
                    logprobs[i] = Logprob(
                        ids[i], chosen[i], top_ids[i][:k] if k else [], top_lps[i][:k] if k else []
                    )
        if self.runs is None:
            result = StepResult(ids, logprobs, self.prompt_lp, self.pooled)
        else:
            result = self._runs(ids, logprobs, accepted_t.tolist())
        if self.beams is not None:
            rids, ks, values, top = self.beams
            values, top = values.tolist(), top.tolist()
            result.beam_ids = {rid: top[j][: ks[j]] for j, rid in enumerate(rids)}
            result.beam_logprobs = {rid: values[j][: ks[j]] for j, rid in enumerate(rids)}
        return result

    def _runs(self, ids: list[int], logprobs: list, accepted: list[bool]) -> StepResult:
        """Each speculating request keeps its rows up to its first unaccepted one: the first
        token in token_ids, the rest in spec_token_ids."""
        first_ids, first_lps, spec, spec_lps = [], [], {}, {}
        row = 0
        for r, n in self.runs:
            keep = 1
            while keep < n and accepted[row + keep - 1]:
                keep += 1
            first_ids.append(ids[row])
            first_lps.append(logprobs[row])
            if n > 1:
                spec[r.request_id] = ids[row + 1 : row + keep]
                spec_lps[r.request_id] = logprobs[row + 1 : row + keep]
            row += n
        return StepResult(first_ids, first_lps, self.prompt_lp, self.pooled, spec, spec_lps)
