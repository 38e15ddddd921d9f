"""A beam search's steps inside the engine (EngineCore's part for core/beam.py): a step's
candidates ranked as transformers ranks them, beams moved on (forks, parks), and the search's
sequences handed out when it is over."""

from __future__ import annotations

from core.beam import BeamGroup
from core.request import BeamSequence, EngineRequest, Request, RequestOutput
from core.stats import finished_stats
from core.stop import StopStrings


class BeamSteps:
    """A part of core/engine_core.py EngineCore (its attributes are the core's)."""

    def _rank_beams(self, group: BeamGroup, now: float) -> RequestOutput | None:
        """A beam search step: its candidates ranked, its beams moved on (forks, parks), or its
        sequences handed out when the search is over."""
        root, live = group.root, group.live
        params = root.sampling_params
        stops = group.stop_ids

        def ends(b: int, token: int) -> str | None:
            if token in stops:
                return "stop"
            r = live[b]
            if r.num_output_tokens + 1 >= root.max_tokens or r.num_tokens + 1 >= self.max_model_len:
                return "length"
            if (
                params.stop
                and r.num_output_tokens >= params.min_tokens
                and self._makes_stop_string(r, token)
            ):
                return "stop"
            return None

        outputs = [r.output_token_ids for r in live]
        going, done = group.search.rank([r.beam for r in live], outputs, ends)
        self._time_token(root, now)
        self.stats.generation_tokens += len(going) if not done else 1
        if done:
            return self._end_beams(group, now)
        group.advance(going, self.scheduler, self._beam_slot)
        return None

    def _beam_slot(self, group: BeamGroup) -> Request:
        """A new sequence for a beam search (its beams outnumber its sequences)."""
        root = group.root
        req = EngineRequest(
            f"{root.request_id}\x1fbeam{len(group.slots)}",  # ids the server never gives
            root.prompt_token_ids,
            root.sampling_params,
            root.arrival_time,
            priority=root.priority,
            cache_salt=root.cache_salt,
            lora=root.lora,
        )
        slot = Request(req, root.max_tokens, None, root.seq_no)
        slot.group = group
        slot.first_scheduled_time = root.first_scheduled_time
        group.slots.append(slot)
        return slot

    def _makes_stop_string(self, request: Request, token: int) -> bool:
        """Whether `token` completes a stop string after the beam's output (decoded over a
        window of its last tokens: a stop found earlier would have ended it)."""
        stops = request.sampling_params.stop
        longest = max(len(s) for s in stops)
        window = request.output_token_ids[-(4 * longest + 4) :]
        decode = self.tokenizer.decode
        before = decode(window, skip_special_tokens=False)
        after = decode([*window, token], skip_special_tokens=False)
        tail = after[max(0, len(before) - longest + 1) :]
        return any(s in tail for s in stops)

    def _end_beams(self, group: BeamGroup, now: float) -> RequestOutput:
        """The search is over: its best hypotheses become the request's sequences."""
        root = group.root
        params = root.sampling_params
        hyps = group.search.results(
            [r.beam for r in group.live], [r.output_token_ids for r in group.live]
        )
        seqs = []
        for h in hyps:
            text = self._beam_text(h, params, group.stop_ids)
            seqs.append(
                BeamSequence(
                    h.token_ids, text, h.finish_reason, h.cumulative_logprob, h.score, h.logprobs
                )
            )
        for r in group.slots:
            self.scheduler.remove(r)
        self._drop(root)
        best = seqs[0]
        self.stats.finished.append(finished_stats(root, best.finish_reason, now))
        return best.output(root.request_id, root.num_prompt_tokens, root.num_cached_tokens, seqs)

    def _beam_text(self, h, params, stop_ids: set[int]) -> str:
        """A finished hypothesis's reply text: a stop token's text left out (unless
        include_stop_str_in_output, as vLLM's), cut at its first stop string that ends past the
        first min_tokens tokens."""
        if self.tokenizer is None:
            return ""
        ids = h.token_ids
        if (
            ids
            and ids[-1] in stop_ids
            and h.finish_reason == "stop"
            and not params.include_stop_str_in_output
        ):
            ids = ids[:-1]
        skip = params.skip_special_tokens
        text = self.tokenizer.decode(ids, skip_special_tokens=skip)
        if not params.stop:
            return text
        early = self.tokenizer.decode(ids[: params.min_tokens], skip_special_tokens=skip)
        if not text.startswith(early):
            early = ""
        stop = StopStrings(params.stop, params.include_stop_str_in_output)
        head, _ = stop.feed(early, armed=False)
        cut, matched = stop.feed(text[len(early) :])
        return head + (cut if matched is not None else cut + stop.flush())
