"""Beam search inside the engine: a request's beams ranked each step as transformers ranks them.

A beam search request computes its prompt as one sequence; from then on each of its live beams
is a sequence of its own (core/request.py `Request`, a "slot" of the request's `BeamSearch`),
scheduled, batched and preempted like any other, whose blocks it shares with the beams it came
from (core/kv_cache_manager.py `fork`: full blocks by reference, the last partial block copied
when a beam writes into it). Each step the runner gives each beam's row its top candidates'
log-probabilities (`num_candidates`); once every live beam has its row, `BeamSearch.rank`
takes the best candidates over all of them:

- scores are cumulative log-probabilities, added in float32 as transformers adds them;
- the `2 x width` (more with several stop tokens) best candidates are looked at; those of the
  first `width` that end (a stop token, `max_tokens`, a stop string) become finished
  hypotheses, scored `cumulative / generated_length ** length_penalty` (the generated length
  counts the last token, the prompt does not), of which the `width` best are kept;
- the `width` best that do not end are the next step's beams;
- the search ends when `early_stopping` is true and `width` hypotheses are finished, when no
  beam can still beat the worst kept hypothesis (false: judged at the current length; "never":
  at `max_tokens` when the length penalty is positive), or when no candidate goes on.

The finished hypotheses, best first, are the request's `n` sequences.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import msgspec

from core.request import Logprob
from core.sampling import SamplingParams

_F32 = struct.Struct("f")


def f32(x: float) -> float:
    """x rounded to float32 (a sum or quotient of float32 values rounded once, as torch's
    float32 arithmetic gives it: double holds the exact result closely enough)."""
    return _F32.unpack(_F32.pack(x))[0]


def stop_ids(params: SamplingParams, eos_token_ids: frozenset[int] | set[int]) -> set[int]:
    """The tokens that end a hypothesis (and are banned before min_tokens)."""
    ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        ids |= eos_token_ids
    return ids


def num_candidates(params: SamplingParams, eos_token_ids: frozenset[int] | set[int]) -> int:
    """Candidates looked at per step (and asked of each beam's row): enough that `width` of them
    go on even if every beam's best continuations are stop tokens."""
    return max(2, 1 + len(stop_ids(params, eos_token_ids))) * params.beam_width


class Hypothesis(msgspec.Struct, gc=False):
    """A finished beam: its output tokens, its score (length-normalized) and how it ended."""

    token_ids: list[int]
    score: float
    cumulative_logprob: float
    finish_reason: str
    logprobs: list[Logprob] = []


class Candidate(msgspec.Struct, array_like=True, gc=False):
    """One continuation of a live beam: the beam's index in the live list, the token, its
    log-probability and the new cumulative score."""

    beam: int
    token_id: int
    logprob: float
    score: float


class Beam:
    """What a live beam carries besides its tokens (which its sequence holds)."""

    __slots__ = ("score", "logprobs", "candidates")

    def __init__(self, score: float = 0.0, logprobs: list[Logprob] | None = None) -> None:
        self.score = score  # cumulative log-probability, float32
        self.logprobs = logprobs if logprobs is not None else []  # per output token, if asked
        # This step's row: the top candidate (ids, log-probs), None until it has run.
        self.candidates: tuple[list[int], list[float]] | None = None


class BeamSearch:
    """One request's search state: its width, how it scores, its finished hypotheses."""

    def __init__(
        self,
        width: int,
        length_penalty: float,
        early_stopping: bool | str,
        max_tokens: int,
        num_candidates: int,
        logprobs: int | None,
    ) -> None:
        self.width = width
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.max_tokens = max_tokens
        self.num_candidates = num_candidates
        self.logprobs = logprobs  # top alternatives kept per token (None: no log-probs)
        self.finished: list[Hypothesis] = []  # best first, at most `width`
        self.num_generated = 0  # tokens each live beam has generated

    def _normalize(self, score: float, length: int) -> float:
        return f32(score / f32(length**self.length_penalty))

    def rank(
        self,
        beams: list[Beam],
        outputs: list[list[int]],
        ends: Callable[[int, int], str | None],
    ) -> tuple[list[Candidate], bool]:
        """One step: `beams` (in score order) with their rows' candidates, `outputs` their
        output tokens so far, `ends(beam, token)` why that continuation ends (None: it goes
        on). Returns the next step's beams as candidates (best first, at most `width`) and
        whether the search is over."""
        pool: list[Candidate] = []
        for b, beam in enumerate(beams):
            ids, lps = beam.candidates
            base = beam.score
            pool += (
                Candidate(b, t, lp, f32(base + lp))
                for t, lp in zip(ids, lps)
                if lp != float("-inf")
            )
        # Best first; equal scores in the order of a flat (beam, token) index, as a top-k
        # over the beams' rows side by side would give.
        pool.sort(key=lambda c: (-c.score, c.beam, c.token_id))
        del pool[self.num_candidates :]
        length = self.num_generated + 1
        going: list[Candidate] = []
        any_going = False
        for rank, c in enumerate(pool):
            reason = ends(c.beam, c.token_id)
            if reason is None:
                any_going = True
                if len(going) < self.width:
                    going.append(c)
            elif rank < self.width:
                self._finish(beams[c.beam], outputs[c.beam], c, reason, length)
        self.num_generated = length
        done = not any_going or not going
        if not done and len(self.finished) == self.width:
            if self.early_stopping is True:
                done = True
            else:
                best = length
                if self.early_stopping == "never" and self.length_penalty > 0.0:
                    best = self.max_tokens
                done = not self._normalize(going[0].score, best) > self.finished[-1].score
        return going, done

    def _finish(self, beam: Beam, output: list[int], c: Candidate, reason: str, length: int):
        score = self._normalize(c.score, length)
        kept = self.finished
        if len(kept) == self.width and not score > kept[-1].score:
            return
        logprobs = beam.logprobs + [self.entry(c, beam)] if self.logprobs is not None else []
        hyp = Hypothesis([*output, c.token_id], score, c.score, reason, logprobs)
        i = len(kept)
        while i and kept[i - 1].score < score:  # after equal scores: the earlier one stays first
            i -= 1
        kept.insert(i, hyp)
        del kept[self.width :]

    def entry(self, c: Candidate, beam: Beam) -> Logprob:
        """The log-prob entry of a chosen continuation, with the row's top alternatives."""
        ids, lps = beam.candidates
        k = self.logprobs or 0
        return Logprob(c.token_id, c.logprob, ids[:k], lps[:k])

    def results(self, beams: list[Beam], outputs: list[list[int]]) -> list[Hypothesis]:
        """The `width` best hypotheses; live beams fill in when fewer have finished (a search
        whose every continuation ended in a stop string)."""
        out = list(self.finished)
        for beam, output in zip(beams, outputs):
            if len(out) >= self.width:
                break
            score = self._normalize(beam.score, max(len(output), 1))
            out.append(Hypothesis(list(output), score, beam.score, "length", beam.logprobs))
        out.sort(key=lambda h: -h.score)
        return out[: self.width]


class BeamGroup:
    """A beam search request's sequences: `root` (the request as it arrived: its prompt is
    computed as one sequence, and it goes on as a beam), `slots` (every sequence it has had,
    root first; one that no beam continues is parked for a later fork) and `live` (the
    sequences of its live beams, best first)."""

    __slots__ = ("root", "search", "stop_ids", "slots", "live")

    def __init__(self, root, search: BeamSearch, stop_ids: set[int]) -> None:
        self.root = root
        self.search = search
        self.stop_ids = stop_ids
        self.slots = [root]
        self.live = [root]
        root.group, root.beam = self, Beam()

    @property
    def width(self) -> int:
        return self.search.width

    @property
    def ready(self) -> bool:
        """Every live beam has its row's candidates: the step can be ranked."""
        return all(r.beam.candidates is not None for r in self.live)

    def advance(self, going: list[Candidate], scheduler, new_slot) -> None:
        """The ranked step's beams take their sequences: a beam's first continuation stays in
        its sequence, further ones fork it into sequences no beam continues (parked ones, else
        `new_slot(self)`); the sequences left over are parked. Forks copy their parent before
        any token of this step is appended."""
        live = self.live
        continued = {c.beam for c in going}
        spare = [r for i, r in enumerate(live) if i not in continued]
        spare += [r for r in self.slots if r.beam is None]  # parked before
        slots, stayed, forked = [], set(), set()
        for c in going:
            parent = live[c.beam]
            if c.beam not in stayed:
                stayed.add(c.beam)
                slots.append(parent)
                continue
            slot = spare.pop(0) if spare else new_slot(self)
            scheduler.fork(slot, parent)
            forked.add(c.beam)
            slots.append(slot)
        for b in forked:  # its partial last block is now its children's too
            scheduler.share_last_block(live[b])
        beams = []
        for c in going:
            parent = live[c.beam].beam
            logprobs = parent.logprobs
            if self.search.logprobs is not None:
                logprobs = [*logprobs, self.search.entry(c, parent)]
            beams.append(Beam(c.score, logprobs))
        for slot, beam, c in zip(slots, beams, going):
            slot.beam = beam
            slot.append_output(c.token_id)
        for r in spare:
            if r.beam is not None:  # a beam no continuation kept
                r.beam = None
                scheduler.park(r)
        self.live = slots
