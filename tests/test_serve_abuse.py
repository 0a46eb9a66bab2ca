"""`python -m colibri serve` under abuse, through raw sockets against a real server process (the
bundled demo model): malformed HTTP answered in the API's error shape, clients that trickle or
idle cut off with a clear status while /health answers, and each limit of a request a clear 4xx
that leaves the server serving. What a process cannot show deterministically (a tokenizer that
is still working) is checked against the ASGI app in this process.

No assertion is on a duration: the timeouts are set small for these servers (limits patched before
`python -m colibri` starts), and a test checks only that the cut comes, with its status.
"""

from __future__ import annotations

import json
import socket

import pytest

from colibri.cli import DEMO_DIR

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from test_server import Server  # noqa: E402

WAIT = 60  # seconds a socket waits for the server's answer (far beyond any timeout set here)


@pytest.fixture(scope="module")
def demo():
    s = Server(DEMO_DIR)
    yield s
    code, err = s.stop()
    assert code == 0 and "Traceback" not in err, err


def exchange(server, data: bytes = b"", parts=(), wait: float = WAIT) -> bytes:
    """Send `data` (then each of `parts`) on a fresh connection; everything the server sends
    until it closes the connection."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=wait) as s:
        try:
            s.sendall(data)
            for part in parts:
                s.sendall(part)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before all was sent: read its answer
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def parsed(raw: bytes) -> tuple:
    """(status, {header: value}, JSON body) of one HTTP/1.1 response."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return status, headers, json.loads(body)


def assert_openai_error(raw: bytes, status: int, code: str) -> dict:
    got, headers, doc = parsed(raw)
    assert got == status, raw
    assert headers["content-type"] == "application/json" and headers["connection"] == "close", headers
    assert set(doc) == {"error"} and set(doc["error"]) == {"message", "type", "param", "code"}, doc
    assert doc["error"]["code"] == code, doc
    return doc


def healthy(server) -> bool:
    return httpx.get(server.url + "/health", timeout=WAIT).json() == {"status": "ok"}


# ---- malformed HTTP: h11 refuses it before the app sees it ----------------------------------------


POST = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"


@pytest.mark.parametrize(
    "data",
    [
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03garbage\r\n\r\n",  # a TLS ClientHello on the plain port
        b"GARBAGE\r\n\r\n",
        POST + b"Content-Length: abc\r\n\r\n{}",
        POST + b"Content-Length: -2\r\n\r\n{}",
        POST + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
        POST + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
        POST + b"Bad Header\r\n\r\n",
    ],
    ids=["tls", "garbage-line", "content-length", "negative-length", "two-lengths", "bad-chunk", "bad-header"],
)
def test_malformed_http_is_a_400_in_openai_shape(demo, data):
    doc = assert_openai_error(exchange(demo, data), 400, "malformed_request")
    assert doc["error"]["message"].startswith("malformed HTTP request")
    assert "garbage" not in doc["error"]["message"]  # h11's words, not the client's bytes
    assert healthy(demo)


def test_malformed_http_on_messages_is_in_anthropics_shape(demo):
    status, headers, doc = parsed(exchange(demo, b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Length: x\r\n\r\n"))
    assert status == 400 and headers["content-type"] == "application/json"
    assert doc["type"] == "error" and doc["error"]["type"] == "invalid_request_error", doc


def test_an_unknown_transfer_encoding_is_501(demo):
    assert_openai_error(exchange(demo, POST + b"Transfer-Encoding: gzip\r\n\r\n"), 501, "malformed_request")


@pytest.mark.parametrize("trickled", [False, True], ids=["whole", "in-pieces"])
def test_a_head_over_the_limit_is_431(demo, trickled):
    from colibri.serve import limits

    big = b"X-Big: " + b"a" * limits.MAX_HEAD_BYTES + b"\r\n"
    if trickled:  # h11's own bound: the head has not arrived whole
        raw = exchange(
            demo, b"GET /health HTTP/1.1\r\nHost: x\r\n", [big[i : i + 4096] for i in range(0, len(big), 4096)]
        )
    else:  # one write: the head arrives whole, measured on arrival
        raw = exchange(demo, b"GET /health HTTP/1.1\r\nHost: x\r\n" + big + b"\r\n")
    assert_openai_error(raw, 431, "request_header_too_large")
    assert healthy(demo)
