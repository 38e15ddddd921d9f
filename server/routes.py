"""The HTTP routes: OpenAI chat and text completions, models, health."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import msgspec
from quart import Blueprint, Response, current_app, request

from core.engine import Engine, EngineDeadError
from core.outputs import RequestChannel
from core.request import EngineRequest, RequestOutput
from core.sampling import InvalidParam, SamplingParams
from server import chat, sse
from server.errors import APIError, error_body, error_response, from_validation
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
    ModelCard,
    ModelList,
    PromptTokensDetails,
    ResponseMessage,
    Usage,
    _SamplingFields,
)
from server.state import ServerState

bp = Blueprint("openai", __name__)
_encoder = msgspec.json.Encoder()
T = TypeVar("T")


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


def sampling_params(req: _SamplingFields, max_tokens: int | None) -> SamplingParams:
    params = SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        max_tokens=max_tokens,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        seed=req.seed,
        skip_special_tokens=req.skip_special_tokens,
    )
    try:
        params.validate()
    except InvalidParam as e:
        raise APIError(400, e.message, e.param, "invalid_value") from None
    return params


class Submitted:
    """The engine requests behind one HTTP request: n samples of each prompt, read through one
    channel. Choice index = prompt index * n + sample index, as the OpenAI API numbers them."""

    def __init__(self, engine: Engine, prefix: str, n: int) -> None:
        self.engine = engine
        self.base = f"{prefix}-{uuid.uuid4().hex}"
        self.n = n
        self.channel = RequestChannel()
        self.ids: list[str] = []
        self.index: dict[str, int] = {}

    def add(self, prompts: list[list[int]], params: SamplingParams, priority: int,
            cache_salt: str | None) -> None:
        single = len(prompts) == 1 and self.n == 1
        try:
            for p, prompt in enumerate(prompts):
                leader = None
                for j in range(self.n):
                    rid = self.base if single else f"{self.base}-{p * self.n + j}"
                    # Each sample gets its own reproducible stream: seed, seed + 1, ...
                    sample_params = params if params.seed is None or j == 0 else \
                        msgspec.structs.replace(params, seed=params.seed + j)
                    self.engine.add(EngineRequest(
                        rid, prompt, sample_params, time.monotonic(), priority=priority,
                        cache_salt=cache_salt, leader_id=leader), self.channel)
                    leader = leader or rid
                    self.index[rid] = len(self.ids)
                    self.ids.append(rid)
        except InvalidParam as e:
            self.abort()
            raise APIError(400, e.message, e.param, "invalid_value") from None
        except EngineDeadError as e:
            self.abort()
            raise APIError(503, str(e), None, "engine_dead") from None

    def abort(self) -> None:
        """Synchronous: safe in the `finally` of a cancelled handler. Finished ones are no-ops."""
        for rid in self.ids:
            self.engine.abort(rid)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) until every request has finished; an engine error raises."""
        left = len(self.ids)
        while left:
            for out in await self.channel.get():
                if out.error is not None:
                    raise APIError(500, f"The engine failed: {out.error}", None, "engine_error")
                if out.finished:
                    left -= 1
                yield self.index[out.request_id], out


class UsageCounter:
    """Prompt tokens count once per prompt (not per sample); completion tokens add up."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.prompt = self.completion = self.cached = 0

    def finished(self, index: int, out: RequestOutput) -> None:
        self.completion += out.num_output_tokens
        if index % self.n == 0:
            self.prompt += out.num_prompt_tokens
            self.cached += out.num_cached_tokens

    def usage(self) -> Usage:
        return Usage(self.prompt, self.completion, self.prompt + self.completion,
                     PromptTokensDetails(cached_tokens=self.cached))


def check_priority(st: ServerState, req: _SamplingFields) -> None:
    if req.priority != 0 and st.config.scheduling_policy != "priority":
        raise APIError(400, f"priority {req.priority} needs the server to run with "
                       "--scheduling-policy priority", "priority", "invalid_value")


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
            sub.abort()

    response = Response(body(), content_type="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    response.timeout = None
    return response


async def collect(sub: Submitted, usage: UsageCounter) -> tuple[list[str], list[str | None]]:
    """Run a non-streaming request to the end: each choice's text and finish reason."""
    texts: list[list[str]] = [[] for _ in sub.ids]
    finish: list[str | None] = [None] * len(sub.ids)
    try:
        async for i, out in sub.outputs():
            texts[i].append(out.new_text)
            if out.finished:
                finish[i] = out.finish_reason
                usage.finished(i, out)
    finally:
        sub.abort()
    return ["".join(t) for t in texts], finish


# ---------------------------------------------------------------- chat
@bp.post("/v1/chat/completions")
async def chat_completions() -> Response:
    st = state()
    req = await decode(ChatCompletionRequest)
    engine = st.ready_engine()
    model = st.model_name(req.model)
    check_priority(st, req)
    prompt = chat.render(st.tokenizer, st.chat_template, req.messages, req.add_generation_prompt)
    params = sampling_params(req, req.max_completion_tokens or req.max_tokens)
    sub = Submitted(engine, "chatcmpl", req.n)
    sub.add([prompt], params, req.priority, req.cache_salt)
    created = int(time.time())
    usage = UsageCounter(req.n)

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(index: int, delta: Delta, finish: str | None = None) -> bytes:
            return sse.event(ChatCompletionChunk(
                id=sub.base, created=created, model=model,
                choices=[ChunkChoice(index=index, delta=delta, finish_reason=finish)]))

        async def events() -> AsyncIterator[bytes]:
            for i in range(len(sub.ids)):
                yield chunk(i, Delta(role="assistant", content=""))
            async for i, out in sub.outputs():
                if out.finished:
                    usage.finished(i, out)
                    yield chunk(i, Delta(content=out.new_text or None), out.finish_reason)
                elif out.new_text:
                    yield chunk(i, Delta(content=out.new_text))
            if include_usage:
                yield sse.event(ChatCompletionChunk(id=sub.base, created=created, model=model,
                                                    choices=[], usage=usage.usage()))
            yield sse.DONE

        return stream_response(events(), sub)

    texts, finish = await collect(sub, usage)
    return json_response(ChatCompletionResponse(
        id=sub.base, created=created, model=model,
        choices=[ChatChoice(index=i, message=ResponseMessage("assistant", t), finish_reason=f)
                 for i, (t, f) in enumerate(zip(texts, finish))],
        usage=usage.usage(),
    ))


# ---------------------------------------------------------------- completions
def completion_prompts(st: ServerState, prompt: str | list[Any]) -> list[list[int]]:
    """A string, list of strings, list of token ids or list of token-id lists -> token lists."""
    def encode(text: str) -> list[int]:
        return st.tokenizer.encode(text)

    def is_ids(x: Any) -> bool:
        return isinstance(x, list) and bool(x) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in x)

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
    raise APIError(400, "prompt must be a string, a list of strings, a list of token ids or a "
                   "list of token-id lists", "prompt", "invalid_value")


@bp.post("/v1/completions")
async def completions() -> Response:
    st = state()
    req = await decode(CompletionRequest)
    engine = st.ready_engine()
    model = st.model_name(req.model)
    check_priority(st, req)
    prompts = completion_prompts(st, req.prompt)
    params = sampling_params(req, req.max_tokens)
    sub = Submitted(engine, "cmpl", req.n)
    sub.add(prompts, params, req.priority, req.cache_salt)
    created = int(time.time())
    usage = UsageCounter(req.n)

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def events() -> AsyncIterator[bytes]:
            async for i, out in sub.outputs():
                if out.finished:
                    usage.finished(i, out)
                if out.new_text or out.finished:
                    yield sse.event(CompletionResponse(
                        id=sub.base, created=created, model=model,
                        choices=[CompletionChoice(i, out.new_text, out.finish_reason)]))
            if include_usage:
                yield sse.event(CompletionResponse(id=sub.base, created=created, model=model,
                                                   choices=[], usage=usage.usage()))
            yield sse.DONE

        return stream_response(events(), sub)

    texts, finish = await collect(sub, usage)
    return json_response(CompletionResponse(
        id=sub.base, created=created, model=model,
        choices=[CompletionChoice(i, t, f) for i, (t, f) in enumerate(zip(texts, finish))],
        usage=usage.usage(),
    ))


# ---------------------------------------------------------------- models, health
@bp.get("/v1/models")
async def models() -> Response:
    st = state()
    root = str(st.config.model or st.served_names[0]) if st.served_names else None
    return json_response(ModelList(data=[
        ModelCard(id=name, created=st.created, root=root, max_model_len=st.max_model_len or None)
        for name in st.served_names
    ]))


@bp.get("/health")
async def health() -> Response:
    ok, reason = state().healthy
    if ok:
        return Response(b"", status=200)
    return error_response(503, reason, None, "unhealthy")
