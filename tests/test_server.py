"""`python -m colibri serve`: OpenAI's shapes over HTTP, checked with raw HTTP (httpx, a raw socket)
and with the official `openai` client against a real server process on a free loopback port;
what a process cannot show deterministically (the model still loading, an unexpected exception,
a chunked body cut at the limit) against the ASGI app in this process.

The model is the chat fixture (qwen3moe_a with a small BPE tokenizer.json and a ChatML template,
conftest.chat_model_dir); answers are compared with Model.generate run in this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

import colibri
from conftest import ENV

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

API_KEY = "sk-test"
STARTUP_SECONDS = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LONG_CTX = ("--n-ctx", "32768")  # room for generations that run far longer than any bound below
LONG = 30000  # max_tokens of a generation a test interrupts (seconds of work)
# `python -m colibri` with a module constant changed first (a server that cancels sooner on SIGTERM)
PATCHED_MAIN = "import sys, colibri.serve.limits as s; s.{}; from colibri.cli import main; sys.exit(main(sys.argv[1:]))"


class Server:
    def __init__(self, model_dir, *extra, patch=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        launcher = ["-m", "colibri"] if patch is None else ["-c", PATCHED_MAIN.format(patch)]
        self.proc = subprocess.Popen(
            [
                sys.executable,
                *launcher,
                "serve",
                "--model-dir",
                str(model_dir),
                "--port",
                str(self.port),
                "--threads",
                "1",
                *extra,
            ],
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.time() + STARTUP_SECONDS
        while time.time() < deadline:
            assert self.proc.poll() is None, self.proc.communicate()
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError("the server did not become healthy")

    def stop(self):
        self.proc.terminate()
        out, err = self.proc.communicate(timeout=60)
        return self.proc.returncode, err

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:  # a test that failed before stopping it
            self.proc.kill()
        self.proc.communicate(timeout=60)

    def queue_depth(self) -> float:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return next(float(ln.split()[1]) for ln in text.splitlines() if ln.startswith("colibri_queue_depth "))


@pytest.fixture(scope="module")
def server(chat_model_dir):
    s = Server(chat_model_dir, "--api-key", API_KEY, "--model-name", "tiny", "--max-queue", "2", *LONG_CTX)
    yield s
    code, err = s.stop()
    assert code == 0 and "Traceback" not in err, err


@pytest.fixture(scope="module")
def local(chat_model_dir):
    return colibri.load(chat_model_dir, threads=1)


AUTH = {"Authorization": f"Bearer {API_KEY}"}
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]


def post(server, path, body, headers=AUTH, timeout=60):
    return httpx.post(server.url + path, json=body, headers=headers, timeout=timeout)


def test_models_and_health(server):
    r = httpx.get(server.url + "/v1/models", headers=AUTH)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny"
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_chat_whole_equals_generate(server, local):
    r = post(
        server,
        "/v1/chat/completions",
        {"model": "tiny", "messages": MESSAGES, "max_tokens": 6, "seed": 3, "temperature": 0.8},
    )
    assert r.status_code == 200, r.text
    doc = r.json()
    ids = local.apply_chat_template(MESSAGES)
    want = list(local.generate(ids, max_new_tokens=6, temperature=0.8, seed=3))
    assert doc["choices"][0]["message"]["content"] == local.tokenizer.decode(want, skip_special_tokens=True)
    assert doc["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": len(want),
        "total_tokens": len(ids) + len(want),
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert doc["choices"][0]["finish_reason"] in ("stop", "length") and doc["object"] == "chat.completion"


def test_chat_streamed_concatenates_to_the_whole(server):
    body = {
        "model": "tiny",
        "messages": MESSAGES,
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[len("data: ") :]) for ln in lines[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert chunks[-1]["usage"]["completion_tokens"] >= 1
    whole = post(server, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 8}).json()
    assert text == whole["choices"][0]["message"]["content"]


def test_completions_and_logprobs(server, local):
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": "the quick", "max_tokens": 4, "logprobs": 2})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    want = list(local.generate(local.encode("the quick"), max_new_tokens=4))
    assert choice["text"] == local.tokenizer.decode(want, skip_special_tokens=True)
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(want) and all(v <= 0 for v in lp["token_logprobs"])
    assert all(len(t) == 2 for t in lp["top_logprobs"])


def test_openai_client(server, local):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5)
    ids = local.apply_chat_template(MESSAGES)
    want = local.tokenizer.decode(list(local.generate(ids, max_new_tokens=5)), skip_special_tokens=True)
    assert out.choices[0].message.content == want
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want
    assert [m.id for m in client.models.list().data] == ["tiny"]


LONG_SYSTEM = " ".join(f"rule {i}: answer in the fewest words that are still correct." for i in range(30))


def _conversation(topic: str) -> list:
    return [{"role": "system", "content": LONG_SYSTEM + " " + topic}, {"role": "user", "content": "hello world"}]


def test_a_conversation_whose_place_was_taken_is_restored_from_the_prefix_store(server, local):
    """One place (--parallel 1) and the default prefix store: a conversation, another one that
    takes the place, then the first one's next turn: its long prefix comes from the store
    (usage.prompt_tokens_details.cached_tokens, /metrics) and its reply is generate()'s."""
    body = {"model": "tiny", "max_tokens": 4}
    first = post(server, "/v1/chat/completions", {**body, "messages": _conversation("first")}).json()
    post(server, "/v1/chat/completions", {**body, "messages": _conversation("an entirely different topic")})
    turn = _conversation("first") + [
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "and then?"},
    ]
    r = post(server, "/v1/chat/completions", {**body, "messages": turn})
    assert r.status_code == 200, r.text
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    ids = local.apply_chat_template(turn)
    assert cached >= 64 and cached <= len(ids) - 1
    want = local.tokenizer.decode(
        list(local.generate(ids, max_new_tokens=4, reuse_prefix=False)), skip_special_tokens=True
    )
    assert r.json()["choices"][0]["message"]["content"] == want
    metrics = httpx.get(server.url + "/metrics").text
    hits = next(
        float(ln.split()[1])
        for ln in metrics.splitlines()
        if ln.startswith('colibri_prefix_store_lookups{result="hit"}')
    )
    assert hits >= 1


def test_the_kv_store_survives_a_restart(chat_model_dir, tmp_path):
    """--kv-store DIR: a prompt served before a restart is restored after it (the official client
    reads cached_tokens)."""
    openai = pytest.importorskip("openai")
    messages = _conversation("restart")
    for round_ in range(2):
        with Server(chat_model_dir, "--kv-store", str(tmp_path / "store")) as s:
            client = openai.OpenAI(base_url=s.url + "/v1", api_key="none")
            out = client.chat.completions.create(model=chat_model_dir.name, messages=messages, max_tokens=2)
            cached = out.usage.prompt_tokens_details.cached_tokens
            code, err = s.stop()
            assert code == 0 and "Traceback" not in err, err
        # after the restart: the prompt's full blocks, short of its last token (whose logits are needed)
        assert cached == (0 if round_ == 0 else (out.usage.prompt_tokens - 1) // 64 * 64)


def test_predicted_outputs_give_the_same_reply_and_count_the_accepted_tokens(server, local):
    """OpenAI's `prediction` (the official client): the reply is the one without it; the predicted
    tokens the reply kept are counted in usage.completion_tokens_details."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=24, extra_body={"draft": "none"})
    text = plain.choices[0].message.content
    out = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=24, prediction={"type": "content", "content": text}
    )
    assert out.choices[0].message.content == text
    details = out.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens >= 0
    ids = local.apply_chat_template(MESSAGES)
    want = local.tokenizer.decode(list(local.generate(ids, 24, draft="none")), skip_special_tokens=True)
    assert text == want


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"model": "tiny", "messages": "hi"}, 400, "messages"),
        ({"model": "other", "messages": MESSAGES}, 404, "model"),
        ({"model": "tiny", "messages": MESSAGES, "max_tokens": 10**6}, 400, "max_tokens"),
        ({"model": "tiny", "messages": MESSAGES, "temperature": "hot"}, 400, "temperature"),
        ({"model": "tiny", "messages": MESSAGES, "n": 9}, 400, "n"),
        ({"model": "tiny", "messages": MESSAGES, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({"model": "tiny", "messages": [{"role": "user", "content": 3}]}, 400, "messages"),
        ({"model": "tiny", "messages": [{"content": "no role"}]}, 400, "messages"),
        ({"model": ["tiny"], "messages": MESSAGES}, 400, "model"),
        # a penalty that would overflow the logits (a 500 mid-generation) is refused up front
        ({"model": "tiny", "messages": MESSAGES, "repetition_penalty": 1e-300}, 400, "repetition_penalty"),
        ({"model": "tiny", "messages": MESSAGES, "tools": "not a list"}, 400, "tools"),
        # a template with no reasoning setting cannot honour reasoning_effort: refused, not ignored
        ({"model": "tiny", "messages": MESSAGES, "reasoning_effort": "low"}, 400, "reasoning_effort"),
        # a template keyword that is the request's own field is refused, not passed twice (a TypeError, a 500)
        (
            {"model": "tiny", "messages": MESSAGES, "chat_template_kwargs": {"messages": []}},
            400,
            "chat_template_kwargs",
        ),
        (
            {"model": "tiny", "messages": MESSAGES, "chat_template_kwargs": {"tokenize": False}},
            400,
            "chat_template_kwargs",
        ),
    ],
)
def test_bad_requests_are_openai_errors(server, body, status, param):
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and (param is None or err["param"] == param)


def test_bad_json_is_400(server):
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{not json", headers=AUTH)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": ""},
        {"Authorization": "Bearer"},
        {"Authorization": "Bearer no"},
        {"Authorization": f"Basic {API_KEY}"},
        {"Authorization": f"Bearer {API_KEY[:-1]}"},
        {"Authorization": f"Bearer {API_KEY}x"},
        {"Authorization": f"Bearer{API_KEY}"},
        {"Authorization": "Bearer sk-t\u00e9st".encode("utf-8")},
    ],
    ids=["missing", "empty", "no-token", "wrong", "basic", "prefix", "longer", "no-space", "non-ascii"],
)
def test_a_missing_or_wrong_key_is_401(server, headers):
    for path in ("/v1/chat/completions", "/v1/models"):
        r = (
            httpx.get(server.url + path, headers=headers)
            if path == "/v1/models"
            else post(server, path, {"model": "tiny", "messages": MESSAGES, "max_tokens": 1}, headers=headers)
        )
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["type"] == "authentication_error" and r.json()["error"]["code"] == "invalid_api_key"


def test_the_key_scheme_is_case_insensitive(server):
    r = post(
        server,
        "/v1/completions",
        {"model": "tiny", "prompt": "hi", "max_tokens": 1},
        headers={"Authorization": f"bearer  {API_KEY}"},
    )
    assert r.status_code == 200, r.text


def test_the_key_is_compared_in_constant_time(chat_model_dir, monkeypatch):
    import hmac

    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)

    async def check(served, client):
        ok = await client.get("/v1/models", headers=AUTH)
        bad = await client.get("/v1/models", headers={"Authorization": "Bearer sk-tesT"})
        return ok.status_code, bad.status_code

    assert in_process(lambda: None, check) == (200, 401)
    ours = [c for c in calls if c[1] == API_KEY.encode()]
    assert ours == [(API_KEY.encode(), API_KEY.encode()), (b"sk-tesT", API_KEY.encode())]


def test_errors_of_routing_are_openai_errors_too(server):
    r = httpx.get(server.url + "/v1/nothing-here", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["message"]
    r = httpx.get(server.url + "/v1/chat/completions", headers=AUTH)
    assert r.status_code == 405 and r.json()["error"]["message"]


def test_prompt_ids_outside_the_vocabulary_are_422(server):
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": [1, 2, 10**6], "max_tokens": 1})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and err["code"] == "token_out_of_vocabulary" and "1000000" in err["message"]


def test_a_body_over_the_limit_is_413_by_its_content_length_before_it_is_read(server):
    from colibri.serve.limits import MAX_BODY_BYTES

    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {MAX_BODY_BYTES + 1}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as sock:
        sock.sendall(head.encode())  # and no body: a server that waited for it would time out here
        data = b""
        while chunk := sock.recv(65536):  # the server answers, then closes the connection
            data += chunk
    status, _, rest = data.partition(b"\r\n")
    headers, _, body = rest.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 413"), data[:200]
    assert b"connection: close" in headers.lower()
    assert json.loads(body)["error"]["code"] == "request_too_large"


def test_metrics_parse_as_prometheus_text(server):
    from prometheus_client.parser import text_string_to_metric_families

    post(server, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 2})
    text = httpx.get(server.url + "/metrics").text
    names = {f.name for f in text_string_to_metric_families(text)}
    for needed in (
        "colibri_requests",
        "colibri_queue_depth",
        "colibri_running_requests",
        "colibri_time_to_first_token_seconds",
        "colibri_generated_tokens",
        "colibri_prefix_reuse_hits",
        "colibri_resident_expert_bytes",
        "colibri_expert_cache_uses",
        "colibri_storage_read_bytes",
        "colibri_expert_budget_bytes",
    ):
        assert needed in names, names


def test_concurrent_clients_get_their_own_answers(server, local):
    prompts = ["hello world", "the quick brown fox", "mixture of experts", "unto the LORD"]
    want = {
        p: local.tokenizer.decode(list(local.generate(local.encode(p), max_new_tokens=5)), skip_special_tokens=True)
        for p in prompts
    }
    got, errors = {}, []

    def ask(p):
        try:
            for _ in range(20):  # a full queue (max 2 waiting) says 503: retry as a client would
                r = post(server, "/v1/completions", {"model": "tiny", "prompt": p, "max_tokens": 5})
                if r.status_code != 503:
                    break
                assert r.headers["retry-after"]
                time.sleep(0.05)
            got[p] = r.json()["choices"][0]["text"]
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and got == want


ONE = {"prompt": "hello", "max_tokens": 1}
ENGINE_FREED_SECONDS = 0.1  # the issue: the next request starts within 100 ms plus one token


def best_seconds(fn, tries=5) -> float:
    best = float("inf")
    for _ in range(tries):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def engine_timings(server):
    """(seconds of a lone one-token request, seconds per generated token) of this server's model."""

    def ask(n):
        r = post(server, "/v1/completions", {**ONE, "max_tokens": n, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == n, r.text

    alone = best_seconds(lambda: ask(1))
    per_token = max(0.0, (best_seconds(lambda: ask(65)) - alone) / 64)
    return alone, per_token


def freed_after(server, drop) -> float:
    """How much longer than alone the one-token request takes right after `drop()` hung up on a
    generation of LONG tokens: the best of three tries (the machine is shared; a generation that
    were not stopped would hold the engine for seconds every time)."""
    alone, _ = server.timings
    best = float("inf")
    for _ in range(3):
        drop()
        t = time.perf_counter()
        r = post(server, "/v1/completions", ONE, timeout=10)
        assert r.status_code == 200, r.text
        best = min(best, time.perf_counter() - t - alone)
    return best


@pytest.fixture(scope="module")
def timed(server):
    server.timings = engine_timings(server)
    return server


def test_a_dropped_stream_frees_the_engine_within_one_token(timed):
    def drop():
        body = {"model": "tiny", "prompt": "the quick", "max_tokens": LONG, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", timed.url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
            for _ in r.iter_lines():
                break  # read one line, then hang up

    late = freed_after(timed, drop)
    assert late < ENGINE_FREED_SECONDS + timed.timings[1], (late, timed.timings)


def test_a_dropped_whole_request_frees_the_engine_within_one_token(timed):
    def drop():
        body = {"model": "tiny", "prompt": "the quick", "max_tokens": LONG, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            post(timed, "/v1/completions", body, timeout=0.3)  # gives up, closing the connection

    late = freed_after(timed, drop)
    assert late < ENGINE_FREED_SECONDS + timed.timings[1], (late, timed.timings)


@contextlib.contextmanager
def engine_held(server):
    """A stream that holds the engine until the block ends (it hangs up): big chunks (20
    alternatives a token) that the client does not read fill the socket buffers, and the server
    waits on them. Yields the stream's remaining lines."""
    body = {
        "messages": MESSAGES,
        "max_tokens": LONG,
        "stream": True,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 20,
    }
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        next(lines)  # the engine is this request's
        yield lines


def assert_503(r, code):
    assert r.status_code == 503, r.text
    assert int(r.headers["retry-after"]) >= 1
    assert set(r.json()["error"]) == {"message", "type", "param", "code"} and r.json()["error"]["code"] == code


def test_a_full_queue_and_a_long_wait_answer_503_with_retry_after(chat_model_dir):
    wait = 2.0
    with Server(chat_model_dir, "--max-queue", "1", "--queue-timeout", str(wait), *LONG_CTX) as s:
        with engine_held(s):
            # a client that gives up while it waits leaves the queue then, not at the queue timeout
            t = time.perf_counter()
            with pytest.raises(httpx.ReadTimeout):
                post(s, "/v1/completions", ONE, timeout=0.3)
            while s.queue_depth() != 0:
                assert time.perf_counter() - t < wait - 0.2
                time.sleep(0.01)
            waited = {}

            def wait_in_queue():
                t = time.perf_counter()
                waited["r"] = post(s, "/v1/completions", ONE)
                waited["s"] = time.perf_counter() - t

            waiter = threading.Thread(target=wait_in_queue)
            waiter.start()
            deadline = time.time() + 10
            while s.queue_depth() != 1:  # the queue's one place is taken
                assert time.time() < deadline and waiter.is_alive()
                time.sleep(0.01)
            assert_503(post(s, "/v1/completions", ONE), "queue_full")
            waiter.join(30)
            assert_503(waited["r"], "queue_timeout")
            assert wait - 0.1 <= waited["s"] < wait + 8, waited["s"]
        r = post(s, "/v1/completions", ONE)  # hung up: the engine is free again
        assert r.status_code == 200 and s.queue_depth() == 0, r.text
        code, err = s.stop()
    assert code == 0 and "Traceback" not in err, err


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])  # SIGHUP: no configuration to reload, a stop
def test_sigterm_lets_the_running_stream_finish_and_exits_0(chat_model_dir, sig):
    n = 2000
    body = {
        "messages": MESSAGES,
        "max_tokens": n,
        "stream": True,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 20,
        "stream_options": {"include_usage": True},
    }
    with Server(chat_model_dir, *LONG_CTX) as s:
        with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)
            s.proc.send_signal(getattr(signal, sig))  # mid-generation: the client has read one line of thousands
            time.sleep(0.5)
            with pytest.raises(httpx.ConnectError):  # no longer accepting
                httpx.get(s.url + "/health", timeout=5)
            rest = [ln for ln in lines if ln]
        assert s.proc.wait(60) == 0
        err = s.proc.stderr.read()
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][len("data: ") :])["usage"]["completion_tokens"] == n
    assert "Traceback" not in err, err


def test_sigterm_cancels_a_stream_that_outlasts_the_grace_and_exits_0(chat_model_dir):
    with Server(chat_model_dir, *LONG_CTX, patch="GRACEFUL_SHUTDOWN_SECONDS = 1") as s:
        with engine_held(s) as lines:  # not read: it cannot finish
            s.proc.send_signal(signal.SIGTERM)
            assert s.proc.wait(30) == 0  # the grace (1 s) passed: the stream was cancelled
            rest = []
            with contextlib.suppress(httpx.TransportError):
                rest.extend(ln for ln in lines if ln)  # what the buffers held, then the connection ends
        err = s.proc.stderr.read()
    assert rest and "data: [DONE]" not in rest
    assert "Traceback" not in err and "cancelled (the server is stopping)" in err, err


# ---- the ASGI app in this process ---------------------------------------------------------------------


def in_process(load, check, **options):
    """`await check(served, client)` against create_app(Served(load, ...)) through httpx's ASGI
    transport (no lifespan: the load starts here, in the background, as the lifespan starts it)."""
    from colibri.serve import Served, create_app

    served = Served(
        load,
        "tiny",
        options.pop("api_key", API_KEY),
        options.pop("max_queue", 2),
        options.pop("queue_timeout", 30.0),
        options.pop("parallel", 1),
    )
    app = create_app(served)

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", headers=AUTH, timeout=60) as client:
            return await check(served, client)

    served.start_loading()
    try:
        return asyncio.run(main())
    finally:
        served.executor.shutdown(wait=True)
        if served.stepper is not None:
            served.stepper.stop()


async def until_healthy(client, seconds=30):
    deadline = time.time() + seconds
    while (r := await client.get("/health")).status_code == 503:
        assert time.time() < deadline
        await asyncio.sleep(0.01)
    return r


def test_health_is_503_while_the_model_loads_then_200(chat_model_dir):
    gate = threading.Event()

    def slow_load():
        assert gate.wait(30)
        return colibri.load(chat_model_dir, threads=1)

    async def check(served, client):
        r = await client.get("/health")
        assert r.status_code == 503 and r.json() == {"status": "loading"} and r.headers["retry-after"]
        r = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1})
        assert r.status_code == 503 and r.json()["error"]["code"] == "loading" and r.headers["retry-after"]
        gate.set()
        r = await until_healthy(client)
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        r = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1})
        assert r.status_code == 200, r.text

    in_process(slow_load, check)


def test_a_model_that_failed_to_load_is_500(chat_model_dir):
    from colibri.errors import ColibriError

    def broken():
        raise ColibriError("no tokenizer here")

    async def check(served, client):
        r = await until_healthy(client)
        assert r.status_code == 500 and r.json()["status"] == "error" and "no tokenizer" in r.json()["error"]
        r = await client.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 500 and "no tokenizer" in r.json()["error"]["message"]

    in_process(broken, check)


def test_a_conversation_the_template_refuses_is_422(chat_model_dir):
    from colibri.chat import ChatTemplate

    def load():
        m = colibri.load(chat_model_dir, threads=1)
        m.chat_template = ChatTemplate(
            "{% if messages[0]['role'] == 'system' %}{{ raise_exception("
            "'System role not supported') }}{% endif %}{{ messages[0]['content'] }}",
            "test template",
        )
        return m

    async def check(served, client):
        await until_healthy(client)
        r = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1})
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["code"] == "chat_template_error" and "System role not supported" in err["message"]
        r = await client.post("/v1/chat/completions", json={"messages": MESSAGES[1:], "max_tokens": 1})
        assert r.status_code == 200, r.text

    in_process(load, check)


def test_an_unexpected_exception_is_a_500_in_openai_shape_and_frees_the_engine(chat_model_dir, monkeypatch, caplog):
    from colibri.serve import engine as srv

    real_start, real_step = srv.Generation.start, srv.Generation.step
    broken = {"start": 0, "step": 0}

    def start(self):
        if broken["start"]:
            broken["start"] -= 1
            raise RuntimeError("secret detail of the start")
        real_start(self)

    def step(self):
        if broken["step"] and self.record.tokens:  # after the first token
            broken["step"] -= 1
            raise KeyError("secret detail of a step")
        return real_step(self)

    monkeypatch.setattr(srv.Generation, "start", start)
    monkeypatch.setattr(srv.Generation, "step", step)
    body = {"messages": MESSAGES, "max_tokens": 4, "ignore_eos": True}

    async def check(served, client):
        await until_healthy(client)
        for where in ("start", "step"):
            broken[where] = 1
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status_code == 500, r.text
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
            assert r.json()["error"]["type"] == "server_error" and "secret" not in r.text and "Traceback" not in r.text
            r = await client.post("/v1/chat/completions", json=body)  # the engine was released
            assert r.status_code == 200, r.text
        broken["step"] = 1
        r = await client.post("/v1/chat/completions", json={**body, "stream": True})
        assert r.status_code == 200
        events = [ln[len("data: ") :] for ln in r.text.splitlines() if ln]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "server_error"
        assert "secret" not in r.text
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and served.active == 0, r.text

    with caplog.at_level(logging.ERROR, logger="colibri.serve"):
        in_process(lambda: colibri.load(chat_model_dir, threads=1), check, queue_timeout=5.0)
    logged = [rec for rec in caplog.records if rec.name == "colibri.serve"]
    assert len(logged) == 3 and all(rec.exc_info for rec in logged)  # the tracebacks stay on the server
    assert "secret detail of the start" in caplog.text


def test_a_chunked_body_over_the_limit_is_413_and_read_no_further(monkeypatch):
    from colibri.serve import limits

    monkeypatch.setattr(limits, "MAX_BODY_BYTES", 1000)
    sent = []

    async def endless():  # 100 times the limit, were it all read
        for _ in range(1000):
            sent.append(100)
            yield b" " * 100

    async def check(served, client):
        r = await client.post("/v1/completions", content=endless())  # no Content-Length: chunked
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
        r = await client.post("/v1/completions", content=b" " * 1001, headers={**AUTH})
        assert r.status_code == 413

    in_process(lambda: None, check)
    assert 1000 < sum(sent) <= 1100  # it stopped at the first piece past the limit


@pytest.mark.parametrize("module", ["fastapi", "uvicorn", "prometheus_client"])
def test_serve_without_the_extra_says_how_to_install_it(chat_model_dir, monkeypatch, capsys, module):
    from colibri import cli

    monkeypatch.setitem(sys.modules, module, None)  # `import module` fails as if not installed
    assert cli.main(["serve", "--model-dir", str(chat_model_dir)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and 'pip install "colibri-moe[serve]"' in err and module in err, err


def test_an_empty_api_key_is_refused(chat_model_dir, capsys):
    from colibri import cli

    assert cli.main(["serve", "--model-dir", str(chat_model_dir), "--api-key", " "]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "--api-key" in err, err


def test_serve_without_the_model_dir_is_one_line(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "colibri", "serve", "--model-dir", str(tmp_path / "none")],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and "none" in r.stderr


# ---- --parallel N: requests decoded together ------------------------------------------------------

PARALLEL = 3


@pytest.fixture(scope="module")
def parallel_server(chat_model_dir):
    s = Server(
        chat_model_dir,
        "--api-key",
        API_KEY,
        "--model-name",
        "tiny",
        "--max-queue",
        "8",
        "--parallel",
        str(PARALLEL),
        "--step-tokens",
        "4",
        *LONG_CTX,
    )  # prompts run in pieces
    yield s
    code, err = s.stop()
    assert code == 0 and "Traceback" not in err, err


def test_a_parallel_server_verifies_each_requests_drafts(parallel_server, local):
    """With --parallel, each request drafts for itself (its prediction, n-gram lookups): the
    replies are generate()'s alone, the prediction's tokens counted."""
    ids = local.apply_chat_template(MESSAGES)
    want = local.tokenizer.decode(list(local.generate(ids, 24, draft="none", temperature=0)), skip_special_tokens=True)
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 24, "temperature": 0}
    for extra in ({"prediction": {"type": "content", "content": want}}, {"draft": "ngram"}, {"draft": "none"}):
        r = post(parallel_server, "/v1/chat/completions", {**body, **extra})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want, r.text
        if "prediction" in extra:
            assert r.json()["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0


def _ask_all(server, bodies, path="/v1/completions"):
    """Every body posted at once from its own thread: [response json] in the bodies' order."""
    got, errors = [None] * len(bodies), []

    def ask(i):
        try:
            if bodies[i].get("stream"):
                with httpx.stream("POST", server.url + path, json=bodies[i], headers=AUTH, timeout=120) as r:
                    assert r.status_code == 200
                    lines = [ln for ln in r.iter_lines() if ln]
                chunks = [json.loads(ln[len("data: ") :]) for ln in lines[:-1]]
                got[i] = "".join(
                    c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content", "")
                    for c in chunks
                    if c["choices"]
                )
            else:
                r = post(server, path, bodies[i], timeout=120)
                assert r.status_code == 200, r.text
                got[i] = r.json()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors
    return got


def test_parallel_requests_get_what_each_gets_alone(parallel_server, local):
    """More requests than places, with different prompts, lengths and sampling, some streamed:
    each answer (text, logprobs, usage, finish reason) is the one generate() gives alone."""
    prompts = ["hello world", "the quick brown fox", "mixture of experts", "unto the LORD", "a b c", "zebra"]
    bodies = [
        {
            "model": "tiny",
            "prompt": p,
            "max_tokens": 3 + 2 * i,
            "seed": i,
            "temperature": 0.5 * (i % 3),
            "logprobs": 2 if i % 2 else None,
            "stream": i == 4,
        }
        for i, p in enumerate(prompts)
    ]
    got = _ask_all(parallel_server, bodies)
    for body, answer in zip(bodies, got):
        ids = local.encode(body["prompt"])
        want = list(
            local.generate(
                ids,
                max_new_tokens=body["max_tokens"],
                seed=body["seed"],
                temperature=body["temperature"],
                logprobs=body["logprobs"],
            )
        )
        text = local.tokenizer.decode(want, skip_special_tokens=True)
        if body["stream"]:
            assert answer == text
            continue
        choice = answer["choices"][0]
        assert choice["text"] == text and answer["usage"]["completion_tokens"] == len(want)
        assert choice["finish_reason"] == local.last_generation.finish_reason
        if body["logprobs"]:
            assert choice["logprobs"]["token_logprobs"] == [p.logprob for p in local.last_generation.picks]


def test_parallel_chat_and_stop_strings(parallel_server, local):
    ids = local.apply_chat_template(MESSAGES)
    full = local.tokenizer.decode(list(local.generate(ids, max_new_tokens=12)), skip_special_tokens=True)
    stop = full[4:6] if len(full) >= 6 else "zz"
    want = "".join(local.stream(ids, 12, stop=stop))
    bodies = [
        {"model": "tiny", "messages": MESSAGES, "max_tokens": 12, "stop": stop, "stream": s} for s in (False, True)
    ]
    whole, streamed = _ask_all(parallel_server, bodies, "/v1/chat/completions")
    assert whole["choices"][0]["message"]["content"] == want == streamed


def test_a_dropped_parallel_stream_frees_its_place(parallel_server):
    """PARALLEL streams that hang up after one line: none keeps its place, so PARALLEL more
    requests all run (with a place held by a dropped stream they would queue behind a generation
    of LONG tokens, past the timeout)."""

    def drop():
        body = {"model": "tiny", "prompt": "the quick", "max_tokens": LONG, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", parallel_server.url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
            for _ in r.iter_lines():
                break

    for _ in range(2):
        threads = [threading.Thread(target=drop) for _ in range(PARALLEL)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        got = _ask_all(parallel_server, [{"model": "tiny", "prompt": "hi", "max_tokens": 2}] * PARALLEL)
        assert all(g["usage"]["completion_tokens"] == 2 for g in got)


def _gauge(server, name) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return next(float(ln.split()[1]) for ln in text.splitlines() if ln.startswith(name + " "))


def test_running_requests_are_a_gauge(parallel_server):
    body = {"model": "tiny", "prompt": "the quick", "max_tokens": LONG, "stream": True, "ignore_eos": True}
    with contextlib.ExitStack() as stack:
        lines = []  # kept: a dropped line iterator closes its stream
        for _ in range(2):
            r = stack.enter_context(
                httpx.stream("POST", parallel_server.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
            )
            lines.append(r.iter_lines())
            assert r.status_code == 200, next(lines[-1])
        assert _gauge(parallel_server, "colibri_running_requests") == 2
    deadline = time.time() + 30
    while _gauge(parallel_server, "colibri_running_requests") != 0:
        assert time.time() < deadline
        time.sleep(0.05)


def test_a_failing_batch_step_is_a_500_for_its_requests_and_the_next_ones_run(chat_model_dir, monkeypatch, caplog):
    from colibri import batching

    real_step = batching.Batch.step
    broken = {"n": 0}

    def step(self):
        if broken["n"] and any(s.record.tokens for s in self.running):
            broken["n"] -= 1
            raise KeyError("secret detail of a step")
        return real_step(self)

    monkeypatch.setattr(batching.Batch, "step", step)
    body = {"messages": MESSAGES, "max_tokens": 4, "ignore_eos": True}

    async def check(served, client):
        await until_healthy(client)
        broken["n"] = 1
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 500 and "secret" not in r.text, r.text
        rs = await asyncio.gather(*[client.post("/v1/chat/completions", json=body) for _ in range(4)])
        assert all(r.status_code == 200 for r in rs) and served.active == 0
        r = await client.post("/v1/chat/completions", json={**body, "max_tokens": 10**6})
        assert r.status_code == 400

    with caplog.at_level(logging.ERROR, logger="colibri.serve"):
        in_process(lambda: colibri.load(chat_model_dir, threads=1, parallel=2), check, parallel=2, max_queue=4)


@pytest.mark.parametrize("value, message", [("0", "--parallel"), ("65", "--parallel must be in 1..64")])
def test_a_bad_parallel_is_one_line(chat_model_dir, value, message):
    r = subprocess.run(
        [sys.executable, "-m", "colibri", "serve", "--model-dir", str(chat_model_dir), "--parallel", value],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_failed_batch_thread_answers_500_instead_of_hanging(chat_model_dir, monkeypatch, caplog):
    """A bug in the Batch's engine thread outside a step ends it: the requests it held and every
    later one get a 500 at once (none waits forever on a thread that is gone)."""
    from colibri.serve import engine as srv

    def broken(self):
        raise RuntimeError("secret detail of the thread")

    monkeypatch.setattr(srv.Stepper, "_step", broken)
    body = {"messages": MESSAGES, "max_tokens": 4}

    async def check(served, client):
        await until_healthy(client)
        rs = await asyncio.wait_for(
            asyncio.gather(*[client.post("/v1/chat/completions", json=body) for _ in range(3)]), 60
        )
        assert all(r.status_code == 500 and "secret" not in r.text for r in rs), [r.text for r in rs]
        r = await asyncio.wait_for(client.post("/v1/chat/completions", json=body), 60)
        assert r.status_code == 500 and served.active == 0
        r = await client.get("/health")
        assert r.status_code == 500 and r.json()["status"] == "error"  # an orchestrator restarts it

    with caplog.at_level(logging.ERROR, logger="colibri.serve"):
        in_process(lambda: colibri.load(chat_model_dir, threads=1, parallel=2), check, parallel=2, max_queue=4)
    assert "secret detail of the thread" in caplog.text


def test_one_requests_failing_sampler_is_its_500_alone(chat_model_dir, monkeypatch):
    from colibri import batching

    real = batching.Sequence._take

    def take(self, logits):
        if self.max_new_tokens == 7 and self.record.tokens:
            raise colibri.ColibriError("the sampler failed")
        return real(self, logits)

    monkeypatch.setattr(batching.Sequence, "_take", take)

    async def check(served, client):
        await until_healthy(client)
        rs = await asyncio.gather(
            *[
                client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": n, "ignore_eos": True})
                for n in (4, 7, 5)
            ]
        )
        assert [r.status_code for r in rs] == [200, 500, 200], [r.text for r in rs]
        assert "the sampler failed" in rs[1].json()["error"]["message"] and served.active == 0

    in_process(lambda: colibri.load(chat_model_dir, threads=1, parallel=3), check, parallel=3, max_queue=4)


def test_a_model_with_fewer_places_than_the_server_is_a_load_error(chat_model_dir):
    async def check(served, client):
        r = await until_healthy(client)
        assert r.status_code == 500 and "loaded with parallel=1" in r.json()["error"], r.text

    in_process(lambda: colibri.load(chat_model_dir, threads=1), check, parallel=2)


def test_parallel_under_an_expert_budget_warns_once(chat_model_dir, caplog):
    """A budget below the experts' bytes: one warning naming --parallel and the budget; none with
    a budget that holds every expert."""

    def check(budget_mb):
        async def check(served, client):
            assert (await until_healthy(client)).status_code == 200

        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="colibri.serve"):
            in_process(
                lambda: colibri.load(chat_model_dir, threads=1, parallel=2, expert_cache_mb=budget_mb),
                check,
                parallel=2,
            )
        return [r.getMessage() for r in caplog.records if "expert budget" in r.getMessage()]

    with colibri.load(chat_model_dir, threads=1) as m:
        experts_mb = m.residency.expert_bytes / (1 << 20)
    warned = check(experts_mb / 2)
    assert len(warned) == 1 and "--parallel 2" in warned[0] and "colibri_expert_cache_uses" in warned[0], warned
    assert check(experts_mb * 2) == []


def test_step_tokens_without_parallel_is_one_line(chat_model_dir):
    r = subprocess.run(
        [sys.executable, "-m", "colibri", "serve", "--model-dir", str(chat_model_dir), "--step-tokens", "8"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and "--step-tokens" in r.stderr and "--parallel" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
