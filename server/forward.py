"""Forwarding a request to another API server (--api-server-count N > 1) and passing its answer
back as it comes, a stream included.

What only the API server running a response can answer (its state so far, its live stream, its
cancellation: server/responses/routes.py) is asked of that server on its own Unix socket
(api-N.sock in the supervisor's run directory), over HTTP/1.1 with h11 (Hypercorn's own
parser). The request goes as the client sent it (method, path and query, headers: the API key
too, body) with `X-Weir-Forwarded`, which a server never forwards again.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import h11
import trio
from quart import Response, current_app, request

from server.errors import APIError

FORWARDED = "X-Weir-Forwarded"
# Headers that describe one connection, not the request or response (RFC 9110 7.6.1), and the
# ones each hop sets itself.
HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
    "date",
    "server",
}


def forwarded() -> bool:
    """This request came from another API server: answer it here, whatever it asks."""
    return FORWARDED in request.headers


async def _next_event(conn: h11.Connection, stream: trio.SocketStream):
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(65536))
            continue
        if isinstance(event, h11.InformationalResponse):
            continue
        return event


class Relay:
    """A forwarded answer being passed on, in flight on this server as the request it follows is
    on its own: a drain waits for it (the other server may still be draining that request: a
    follower of a background response had been cut when this server stopped first). It is not
    cut at the drain's deadline, as a background response is not (server/app.py serve): the
    server running what it follows stops that at the same deadline, and its last events
    (response.incomplete) still come through; Hypercorn's graceful timeout bounds the rest."""

    background = True


async def forward(path: str, server: int) -> Response:
    """The current request, answered by API server `server` listening on `path`."""
    body = await request.get_data()
    target = request.path
    if request.query_string:
        target += "?" + request.query_string.decode("latin-1")
    headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP]
    headers += [("Host", "weir"), (FORWARDED, "1"), ("Content-Length", str(len(body)))]
    try:
        stream = await trio.open_unix_socket(path)
    except OSError as e:
        raise APIError(
            503,
            f"API server {server}, which runs this response, cannot be reached: {e}",
            None,
            "service_unavailable",
        ) from None
    conn = h11.Connection(h11.CLIENT)
    try:
        await stream.send_all(
            conn.send(h11.Request(method=request.method, target=target, headers=headers))
            + conn.send(h11.Data(data=body))
            + conn.send(h11.EndOfMessage())
        )
        head = await _next_event(conn, stream)
    except BaseException:
        with trio.CancelScope(shield=True):
            await stream.aclose()
        raise
    if not isinstance(head, h11.Response):
        await stream.aclose()
        raise APIError(502, f"API server {server} sent no answer", None, "bad_gateway")

    st = current_app.weir_state

    async def relay() -> AsyncIterator[bytes]:
        relaying = Relay()
        st.begin(relaying)
        try:
            while True:
                event = await _next_event(conn, stream)
                if isinstance(event, h11.Data):
                    yield bytes(event.data)
                elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                    return
        finally:
            st.end(relaying)
            with trio.CancelScope(shield=True):  # the client left: so does the other server
                await stream.aclose()

    kept = [
        (k.decode("latin-1"), v.decode("latin-1"))
        for k, v in head.headers
        if k.decode("latin-1").lower() not in HOP_BY_HOP
    ]
    out = Response(relay(), status=head.status_code)
    for k, v in kept:
        out.headers[k] = v
    out.headers["X-Weir-Forwarded-To"] = str(server)
    out.timeout = None
    return out
