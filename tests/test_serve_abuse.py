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
import collections
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


# ---- each limit of a request: a clear 4xx, and the server goes on ---------------------------------

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]
DEMO_CONTEXT = 512  # the demo's max_position_embeddings


def nested_schema(depth: int) -> dict:
    s = {"type": "string"}
    for _ in range(depth):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


def schema_body(schema) -> dict:
    return {
        "messages": HI,
        "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }


def deep_json(depth: int) -> bytes:
    return b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"


def ok_chat(server) -> None:
    r = httpx.post(server.url + CHAT, json={"messages": HI, "max_tokens": 2}, timeout=WAIT)
    assert r.status_code == 200, r.text


LIMITS = {
    # JSON nested past the parser's recursion limit
    "json-depth": (CHAT, deep_json(100_000), 400, "not valid JSON"),
    # a schema nested past llguidance's recursion limit
    "schema-depth": (CHAT, schema_body(nested_schema(100)), 400, "recursion limit"),
    # a schema over constraint.MAX_SPEC_CHARS
    "schema-size": (CHAT, schema_body({"enum": [f"value{i}" for i in range(100_000)]}), 400, "the limit is"),
    # a pattern that backtracks exponentially in a backtracking engine; this vocabulary cannot
    # write a JSON string at all: the constraint says so, a 422
    "catastrophic-pattern": (CHAT, schema_body({"type": "string", "pattern": "^(a|aa)*b$"}), 422, "constraint"),
    "logit-bias-1e5": (
        CHAT,
        {"messages": HI, "max_tokens": 2, "logit_bias": {str(i): 1 for i in range(100_000)}},
        400,
        "logit_bias",
    ),
    "n-over": (CHAT, {"messages": HI, "n": 9}, 400, "'n'"),
    "max-tokens-0": (CHAT, {"messages": HI, "max_tokens": 0}, 400, "max_tokens"),
    "max-tokens-huge": (CHAT, {"messages": HI, "max_tokens": 2**70}, 400, "exceed the context"),
    "max-tokens-context": (CHAT, {"messages": HI, "max_tokens": DEMO_CONTEXT}, 400, "exceed the context"),
    "tools-1000": (
        CHAT,
        {"messages": HI, "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(1000)]},
        400,
        "at most 128",
    ),
    "messages-tools-1000": (
        "/v1/messages",
        {
            "model": "demo",
            "messages": HI,
            "max_tokens": 2,
            "tools": [{"name": f"f{i}", "input_schema": {"type": "object"}} for i in range(1000)],
        },
        400,
        "at most 128",
    ),
    "responses-tools-1000": (
        "/v1/responses",
        {"input": "hi", "tools": [{"type": "function", "name": f"f{i}"} for i in range(1000)]},
        400,
        "at most 128",
    ),
}


@pytest.mark.parametrize("case", list(LIMITS))
def test_each_limit_is_a_clear_4xx_and_the_server_goes_on(demo, case):
    path, body, status, words = LIMITS[case]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(demo.url + path, content=content, headers={"content-type": "application/json"}, timeout=WAIT)
    assert r.status_code == status, r.text
    doc = r.json()
    message = doc["error"]["message"]
    assert words in message, message
    if path == "/v1/messages":
        assert doc["type"] == "error"
    assert healthy(demo)
    ok_chat(demo)


def test_n_and_max_tokens_at_their_bounds_are_served(demo):
    prompt = httpx.post(demo.url + "/tokenize", json={"messages": HI}, timeout=WAIT).json()["count"]
    body = {"messages": HI, "n": 8, "max_tokens": DEMO_CONTEXT - prompt, "ignore_eos": True}
    r = httpx.post(demo.url + CHAT, json=body, timeout=WAIT * 5)
    assert r.status_code == 200, r.text
    doc = r.json()
    assert len(doc["choices"]) == 8 and doc["usage"]["completion_tokens"] == 8 * (DEMO_CONTEXT - prompt)
    bias = {str(i): -1 for i in range(4096)}  # every id of the demo's vocabulary
    r = httpx.post(demo.url + CHAT, json={"messages": HI, "max_tokens": 2, "logit_bias": bias}, timeout=WAIT)
    assert r.status_code == 200, r.text


def test_a_kv_store_directory_that_cannot_be_made_is_one_line_and_the_server_serves():
    with Server(DEMO_DIR, "--kv-store", "/proc/colibri-kv-store") as s:  # /proc takes no directory
        ok_chat(s)
        metrics = httpx.get(s.url + "/metrics", timeout=WAIT).text
        assert "colibri_prefix_store_write_errors 0.0" in metrics
        code, err = s.stop()
    lines = [ln for ln in err.splitlines() if "KV store" in ln]
    assert code == 0 and len(lines) == 1 and "keeps its blocks in RAM only" in lines[0], err


EXPLOSIVE_PATTERNS = [
    "^(a|aa)*b$",  # exponential backtracking in a backtracking engine
    "^(a|b)*a(a|b){40}$",  # a DFA of 2^41 states
    "^(x{1000}){1000}$",  # a million-character string
]


@pytest.mark.parametrize("pattern", EXPLOSIVE_PATTERNS)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_explosive_pattern_is_served_or_refused_never_a_5xx(chat_model_dir, pattern, stream):
    """Compiled under llguidance's limits (a lazy automaton: no backtracking, lexer states and work
    per token bounded); what the constraint cannot do with this model is a 422, or, once a stream
    has started, its last event with the 422's error."""
    import colibri

    body = schema_body({"type": "string", "pattern": pattern})
    body.update(max_tokens=48, temperature=1.0, seed=1, stream=stream)

    async def check(served, client):
        await until_healthy(client)
        r = await client.post(CHAT, json=body)
        assert r.status_code in (200, 422), r.text  # 422: before the first token
        if r.status_code == 422:
            assert r.json()["error"]["code"] == "constraint_failed"
        elif stream:  # after it: the stream's last event
            errors = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {") and "error" in ln]
            assert all(e["error"]["code"] == "constraint_failed" for e in errors), errors
        r = await client.post(CHAT, json={"messages": HI, "max_tokens": 2})
        assert r.status_code == 200, r.text

    in_process(lambda: colibri.load(chat_model_dir, threads=1), check)


@pytest.mark.parametrize("constrained", [True, False])
def test_a_constraint_failing_mid_stream_is_a_422_event_and_other_failures_500(monkeypatch, constrained):
    from colibri.errors import ColibriError
    from colibri.serve import engine

    calls = []

    def step(self):  # one piece of text, then the failure a constraint raises at its next token
        calls.append(1)
        if len(calls) == 1:
            return ("x", None)
        raise ColibriError("the json_schema constraint failed after 1 tokens: step fuel exhausted")

    monkeypatch.setattr(engine.Generation, "step", step)
    body = {"messages": HI, "max_tokens": 8, "stream": True}
    if constrained:
        body["response_format"] = {"type": "json_object"}

    async def check(served, client):
        await until_healthy(client)
        r = await client.post(CHAT, json=body)
        assert r.status_code == 200
        events = [ln[len("data: ") :] for ln in r.text.splitlines() if ln.startswith("data: ")]
        error = json.loads(events[-2])["error"]
        assert events[-1] == "[DONE]"
        assert (error["code"], error["type"]) == (
            ("constraint_failed", "invalid_request_error") if constrained else (None, "server_error")
        )
        counts = (await client.get("/metrics")).text
        assert f'colibri_requests_total{{endpoint="chat",outcome="{422 if constrained else 500}"}} 1.0' in counts

    in_process(demo_model, check)


def requests_counted(metrics: str) -> dict:
    """{(endpoint, outcome): count} of colibri_requests_total."""
    out = {}
    for ln in metrics.splitlines():
        if ln.startswith("colibri_requests_total{"):
            labels, value = ln.rsplit(" ", 1)
            pairs = dict(p.split("=", 1) for p in labels[len("colibri_requests_total{") : -1].split(","))
            out[(pairs["endpoint"].strip('"'), pairs["outcome"].strip('"'))] = float(value)
    return out


def test_every_request_is_counted_once_by_its_outcome():
    sent = [
        ("GET", "/health", None, ("health", "200")),
        ("GET", "/v1/models", None, ("models", "200")),
        ("POST", "/tokenize", {"content": "hi"}, ("tokenize", "200")),
        ("POST", "/detokenize", {"tokens": [5]}, ("detokenize", "200")),
        ("POST", CHAT, {"messages": HI, "max_tokens": 2}, ("chat", "200")),
        ("POST", CHAT, {"messages": HI, "max_tokens": 2, "stream": True}, ("chat", "200")),
        ("POST", CHAT, {"messages": HI, "n": 9}, ("chat", "400")),
        ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}, ("completions", "200")),
        ("POST", "/v1/messages", {"model": "tiny", "messages": HI, "max_tokens": 2}, ("messages", "200")),
        ("POST", "/v1/messages/count_tokens", {"model": "tiny", "messages": HI}, ("count_tokens", "200")),
        ("POST", "/v1/responses", {"input": "hi", "max_output_tokens": 2, "stream": True}, ("responses", "200")),
        ("GET", "/nowhere", None, ("unrouted", "404")),
        ("GET", "/metrics", None, ("metrics", "200")),
    ]

    async def check(served, client):
        await until_healthy(client)
        before = requests_counted((await client.get("/metrics")).text)
        for method, path, body, _ in sent:
            r = await client.request(method, path, json=body)
            assert r.status_code < 500, (path, r.text)
        after = requests_counted((await client.get("/metrics")).text)
        want = collections.Counter(key for *_, key in sent)
        want[("metrics", "200")] += 1  # the scrape that took `before`
        got = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
        assert got == dict(want)

    in_process(demo_model, check)
