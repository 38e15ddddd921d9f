"""Engine-side request state, plus the structs that carry a request in and its output out."""

from __future__ import annotations

import enum
import time

import msgspec

from core.lora import LoraRef
from core.pooling import PoolingParams
from core.sampling import SamplingParams
from core.stop import StopStrings


class EngineRequest(msgspec.Struct, gc=False):
    """What a handler hands to `Engine.add`: already tokenized and validated."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0  # lower runs first under --scheduling-policy priority
    cache_salt: str | None = None  # requests share cached prefixes only with the same salt
    # Another sample of the same prompt (n > 1): wait until that request's prompt is cached.
    leader_id: str | None = None
    # An embedding: the prompt's hidden states pooled into a vector, nothing sampled.
    pooling: PoolingParams | None = None
    # The LoRA adapter it runs with (core/lora.py), or None: the base model.
    lora: LoraRef | None = None


class Logprob(msgspec.Struct, array_like=True, gc=False):
    """A token's log-probability in the distribution it was sampled from, with the top
    alternatives (as many as the request asked for)."""

    token_id: int
    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class StepResult(msgspec.Struct, gc=False):
    """What the model runner returns for one step."""

    token_ids: list[int]  # one per sampled sequence, in schedule order
    logprobs: list[Logprob | None]  # aligned with token_ids; None where not asked for
    # Per request asking for prompt logprobs: entries for the prompt positions this step computed.
    prompt_logprobs: dict[str, list[Logprob]] = {}
    # Per pooling request whose prompt this step finished: its vector, little-endian float32.
    pooled: dict[str, bytes] = {}
    # Speculative decoding: per request whose proposals were verified, the tokens after the
    # first (token_ids has the first; together, the accepted proposals and one token more),
    # and their log-probs when asked for.
    spec_token_ids: dict[str, list[int]] = {}
    spec_logprobs: dict[str, list[Logprob | None]] = {}
    # Beam search (core/beam.py): per beam sampled, its row's top candidates, best first (ids
    # and raw log-probs, EOS and stop tokens at -inf before min_tokens).
    beam_ids: dict[str, list[int]] = {}
    beam_logprobs: dict[str, list[float]] = {}


class BeamSequence(msgspec.Struct, omit_defaults=True, gc=False):
    """One of a beam search's returned sequences (the request's `n`, best first)."""

    token_ids: list[int]
    text: str
    finish_reason: str
    cumulative_logprob: float
    score: float  # what it was ranked by: cumulative_logprob / length ** length_penalty
    logprobs: list[Logprob] = []

    def output(
        self, request_id: str, num_prompt_tokens: int, num_cached_tokens: int, beams=()
    ) -> RequestOutput:
        """This sequence as its request's finished output (`beams`: every returned sequence,
        carried by the engine's one output of the search)."""
        return RequestOutput(
            request_id=request_id,
            new_token_ids=self.token_ids,
            new_text=self.text,
            finished=True,
            finish_reason=self.finish_reason,
            num_prompt_tokens=num_prompt_tokens,
            num_output_tokens=len(self.token_ids),
            num_cached_tokens=num_cached_tokens,
            logprobs=self.logprobs,
            beams=list(beams),
        )


class RequestOutput(msgspec.Struct, omit_defaults=True, gc=False):
    """One step's news for one request. Deltas of the same request merge (see outputs.py)."""

    request_id: str
    new_token_ids: list[int] = []
    new_text: str = ""
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    logprobs: list[Logprob] = []  # one per new token, when asked for
    embedding: bytes | None = None  # a pooling request's vector (little-endian float32)
    prompt_logprobs: list[Logprob | None] | None = None  # with the first output, when asked for
    error: str | None = None
    # vLLM's stop_reason: the stop string or stop_token_ids entry that ended it (None: EOS,
    # length, or anything else)
    stop_reason: str | int | None = None
    # the HTTP status of `error`: 500 an engine fault, 503 a request the server could not
    # hold (retry later), 400 the request's own problem found only in the engine
    error_status: int = 500
    # A beam search's sequences, best first, in its one (final) output; the fields above then
    # describe the best of them.
    beams: list[BeamSequence] = []

    def merge(self, later: RequestOutput) -> RequestOutput:
        """This output followed by a later one of the same request: several tokens of one step
        (a verified run of speculative proposals), or deltas a slow reader has not taken yet
        (core/outputs.py). Ids, text and log-probs joined; the later one's finish, counts, stop
        and error kept."""
        self.new_token_ids = self.new_token_ids + later.new_token_ids
        self.new_text += later.new_text
        self.logprobs = self.logprobs + later.logprobs
        self.finished, self.finish_reason = later.finished, later.finish_reason
        self.num_prompt_tokens = later.num_prompt_tokens
        self.num_output_tokens = later.num_output_tokens
        self.num_cached_tokens = later.num_cached_tokens
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs
        if later.embedding is not None:
            self.embedding = later.embedding
        if later.error is not None:
            self.error, self.error_status = later.error, later.error_status
        self.stop_reason = later.stop_reason if later.finished else self.stop_reason
        self.beams = later.beams or self.beams
        return self


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class Request:
    """A request as the engine thread sees it. Only the engine thread touches it."""

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "output_token_ids",
        "all_token_ids",
        "sampling_params",
        "max_tokens",
        "num_computed_tokens",
        "status",
        "finish_reason",
        "arrival_time",
        "detokenizer",
        "num_preemptions",
        "priority",
        "cache_salt",
        "block_hashes",
        "num_cached_tokens",
        "leader",
        "seq_no",
        "shown",
        "runner_tokens",
        "runner_blocks",
        "stop",
        "prompt_logprobs",
        "first_scheduled_time",
        "first_token_time",
        "last_token_time",
        "grammar",
        "grammar_future",
        "pooling",
        "num_pending",
        "spec_token_ids",
        "spec_index",
        "spec_off",
        "spec_drafted",
        "spec_accepted",
        "lora",
        "group",
        "beam",
        "forked",
    )

    def __init__(
        self,
        req: EngineRequest,
        max_tokens: int,
        detokenizer: object = None,
        seq_no: int = 0,
        leader: Request | None = None,
    ) -> None:
        self.request_id = req.request_id
        self.prompt_token_ids = list(req.prompt_token_ids)
        self.output_token_ids: list[int] = []
        # Prompt then outputs, appended in place: the runner slices new tokens out of it.
        self.all_token_ids: list[int] = list(req.prompt_token_ids)
        self.sampling_params = req.sampling_params
        self.max_tokens = max_tokens
        self.num_computed_tokens = 0
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.arrival_time = req.arrival_time or time.monotonic()
        self.detokenizer = detokenizer
        self.num_preemptions = 0
        self.priority = req.priority
        self.cache_salt = req.cache_salt
        self.block_hashes: list[int] = []  # chained hashes of full blocks, filled lazily
        self.num_cached_tokens = 0
        self.leader = leader
        self.seq_no = seq_no  # arrival order, for FCFS ties
        # What the model runner holds of this request (core/runner_step.py): whether it has been
        # shown, and how many of its token ids and block ids it has been given.
        self.shown = False
        self.runner_tokens = 0
        self.runner_blocks = 0
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        params = req.sampling_params
        self.stop = (
            StopStrings(params.stop, params.include_stop_str_in_output) if params.stop else None
        )
        # Structured outputs: the matcher (llguidance), once its compile (the future) is done.
        self.grammar: object = None
        self.grammar_future: object = None
        self.pooling = req.pooling
        self.lora = req.lora
        # Tokens sampled by launched steps the engine has not yet taken in: under asynchronous
        # scheduling the next step computes the last one before it is known.
        self.num_pending = 0
        # Speculative decoding (core/speculative.py): this step's proposed tokens, the request's
        # n-gram index, and its proposals' record (a request whose proposals keep failing
        # stops proposing).
        self.spec_token_ids: list[int] = []
        self.spec_index = None
        self.spec_off = False
        self.spec_drafted = 0
        self.spec_accepted = 0
        # Beam search (core/beam.py): the request's search, shared by its beams, and this
        # sequence's beam (None while it is not one); `forked`: it may share the block it
        # writes next with another beam (the scheduler then allocates, to copy it).
        self.group = None
        self.beam = None
        self.forked = False
        # Index p: log-probability of prompt token p given the tokens before it (none for p = 0).
        self.prompt_logprobs: list[Logprob | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """The tokens a step may compute: the known ones and a pending sample."""
        return len(self.all_token_ids) + self.num_pending

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output(self, token_id: int) -> None:
        """A sampled token taken in (it was pending since its step was launched)."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.num_pending:
            self.num_pending -= 1

    def record_prompt_logprobs(self, start: int, entries: list[Logprob] | None) -> None:
        """Prompt log-probs a step computed from position `start`: entry j scores prompt token
        start + j + 1. A recompute after preemption repeats positions already recorded: the
        first are kept."""
        have = self.prompt_logprobs
        for j, entry in enumerate(entries or ()):
            if start + j + 1 == len(have):
                have.append(entry)

    def output(
        self,
        new_ids: list[int],
        text: str,
        finish_reason: str | None,
        logprobs: list[Logprob] | None = None,
    ) -> RequestOutput:
        """This step's news of the request (prompt log-probs go out once, with the first
        token)."""
        prompt_lp = None
        if self.prompt_logprobs is not None and self.num_output_tokens <= 1:
            prompt_lp = self.prompt_logprobs
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=new_ids,
            new_text=text,
            finished=finish_reason is not None,
            finish_reason=finish_reason,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=self.num_output_tokens,
            num_cached_tokens=self.num_cached_tokens,
            logprobs=logprobs or [],
            prompt_logprobs=prompt_lp,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
