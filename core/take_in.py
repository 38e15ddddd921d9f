"""Taking a launched step's results in (EngineCore's part that does it): each sampled token
appended to its request, detokenized and checked against every stop; a verified run of
speculative proposals kept token by token; pooled vectors and prompt log-probs handed out; the
beams of a beam search ranked once all have their candidates (core/beam_steps.py)."""

from __future__ import annotations

import time

from core.beam import BeamGroup
from core.request import Logprob, Request, RequestOutput, Status
from core.scheduler import ScheduledSeq, ScheduledStep
from core.stats import finished_stats


class TakeIn:
    """A part of core/engine_core.py EngineCore (its attributes are the core's)."""

    def _take_in(self, out: ScheduledStep, pending) -> list[RequestOutput]:
        """A launched step's results (waited for): sampled tokens appended, stops checked,
        pooled vectors and prompt log-probs handed out. Rows of requests that ended meanwhile
        (finished by the step before, or aborted) are dropped."""
        result = pending.result()
        outputs: list[RequestOutput] = []
        sampled = [s.request for s in out.seqs if s.sample]
        if self._grammars is not None:
            # The constrained requests' matchers take their tokens in one call (on llguidance's
            # threads, without the interpreter lock) rather than one call per request.
            taken = [
                (r.grammar, t)
                for r, t in zip(sampled, result.token_ids)
                if r.grammar is not None and r.status is not Status.FINISHED
            ]
            if taken:
                self._grammars.consume(taken)
        row = 0
        now = time.monotonic()
        ranked: list[BeamGroup] = []  # beam searches whose every live beam has its row
        for seq in out.seqs:
            request = seq.request
            if request.status is Status.FINISHED:
                row += seq.sample
                continue
            prompt_end = request.num_prompt_tokens
            if seq.start < prompt_end:
                self.num_computed_prompt_tokens += (
                    min(seq.start + seq.num_new_tokens, prompt_end) - seq.start
                )
                if request.prompt_logprobs is not None:
                    request.record_prompt_logprobs(
                        seq.start, result.prompt_logprobs.get(request.request_id)
                    )
            if not seq.sample:
                vector = result.pooled.get(request.request_id)
                if vector is not None:
                    outputs.append(self._pooled(request, vector, now))
                else:
                    self.num_partial_prefills += 1
                continue
            token_id, logprob = result.token_ids[row], result.logprobs[row]
            row += 1
            if request.group is not None:
                rid = request.request_id
                request.beam.candidates = (result.beam_ids[rid], result.beam_logprobs[rid])
                if request.group.ready:
                    ranked.append(request.group)
                continue
            if seq.num_draft:
                outputs.append(self._take_run(seq, token_id, logprob, result, now))
                continue
            outputs.append(self._append_token(request, token_id, logprob, now))
            if self.async_scheduling and request.status is not Status.FINISHED:
                self.scheduler.cache_known(request)
        for group in ranked:
            out = self._rank_beams(group, now)
            if out is not None:
                outputs.append(out)
        return outputs

    def _take_run(self, seq: ScheduledSeq, token_id, logprob, result, now) -> RequestOutput:
        """A verified run of proposals: the kept tokens appended one by one (a stop inside the
        run ends it there), the computed positions cut back to the kept ones, one output."""
        request = seq.request
        rid = request.request_id
        tokens = [token_id, *result.spec_token_ids.get(rid, ())]
        logprobs = [logprob, *result.spec_logprobs.get(rid, ())]
        accepted = len(tokens) - 1
        stats = self.stats
        stats.spec_drafts += 1
        stats.spec_draft_tokens += seq.num_draft
        stats.spec_accepted_tokens += accepted
        per_pos = stats.spec_accepted_per_pos
        per_pos.extend([0] * (accepted - len(per_pos)))
        for i in range(accepted):
            per_pos[i] += 1
        self.speculator.judge(request, seq.num_draft, accepted)
        out = None
        for i, (token, lp) in enumerate(zip(tokens, logprobs)):
            if i and request.grammar is not None:  # the first was taken with the batch's
                request.grammar.consume_token(token)
            step = self._append_token(request, token, lp, now)
            out = step if out is None else out.merge(step)
            if step.finished:
                return out
        # the rejected proposals' positions are computed again from the kept tokens
        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
        self.scheduler.cache_known(request)
        return out

    def _time_token(self, request: Request, now: float) -> None:
        """A token (or a beam search's step) out at `now`: its time to first token or its
        inter-token latency, and the prompt counted once."""
        stats = self.stats
        if request.first_token_time is None:
            request.first_token_time = now
            stats.ttft.append(now - request.arrival_time)
            stats.prompt_tokens += request.num_prompt_tokens
        else:
            stats.itl.append(now - request.last_token_time)
        request.last_token_time = now

    def _append_token(
        self, request: Request, token_id: int, logprob: Logprob | None, now: float
    ) -> RequestOutput:
        self._time_token(request, now)
        self.stats.generation_tokens += 1
        request.append_output(token_id)
        detok = request.detokenizer
        reason = self._stop_reason(request, token_id)
        params = request.sampling_params
        # A stop token (EOS, stop_token_ids) ends the text before it, as vLLM's does, unless
        # include_stop_str_in_output; its id still counts, with its log-prob.
        shown = reason != "stop" or params.include_stop_str_in_output
        text = detok.step(token_id) if detok and shown else ""
        error, error_status = None, 500
        stop_reason = (
            token_id  # a stop_token_ids entry, not the model's own EOS (vLLM's stop_reason)
            if reason == "stop"
            and token_id in params.stop_token_ids
            and (params.ignore_eos or token_id not in self.eos_token_ids)
            else None
        )
        if request.grammar is not None:  # the token was consumed in step(), all at once
            matcher = request.grammar
            if matcher.is_error():
                reason, error = "error", f"structured output: {matcher.get_error()}"
                if error.startswith("structured output: NoExtensionBias"):
                    # The request's grammar allows no text after what it allowed so far (a
                    # rule that matches nothing, which no check finds before): its own fault.
                    error_status = 400
                    error = (
                        "structured output: the constraint allows nothing after the "
                        f"{request.num_output_tokens - 1} tokens before this one (a rule of "
                        "it matches no text)"
                    )
            elif matcher.is_stopped():
                reason = "stop"  # the grammar is complete: nothing more may follow
        if reason is not None and detok:
            text += detok.flush()  # the request ends: release bytes held for an unfinished char
        if request.stop is not None:
            text, matched = request.stop.feed(text, request.num_output_tokens > params.min_tokens)
            if matched is not None:
                reason, stop_reason = "stop", matched
            elif reason is not None:
                text += request.stop.flush()
        if reason is not None:
            self.scheduler.remove(request)
            self._drop(request)
            self.stats.finished.append(finished_stats(request, reason, now))
        out = request.output([token_id], text, reason, [logprob] if logprob is not None else None)
        out.error, out.error_status = error, error_status
        out.stop_reason = stop_reason if reason == "stop" else None
        return out

    def _pooled(self, request: Request, vector: bytes, now: float) -> RequestOutput:
        """A pooling request whose prompt is done: its vector is the output; it ends here."""
        request.first_token_time = request.last_token_time = now
        self.stats.ttft.append(now - request.arrival_time)
        self.stats.prompt_tokens += request.num_prompt_tokens
        self.scheduler.remove(request)
        self._drop(request)
        self.stats.finished.append(finished_stats(request, "stop", now))
        out = request.output([], "", "stop")
        out.embedding = vector
        return out

    def _stop_reason(self, request: Request, token_id: int) -> str | None:
        params = request.sampling_params
        # min_tokens is enforced in the sampler (EOS and stop tokens are banned until then).
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return "stop"
        if token_id in params.stop_token_ids:
            return "stop"
        if request.num_output_tokens >= request.max_tokens:
            return "length"
        if request.num_tokens >= self.max_model_len:
            return "length"
        return None
