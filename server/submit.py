"""The one generation path behind every route: the engine requests behind one HTTP request
(Submitted), their outputs collected to the end or streamed as SSE, and usage counted."""

from __future__ import annotations

import logging
import time
import uuid
import weakref
from collections.abc import AsyncIterator

import msgspec
import trio
from quart import Response, request

from core.engine import Engine, EngineDeadError
from core.outputs import RequestChannel
from core.pooling import PoolingParams
from core.request import EngineRequest, Logprob, RequestOutput
from core.sampling import InvalidParam, SamplingParams
from server import sse
from server.errors import APIError, error_body
from server.state import ServerState
from server.usage import UsageCounter

log = logging.getLogger("weir.requests")


def engine_error(out: RequestOutput) -> APIError:
    """The client's error for a request the engine ended with one: a fault of the engine (500),
    a request it could not hold then (503: retry), or one found invalid only there (400)."""
    if out.error_status == 500:
        return APIError(500, f"The engine failed: {out.error}", None, "engine_error")
    code = "server_overloaded" if out.error_status == 503 else "invalid_value"
    return APIError(out.error_status, out.error, None, code)


def request_id(prefix: str, body_id: str | None = None) -> str:
    """The client's X-Request-Id when it sent one (vLLM does the same), else the body's
    `request_id` (vLLM's field, under the route's prefix as vLLM puts it), else a fresh id."""
    given, name = request.headers.get("X-Request-Id"), "X-Request-Id"
    if not given and body_id:
        given, name = f"{prefix}-{body_id}", "request_id"
    if given:
        if len(given) > 256 or not given.isprintable():
            raise APIError(400, f"{name} must be printable and at most 256 characters", name)
        return given
    return f"{prefix}-{uuid.uuid4().hex}"


class Submitted:
    """The engine requests behind one HTTP request: n samples of each prompt, read through one
    channel. Choice index = prompt index * n + sample index, as the OpenAI API numbers them.
    A beam search (`beams`) is one engine request per prompt whose final output carries its n
    sequences: they become its n choices, best first.

    `close()` (synchronous, so it runs in the `finally` of a cancelled handler) aborts whatever
    is unfinished, logs the request and takes it off the server's in-flight set."""

    def __init__(
        self,
        st: ServerState,
        engine: Engine,
        base: str,
        n: int,
        stream: bool,
        model: str = "",
        beams: bool = False,
        names: dict[str, str] | None = None,
    ) -> None:
        """`names`: the route's own names of the fields the engine's checks name after chat
        completions' ("messages": the prompt, "max_tokens")."""
        self.st = st
        self.names = names or {}
        # The LoRA adapter the request's model names (or None), held in use until close(); the
        # name is looked up again, as it may have been unloaded while the prompt was prepared.
        self.lora = st.lora_ref(model) if model else None
        if model and self.lora is None:
            st.model_name(model)
        self._holds_lora = False
        self.engine = engine
        self.base = base
        self.n = n
        self.beams = beams
        # Streams wake every --stream-interval tokens; a non-streaming request only at the end.
        self.channel = RequestChannel(st.options.stream_interval if stream else 0)
        self.ids: list[str] = []  # the engine requests
        self.index: dict[str, int] = {}  # engine request -> its (first) choice
        self.started = time.monotonic()
        self.first_output: float | None = None
        self.last: dict[int, RequestOutput] = {}
        self.finish: dict[int, str] = {}
        self.closed = False
        self.cut_reason: str | None = None  # set by cut(): the server is shutting down
        self.background = False  # a background response's: the drain stores it incomplete
        self.prompt_tokens: dict[str, int] = {}  # engine request -> its prompt's tokens
        timeout = st.options.request_timeout
        self.deadline = trio.current_time() + timeout if timeout else float("inf")

    def add(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        priority: int,
        cache_salt: str | None,
        pooling: PoolingParams | list[PoolingParams] | None = None,
    ) -> None:
        """`pooling`: every prompt's, or each prompt's own (a list as long as `prompts`)."""
        limit = self.st.options.max_waiting_requests
        if limit is not None and self._refuses(limit):
            status = self.st.options.shed_status
            if self.st.metrics is not None:
                self.st.metrics.admission_rejected()
            raise APIError(
                status,
                f"The server is overloaded: {self.engine.num_waiting} requests "
                "are already waiting. Retry later.",
                None,
                "overloaded",
                headers={"Retry-After": "1"},
            )
        per_prompt = 1 if self.beams else self.n
        single = len(prompts) == 1 and per_prompt == 1
        self.st.begin(self)
        if self.lora is not None and not self._holds_lora:
            self.st.lora.acquire(self.lora.name)
            self._holds_lora = True
        try:
            for p, prompt in enumerate(prompts):
                leader = None
                for j in range(per_prompt):
                    rid = self.base if single else f"{self.base}-{p * per_prompt + j}"
                    # Each sample gets its own reproducible stream: seed, seed + 1, ...
                    sample_params = (
                        params
                        if params.seed is None or j == 0
                        else msgspec.structs.replace(params, seed=params.seed + j)
                    )
                    self.engine.add(
                        EngineRequest(
                            rid,
                            prompt,
                            sample_params,
                            time.monotonic(),
                            priority=priority,
                            cache_salt=cache_salt,
                            leader_id=leader,
                            pooling=pooling[p] if isinstance(pooling, list) else pooling,
                            lora=self.lora,
                        ),
                        self.channel,
                    )
                    leader = leader or rid
                    self.prompt_tokens[rid] = len(prompt)
                    self.index[rid] = p * self.n + j
                    self.ids.append(rid)
        except InvalidParam as e:
            self.close()
            message, param = e.message, self.names.get(e.param, e.param)
            for ours, theirs in self.names.items():
                if "_" in ours:  # a field's name in the text (not a word such as "prompt")
                    message = message.replace(ours, theirs)
            raise APIError(400, message, param, "invalid_value") from None
        except EngineDeadError as e:
            self.close()
            raise APIError(503, str(e), None, "engine_dead") from None

    @property
    def choices(self) -> int:
        """The choices the reply has (n per prompt)."""
        return len(self.ids) * self.n if self.beams else len(self.ids)

    def _choices_of(self, rid: str) -> range:
        first = self.index[rid]
        return range(first, first + self.n) if self.beams else range(first, first + 1)

    def _expand(self, out: RequestOutput) -> list[tuple[int, RequestOutput]]:
        """An engine output as (choice, output) pairs: a beam search's final output as one
        output per sequence; its abort or error as the same end for each of its choices."""
        if not self.beams:
            return [(self.index[out.request_id], out)]
        first = self.index[out.request_id]
        if not out.beams:
            return [(first + j, out) for j in range(self.n)]
        return [
            (first + j, b.output(out.request_id, out.num_prompt_tokens, out.num_cached_tokens))
            for j, b in enumerate(out.beams)
        ]

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for rid in self.ids:
            self.engine.abort(rid)  # a no-op for the finished ones
        self.st.end(self)
        if self._holds_lora:
            self.st.lora.release(self.lora.name)
        if self.st.metrics is not None and self.ids:
            self.st.metrics.request_params_n(self.n, self.choices // self.n)
        if self.st.options.log_requests and self.ids:
            # outputs the reader never took (a non-streaming request is woken only at its end):
            # their counts are the latest (aborted, it had logged its first output's)
            for out in self.channel.take_nowait():
                for i, o in self._expand(out):
                    self.last[i] = o
            outs = self.last.values()
            ttft = (self.first_output - self.started) if self.first_output else None
            log.info(
                "request %s: prompt_tokens=%d generated=%d cached=%d ttft=%s duration=%.3fs "
                "finish=%s",
                self.base,
                sum(o.num_prompt_tokens for i, o in self.last.items() if i % self.n == 0),
                sum(o.num_output_tokens for o in outs),
                sum(o.num_cached_tokens for i, o in self.last.items() if i % self.n == 0),
                f"{ttft:.3f}s" if ttft is not None else "-",
                time.monotonic() - self.started,
                ",".join(self.finish.get(i, "abort") for i in range(self.choices)),
            )

    def _refuses(self, limit: int) -> bool:
        """--max-waiting-requests: whether a new request would wait behind `limit` others or
        more (those sent and not yet running). 0 refuses only one that would wait at all: every
        seat of --max-num-seqs taken as of the engine's last step (an idle server had refused
        everything)."""
        waiting = self.engine.num_waiting
        if limit > 0:
            return waiting >= limit
        last = self.engine.last_stats
        free = 0 if last.num_waiting else max(0, self.st.config.max_num_seqs - last.num_running)
        return waiting >= free

    def cut(self, reason: str) -> None:
        """End this request at its reader's next wake: unfinished, it gets `reason` as a 503
        (a stream: an error event, then [DONE]) instead of a dropped connection."""
        self.cut_reason = reason
        self.channel.wake()

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) until every request has finished; an engine error raises.
        Past --request-timeout the unfinished ones end with finish_reason "length"."""
        left = len(self.ids)
        while left:
            outs = None
            if self.deadline == float("inf"):  # no --request-timeout: no cancel scope per event
                outs = await self.channel.get()
            else:
                with trio.move_on_at(self.deadline):
                    outs = await self.channel.get()
            if self.cut_reason is not None:
                self.close()  # aborts what is unfinished
                raise APIError(503, self.cut_reason, None, "server_shutting_down")
            if outs is None:
                for out in self.channel.take_nowait():  # what arrived but was not yet due
                    for i, o in self._expand(out):
                        self.last[i] = o
                        if o.finished:
                            self.finish[i] = o.finish_reason
                        yield i, o
                for rid in self.ids:
                    for i in self._choices_of(rid):
                        if i in self.finish:
                            continue
                        self.engine.abort(rid)
                        prev = self.last.get(i)
                        self.finish[i] = "length"
                        yield (
                            i,
                            RequestOutput(
                                request_id=rid,
                                finished=True,
                                finish_reason="length",
                                num_prompt_tokens=prev.num_prompt_tokens
                                if prev
                                else self.prompt_tokens.get(rid, 0),
                                num_output_tokens=prev.num_output_tokens if prev else 0,
                                num_cached_tokens=prev.num_cached_tokens if prev else 0,
                            ),
                        )
                return
            if self.first_output is None:
                self.first_output = time.monotonic()
            for out in outs:
                if out.error is not None:
                    raise engine_error(out)
                if out.finished:
                    left -= 1
                for i, o in self._expand(out):
                    self.last[i] = o
                    if o.finished:
                        self.finish[i] = o.finish_reason
                    yield i, o


def stream_response(events: AsyncIterator[bytes], sub: Submitted) -> Response:
    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in events:
                yield chunk
        except APIError as e:
            # Headers are gone already: say what happened in the stream, then end it properly.
            yield sse.event(error_body(e.status, e.message, e.param, e.code))
            yield sse.DONE
        except Exception as e:  # noqa: BLE001 - a cut stream with no reason is worse
            log.exception("stream failed")  # (no app context here: the module's logger)
            yield sse.event(error_body(500, f"Internal error: {type(e).__name__}: {e}"))
            yield sse.DONE
        finally:
            # Synchronous, so it also runs when the client went away and we were cancelled.
            sub.close()

    gen = body()
    # If the client is gone before the body is ever iterated, the generator never runs its
    # `finally`: close the request when the generator object is dropped instead (idempotent).
    weakref.finalize(gen, sub.close)
    return sse.response(gen)


class Collected:
    """A non-streaming request run to the end: per choice text, finish, log-probs."""

    def __init__(self, count: int) -> None:
        self.text: list[list[str]] = [[] for _ in range(count)]
        self.finish: list[str | None] = [None] * count
        self.stop_reason: list[str | int | None] = [None] * count
        self.logprobs: list[list[Logprob]] = [[] for _ in range(count)]
        self.token_ids: list[list[int]] = [[] for _ in range(count)]
        self.prompt_logprobs: list[list[Logprob | None] | None] = [None] * count


async def collect(sub: Submitted, usage: UsageCounter) -> Collected:
    got = Collected(sub.choices)
    try:
        async for i, out in sub.outputs():
            got.text[i].append(out.new_text)
            got.logprobs[i] += out.logprobs
            got.token_ids[i] += out.new_token_ids
            if out.prompt_logprobs is not None:
                got.prompt_logprobs[i] = out.prompt_logprobs
            usage.update(i, out)
            if out.finished:
                got.finish[i], got.stop_reason[i] = out.finish_reason, out.stop_reason
    finally:
        sub.close()
    return got
