"""`python -m benchmarks.serve_one_per_event serve ...`: weir with delta coalescing turned off,
so every engine output becomes its own SSE event even when the client is behind. Only for the
overhead benchmark's A/B; the product always coalesces."""

from __future__ import annotations

import sys
from collections import deque

from core import outputs
from core.request import RequestOutput


class OnePerEventChannel(outputs.RequestChannel):
    """Queues outputs instead of merging them: `get` hands back one per request at a time."""

    __slots__ = ("_queue",)

    def __init__(self, interval: int = 1) -> None:
        super().__init__(interval)
        self._queue: deque[RequestOutput] = deque()

    def put(self, out: RequestOutput) -> None:
        self._queue.append(out)
        self._event.set()

    async def get(self) -> list[RequestOutput]:
        await self._event.wait()
        out = [self._queue.popleft()]
        if not self._queue:
            import trio

            self._event = trio.Event()
        return out


def main() -> int:
    import server.submit

    server.submit.RequestChannel = OnePerEventChannel
    from server.cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
