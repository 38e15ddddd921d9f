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


def submit(engine: Engine, prompts: list[list[int]], params: SamplingParams, prefix: str
           ) -> tuple[RequestChannel, list[str]]:
    """Queue one engine request per prompt, all read through one channel."""
    channel = RequestChannel()
    ids: list[str] = []
    base = f"{prefix}-{uuid.uuid4().hex}"
    try:
        for i, prompt in enumerate(prompts):
            rid = base if len(prompts) == 1 else f"{base}-{i}"
            engine.add(EngineRequest(rid, prompt, params, time.monotonic()), channel)
            ids.append(rid)
    except InvalidParam as e:
        for rid in ids:
            engine.abort(rid)
        raise APIError(400, e.message, e.param, "invalid_value") from None
    except EngineDeadError as e:
        for rid in ids:
            engine.abort(rid)
        raise APIError(503, str(e), None, "engine_dead") from None
    return channel, ids


async def outputs(channel: RequestChannel, ids: list[str]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) until every request has finished; an engine error raises."""
    index = {rid: i for i, rid in enumerate(ids)}
    left = len(ids)
    while left:
        for out in await channel.get():
            if out.error is not None:
                raise APIError(500, f"The engine failed: {out.error}", None, "engine_error")
            if out.finished:
                left -= 1
            yield index[out.request_id], out


def usage_of(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)


def stream_response(events: AsyncIterator[bytes], engine: Engine, ids: list[str]) -> Response:
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
            for rid in ids:
                engine.abort(rid)

    response = Response(body(), content_type="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    response.timeout = None
    return response


# ---------------------------------------------------------------- chat
@bp.post("/v1/chat/completions")
async def chat_completions() -> Response:
    st = state()
    req = await decode(ChatCompletionRequest)
    engine = st.ready_engine()
    model = st.model_name(req.model)
    prompt = chat.render(st.tokenizer, st.chat_template, req.messages, req.add_generation_prompt)
    params = sampling_params(req, req.max_completion_tokens or req.max_tokens)
    channel, ids = submit(engine, [prompt], params, "chatcmpl")
    created = int(time.time())
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    if req.stream:
        def chunk(delta: Delta, finish: str | None = None) -> bytes:
            return sse.event(ChatCompletionChunk(
                id=ids[0], created=created, model=model,
                choices=[ChunkChoice(index=0, delta=delta, finish_reason=finish)]))

        async def events() -> AsyncIterator[bytes]:
            yield chunk(Delta(role="assistant", content=""))
            async for _, out in outputs(channel, ids):
                if out.finished:
                    yield chunk(Delta(content=out.new_text or None), out.finish_reason)
                    if include_usage:
                        yield sse.event(ChatCompletionChunk(
                            id=ids[0], created=created, model=model, choices=[],
                            usage=usage_of(out.num_prompt_tokens, out.num_output_tokens)))
                elif out.new_text:
                    yield chunk(Delta(content=out.new_text))
            yield sse.DONE

        return stream_response(events(), engine, ids)

    try:
        text: list[str] = []
        last: RequestOutput | None = None
        async for _, out in outputs(channel, ids):
            text.append(out.new_text)
            last = out
    finally:
        for rid in ids:
            engine.abort(rid)
    assert last is not None
    return json_response(ChatCompletionResponse(
        id=ids[0], created=created, model=model,
        choices=[ChatChoice(index=0, message=ResponseMessage("assistant", "".join(text)),
                            finish_reason=last.finish_reason)],
        usage=usage_of(last.num_prompt_tokens, last.num_output_tokens),
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
    prompts = completion_prompts(st, req.prompt)
    params = sampling_params(req, req.max_tokens)
    channel, ids = submit(engine, prompts, params, "cmpl")
    created = int(time.time())
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    if req.stream:
        async def events() -> AsyncIterator[bytes]:
            prompt_tokens = completion_tokens = 0
            async for i, out in outputs(channel, ids):
                if out.new_text or out.finished:
                    yield sse.event(CompletionResponse(
                        id=ids[0], created=created, model=model,
                        choices=[CompletionChoice(i, out.new_text, out.finish_reason)]))
                if out.finished:
                    prompt_tokens += out.num_prompt_tokens
                    completion_tokens += out.num_output_tokens
            if include_usage:
                yield sse.event(CompletionResponse(
                    id=ids[0], created=created, model=model, choices=[],
                    usage=usage_of(prompt_tokens, completion_tokens)))
            yield sse.DONE

        return stream_response(events(), engine, ids)

    texts = [[] for _ in ids]
    finals: list[RequestOutput | None] = [None] * len(ids)
    try:
        async for i, out in outputs(channel, ids):
            texts[i].append(out.new_text)
            if out.finished:
                finals[i] = out
    finally:
        for rid in ids:
            engine.abort(rid)
    choices = [CompletionChoice(i, "".join(t), f.finish_reason if f else None)
               for i, (t, f) in enumerate(zip(texts, finals))]
    return json_response(CompletionResponse(
        id=ids[0], created=created, model=model, choices=choices,
        usage=usage_of(sum(f.num_prompt_tokens for f in finals if f),
                       sum(f.num_output_tokens for f in finals if f)),
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
