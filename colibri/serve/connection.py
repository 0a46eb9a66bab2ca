"""The connections under the app: what a client sends that never reaches a route, answered in the
API's error shape.

Design
------
uvicorn parses HTTP/1.1 with h11 and answers what h11 refuses (a garbage request line, a bad or
doubled Content-Length, a broken chunk, a head over h11's buffer) itself, with a plain-text 400:
the app never sees such a request, so no route can answer it. uvicorn takes its protocol as a
class (its `http` option), and Connection is its h11 protocol with these answers made here: JSON
in OpenAI's error shape, or Anthropic's where the request line names /v1/messages, with
h11's status (400; 431 for a head too large; 501 for a Transfer-Encoding it does not know) and
`Connection: close`, written straight to the socket (h11's state is of no use after its error).
So the server always parses with h11, uvicorn's pure-Python parser, even where httptools (which
uvicorn would pick) is installed: a request's parsing is a small part of its time here.
A head is at most limits.MAX_HEAD_BYTES: h11 bounds the part that has not arrived whole, and a
head that arrived whole in one read is measured here (h11 takes any size then).

Bytes that are not HTTP at all (a TLS handshake on the plain port, a port scanner) get the same
JSON 400: a client that speaks no HTTP reads none of it, and one that does gets the API's shape.

Clients that hold a connection without using it (slowloris) are cut here too; uvicorn has only
its keep-alive timeout, which starts once a response is complete:
- a request's line and headers must arrive whole within limits.HEAD_SECONDS of the connection's
  start or of the previous response's end: else 408 and the connection is closed (a kept-alive
  connection that sent nothing is just closed, as uvicorn's keep-alive timeout closes it sooner);
- a response the client reads nothing of for limits.STALLED_WRITE_SECONDS (the socket's buffers
  full, uvicorn's writes paused) ends the connection: the route sees the client gone, as after a
  disconnect, and frees its place in the engine;
- a connection beyond limits.MAX_CONNECTIONS is answered 503 at once and closed, so idle
  connections cannot take every file descriptor.
The body's deadline is the app's (serve/app.py, read_body): it answers in the route's shape.
"""

from __future__ import annotations

import http
import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from . import anthropic, limits
from .errors import APIError

logger = logging.getLogger("colibri.serve")

FIRST_LINE_BYTES = 2048  # what is kept of a request's first bytes: its line names the API's error shape


class Connection(H11Protocol):
    """uvicorn's h11 protocol, with the server's answers for what h11 refuses (see the module)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.refusal = None  # the h11 error that ended this connection
        self.first = b""  # the first bytes of the request being read (its line: the error shape)
        self.answered = 0  # responses completed on this connection
        self.head_timer = None  # the deadline of the head being read
        self.write_timer = None  # the deadline of a write the client does not take
        self.conn.next_event = self._checked(self.conn.next_event)

    # -- the connection's life: its cap and the deadlines of what the client owes --

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > limits.MAX_CONNECTIONS:
            self.refuse(
                APIError(
                    503,
                    f"the server has {limits.MAX_CONNECTIONS} connections open; retry later",
                    kind="server_error",
                    code="too_many_connections",
                )
            )
            return
        self._arm_head()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        self.answered += 1
        self.first = b""
        if not self.transport.is_closing():
            self._arm_head()  # before uvicorn reads a pipelined request, whose head disarms it
        super().on_response_complete()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.write_timer is None:
            self.write_timer = self.loop.call_later(limits.STALLED_WRITE_SECONDS, self._stalled)

    def resume_writing(self) -> None:
        if self.write_timer is not None:
            self.write_timer.cancel()
            self.write_timer = None
        super().resume_writing()

    def _arm_head(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
        self.head_timer = self.loop.call_later(limits.HEAD_SECONDS, self._head_late)

    def _disarm(self) -> None:
        for timer in (self.head_timer, self.write_timer):
            if timer is not None:
                timer.cancel()
        self.head_timer = self.write_timer = None

    def _head_late(self) -> None:
        self.head_timer = None
        if self.transport.is_closing():
            return
        if self.answered and not self.first:  # kept alive, and no byte of another request came
            self.transport.close()
            return
        self.refuse(
            APIError(
                408,
                f"the request's line and headers did not arrive within {limits.HEAD_SECONDS} s",
                code="request_timeout",
            )
        )

    def _stalled(self) -> None:
        self.write_timer = None
        logger.warning(
            "a client read nothing of its response for %s s: its connection is closed", limits.STALLED_WRITE_SECONDS
        )
        self.transport.abort()  # close() would wait to send what the client does not read

    def _checked(self, next_event):
        """h11's next_event, remembering its error (uvicorn keeps only "invalid request") and
        refusing a head larger than limits.MAX_HEAD_BYTES that arrived whole."""

        def checked():
            try:
                event = next_event()
            except h11.RemoteProtocolError as e:
                self.refusal = e
                raise
            if isinstance(event, h11.Request):
                size = len(event.method) + len(event.target) + sum(len(k) + len(v) + 4 for k, v in event.headers)
                if size > limits.MAX_HEAD_BYTES:
                    self.refusal = h11.RemoteProtocolError("head too large", error_status_hint=431)
                    raise self.refusal
                if self.head_timer is not None:
                    self.head_timer.cancel()
                    self.head_timer = None
                self.first = b""
            return event

        return checked

    def data_received(self, data: bytes) -> None:
        if len(self.first) < FIRST_LINE_BYTES and (self.cycle is None or self.cycle.response_complete):
            self.first += data[: FIRST_LINE_BYTES - len(self.first)]
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        """What uvicorn calls for a request h11 refused: the API's error instead of its text."""
        e = self.refusal
        status = getattr(e, "error_status_hint", 400)
        if status == 431:
            error = APIError(
                431,
                f"the request's line and headers are larger than {limits.MAX_HEAD_BYTES} bytes",
                code="request_header_too_large",
            )
        else:
            reason = str(e).split(":")[0] if e is not None else "not HTTP/1.1"  # h11's words, not the bytes
            error = APIError(status, f"malformed HTTP request: {reason}", code="malformed_request")
        self.refuse(error)  # (uvicorn has logged "Invalid HTTP request received.")

    def refuse(self, error: APIError) -> None:
        """Answer `error` in the shape of the API the request names and close the connection; a
        response already under way (a pipelined request broke mid-body) is just cut."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app's task, if any, sees the client gone
            cycle.message_event.set()
            if cycle.response_started:
                self.transport.close()
                return
        target = self._target()
        doc = anthropic.error_body(error) if target.startswith(b"/v1/messages") else error.body()
        body = json.dumps(doc).encode()
        phrase = _phrase(error.status)
        headers = {"content-type": "application/json", "content-length": str(len(body)), "connection": "close"}
        headers.update({k.lower(): v for k, v in error.headers.items() if k.lower() != "connection"})
        head = f"HTTP/1.1 {error.status} {phrase}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        if not self.transport.is_closing():
            self.transport.write(head.encode("latin-1") + b"\r\n" + body)
            self.transport.close()

    def _target(self) -> bytes:
        """The path the request being read names, or b"" (not HTTP, or not known yet)."""
        if self.cycle is not None and not self.cycle.response_complete:
            return self.cycle.scope["raw_path"]
        parts = self.first.split(b"\r\n", 1)[0].split(b" ")
        return parts[1] if len(parts) >= 2 else b""


def _phrase(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return "Error"
