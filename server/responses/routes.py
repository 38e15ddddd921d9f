"""/v1/responses: create (streamed, whole or in the background), retrieve (or replay its
stream), input_items, delete, cancel. A response request becomes a chat request (items ->
messages, flat tools -> chat tools) and runs on the same path as chat completions."""

from __future__ import annotations

import time
import weakref
from typing import Any

from quart import Blueprint, Response, current_app, request

from core.structured import Constraint
from server import chat as chat_module
from server import sse, structured
from server.chat_job import prepare_chat
from server.api_server_messages import local_socket
from server.errors import APIError
from server.forward import forward, forwarded
from server.params import check_common
from server.requests import ChatCompletionRequest, ChatMessage, SamplingFields
from server.responses import items as item_forms
from server.responses.protocol import (
    ItemList,
    ResponseDeleted,
    ResponseObject,
    ResponsesRequest,
)
from server.responses.registry import Runs
from server.responses.run import Run, replay
from server.responses.store import Stored
from server.tools import FirstCall
from server.submit import Submitted, stream_response
from server.wire import decode, json_response, state

bp = Blueprint("responses", __name__)
LOGPROBS = "message.output_text.logprobs"
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param, "invalid_value")


def text_format(text: dict[str, Any] | None) -> tuple[Constraint, str] | None:
    """text.format (json_schema, json_object or text) as a constraint."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object"), "text.format"
    if kind == "json_schema":
        if fmt.get("schema") is None:
            raise _bad("text.format.schema", "type json_schema needs a schema")
        return Constraint("json", structured.schema_text("text.format", fmt["schema"])), (
            "text.format"
        )
    raise _bad("text.format.type", "must be text, json_object or json_schema")


def template_kwargs(req: ResponsesRequest) -> dict[str, Any] | None:
    """reasoning.effort: none turns thinking off for templates that read enable_thinking."""
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning is not None:
        effort = req.reasoning.get("effort")
        if effort is not None and effort not in EFFORTS:
            raise _bad("reasoning.effort", f"must be one of {', '.join(EFFORTS)}")
        if effort is not None:
            kwargs.setdefault("enable_thinking", effort != "none")
    return kwargs or None


def chat_request(req: ResponsesRequest, messages: list[ChatMessage]) -> ChatCompletionRequest:
    shared = {name: getattr(req, name) for name in SamplingFields.__struct_fields__}
    logprobs = LOGPROBS in (req.include or []) or req.top_logprobs is not None
    return ChatCompletionRequest(
        **shared,
        logprobs=logprobs,
        top_logprobs=(req.top_logprobs or 0) if logprobs else None,
        messages=messages,
        max_completion_tokens=req.max_output_tokens,
        chat_template_kwargs=template_kwargs(req),
        tools=item_forms.chat_tools(req.tools),
        tool_choice=item_forms.chat_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls,
    )


def _fit(st: Any, req: ResponsesRequest, context: list[dict]) -> list[dict]:
    """truncation "auto": the conversation less its oldest items, as few as make the prompt
    and max_output_tokens (or one token) fit the context (found by bisection: a few templates
    rendered); the last item is always kept (a prompt still too long is then the usual 400).
    Items that no longer make a conversation alone (an output whose call was dropped) go with
    the items before them."""
    room = st.max_model_len - (req.max_output_tokens or 1)

    def fits(start: int) -> bool | None:  # None: context[start:] is no conversation
        try:
            messages = item_forms.to_messages(context[start:], req.instructions)
        except APIError:
            return None
        text = chat_module.request_text(st.tokenizer, st.chat_template, chat_request(req, messages))
        return len(st.tokenizer.encode(text, add_special_tokens=False)) <= room

    if fits(0) is not False:
        return context
    low, high = 1, len(context) - 1  # the answer lies in [low, high]: high always kept
    while low < high:
        mid = (low + high) // 2
        if fits(mid) is False:
            low = mid + 1
        else:
            high = mid
    while low < len(context) - 1 and fits(low) is None:
        low += 1
    return context[low:]


def _runs() -> Runs:
    return state().responses


@bp.post("/v1/responses")
async def create() -> Response:
    st = state()
    req = await decode(ResponsesRequest)
    engine = st.ready_engine()
    st.check_task("generate")
    model = st.model_name(req.model)
    runs = _runs()
    if req.n != 1:
        raise _bad("n", "a response has one output; n must be 1")
    store = req.store and runs.store is not None
    if req.background and not req.store:
        raise _bad("background", "a background response must be stored: set store to true")
    if req.background and runs.store is None:
        raise _bad("background", "this server keeps no responses (--disable-responses-store)")
    context = []
    if req.previous_response_id is not None:
        context = await runs.conversation(req.previous_response_id)
    new_items = item_forms.input_items(req.input)
    if not new_items and not context:
        raise _bad("input", "give input (a string or a list of items)")
    context = context + new_items
    if req.truncation not in (None, "disabled", "auto"):
        raise _bad("truncation", "truncation must be auto or disabled")
    kept = _fit(st, req, context) if req.truncation == "auto" else context
    chat = chat_request(req, item_forms.to_messages(kept, req.instructions))
    check_common(st, chat)
    try:
        job = await prepare_chat(st, chat, text_format(req.text))
    except APIError as e:
        # A tool's parameters, named as chat's tools are (tools[i].function.parameters), are
        # the flat tool's own here (tools[i].parameters).
        if e.param and e.param.startswith("tools[") and ".function." in e.param:
            e.message = e.message.replace(e.param, e.param.replace(".function.", ".", 1))
            e.param = e.param.replace(".function.", ".", 1)
        raise
    if req.max_tool_calls is not None and job.call_parser is not None:
        job.call_parser = FirstCall(job.call_parser, req.max_tool_calls)
    response = ResponseObject(
        id=item_forms.new_id("resp"),
        created_at=int(time.time()),
        status="queued" if req.background else "in_progress",
        background=req.background,
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        max_tool_calls=req.max_tool_calls,
        metadata=req.metadata or {},
        model=model,
        parallel_tool_calls=req.parallel_tool_calls,
        previous_response_id=req.previous_response_id,
        prompt_cache_key=req.prompt_cache_key,
        reasoning=req.reasoning,
        store=store,
        temperature=job.params.temperature,
        text=req.text or {"format": {"type": "text"}},
        tool_choice=req.tool_choice,
        tools=req.tools or [],
        top_p=job.params.top_p,
        top_logprobs=req.top_logprobs,
        truncation=req.truncation or "disabled",
        user=req.user,
    )
    run = Run(response, context, record=req.background)
    # Log-probs go with the text of the step that made them: read the outputs step by step.
    stepwise = req.stream or req.background or job.params.logprobs is not None
    sub = Submitted(
        st, engine, response.id, 1, stepwise, model,
        names={"messages": "input", "max_tokens": "max_output_tokens"},
    )  # fmt: skip
    sub.background = req.background
    sub.add([job.prompt], job.params, req.priority, req.prompt_cache_key or req.cache_salt)
    runs.start(run)
    if req.background or runs.shared:  # shared: the other API servers see it running
        await runs.save(run)
    if req.background:
        current_app.nursery.start_soon(run.background, st, sub, job)
        if req.stream:
            return sse.response(run.follow())
        return json_response(run.snapshot())
    events = run.foreground(st, sub, job)
    if req.stream:
        # A client gone before the body is ever iterated: the generator never runs its finally.
        weakref.finalize(events, run.abandon, runs)
        return stream_response(events, sub)
    async for _ in events:
        pass
    return json_response(run.snapshot())


def _int_arg(name: str, default: int | None, low: int, high: int | None = None) -> int | None:
    value = request.args.get(name)
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        raise _bad(name, "must be an integer") from None
    if number < low or (high is not None and number > high):
        raise _bad(name, f"must be between {low} and {high}" if high else f"must be >= {low}")
    return number


async def _found_here(rid: str) -> tuple[Run | Stored | None, Response | None]:
    """The response, or the answer of the API server running it when that is another one
    (--api-server-count > 1): only that server has its state so far and its stream."""
    runs = _runs()
    found = await runs.get(rid)
    server = runs.elsewhere(found)
    if server is None or forwarded():
        return found, None
    return None, await forward(local_socket(runs.seat.run_dir, server), server)


@bp.get("/v1/responses/<rid>")
async def retrieve(rid: str) -> Response:
    found, answer = await _found_here(rid)
    if answer is not None:
        return answer
    if request.args.get("stream", "false").lower() not in ("true", "1"):
        return json_response(found.snapshot() if isinstance(found, Run) else found.response)
    after = _int_arg("starting_after", -1, -1)
    if isinstance(found, Run):
        if found.log is None:
            raise _bad(
                "stream",
                "only background responses can be streamed again; this one is "
                "still being streamed to the request that created it",
            )
        return sse.response(found.follow(after))
    if found.events is None:
        raise _bad("stream", "only background responses keep their stream to replay")
    return sse.response(replay(found.events, after))


@bp.get("/v1/responses/<rid>/input_items")
async def input_items(rid: str) -> Response:
    found = await _runs().get(rid)
    items = found.context
    limit = _int_arg("limit", 20, 1, 100)
    order = request.args.get("order", "desc")
    if order not in ("asc", "desc"):
        raise _bad("order", "must be asc or desc")
    if order == "desc":
        items = items[::-1]
    after = request.args.get("after")
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise _bad("after", f"no input item {after!r} in response {rid}")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return json_response(
        ItemList(
            data=page,
            first_id=page[0]["id"] if page else None,
            last_id=page[-1]["id"] if page else None,
            has_more=len(items) > limit,
        )
    )


@bp.delete("/v1/responses/<rid>")
async def delete(rid: str) -> Response:
    runs = _runs()
    if not await runs.delete(rid):
        await runs.get(rid)  # the 404, worded as for any unknown id
    return json_response(ResponseDeleted(rid))


@bp.post("/v1/responses/<rid>/cancel")
async def cancel(rid: str) -> Response:
    found, answer = await _found_here(rid)
    if answer is not None:
        return answer
    if isinstance(found, Run):
        if found.log is None:
            raise _bad("response_id", "only background responses can be cancelled")
        found.stop("cancelled")
        await found.done.wait()
        return json_response(found.snapshot())
    status = found.status
    if status != "cancelled":
        if not found.response.get("background"):
            raise _bad("response_id", "only background responses can be cancelled")
        raise _bad("response_id", f"cannot cancel a response that is already {status}")
    return json_response(found.response)
