"""One response being generated (Run), and the registry of running and stored responses (Runs).

A Run turns the engine's outputs into output items and stream events (output.py) and ends in
one terminal status. It is driven either by the HTTP request that created it (`foreground`, an
async generator of events: the client going away aborts it) or by a task of its own
(`background`: runs without a connection, can be cancelled, records its events so a stream
can be replayed or resumed with `starting_after`)."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import trio

from core.request import RequestOutput
from server.chat_job import ChatJob
from server.errors import APIError
from server.logprobs import chat_logprobs
from server.params import tokens_as_ids
from server.responses.output import OutputBuilder
from server.responses.protocol import (
    TERMINAL,
    IncompleteDetails,
    InputTokensDetails,
    OutputTokensDetails,
    ResponseError,
    ResponseObject,
    ResponseUsage,
)
from server.responses.store import Stored
from server.submit import Submitted
from server.usage import UsageCounter

log = logging.getLogger("weir.responses")
_encoder = msgspec.json.Encoder()
END_EVENT = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "failed": "response.failed",
    "cancelled": "response.cancelled",
}


class Progress:
    """What one run has read from the engine so far."""

    def __init__(self, st: Any, job: ChatJob) -> None:
        self.st = st
        self.job = job
        self.reply = job.reply()
        self.usage = UsageCounter(1, 1)
        if job.thinker is not None:
            self.usage.count_reasoning()
        self.finish: str | None = None


class Run:
    def __init__(
        self, response: ResponseObject, context: list[dict[str, Any]], record: bool
    ) -> None:
        self.response = response
        self.context = context
        self.created = time.time()
        self.log: list[bytes] | None = [] if record else None  # every event, for replay
        self.pending: list[bytes] = []  # events not yet sent by the foreground stream
        self.seq = -1
        self.changed = trio.Event()
        self.done = trio.Event()
        self.saved = trio.Event()  # a background run: its final state is in the store
        self.scope = trio.CancelScope()
        self.stop_reason: str | None = None  # cancelled | interrupted
        self.builder = OutputBuilder(self.emit)

    @property
    def id(self) -> str:
        return self.response.id

    # ---------------------------------------------------------------- events
    def emit(self, kind: str, **fields: Any) -> None:
        self.seq += 1
        event = {"type": kind, "sequence_number": self.seq, **fields}
        data = b"event: " + kind.encode() + b"\ndata: " + _encoder.encode(event) + b"\n\n"
        self.pending.append(data)
        if self.log is not None:
            self.log.append(data)
            self.changed.set()
            self.changed = trio.Event()

    def take(self) -> list[bytes]:
        out, self.pending = self.pending, []
        return out

    def snapshot(self) -> dict[str, Any]:
        """The response as it stands: a running one shows its output so far."""
        body = msgspec.to_builtins(self.response)
        if self.response.status not in TERMINAL:
            items = [dict(item) for item in self.builder.items]
            if self.builder.open is not None and items:
                last, text = items[-1], self.builder.text
                if last["type"] == "function_call":
                    last["arguments"] = text
                elif last["type"] == "message":
                    last["content"] = [
                        {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
                    ]
                else:
                    last["content"] = [{"type": "reasoning_text", "text": text}]
            body["output"] = items
        return body

    def stored(self) -> Stored:
        return Stored(self.id, self.snapshot(), self.context, self.log, self.created)

    def begin(self) -> None:
        self.emit("response.created", response=self.snapshot())
        self.response.status = "in_progress"
        self.emit("response.in_progress", response=self.snapshot())

    # ---------------------------------------------------------------- generation
    def _feed(self, progress: Progress, out: RequestOutput) -> None:
        progress.usage.update(0, out)
        logprobs = None
        if progress.job.params.logprobs is not None and out.logprobs:
            as_ids = tokens_as_ids(progress.st, progress.job.request)
            entries = chat_logprobs(out.logprobs, progress.st.token_text, as_ids).content
            logprobs = msgspec.to_builtins(entries)
        self.builder.feed(progress.reply.delta(out.new_text, out.finished), logprobs)
        if out.finished:
            progress.finish = out.finish_reason

    async def foreground(self, st: Any, sub: Submitted, job: ChatJob) -> AsyncIterator[bytes]:
        progress = Progress(st, job)
        self.begin()
        for data in self.take():
            yield data
        error = None
        try:
            async for _, out in sub.outputs():
                self._feed(progress, out)
                for data in self.take():
                    yield data
        except APIError as e:
            error = e
        finally:
            sub.close()
            if not self.done.is_set() and error is None and progress.finish is None:
                # The client went away (we are being cancelled): end it here, synchronously.
                self.stop_reason = "disconnected"
                self._end(progress, None)
                st.responses.save_now(self)
        if not self.done.is_set():
            self._end(progress, error)
            await st.responses.save(self)
        for data in self.take():
            yield data

    async def background(self, st: Any, sub: Submitted, job: ChatJob) -> None:
        progress = Progress(st, job)
        error = None
        try:
            with self.scope:
                self.begin()
                async for _, out in sub.outputs():
                    self._feed(progress, out)
                    self.pending.clear()  # followers read the log
        except APIError as e:
            error = e
        except Exception as e:  # noqa: BLE001 - a background task has nobody else to tell
            log.exception("background response %s failed", self.id)
            error = APIError(500, f"Internal error: {type(e).__name__}: {e}")
        finally:
            sub.close()
            with trio.CancelScope(shield=True):
                if not self.done.is_set():
                    self._end(progress, error)
                    self.pending.clear()
                    await st.responses.save(self)
                self.saved.set()

    def _end(self, progress: Progress, error: APIError | None) -> None:
        r = self.response
        finish = progress.finish
        if error is not None:
            status = "failed"
            r.error = ResponseError(error.code or "server_error", error.message)
        elif self.stop_reason == "cancelled":
            status = "cancelled"
        elif self.stop_reason is not None or finish is None:  # drain, shutdown, client gone
            status = "incomplete"
            r.incomplete_details = IncompleteDetails(self.stop_reason or "interrupted")
        elif finish == "length":
            status = "incomplete"
            r.incomplete_details = IncompleteDetails("max_output_tokens")
        else:
            status = "completed"
        self.builder.close("completed" if status == "completed" else "incomplete")
        if r.error is not None:
            self.emit("error", code=r.error.code, message=r.error.message, param=None)
        usage = progress.usage.usage()
        r.usage = ResponseUsage(
            usage.prompt_tokens,
            InputTokensDetails(usage.prompt_tokens_details.cached_tokens),
            usage.completion_tokens,
            OutputTokensDetails(
                progress.job.reasoning_tokens(progress.st, progress.reply, progress.usage, 0)
            ),
            usage.total_tokens,
        )
        r.output = self.builder.items
        r.status = status
        r.completed_at = int(time.time())
        self.emit(END_EVENT[status], response=self.snapshot())
        self.done.set()
        self.changed.set()

    # ---------------------------------------------------------------- readers
    async def follow(self, after: int = -1) -> AsyncIterator[bytes]:
        """The recorded stream from event `after + 1`, live until the response ends."""
        assert self.log is not None
        sent = after + 1
        while True:
            while sent < len(self.log):
                yield self.log[sent]
                sent += 1
            if self.done.is_set():
                return
            await self.changed.wait()

    def abandon(self, runs: Any) -> None:
        """The client left before its stream ever started: nothing was generated for it."""
        if self.done.is_set():
            return
        r = self.response
        r.status, r.incomplete_details = "incomplete", IncompleteDetails("disconnected")
        r.completed_at = int(time.time())
        self.done.set()
        runs.save_now(self)

    def stop(self, reason: str) -> None:
        self.stop_reason = self.stop_reason or reason
        self.scope.cancel()


async def replay(events: list[bytes], after: int) -> AsyncIterator[bytes]:
    for data in events[after + 1 :]:
        yield data
