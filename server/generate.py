"""The generation routes: /v1/chat/completions and /v1/completions, streaming or not."""

from __future__ import annotations

import logging
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import msgspec
import trio
from quart import Blueprint, Response, current_app, request

from core.engine import Engine, EngineDeadError
from core.outputs import RequestChannel
from core.request import EngineRequest, Logprob, RequestOutput
from core.sampling import InvalidParam, SamplingParams
from server import chat, sse
from server.errors import APIError, error_body, from_validation
from server.logprobs import CompletionLogprobsBuilder, chat_logprobs, prompt_logprobs
from server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChunkChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Delta,
    PromptTokensDetails,
    ResponseMessage,
    SamplingFields,
    Usage,
)
from server.state import ServerState

bp = Blueprint("generate", __name__)
log = logging.getLogger("weir.requests")
_encoder = msgspec.json.Encoder()
T = TypeVar("T")

# Request fields that fall back to the model's generation config, then to these defaults.
SAMPLING_DEFAULTS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
}


def state() -> ServerState:
    return current_app.weir_state


def json_response(payload: Any, status: int = 200) -> Response:
    return Response(_encoder.encode(payload), status=status, content_type="application/json")


async def decode(body_type: type[T]) -> T:
    body = await request.get_data()
    if not body:
        raise APIError(400, "The request body is empty; send a JSON object", None, "invalid_json")
    try:
        return msgspec.json.decode(body, type=body_type)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise from_validation(e) from None


def sampling_params(
    st: ServerState,
    req: SamplingFields,
    max_tokens: int | None,
    prompt_len: int,
    logprobs: int | None,
) -> SamplingParams:
    defaults = st.generation_defaults
    values = {
        name: getattr(req, name) if getattr(req, name) is not None else defaults.get(name, default)
        for name, default in SAMPLING_DEFAULTS.items()
    }
    if max_tokens is None and "max_tokens" in defaults:
        room = st.max_model_len - prompt_len
        max_tokens = min(defaults["max_tokens"], room) if room >= 1 else None
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    bias: dict[int, float] = {}
    for key, value in (req.logit_bias or {}).items():
        try:
            bias[int(key)] = value
        except ValueError:
            raise APIError(
                400,
                f"logit_bias keys must be token ids, got {key!r}",
                "logit_bias",
                "invalid_value",
            ) from None
    params = SamplingParams(
        temperature=values["temperature"],
        top_p=values["top_p"],
        top_k=values["top_k"] or 0,
        min_p=values["min_p"],
        presence_penalty=values["presence_penalty"],
        frequency_penalty=values["frequency_penalty"],
        repetition_penalty=values["repetition_penalty"],
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        stop=stop,
        include_stop_str_in_output=req.include_stop_str_in_output,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        seed=req.seed,
        logit_bias=bias,
        logprobs=logprobs,
        prompt_logprobs=req.prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
    )
    try:
        params.validate()
    except InvalidParam as e:
        raise APIError(400, e.message, e.param, "invalid_value") from None
    return params


def request_id(prefix: str) -> str:
    """The client's X-Request-Id when it sent one (vLLM does the same), else a fresh id."""
    given = request.headers.get("X-Request-Id")
    if given:
        if len(given) > 256 or not given.isprintable():
            raise APIError(
                400, "X-Request-Id must be printable and at most 256 characters", "X-Request-Id"
            )
        return given
    return f"{prefix}-{uuid.uuid4().hex}"


class Submitted:
    """The engine requests behind one HTTP request: n samples of each prompt, read through one
    channel. Choice index = prompt index * n + sample index, as the OpenAI API numbers them.

    `close()` (synchronous, so it runs in the `finally` of a cancelled handler) aborts whatever
    is unfinished, logs the request and takes it off the server's in-flight set."""

    def __init__(self, st: ServerState, engine: Engine, base: str, n: int, stream: bool) -> None:
        self.st = st
        self.engine = engine
        self.base = base
        self.n = n
        # Streams wake every --stream-interval tokens; a non-streaming request only at the end.
        self.channel = RequestChannel(st.options.stream_interval if stream else 0)
        self.ids: list[str] = []
        self.index: dict[str, int] = {}
        self.started = time.monotonic()
        self.first_output: float | None = None
        self.last: dict[int, RequestOutput] = {}
        self.finish: dict[int, str] = {}
        self.closed = False
        timeout = st.options.request_timeout
        self.deadline = trio.current_time() + timeout if timeout else float("inf")

    def add(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        priority: int,
        cache_salt: str | None,
    ) -> None:
        limit = self.st.options.max_waiting_requests
        if limit is not None and self.engine.num_waiting >= limit:
            status = self.st.options.shed_status
            raise APIError(
                status,
                f"The server is overloaded: {self.engine.num_waiting} requests "
                "are already waiting. Retry later.",
                None,
                "overloaded",
                headers={"Retry-After": "1"},
            )
        single = len(prompts) == 1 and self.n == 1
        self.st.begin(self)
        try:
            for p, prompt in enumerate(prompts):
                leader = None
                for j in range(self.n):
                    rid = self.base if single else f"{self.base}-{p * self.n + j}"
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
                        ),
                        self.channel,
                    )
                    leader = leader or rid
                    self.index[rid] = len(self.ids)
                    self.ids.append(rid)
        except InvalidParam as e:
            self.close()
            raise APIError(400, e.message, e.param, "invalid_value") from None
        except EngineDeadError as e:
            self.close()
            raise APIError(503, str(e), None, "engine_dead") from None

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for rid in self.ids:
            self.engine.abort(rid)  # a no-op for the finished ones
        self.st.end(self)
        if self.st.options.log_requests and self.ids:
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
                ",".join(self.finish.get(i, "abort") for i in range(len(self.ids))),
            )

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) until every request has finished; an engine error raises.
        Past --request-timeout the unfinished ones end with finish_reason "length"."""
        left = len(self.ids)
        while left:
            outs = None
            with trio.move_on_at(self.deadline):
                outs = await self.channel.get()
            if outs is None:
                for out in self.channel.take_nowait():  # what arrived but was not yet due
                    i = self.index[out.request_id]
                    self.last[i] = out
                    if out.finished:
                        self.finish[i] = out.finish_reason
                    yield i, out
                for i, rid in enumerate(self.ids):
                    if i not in self.finish:
                        self.engine.abort(rid)
                        prev = self.last.get(i)
                        self.finish[i] = "length"
                        yield (
                            i,
                            RequestOutput(
                                request_id=rid,
                                finished=True,
                                finish_reason="length",
                                num_prompt_tokens=prev.num_prompt_tokens if prev else 0,
                                num_output_tokens=prev.num_output_tokens if prev else 0,
                                num_cached_tokens=prev.num_cached_tokens if prev else 0,
                            ),
                        )
                return
            if self.first_output is None:
                self.first_output = time.monotonic()
            for out in outs:
                if out.error is not None:
                    raise APIError(500, f"The engine failed: {out.error}", None, "engine_error")
                i = self.index[out.request_id]
                self.last[i] = out
                if out.finished:
                    left -= 1
                    self.finish[i] = out.finish_reason
                yield i, out


class UsageCounter:
    """Prompt tokens count once per prompt (not per sample); completion tokens add up."""

    def __init__(self, n: int, choices: int) -> None:
        self.n = n
        self.prompt = self.cached = 0
        self.prompt_seen: set[int] = set()
        self.completion = [0] * choices

    def update(self, index: int, out: RequestOutput) -> None:
        self.completion[index] = out.num_output_tokens
        prompt = index // self.n
        if prompt not in self.prompt_seen:
            self.prompt_seen.add(prompt)
            self.prompt += out.num_prompt_tokens
            self.cached += out.num_cached_tokens

    def usage(self) -> Usage:
        done = sum(self.completion)
        return Usage(
            self.prompt, done, self.prompt + done, PromptTokensDetails(cached_tokens=self.cached)
        )


def check_common(st: ServerState, req: SamplingFields) -> None:
    if req.priority != 0 and st.config.scheduling_policy != "priority":
        raise APIError(
            400,
            f"priority {req.priority} needs the server to run with --scheduling-policy priority",
            "priority",
            "invalid_value",
        )
    if req.stream_options is not None and not req.stream:
        raise APIError(
            400,
            "stream_options is only allowed when stream is true",
            "stream_options",
            "invalid_value",
        )


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
            current_app.logger.exception("stream failed")
            yield sse.event(error_body(500, f"Internal error: {type(e).__name__}: {e}"))
            yield sse.DONE
        finally:
            # Synchronous, so it also runs when the client went away and we were cancelled.
            sub.close()

    gen = body()
    # If the client is gone before the body is ever iterated, the generator never runs its
    # `finally`: close the request when the generator object is dropped instead (idempotent).
    weakref.finalize(gen, sub.close)
    response = Response(
        gen,
        content_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
    response.timeout = None
    return response


class Collected:
    """A non-streaming request run to the end: per choice text, finish, log-probs."""

    def __init__(self, count: int) -> None:
        self.text: list[list[str]] = [[] for _ in range(count)]
        self.finish: list[str | None] = [None] * count
        self.logprobs: list[list[Logprob]] = [[] for _ in range(count)]
        self.token_ids: list[list[int]] = [[] for _ in range(count)]
        self.prompt_logprobs: list[list[Logprob | None] | None] = [None] * count


async def collect(sub: Submitted, usage: UsageCounter) -> Collected:
    got = Collected(len(sub.ids))
    try:
        async for i, out in sub.outputs():
            got.text[i].append(out.new_text)
            got.logprobs[i] += out.logprobs
            got.token_ids[i] += out.new_token_ids
            if out.prompt_logprobs is not None:
                got.prompt_logprobs[i] = out.prompt_logprobs
            usage.update(i, out)
            if out.finished:
                got.finish[i] = out.finish_reason
    finally:
        sub.close()
    return got


def include_usage(req: SamplingFields) -> tuple[bool, bool]:
    opts = req.stream_options
    return bool(opts and opts.include_usage), bool(opts and opts.continuous_usage_stats)


# ---------------------------------------------------------------- chat
@bp.post("/v1/chat/completions")
async def chat_completions() -> Response:
    st = state()
    req = await decode(ChatCompletionRequest)
    engine = st.ready_engine()
    model = st.model_name(req.model)
    check_common(st, req)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs to be true", "top_logprobs")
    prompt = chat.render(
        st.tokenizer,
        st.chat_template,
        req.messages,
        req.add_generation_prompt and not req.continue_final_message,
        req.continue_final_message,
        req.chat_template_kwargs,
        req.tools,
    )
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(
        st, req, req.max_completion_tokens or req.max_tokens, len(prompt), logprobs
    )
    sub = Submitted(st, engine, request_id("chatcmpl"), req.n, req.stream)
    sub.add([prompt], params, req.priority, req.cache_salt)
    created = int(time.time())
    usage = UsageCounter(req.n, len(sub.ids))
    text_of = st.token_text

    if req.stream:
        want_usage, continuous = include_usage(req)

        def chunk(
            index: int,
            delta: Delta,
            finish: str | None = None,
            entries: list[Logprob] | None = None,
        ) -> bytes:
            lp = chat_logprobs(entries, text_of) if logprobs is not None and entries else None
            return sse.event(
                ChatCompletionChunk(
                    id=sub.base,
                    created=created,
                    model=model,
                    choices=[
                        ChunkChoice(index=index, delta=delta, finish_reason=finish, logprobs=lp)
                    ],
                    usage=usage.usage() if continuous else None,
                )
            )

        async def events() -> AsyncIterator[bytes]:
            for i in range(len(sub.ids)):
                yield chunk(i, Delta(role="assistant", content=""))
            async for i, out in sub.outputs():
                usage.update(i, out)
                if out.finished:
                    yield chunk(
                        i, Delta(content=out.new_text or None), out.finish_reason, out.logprobs
                    )
                elif out.new_text or (logprobs is not None and out.logprobs):
                    yield chunk(i, Delta(content=out.new_text), None, out.logprobs)
            if want_usage:
                yield sse.event(
                    ChatCompletionChunk(
                        id=sub.base, created=created, model=model, choices=[], usage=usage.usage()
                    )
                )
            yield sse.DONE

        return stream_response(events(), sub)

    got = await collect(sub, usage)
    return json_response(
        ChatCompletionResponse(
            id=sub.base,
            created=created,
            model=model,
            choices=[
                ChatChoice(
                    index=i,
                    message=ResponseMessage("assistant", "".join(got.text[i])),
                    finish_reason=got.finish[i],
                    logprobs=chat_logprobs(got.logprobs[i], text_of)
                    if logprobs is not None
                    else None,
                )
                for i in range(len(sub.ids))
            ],
            usage=usage.usage(),
            prompt_logprobs=prompt_logprobs(got.prompt_logprobs[0], text_of)
            if got.prompt_logprobs[0] is not None
            else None,
        )
    )


# ---------------------------------------------------------------- completions
def completion_prompts(st: ServerState, prompt: str | list[Any]) -> list[list[int]]:
    """A string, list of strings, list of token ids or list of token-id lists -> token lists."""

    def encode(text: str) -> list[int]:
        return st.tokenizer.encode(text)

    def is_ids(x: Any) -> bool:
        return (
            isinstance(x, list)
            and bool(x)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
        )

    if isinstance(prompt, str):
        return [encode(prompt)]
    if not prompt:
        raise APIError(400, "prompt must not be empty", "prompt", "invalid_value")
    if all(isinstance(p, str) for p in prompt):
        return [encode(p) for p in prompt]
    if is_ids(prompt):
        return [list(prompt)]
    if all(is_ids(p) for p in prompt):
        return [list(p) for p in prompt]
    raise APIError(
        400,
        "prompt must be a string, a list of strings, a list of token ids or a "
        "list of token-id lists",
        "prompt",
        "invalid_value",
    )


@bp.post("/v1/completions")
async def completions() -> Response:
    st = state()
    req = await decode(CompletionRequest)
    engine = st.ready_engine()
    model = st.model_name(req.model)
    check_common(st, req)
    prompts = completion_prompts(st, req.prompt)
    params = sampling_params(st, req, req.max_tokens, max(len(p) for p in prompts), req.logprobs)
    if req.echo and req.logprobs is not None:
        # Echoed prompt tokens carry log-probs too: ask the engine for them.
        want = max(req.logprobs, params.prompt_logprobs or 0)
        params = msgspec.structs.replace(params, prompt_logprobs=want)
    sub = Submitted(st, engine, request_id("cmpl"), req.n, req.stream)
    sub.add(prompts, params, req.priority, req.cache_salt)
    created = int(time.time())
    usage = UsageCounter(req.n, len(sub.ids))
    text_of = st.token_text
    echo_text = [
        st.tokenizer.decode(prompts[i // req.n]) if req.echo else "" for i in range(len(sub.ids))
    ]
    builders = [CompletionLogprobsBuilder(text_of) for _ in sub.ids]

    def choice_logprobs(
        i: int, out_ids: list[int], entries: list[Logprob], prompt_lp: list[Logprob | None] | None
    ):
        if req.logprobs is None:
            return None
        ids, lps = list(out_ids), list(entries)
        if req.echo and prompt_lp is not None:
            ids = prompts[i // req.n] + ids
            lps = list(prompt_lp) + lps
        return builders[i].build(lps, ids)

    if req.stream:
        want_usage, continuous = include_usage(req)
        started = [False] * len(sub.ids)

        async def events() -> AsyncIterator[bytes]:
            async for i, out in sub.outputs():
                usage.update(i, out)
                text = out.new_text
                prompt_lp = None
                if not started[i]:
                    started[i] = True
                    text = echo_text[i] + text
                    prompt_lp = out.prompt_logprobs
                if text or out.finished or (req.logprobs is not None and out.logprobs):
                    yield sse.event(
                        CompletionResponse(
                            id=sub.base,
                            created=created,
                            model=model,
                            choices=[
                                CompletionChoice(
                                    i,
                                    text,
                                    out.finish_reason,
                                    choice_logprobs(i, out.new_token_ids, out.logprobs, prompt_lp),
                                    prompt_logprobs(out.prompt_logprobs, text_of)
                                    if out.prompt_logprobs is not None
                                    and req.prompt_logprobs is not None
                                    else None,
                                )
                            ],
                            usage=usage.usage() if continuous else None,
                        )
                    )
            if want_usage:
                yield sse.event(
                    CompletionResponse(
                        id=sub.base, created=created, model=model, choices=[], usage=usage.usage()
                    )
                )
            yield sse.DONE

        return stream_response(events(), sub)

    got = await collect(sub, usage)
    choices = []
    for i in range(len(sub.ids)):
        plp = got.prompt_logprobs[i]
        choices.append(
            CompletionChoice(
                i,
                echo_text[i] + "".join(got.text[i]),
                got.finish[i],
                choice_logprobs(i, got.token_ids[i], got.logprobs[i], plp),
                prompt_logprobs(plp, text_of)
                if plp is not None and req.prompt_logprobs is not None
                else None,
            )
        )
    return json_response(
        CompletionResponse(
            id=sub.base, created=created, model=model, choices=choices, usage=usage.usage()
        )
    )
