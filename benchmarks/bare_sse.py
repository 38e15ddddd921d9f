"""`python -m benchmarks.bare_sse PORT [TICK_MS]`: the HTTP stack alone, for the overhead
benchmark's floor.

A QuartTrio app on Hypercorn (weir's stack and settings: listen backlog, no access log) whose
chat-completions route streams canned chunks of the same shape as weir's, with only a Trio
checkpoint between them: no engine, no tokenizer. Its server CPU per SSE event is what the
framework costs before weir does anything. With TICK_MS, every open stream gets its next event
together every TICK_MS milliseconds instead, as the engine's steps deliver them (one wake-up of
the event loop, then one event per stream): benchmarks/http_floor.py.
"""

from __future__ import annotations

import sys

import msgspec
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from quart import Response, request
from quart_trio import QuartTrio

from server.listen import BACKLOG

app = QuartTrio(__name__)
_encode = msgspec.json.Encoder().encode
TICK_S = float(sys.argv[2]) / 1000 if len(sys.argv) > 2 else 0.0
_waiting: list[trio.Event] = []  # the streams waiting for the next tick


@app.before_serving
async def start_ticker() -> None:
    async def ticker() -> None:
        while True:
            await trio.sleep(TICK_S)
            ready = _waiting[:]
            _waiting.clear()
            for ev in ready:
                ev.set()

    if TICK_S:
        app.nursery.start_soon(ticker)


async def next_event() -> None:
    if not TICK_S:
        await trio.sleep(0)
        return
    ev = trio.Event()
    _waiting.append(ev)
    await ev.wait()


@app.get("/health")
async def health() -> str:
    return "ok"


@app.post("/v1/chat/completions")
async def chat() -> Response:
    body = await request.get_json()
    n = int(body.get("max_tokens") or 16)

    async def events():
        for _ in range(n):
            await next_event()
            yield (
                b"data: "
                + _encode(
                    {
                        "id": "chatcmpl-bare",
                        "object": "chat.completion.chunk",
                        "model": body.get("model"),
                        "choices": [
                            {"index": 0, "delta": {"content": " tok"}, "finish_reason": None}
                        ],
                    }
                )
                + b"\n\n"
            )
        usage = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
        yield b"data: " + _encode({"id": "chatcmpl-bare", "choices": [], "usage": usage}) + b"\n\n"
        yield b"data: [DONE]\n\n"

    response = Response(events(), content_type="text/event-stream")
    response.timeout = None
    return response


def main() -> None:
    config = Config()
    config.bind = [f"127.0.0.1:{int(sys.argv[1])}"]
    config.backlog = BACKLOG
    config.accesslog = None
    trio.run(serve, app, config)


if __name__ == "__main__":
    main()
