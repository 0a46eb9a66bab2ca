"""Schema-driven fuzzing of every HTTP operation of /openapi.json with schemathesis (stateless):
requests generated from the documented request bodies (its examples, fuzzing and coverage phases;
valid bodies and, in the negative mode, invalid ones) sent to a real `python -m colibri serve`
process on a free loopback port (the chat fixture, conftest.chat_model_dir, with a small --n-ctx so
that any max_tokens stays cheap). Half of the valid bodies are given the served model's name (the
fuzzer cannot guess it; /v1/messages requires one), the other half keep theirs (a 404).

Checks: no 5xx (not_a_server_error), every schema-invalid body refused (negative_data_rejection),
routing's 405 with its Allow header (unsupported_method, allow_header_conformance), the documented
response schemas and headers (response_schema_conformance, response_headers_conformance), and
ours: every 4xx body in the API's error shape, OpenAI's {"error": {"message", "type", "param",
"code"}} and Anthropic's {"type": "error", "error": {"type", "message"}} on /v1/messages*
(error_shape); a 200 in its media type, a stream's events JSON with no error event and, on
OpenAI's routes, `data: [DONE]` last (answer_shape).

Off: the app documents each 200 as application/json with an empty schema ({}) and documents no
error status, so status_code_conformance would flag every documented refusal (a 400 for an
unsupported field, a 404 for another model's name, a 405) and content_type_conformance every
stream and /metrics: answer_shape and error_shape stand in for them.

The budget is bounded and reproducible for CI: MAX_EXAMPLES per operation in the fuzzing phase
(the coverage phase adds its own boundary cases), derandomize=True (the same requests on every
run), no example database. A longer run sets COLIBRI_FUZZ_EXAMPLES (e.g. 500) and, for other
requests than CI's, COLIBRI_FUZZ_SEED (random draws from that seed instead of derandomize).
"""

from __future__ import annotations

import json
import os

import pytest

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    allow_header_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    unsupported_method,
)

from test_server import API_KEY, AUTH, Server  # noqa: E402

MAX_EXAMPLES = int(os.environ.get("COLIBRI_FUZZ_EXAMPLES", "15"))
SEED = os.environ.get("COLIBRI_FUZZ_SEED")  # None: derandomized, the same requests as CI's
TIMEOUT = 60  # seconds for one request (a generation with n=8 at most n-ctx tokens)
STREAMED = "text/event-stream"


@pytest.fixture(scope="module")
def fuzzed(chat_model_dir):
    s = Server(chat_model_dir, "--api-key", API_KEY, "--model-name", "tiny", "--max-queue", "4", "--n-ctx", "128")
    before = served_outcomes(s)  # the start's /health polls (503 while loading)
    yield s
    # what the server counted since: every request once by outcome (a stream's error event as its
    # status), printed for a long run's record (pytest -s); none a 5xx
    outcomes = {k: v - before.get(k, 0) for k, v in served_outcomes(s).items() if v != before.get(k, 0)}
    outcomes["200"] -= 1  # the first scrape
    print(f"\n[fuzz] {sum(outcomes.values())} requests served, by outcome: {dict(sorted(outcomes.items()))}")
    code, err = s.stop()
    assert code == 0 and "Traceback" not in err, err
    assert not any(o.startswith("5") for o in outcomes), outcomes


def served_outcomes(server) -> dict:
    """{outcome: requests} of the server's colibri_requests_total, over every endpoint."""
    outcomes = {}
    for ln in httpx.get(server.url + "/metrics", timeout=TIMEOUT).text.splitlines():
        if ln.startswith("colibri_requests_total{"):
            outcome = ln.split('outcome="', 1)[1].split('"', 1)[0]
            outcomes[outcome] = outcomes.get(outcome, 0) + int(float(ln.split()[-1]))
    return outcomes


@pytest.fixture(scope="module")
def api_schema(fuzzed):
    return schemathesis.openapi.from_url(fuzzed.url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


def error_shape(ctx, response, case) -> None:
    """A 4xx (or 5xx) answer is JSON in the API's error shape: Anthropic's on /v1/messages*,
    OpenAI's elsewhere."""
    if response.status_code < 400:
        return
    path = case.operation.path
    assert response.headers.get("content-type", [""])[0].startswith("application/json"), response.headers
    doc = json.loads(response.content)
    if path.startswith("/v1/messages"):
        assert isinstance(doc, dict) and doc.get("type") == "error", doc
        err = doc.get("error")
        assert isinstance(err, dict) and isinstance(err.get("type"), str) and isinstance(err.get("message"), str), doc
    else:
        assert isinstance(doc, dict) and set(doc) == {"error"}, doc
        err = doc["error"]
        assert isinstance(err, dict) and {"message", "type", "param", "code"} <= set(err), doc
        assert isinstance(err["message"], str) and isinstance(err["type"], str), doc


def answer_shape(ctx, response, case) -> None:
    """A 200 is JSON (as documented), or Prometheus text for /metrics, or, for a request that
    asked for a stream, server-sent events whose data are JSON, with no error event (an error
    once the headers are out is the server's own: a request's refusals come before them) and,
    on OpenAI's routes, `data: [DONE]` last."""
    if response.status_code != 200:
        return
    kind = response.headers.get("content-type", [""])[0]
    if case.operation.path == "/metrics":
        assert kind.startswith("text/plain"), kind
        return
    body = case.body if isinstance(case.body, dict) else {}
    if body.get("stream") is not True:
        assert kind.startswith("application/json"), kind
        assert isinstance(json.loads(response.content), dict)
        return
    assert kind.startswith(STREAMED), kind
    lines = [ln for ln in response.content.decode("utf-8").splitlines() if ln and not ln.startswith(":")]
    assert lines, "an empty stream"
    names = [ln[len("event: ") :] for ln in lines if ln.startswith("event: ")]
    data = [ln[len("data: ") :] for ln in lines if ln.startswith("data: ")]
    assert "error" not in names, lines[-4:]
    if not names:  # chat and text completions
        assert data[-1] == "[DONE]", lines[-4:]
        data = data[:-1]
    for d in data:
        doc = json.loads(d)
        assert isinstance(doc, dict) and "error" not in doc, d


# schemathesis' own checks, less status_code_conformance and content_type_conformance (see above)
CHECKS = [
    not_a_server_error,
    negative_data_rejection,
    unsupported_method,
    allow_header_conformance,
    response_schema_conformance,
    response_headers_conformance,
    error_shape,
    answer_shape,
]


def _seeded(test):
    return test if SEED is None else hypothesis.seed(int(SEED))(test)


@schema.parametrize()
@hypothesis.settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    derandomize=SEED is None,
    database=None,
    suppress_health_check=list(hypothesis.HealthCheck),
)
@_seeded
def test_every_operation(case):
    if (
        case.meta is not None
        and case.meta.generation.mode == schemathesis.GenerationMode.POSITIVE
        and isinstance(case.body, dict)
        and isinstance(case.body.get("model"), str)
        and not len(case.body["model"]) % 2
    ):
        # half of the valid bodies name the served model (the other half: a 404 for another
        # model), so that /v1/messages, which requires the name, gets to generate too
        case.body["model"] = "tiny"
    case.call_and_validate(headers=AUTH, timeout=TIMEOUT, checks=CHECKS)


# ---- regressions: what the fuzzing found ---------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_a_wrong_method_on_messages_is_answered_in_anthropics_shape(fuzzed, path):
    # routing's 405 (TRACE, GET, ...) was answered in OpenAI's shape on Anthropic's routes
    for method in ("GET", "TRACE", "PUT"):
        r = httpx.request(method, fuzzed.url + path, headers=AUTH, timeout=TIMEOUT)
        assert r.status_code == 405, r.text
        assert r.json() == {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": f"{method} {path}: Method Not Allowed"},
        }


def test_routing_errors_elsewhere_stay_in_openais_shape(fuzzed):
    r = httpx.request("TRACE", fuzzed.url + "/v1/chat/completions", headers=AUTH, timeout=TIMEOUT)
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error", r.text
    r = httpx.get(fuzzed.url + "/v1/nowhere", headers=AUTH, timeout=TIMEOUT)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", r.text


def test_openapi_documents_the_ranges_as_json_schema(fuzzed):
    # ranges were published as pydantic's "ge"/"le" keys (unknown to JSON Schema): the fuzzer's
    # valid examples held max_tokens 0, n 9, temperature 5, ... and every one of them was a 400
    doc = httpx.get(fuzzed.url + "/openapi.json", timeout=TIMEOUT).json()
    text = json.dumps(doc)
    for key in ("ge", "le", "gt", "lt"):
        assert f'"{key}":' not in text
    schemas = doc["components"]["schemas"]
    assert schemas["MessagesRequest"]["properties"]["max_tokens"] == {
        "minimum": 1,
        "title": "Max Tokens",
        "type": "integer",
    }
    n = next(s for s in schemas["ChatCompletionRequest"]["properties"]["n"]["anyOf"] if s.get("type") == "integer")
    assert (n["minimum"], n["maximum"]) == (1, 8)
    top_p = next(
        s for s in schemas["ChatCompletionRequest"]["properties"]["top_p"]["anyOf"] if s.get("type") == "number"
    )
    assert (top_p["exclusiveMinimum"], top_p["maximum"]) == (0, 1)
    # and the server still refuses what the range excludes, in the API's error shape
    r = httpx.post(
        fuzzed.url + "/v1/messages",
        headers=AUTH,
        timeout=TIMEOUT,
        json={"model": "tiny", "max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 400 and r.json()["type"] == "error", r.text


@pytest.mark.parametrize("prompt", [[[False]], [[True, 5]], [False], [[5, 1.0]]])
def test_a_boolean_is_not_a_token_id(fuzzed, prompt):
    # "prompt": [[false]] (schema-invalid) was a 200: pydantic's lax int took false for token 0
    r = httpx.post(
        fuzzed.url + "/v1/completions",
        headers=AUTH,
        timeout=TIMEOUT,
        json={"model": "tiny", "prompt": prompt, "max_tokens": 1},
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "prompt", err


def test_nested_token_ids_are_still_a_prompt(fuzzed):
    r = httpx.post(
        fuzzed.url + "/v1/completions",
        headers=AUTH,
        timeout=TIMEOUT,
        json={"model": "tiny", "prompt": [[5, 6]], "max_tokens": 1},
    )
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 2, r.text
