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
A head is at most limits.MAX_HEAD_BYTES: h11 bounds the part that has not arrived whole, and a
head that arrived whole in one read is measured here (h11 takes any size then).

Bytes that are not HTTP at all (a TLS handshake on the plain port, a port scanner) get the same
JSON 400: a client that speaks no HTTP reads none of it, and one that does gets the API's shape.
"""

from __future__ import annotations

import http
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from . import anthropic, limits
from .errors import APIError

FIRST_LINE_BYTES = 2048  # what is kept of a request's first bytes: its line names the API's error shape


class Connection(H11Protocol):
    """uvicorn's h11 protocol, with the server's answers for what h11 refuses (see the module)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.refusal = None  # the h11 error that ended this connection
        self.first = b""  # the first bytes of the request being read (its line: the error shape)
        self.conn.next_event = self._checked(self.conn.next_event)

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
