"""`python -m colibri serve` under abuse, through raw sockets against a real server process (the
bundled demo model): malformed HTTP answered in the API's error shape, clients that trickle or
idle cut off with a clear status while /health answers, and each limit of a request a clear 4xx
that leaves the server serving. What a process cannot show deterministically (a tokenizer that
is still working) is checked against the ASGI app in this process.

No assertion is on a duration: the timeouts are set small for these servers (limits patched before
`python -m colibri` starts), and a test checks only that the cut comes, with its status.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import select
import socket
import threading
import time

import pytest

from colibri.cli import DEMO_DIR

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from test_server import Server, in_process, until_healthy  # noqa: E402

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


# ---- clients that hold a connection without using it (slowloris) ----------------------------------

# deadlines of a second (the defaults are tens of seconds); the byte rate high, so that a body's
# deadline is its first second
STRICT = "HEAD_SECONDS = 1; s.BODY_SECONDS = 1; s.BODY_BYTES_PER_SECOND = 1 << 30; s.IDLE_SECONDS = 1; " + (
    "s.STALLED_WRITE_SECONDS = 1"
)
EVERY = 0.05  # seconds between the bytes of a trickling client


@pytest.fixture(scope="module")
def strict():
    s = Server(DEMO_DIR, patch=STRICT)
    yield s
    code, err = s.stop()
    assert code == 0 and "Traceback" not in err, err


def trickle(server, data: bytes, first: bytes = b"") -> bytes:
    """Send `first`, then `data` a byte every EVERY seconds until the server answers; its whole answer."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT) as s:
        s.sendall(first)
        for i in range(len(data)):
            readable, _, _ = select.select([s], [], [], 0)
            if readable:
                break
            try:
                s.sendall(data[i : i + 1])
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(EVERY)
        else:
            raise AssertionError("the server took the whole trickle")
        out = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := s.recv(65536):
                out += chunk
    return out


def test_connections_that_send_nothing_are_cut_with_408_while_health_answers(strict):
    idle = [socket.create_connection(("127.0.0.1", strict.port), timeout=WAIT) for _ in range(20)]
    try:
        assert healthy(strict)
        for s in idle:
            out = b""
            while chunk := s.recv(65536):
                out += chunk
            assert_openai_error(out, 408, "request_timeout")
    finally:
        for s in idle:
            s.close()


def test_a_head_sent_a_byte_at_a_time_is_cut_with_408_while_health_answers(strict):
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 2000 + b"\r\n\r\n"
        cut = [pool.submit(trickle, strict, head) for _ in range(4)]
        assert healthy(strict)
        for f in cut:
            doc = assert_openai_error(f.result(), 408, "request_timeout")
            assert "line and headers" in doc["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_a_body_sent_a_byte_at_a_time_is_cut_with_408_while_health_answers(strict, path):
    body = json.dumps({"messages": [{"role": "user", "content": "x" * 2000}], "max_tokens": 1}).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        cut = pool.submit(trickle, strict, body, head.encode())
        assert healthy(strict)
        raw = cut.result()
    status, headers, doc = parsed(raw)
    assert status == 408 and headers["connection"] == "close", raw
    if path == "/v1/messages":
        assert doc["type"] == "error" and doc["error"]["type"] == "invalid_request_error", doc
    else:
        assert doc["error"]["code"] == "request_timeout", doc
    assert "did not arrive in time" in json.dumps(doc)


def test_a_kept_alive_connection_that_goes_quiet_is_closed_without_a_word(strict):
    with socket.create_connection(("127.0.0.1", strict.port), timeout=WAIT) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    status, _, doc = parsed(out)  # one answer, then the end (IDLE_SECONDS), no 408 after it
    assert status == 200 and doc == {"status": "ok"}, out


def counted(server, endpoint: str, outcome: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=WAIT).text
    want = f'colibri_requests_total{{endpoint="{endpoint}",outcome="{outcome}"}}'
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(want))


def test_a_client_that_reads_nothing_of_its_stream_is_cut_and_its_place_freed(strict):
    before = counted(strict, "chat", "disconnected")
    body = json.dumps(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 400,
            "n": 4,
            "ignore_eos": True,
            "logprobs": True,
            "top_logprobs": 20,  # some 2 kB a token: far more than the sockets' buffers hold
            "stream": True,
        }
    ).encode()
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
        s.connect(("127.0.0.1", strict.port))
        s.sendall(head + body)
        while counted(strict, "chat", "disconnected") == before:  # it ends: the server cuts it
            assert healthy(strict)
            time.sleep(0.1)
    r = httpx.post(
        strict.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    )
    assert r.status_code == 200, r.text  # the place was freed


def test_connections_beyond_the_cap_are_refused_with_503(tmp_path):
    with Server(DEMO_DIR, patch="MAX_CONNECTIONS = 4") as s:
        held = [socket.create_connection(("127.0.0.1", s.port), timeout=WAIT) for _ in range(4)]
        try:
            doc = assert_openai_error(exchange(s), 503, "too_many_connections")
            assert doc["error"]["type"] == "server_error"
        finally:
            for c in held:
                c.close()
        assert healthy(s)  # the held ones gone, a connection is served again
        code, err = s.stop()
    assert code == 0 and "Traceback" not in err, err


# ---- a request's own work runs off the event loop, in order ---------------------------------------


def demo_model():
    import colibri

    return colibri.load(DEMO_DIR, threads=1)


BIG = "hello world, " * 20000  # a prompt far over the demo's context: a 400 once tokenized


@pytest.mark.parametrize("stage", ["tokenize", "parse", "render"])
def test_health_answers_while_a_request_is_prepared(monkeypatch, stage):
    """The stage blocks until /health has answered: were it on the event loop, /health would
    come after it (the wait gives up after WAIT seconds, and the order says so)."""
    from colibri.serve import app as app_module

    m = demo_model()
    inside, order = threading.Event(), []
    release = threading.Event()

    def held(fn):
        def run(*args, **kwargs):
            if stage != "tokenize" or len(args[0]) > 1000:
                inside.set()
                release.wait(WAIT)
                order.append(stage)
            return fn(*args, **kwargs)

        return run

    if stage == "tokenize":
        m.encode = held(m.encode)
    elif stage == "parse":
        monkeypatch.setattr(app_module, "parse_body", held(app_module.parse_body))
    else:
        monkeypatch.setattr(app_module, "render_json", held(app_module.render_json))
    path, body = ("/tokenize", {"content": BIG}) if stage == "render" else ("/v1/completions", {"prompt": BIG})

    async def check(served, client):
        await until_healthy(client)
        inside.clear()
        order.clear()
        task = asyncio.ensure_future(client.post(path, json=body))
        assert await asyncio.get_running_loop().run_in_executor(None, inside.wait, WAIT)
        r = await client.get("/health")
        order.append("health")
        release.set()
        assert r.status_code == 200
        r = await task
        assert r.status_code == (200 if stage == "render" else 400), r.text

    in_process(lambda: m, check)
    assert order == ["health", stage]


def test_requests_are_prepared_one_at_a_time_in_their_order_of_arrival():
    m = demo_model()
    release, entered, order = threading.Event(), threading.Event(), []
    encode = m.encode

    def slow(text, **kwargs):
        order.append(("in", text[:5]))
        if text.startswith("first"):
            entered.set()
            release.wait(WAIT)
        order.append(("out", text[:5]))
        return encode(text, **kwargs)

    m.encode = slow

    async def check(served, client):
        await until_healthy(client)
        order.clear()
        first = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "first", "max_tokens": 1}))
        assert await asyncio.get_running_loop().run_in_executor(None, entered.wait, WAIT)
        second = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "later", "max_tokens": 1}))
        while served.prep["waiting"] == 0 and not second.done():  # the second has arrived, behind the first
            await asyncio.sleep(0.01)
        assert served.prep == {"running": 1, "waiting": 1}
        release.set()
        assert (await first).status_code == 200 and (await second).status_code == 200

    in_process(lambda: m, check)
    assert order == [("in", "first"), ("out", "first"), ("in", "later"), ("out", "later")]
