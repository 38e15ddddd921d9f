"""The generation routes: /v1/chat/completions and /v1/completions, streaming or not."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import msgspec
from msgspec import UNSET
from quart import Blueprint, Response

from core.request import Logprob
from server import sse, structured
from server.chat import echo_text
from server.chat_job import prepare_chat
from server.errors import APIError
from server.prompts import token_lists
from server.logprobs import CompletionLogprobsBuilder, chat_logprobs, prompt_logprobs
from server.params import (
    check_common,
    include_usage,
    sampling_params,
    tokens_as_ids,
    truncate_prompt,
)
from server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChunkChoice,
    CompletionChoice,
    CompletionResponse,
    Delta,
)
from server.requests import ChatCompletionRequest, CompletionRequest
from server.submit import Submitted, collect, request_id, stream_response
from server.usage import UsageCounter
from server.wire import decode, json_response, state

bp = Blueprint("generate", __name__)


# ---------------------------------------------------------------- chat
@bp.post("/v1/chat/completions")
async def chat_completions() -> Response:
    st = state()
    req = await decode(ChatCompletionRequest)
    engine = st.ready_engine()
    st.check_task("generate")
    model = st.model_name(req.model)
    check_common(st, req)
    job = await prepare_chat(st, req)
    thinker = job.thinker
    logprobs = job.params.logprobs
    sub = Submitted(
        st,
        engine,
        request_id("chatcmpl", req.request_id),
        req.n,
        req.stream,
        model,
        req.use_beam_search,
    )
    sub.add([job.prompt], job.params, req.priority, req.cache_salt)
    created = int(time.time())
    usage = UsageCounter(req.n, sub.choices)
    if thinker is not None:
        usage.count_reasoning()
    text_of = st.token_text
    as_ids = tokens_as_ids(st, req)
    echo = echo_text(req)
    want_ids = req.return_token_ids

    if req.stream:
        want_usage, continuous = include_usage(req)

        def chunk(
            index: int,
            delta: Delta,
            finish: str | None = None,
            entries: list[Logprob] | None = None,
            stop_reason: str | int | None = None,
            ids: list[int] | None = None,
        ) -> bytes:
            lp = (
                chat_logprobs(entries, text_of, as_ids)
                if logprobs is not None and entries
                else None
            )
            return sse.event(
                ChatCompletionChunk(
                    id=sub.base,
                    created=created,
                    model=model,
                    choices=[
                        ChunkChoice(
                            index=index,
                            delta=delta,
                            finish_reason=finish,
                            logprobs=lp,
                            stop_reason=stop_reason,
                            token_ids=UNSET if ids is None or not want_ids else ids,
                        )
                    ],
                    usage=usage.of_choice(index, len(job.prompt)) if continuous else None,
                    prompt_token_ids=job.prompt if want_ids and delta.role else UNSET,
                )
            )

        replies = [job.reply() for _ in range(sub.choices)]

        async def events() -> AsyncIterator[bytes]:
            for i in range(sub.choices):
                yield chunk(i, Delta(role="assistant", content=""), ids=[])
            for i in range(sub.choices if echo else 0):
                yield chunk(i, Delta(content=echo), ids=[])
            async for i, out in sub.outputs():
                usage.update(i, out)
                reply = replies[i]
                delta = reply.delta(out.new_text, out.finished)
                if out.finished and thinker is not None:
                    usage.reasoning[i] = job.reasoning_tokens(st, reply, usage, i)
                if out.finished:
                    finish = reply.finish(out.finish_reason)
                    yield chunk(i, delta, finish, out.logprobs, out.stop_reason, out.new_token_ids)
                elif (
                    delta.content
                    or delta.reasoning
                    or delta.tool_calls
                    or (logprobs is not None and out.logprobs)
                    or (want_ids and out.new_token_ids)  # every token's id is sent
                ):
                    if reply.plain:
                        delta.content = out.new_text
                    yield chunk(i, delta, None, out.logprobs, ids=out.new_token_ids)
            if want_usage:
                yield sse.event(
                    ChatCompletionChunk(
                        id=sub.base, created=created, model=model, choices=[], usage=usage.usage()
                    )
                )
            yield sse.DONE

        return stream_response(events(), sub)

    got = await collect(sub, usage)
    shaped = []
    for i in range(sub.choices):
        reply, text = job.reply(), "".join(got.text[i])
        message, finish = reply.whole(text, got.finish[i])
        if echo:
            message.content = echo + (message.content or "")
        shaped.append((message, finish))
        if thinker is not None:
            usage.reasoning[i] = job.reasoning_tokens(st, reply, usage, i, text)
    return json_response(
        ChatCompletionResponse(
            id=sub.base,
            created=created,
            model=model,
            choices=[
                ChatChoice(
                    index=i,
                    message=shaped[i][0],
                    finish_reason=shaped[i][1],
                    logprobs=chat_logprobs(got.logprobs[i], text_of, as_ids)
                    if logprobs is not None
                    else None,
                    stop_reason=got.stop_reason[i],
                    token_ids=got.token_ids[i] if want_ids else UNSET,
                )
                for i in range(sub.choices)
            ],
            usage=usage.usage(),
            prompt_logprobs=prompt_logprobs(got.prompt_logprobs[0], text_of)
            if got.prompt_logprobs[0] is not None
            else None,
            prompt_token_ids=job.prompt if want_ids else UNSET,
        )
    )


# ---------------------------------------------------------------- completions
@bp.post("/v1/completions")
async def completions() -> Response:
    st = state()
    req = await decode(CompletionRequest)
    engine = st.ready_engine()
    st.check_task("generate")
    model = st.model_name(req.model)
    check_common(st, req)
    if req.suffix is not None:
        raise APIError(400, "suffix (text after the insertion point) is not supported", "suffix")
    if (req.best_of or 1) > 1:
        raise APIError(400, "best_of above 1 is not supported; ask for n samples", "best_of")
    prompts = [truncate_prompt(st, req, p) for p in token_lists(st, req.prompt, "prompt")]
    constraint = await structured.request_constraint(st, req)
    params = sampling_params(
        st, req, req.max_tokens, max(len(p) for p in prompts), req.logprobs, constraint
    )
    if req.echo and params.logprobs is not None:
        if req.use_beam_search:
            raise APIError(
                400,
                "echo with logprobs (the prompt's log-probs) cannot be used with beam search",
                "echo",
                "invalid_value",
            )
        # Echoed prompt tokens carry log-probs too: ask the engine for them.
        want = max(params.logprobs, params.prompt_logprobs or 0)
        params = msgspec.structs.replace(params, prompt_logprobs=want)
    rid = request_id("cmpl", req.request_id)
    sub = Submitted(
        st, engine, rid, req.n, req.stream, model, req.use_beam_search,
        names={"messages": "prompt"},
    )  # fmt: skip
    sub.add(prompts, params, req.priority, req.cache_salt)
    created = int(time.time())
    usage = UsageCounter(req.n, sub.choices)
    text_of = st.token_text
    echo_text = [
        st.tokenizer.decode(prompts[i // req.n]) if req.echo else "" for i in range(sub.choices)
    ]
    as_ids = tokens_as_ids(st, req)
    want_ids = req.return_token_ids
    builders = [CompletionLogprobsBuilder(text_of, as_ids) for _ in range(sub.choices)]

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
        started = [False] * sub.choices

        async def events() -> AsyncIterator[bytes]:
            async for i, out in sub.outputs():
                usage.update(i, out)
                text = out.new_text
                prompt_lp, first = None, not started[i]
                if first:
                    started[i] = True
                    text = echo_text[i] + text
                    prompt_lp = out.prompt_logprobs
                if (
                    text
                    or out.finished
                    or (req.logprobs is not None and out.logprobs)
                    or (want_ids and (out.new_token_ids or first))  # every id, the prompt's first
                ):
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
                                    out.stop_reason,
                                    prompts[i // req.n] if want_ids and first else UNSET,
                                    out.new_token_ids if want_ids else UNSET,
                                )
                            ],
                            usage=usage.of_choice(i, len(prompts[i // req.n]))
                            if continuous
                            else None,
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
    for i in range(sub.choices):
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
                got.stop_reason[i],
                prompts[i // req.n] if want_ids else UNSET,
                got.token_ids[i] if want_ids else UNSET,
            )
        )
    return json_response(
        CompletionResponse(
            id=sub.base, created=created, model=model, choices=choices, usage=usage.usage()
        )
    )
