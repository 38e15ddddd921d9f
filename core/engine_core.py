"""EngineCore: one engine step (schedule, run the model, sample, stop, detokenize), no threads.

The engine thread drives it (engine.py); tests and offline use can drive it directly.
"""

from __future__ import annotations

import time
from typing import Protocol

import msgspec
from tokenizers import Tokenizer

from core.beam import BeamGroup, BeamSearch, num_candidates, stop_ids
from core.beam_steps import BeamSteps
from core.detokenizer import Detokenizer
from core.kv_cache_manager import KVCacheManager
from core.request import (
    EngineRequest,
    Request,
    RequestOutput,
    StepResult,
)
from core.request_check import check_classifier, check_encoder_request, check_request
from core.sampling import InvalidParam, bad_words_ids
from core.runner_step import GrammarBatch, SchedulerOutput
from core.scheduler import ScheduledSeq, ScheduledStep, Scheduler
from core.speculative import SpeculativeConfig, Speculator
from core.stats import StepStats, finished_stats
from core.structured import Grammars
from core.take_in import TakeIn


class ModelRunner(Protocol):
    """What the engine needs from gpu/: run one step (core/runner_step.py), return one sampled
    id per scheduled request whose `sample` flag is set, in order; `grammar`: the constrained
    rows' bitmask, to fill while the forward runs."""

    vocab_size: int
    num_labels: int  # a sequence classifier's labels (0: a causal LM)
    pooling_only: bool  # an encoder (BERT): it embeds and classifies, never generates
    per_token: bool  # the classifier labels every token (a *ForTokenClassification)

    def execute(self, out: SchedulerOutput, grammar: GrammarBatch | None) -> StepResult: ...


class EngineCore(TakeIn, BeamSteps):
    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Tokenizer | None,
        *,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
        check_integrity: bool = False,
        enable_prefix_caching: bool = True,
        scheduling_policy: str = "fcfs",
        max_logprobs: int = 20,
        max_beam_width: int = 16,
        async_scheduling: bool = False,
        speculative: SpeculativeConfig | None = None,
        max_loras: int = 0,
    ) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.max_model_len = min(max_model_len, num_blocks * block_size)
        self.eos_token_ids = frozenset(eos_token_ids)
        # An encoder's inputs attend both ways and leave no K/V: none cached, none chunked.
        self.pooling_only = getattr(runner, "pooling_only", False)
        self.per_token = getattr(runner, "per_token", False)
        caching = enable_prefix_caching and not self.pooling_only
        self.kv = KVCacheManager(num_blocks, block_size, caching)
        self.scheduler = Scheduler(
            self.kv, max_num_seqs, max_num_batched_tokens, scheduling_policy, max_loras,
            whole_prompts=self.pooling_only,
        )  # fmt: skip
        self.requests: dict[str, Request] = {}
        self.check_integrity = check_integrity
        self.max_logprobs = max_logprobs
        self.max_beam_width = max_beam_width
        self.num_steps = 0
        self.num_partial_prefills = 0
        self.num_aborted = 0
        self.num_computed_prompt_tokens = 0  # prompt positions run through the model
        self.stats = StepStats()  # increments since the last take_stats()
        self.num_adds_seen = 0
        self._seq_no = 0
        self._grammars: Grammars | None = None  # built with the first constrained request
        self._compiling: dict[str, Request] = {}  # requests whose grammar is not ready yet
        # Asynchronous scheduling: the next step is scheduled and launched before the last
        # one's results are taken in (see step()).
        self.speculator = Speculator(speculative, self.max_model_len) if speculative else None
        if async_scheduling and speculative is not None:
            raise ValueError("speculative decoding runs with synchronous scheduling")
        if async_scheduling and not hasattr(runner, "submit"):
            raise ValueError("asynchronous scheduling needs a runner that submits steps")
        self.async_scheduling = async_scheduling
        self._inflight: tuple[ScheduledStep, object] | None = None  # launched, not taken in
        # Live requests whose steps need their tokens known on the host (a grammar's mask,
        # penalties' counts, a beam search's ranking): while there is one, each step's results
        # are taken in first.
        self._num_need_known = 0

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._inflight is not None

    def _drop(self, request: Request) -> None:
        """The request has ended: the engine forgets it."""
        del self.requests[request.request_id]
        if _needs_known(request.sampling_params):
            self._num_need_known -= 1

    def close(self) -> None:
        """Release what the runner holds outside this process (tensor-parallel workers)."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def check(self, req: EngineRequest) -> int:
        """Validate a request against the model; return its resolved max_tokens.

        Reads only settings fixed at start-up, so the Trio thread may call it.
        """
        if req.lora is not None and not self.scheduler.max_loras:
            raise InvalidParam("model", "LoRA adapters are not served: start with --enable-lora")
        check_classifier(req, self.runner.num_labels, self.per_token)
        if self.pooling_only:
            check_encoder_request(req, self.scheduler.max_num_batched_tokens)
        return check_request(
            req,
            self.runner.vocab_size,
            self.max_model_len,
            self.max_logprobs,
            self.max_beam_width,
            self.scheduler.max_num_seqs,
            (self.kv.num_blocks, self.kv.block_size),
            self.eos_token_ids,
        )

    def add(self, req: EngineRequest) -> None:
        self.num_adds_seen += 1  # counted even if refused: the Trio side counts every send
        if req.request_id in self.requests:
            raise InvalidParam("request_id", f"request id {req.request_id!r} is already running")
        max_tokens = self.check(req)
        if req.sampling_params.bad_words and not req.sampling_params.bad_words_token_ids:
            req = self._with_bad_words_ids(req)
        slots = getattr(self.runner, "lora", None)
        if req.lora is not None and slots is not None:
            # Read its weights now (once; kept in host memory): an adapter whose files went
            # bad since it was registered fails this request here, not a step.
            slots.preload(req.lora)
        params = req.sampling_params
        detok = None  # a beam search decodes its sequences once, at its end
        if self.tokenizer is not None and req.pooling is None and not params.beam_width:
            detok = Detokenizer(
                self.tokenizer, req.prompt_token_ids, req.sampling_params.skip_special_tokens
            )
        self._seq_no += 1
        leader = self.requests.get(req.leader_id) if req.leader_id is not None else None
        request = Request(req, max_tokens, detok, self._seq_no, leader)
        constraint = params.structured
        if constraint is not None:
            request.grammar_future = self.grammars.start(constraint)
            self._compiling[request.request_id] = request
        if params.beam_width:
            search = BeamSearch(
                params.beam_width,
                params.length_penalty,
                params.early_stopping,
                max_tokens,
                num_candidates(params, self.eos_token_ids),
                params.logprobs,
            )
            BeamGroup(request, search, stop_ids(params, self.eos_token_ids))
        self.requests[request.request_id] = request
        if _needs_known(params):
            self._num_need_known += 1
        self.scheduler.add(request)

    def _with_bad_words_ids(self, req: EngineRequest) -> EngineRequest:
        """The request with its bad_words tokenized (the runner bans by token)."""
        if self.tokenizer is None:
            raise InvalidParam("bad_words", "bad_words need the model's tokenizer")
        tokenizer = self.tokenizer

        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False).ids

        params = req.sampling_params
        ids = bad_words_ids(encode, params.bad_words)
        problem = next((t for w in ids for t in w if not 0 <= t < self.runner.vocab_size), None)
        if problem is not None:
            raise InvalidParam("bad_words", f"bad_words: token id {problem} is outside the model")
        params = msgspec.structs.replace(params, bad_words_token_ids=ids)
        return msgspec.structs.replace(req, sampling_params=params)

    @property
    def grammars(self) -> Grammars:
        """The structured-outputs compiler, shared with the runner (which fills the masks)."""
        if self._grammars is None:
            if self.tokenizer is None or not self.eos_token_ids:
                raise InvalidParam(
                    "response_format", "structured outputs need the model's tokenizer and EOS"
                )
            self._grammars = Grammars(
                self.tokenizer.to_str(), self.runner.vocab_size, sorted(self.eos_token_ids)
            )
        return self._grammars

    def _take_compiled(self) -> list[RequestOutput]:
        """Requests whose grammar finished compiling become schedulable; a failed compile ends
        its request with an error (the server checks constraints first, so this is rare)."""
        self._grammars.done.clear()  # before looking: a compile finishing now sets it again
        failed = []
        for rid, request in list(self._compiling.items()):
            future = request.grammar_future
            if not future.done():
                continue
            del self._compiling[rid]
            request.grammar_future = None
            try:
                request.grammar = future.result()
            except Exception as e:  # noqa: BLE001 - the request's own problem, not the engine's
                self.scheduler.remove(request)
                self._drop(request)
                self.stats.finished.append(finished_stats(request, "error", time.monotonic()))
                out = request.output([], "", "error")
                out.error = f"the structured output constraint did not compile: {e}"
                out.error_status = 400
                failed.append(out)
        return failed

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._drop(request)
        if self._compiling.pop(request_id, None) is not None:
            request.grammar_future.cancel()
            request.grammar_future = None
        for r in request.group.slots if request.group is not None else (request,):
            self.scheduler.remove(r)
        self.num_aborted += 1
        self.stats.finished.append(finished_stats(request, "abort", time.monotonic()))
        return request.output([], "", "abort")

    def _fail_stuck(self) -> list[RequestOutput]:
        """Beam searches the scheduler can never admit end with an error (not a queue that
        waits on them forever: a server that answers /health and serves nothing)."""
        outputs = []
        while self.scheduler.stuck:
            group = self.scheduler.stuck.pop()
            out = self.abort(group.root.request_id)
            if out is not None:
                out.finish_reason = "error"
                out.error = (
                    f"the KV cache cannot hold this beam search's {group.width} beams (their "
                    "shared prefix was evicted while they were preempted); lower n or max_tokens"
                )
                out.error_status = 503  # other requests held the cache: it may fit later
                outputs.append(out)
        return outputs

    def take_stats(self) -> StepStats:
        """The increments gathered since the last call, with the current gauges."""
        out = self.stats
        out.num_running, out.num_waiting = len(self.scheduler.running), len(self.scheduler.waiting)
        out.num_deferred = self.scheduler.num_deferred
        if self.scheduler.max_loras:  # a request waiting for an adapter slot is deferred
            out.num_deferred += self.scheduler.num_waiting_lora
            running = self.scheduler.running_loras()
            out.lora_running = sorted(set(running.values()))
            out.lora_waiting = sorted(
                {r.lora.name for r in self.scheduler.waiting if r.lora is not None}
            )
        out.kv_usage, out.num_free_blocks = self.kv.usage, self.kv.num_free_blocks
        out.num_adds_seen = self.num_adds_seen
        self.stats = StepStats()
        return out

    def _grammar_batch(self, seqs: list[ScheduledSeq]) -> GrammarBatch | None:
        """The sampled rows whose request has a grammar, and their matchers' mask fill. A
        request verifying proposals has a row per position: each masked by its matcher as it
        will be there, a copy having taken the proposals before it (they are the grammar's:
        core/speculative.py cut them where it refused)."""
        rows, matchers = [], []
        row = 0
        for s in seqs:
            if not s.sample:
                continue
            r = s.request
            if r.grammar is not None:
                matchers.append(r.grammar)
                ahead = r.grammar.deep_copy() if s.num_draft else None
                for token in r.spec_token_ids[: s.num_draft]:
                    ahead.consume_token(token)
                    matchers.append(ahead.deep_copy())
                rows += range(row, row + s.num_draft + 1)
            row += s.num_draft + 1
        if not rows:
            return None
        grammars = self._grammars
        pairs = [(m, j) for j, m in enumerate(matchers)]
        return GrammarBatch(
            rows, grammars.words, lambda pointer: grammars.fill(pairs, pointer, len(pairs))
        )

    def step(self) -> list[RequestOutput]:
        """Schedule and launch a step, and take in the results of the one before it.

        Synchronously, a step's results are taken in before the next is scheduled. With
        asynchronous scheduling the step launched last is still running when this is called:
        the next one is scheduled and launched behind it first (its rows for requests whose
        sample is pending take that sample on the device), and then the previous step's
        results are taken in while the new one runs. A request that the previous step ends has
        one discarded row in the new step; a batch that needs its requests' tokens on the host
        (grammars, penalties) waits for the previous step first."""
        outputs: list[RequestOutput] = self._take_compiled() if self._compiling else []
        previous, self._inflight = self._inflight, None
        if previous is not None and self._num_need_known:
            outputs += self._take_in(*previous)
            previous = None
        launched = self._launch()
        outputs += self._fail_stuck()
        if previous is not None:
            outputs += self._take_in(*previous)
        if launched is not None:
            if self.async_scheduling:
                self._inflight = launched
            else:
                outputs += self._take_in(*launched)
        elif previous is None and self._compiling and not outputs:
            # Only compiles are pending: wait briefly for one instead of spinning (the caller
            # takes new commands between steps).
            self._grammars.done.wait(0.01)
        if self.check_integrity:
            self.kv.check_integrity()
        return outputs

    def _launch(self):
        """Schedule a step and launch it on the runner; None when nothing is scheduled."""
        preemptions_before = self.scheduler.num_preemptions
        queried, hits = self.kv.num_queried_tokens, self.kv.num_hit_tokens
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        out = self.scheduler.schedule()
        stats = self.stats
        stats.preemptions += self.scheduler.num_preemptions - preemptions_before
        stats.prefix_queries += self.kv.num_queried_tokens - queried
        stats.prefix_hits += self.kv.num_hit_tokens - hits
        if not out.seqs:
            return None
        now = time.monotonic()
        for seq in out.seqs:
            if seq.request.first_scheduled_time is None:
                seq.request.first_scheduled_time = now
        stats.iteration_tokens.append(out.num_tokens)
        grammar = self._grammar_batch(out.seqs) if self._grammars is not None else None
        submit = getattr(self.runner, "submit", None)
        if submit is not None:
            pending = submit(out.output, grammar)
        else:  # a runner that only executes (tensor parallel): its result is ready at once
            pending = _Done(self.runner.execute(out.output, grammar))
        self.scheduler.commit(out)
        self.num_steps += 1
        return out, pending


def _needs_known(params) -> bool:
    """Whether a request's steps need the step before taken in (its tokens on the host)."""
    return (
        params.structured is not None
        or params.needs_penalties
        or params.beam_width > 0
        or bool(params.bad_words)
    )


class _Done:
    """A step already run to its end (a runner without `submit`)."""

    __slots__ = ("value",)

    def __init__(self, value: StepResult) -> None:
        self.value = value

    def result(self) -> StepResult:
        return self.value
