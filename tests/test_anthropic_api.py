"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens), a translation onto chat
completions: checked with the official `anthropic` client against a real server process running
test_agents' random-weight model with Qwen3's chat template, and against /v1/chat/completions
for the same request (the same seed, the same tokens).
"""

from __future__ import annotations

import json

import pytest

from test_agents import PERSON, TIME, WEATHER, agent_dir, schema_of  # noqa: F401  (agent_dir: the model fixture)

httpx = pytest.importorskip("httpx")
anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from conftest import sse_events  # noqa: E402
from test_server import Server  # noqa: E402

KEY = "sk-anthropic-test"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOL = {
    "name": WEATHER["function"]["name"],
    "description": WEATHER["function"]["description"],
    "input_schema": schema_of(WEATHER),
}
CLOCK = {"name": TIME["function"]["name"], "input_schema": schema_of(TIME)}


@pytest.fixture(scope="module")
def agent(agent_dir):  # noqa: F811
    s = Server(agent_dir, "--model-name", "agent", "--n-ctx", "4096", "--api-key", KEY)
    yield s
    code, err = s.stop()
    assert code == 0 and "Traceback" not in err, err


@pytest.fixture(scope="module")
def client(agent):
    return anthropic.Anthropic(base_url=agent.url, api_key=KEY, max_retries=0, timeout=120)


def chat(server, **body):
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": "agent", **body},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()


def messages(server, **body):
    return httpx.post(
        server.url + "/v1/messages", json={"model": "agent", **body}, headers={"x-api-key": KEY}, timeout=120
    )


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


# ---- whole and streamed --------------------------------------------------------------------------


def test_a_whole_reply_is_the_chat_completions_reply(agent, client):
    """The same request and seed through both APIs: the same text, the same token counts."""
    out = client.messages.create(
        model="agent", max_tokens=12, system="be brief", messages=ASK, extra_body={"temperature": 1.0, "seed": 5}
    )
    ref = chat(
        agent, messages=[{"role": "system", "content": "be brief"}, *ASK], max_tokens=12, temperature=1.0, seed=5
    )
    assert out.type == "message" and out.role == "assistant" and out.id.startswith("msg_") and out.model == "agent"
    assert text_of(out) == ref["choices"][0]["message"]["content"]
    assert out.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[ref["choices"][0]["finish_reason"]]
    assert out.usage.output_tokens == ref["usage"]["completion_tokens"]
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens == ref["usage"]["prompt_tokens"]
    assert out.usage.cache_creation_input_tokens == 0


def test_streamed_text_adds_up_to_the_whole(client):
    body = dict(model="agent", max_tokens=16, messages=ASK, extra_body={"temperature": 1.0, "seed": 8})
    whole = client.messages.create(**body)
    with client.messages.stream(**body) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == text_of(final) == text_of(whole)
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_the_event_sequence(agent):
    events = sse_events(
        agent.url + "/v1/messages",
        {"model": "agent", "max_tokens": 6, "messages": ASK, "stream": True},
        headers={"x-api-key": KEY},
    )
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert events[0]["message"]["content"] == [] and events[0]["message"]["usage"]["input_tokens"] > 0
    assert kinds.count("content_block_start") == kinds.count("content_block_stop")
    assert events[-2]["delta"]["stop_reason"] in ("max_tokens", "end_turn") and events[-2]["usage"]["output_tokens"]


def test_stop_sequences(client):
    body = dict(model="agent", max_tokens=12, messages=ASK, extra_body={"temperature": 1.0, "seed": 5})
    text = text_of(client.messages.create(**body))
    cut = text[3:5]
    assert len(text) > 5 and cut.strip()
    out = client.messages.create(stop_sequences=["nothing like this", cut], **body)
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == cut
    assert text_of(out) == text[: text.index(cut)].strip() or text.startswith(text_of(out))


# ---- tools -------------------------------------------------------------------------------------


def test_tool_choice_any_gives_a_tool_use_that_validates(client):
    out = client.messages.create(
        model="agent",
        max_tokens=200,
        messages=ASK,
        tools=[TOOL, CLOCK],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body={"temperature": 0.8, "seed": 3},
    )
    assert out.stop_reason == "tool_use"
    uses = [b for b in out.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].id and uses[0].name in ("get_weather", "get_time")
    jsonschema.validate(uses[0].input, TOOL["input_schema"] if uses[0].name == "get_weather" else CLOCK["input_schema"])


def test_a_named_tool_is_called(client):
    out = client.messages.create(
        model="agent",
        max_tokens=200,
        messages=ASK,
        tools=[TOOL, CLOCK],
        tool_choice={"type": "tool", "name": "get_time"},
        extra_body={"temperature": 0},
    )
    use = next(b for b in out.content if b.type == "tool_use")
    assert out.stop_reason == "tool_use" and use.name == "get_time"
    jsonschema.validate(use.input, CLOCK["input_schema"])


def test_a_tool_round_trip(client):
    history = list(ASK)
    first = client.messages.create(
        model="agent",
        max_tokens=200,
        messages=history,
        tools=[TOOL],
        tool_choice={"type": "any"},
        extra_body={"temperature": 0},
    )
    use = next(b for b in first.content if b.type == "tool_use")
    history.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]})
    history.append(
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": [{"type": "text", "text": "18 C and sunny"}]},
                {"type": "text", "text": "and tomorrow?"},
            ],
        }
    )
    second = client.messages.create(
        model="agent",
        max_tokens=8,
        messages=history,
        tools=[TOOL],
        tool_choice={"type": "none"},
        extra_body={"temperature": 0},
    )
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert not [b for b in second.content if b.type == "tool_use"]
    # the tool's answer is in the prompt: it counts
    counted = client.messages.count_tokens(model="agent", messages=history, tools=[TOOL])
    assert counted.input_tokens == second.usage.input_tokens + second.usage.cache_read_input_tokens
    shorter = client.messages.count_tokens(
        model="agent",
        messages=history[:2]
        + [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18"}]}],
        tools=[TOOL],
    )
    assert shorter.input_tokens < counted.input_tokens


def test_streamed_tool_use_is_the_whole_one(client):
    body = dict(
        model="agent",
        max_tokens=200,
        messages=ASK,
        tools=[TOOL, CLOCK],
        tool_choice={"type": "any"},
        extra_body={"temperature": 0.9, "seed": 21},
    )
    whole = client.messages.create(**body)
    with client.messages.stream(**body) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == whole.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [
        (b.name, b.input) for b in whole.content if b.type == "tool_use"
    ]


def test_output_config_format_constrains_to_the_schema(client):
    out = client.messages.create(
        model="agent",
        max_tokens=300,
        messages=[{"role": "user", "content": "a person"}],
        output_config={"format": {"type": "json_schema", "schema": PERSON}},
        extra_body={"temperature": 1.0, "seed": 1},
    )
    assert out.stop_reason == "end_turn", out
    jsonschema.validate(json.loads(text_of(out)), PERSON)


# ---- thinking -----------------------------------------------------------------------------------


def test_thinking_reaches_the_template(agent, client):
    """Qwen3's template: thinking disabled renders the empty think block (enable_thinking false)."""

    def tokenized(thinking: bool) -> int:
        return httpx.post(
            agent.url + "/tokenize",
            headers={"x-api-key": KEY},
            json={"messages": ASK, "chat_template_kwargs": {"enable_thinking": thinking}},
        ).json()["count"]

    off = client.messages.count_tokens(model="agent", messages=ASK, thinking={"type": "disabled"}).input_tokens
    on = client.messages.count_tokens(
        model="agent", messages=ASK, thinking={"type": "enabled", "budget_tokens": 1024}
    ).input_tokens
    assert (off, on) == (tokenized(False), tokenized(True)) and off > on
    out = client.messages.create(model="agent", max_tokens=2, messages=ASK, thinking={"type": "disabled"})
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens == off


def test_a_parsed_reply_becomes_blocks():
    """The translation of the reply parser's message (the random model rarely closes </think>)."""
    from colibri.serve import anthropic as api
    from colibri.serve.openai import Outcome

    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'},
    }
    msg = {
        "role": "assistant",
        "content": "Let me look.",
        "reasoning_content": "they want weather",
        "tool_calls": [call],
    }
    doc = api.document(Outcome(msg, "tool_calls", None, 10, 4, 7), "msg_x", "agent")
    assert doc["content"] == [
        {"type": "thinking", "thinking": "they want weather", "signature": ""},
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris", "unit": "C"}},
    ]
    assert doc["stop_reason"] == "tool_use" and doc["stop_sequence"] is None
    assert doc["usage"] == {
        "input_tokens": 6,
        "cache_read_input_tokens": 4,
        "cache_creation_input_tokens": 0,
        "output_tokens": 7,
    }
    # streamed: the same blocks from the parser's deltas, accumulated as the SDK does
    stream = api.Stream("msg_x", "agent")
    events = stream.start(Outcome({}, "", None, 10, 4, 0))
    for delta in (
        {"reasoning_content": "they want"},
        {"reasoning_content": " weather"},
        {"content": "Let me look."},
        {
            "tool_calls": [
                {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": call["function"]["arguments"]}}]},
    ):
        events += stream.deltas([delta])
    events += stream.end(Outcome(msg, "tool_calls", None, 10, 4, 7))
    assert [name for name, _ in events] == ["message_start"] + [
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
    ] + ["content_block_start", "content_block_delta", "content_block_stop"] * 2 + ["message_delta", "message_stop"]
    blocks, partial = [], {}
    for name, data in events:  # accumulated as the SDK does
        if name == "content_block_start":
            blocks.append(dict(data["content_block"]))
        elif name == "content_block_delta":
            delta, block = data["delta"], blocks[data["index"]]
            if delta["type"] == "input_json_delta":
                partial[data["index"]] = partial.get(data["index"], "") + delta["partial_json"]
                block["input"] = json.loads(partial[data["index"]])
            else:
                key = delta["type"].removesuffix("_delta")
                block[key] += delta[key]
    assert blocks == doc["content"]
    assert events[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


def test_thinking_history_is_passed_as_reasoning():
    from colibri.serve import anthropic as api

    req = api.MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 5,
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hmm", "signature": "s"},
                        {"type": "redacted_thinking", "data": "x"},
                        {"type": "text", "text": "hello"},
                    ],
                },
                {"role": "user", "content": "again"},
            ],
        }
    )
    assert api.conversation(req.messages) == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", "reasoning_content": "hmm"},
        {"role": "user", "content": "again"},
    ]


# ---- errors, counting, the schema -----------------------------------------------------------------


def anthropic_error(r, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    doc = r.json()
    assert doc["type"] == "error" and doc["error"]["type"] == kind and set(doc["error"]) == {"type", "message"}
    return doc["error"]["message"]


def test_errors_are_in_anthropics_shape(agent, client):
    assert "max_tokens" in anthropic_error(messages(agent, messages=ASK), 400, "invalid_request_error")
    assert "bogus" in anthropic_error(
        messages(agent, messages=ASK, max_tokens=2, bogus=1), 400, "invalid_request_error"
    )
    anthropic_error(
        messages(agent, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}], max_tokens=2),
        400,
        "invalid_request_error",
    )
    anthropic_error(
        messages(agent, messages=ASK, max_tokens=2, tools=[TOOL], tool_choice={"type": "tool", "name": "nope"}),
        400,
        "invalid_request_error",
    )
    anthropic_error(messages(agent, messages=ASK, max_tokens=2, model="claude-x"), 404, "not_found_error")
    prefill = messages(agent, messages=ASK + [{"role": "assistant", "content": "The weather"}], max_tokens=2)
    assert "prefill" in anthropic_error(prefill, 400, "invalid_request_error")
    anthropic_error(messages(agent, messages=ASK, max_tokens=2, temperature=1.5), 400, "invalid_request_error")
    r = httpx.post(
        agent.url + "/v1/messages",
        json={"model": "agent", "messages": ASK, "max_tokens": 2},
        headers={"x-api-key": "wrong"},
    )
    anthropic_error(r, 401, "authentication_error")
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=agent.url, api_key="wrong", max_retries=0).messages.create(
            model="agent", max_tokens=2, messages=ASK
        )
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="agent", max_tokens=2, messages=ASK, extra_body={"frequency_penalty": 1})
    # the OpenAI routes keep OpenAI's shape
    r = httpx.post(agent.url + "/v1/chat/completions", json={"messages": ASK}, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_fields_meaningless_here_are_accepted(client):
    out = client.messages.create(
        model="agent",
        max_tokens=2,
        metadata={"user_id": "u"},
        extra_body={"top_k": 5, "top_p": 0.9},
        cache_control={"type": "ephemeral"},
        system=[{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}
        ],
    )
    assert out.usage.output_tokens == 2


def test_count_tokens_is_the_rendered_prompt(agent, client):
    counted = client.messages.count_tokens(model="agent", system="be brief", messages=ASK, tools=[TOOL])
    ref = httpx.post(
        agent.url + "/tokenize",
        headers={"x-api-key": KEY},
        json={"messages": [{"role": "system", "content": "be brief"}, *ASK], "tools": [WEATHER]},
    ).json()["count"]
    assert counted.input_tokens == ref
    r = httpx.post(
        agent.url + "/v1/messages/count_tokens",
        headers={"x-api-key": KEY},
        json={"model": "agent", "messages": ASK, "max_tokens": 5},
    )
    assert "max_tokens" in anthropic_error(r, 400, "invalid_request_error")


def test_count_tokens_counts_a_prompt_longer_than_the_context(agent, client):
    """Counting is how a client learns that a prompt does not fit: count_tokens answers with the
    count (above the server's 4096), and only the Messages request itself is refused."""
    long = [{"role": "user", "content": "weather in Paris and elsewhere " * 1500}]
    counted = client.messages.count_tokens(model="agent", messages=long).input_tokens
    assert counted > 4096
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="agent", max_tokens=4, messages=long)
    assert "context" in str(e.value)


def test_openapi_documents_the_messages_api(agent):
    doc = httpx.get(agent.url + "/openapi.json").json()
    assert {"/v1/messages", "/v1/messages/count_tokens"} <= set(doc["paths"])
    schema = doc["components"]["schemas"]["MessagesRequest"]
    assert {"max_tokens", "messages", "tools", "tool_choice", "thinking", "stop_sequences"} <= set(schema["properties"])
    assert "max_tokens" in schema["required"] and schema.get("additionalProperties") is False


def test_pings_while_waiting_and_the_same_reply(agent_dir, client):  # noqa: F811
    """A server that sends its keep-alives at once: `ping` events come between Anthropic's
    events (never before message_start), a Responses stream gets SSE comment lines, and both
    replies are the ones a server without pings gives."""
    with Server(agent_dir, "--model-name", "agent", "--n-ctx", "4096", patch="KEEPALIVE_SECONDS = 0") as s:
        body = {"model": "agent", "max_tokens": 24, "messages": ASK, "temperature": 1.0, "seed": 9}
        names, text = [], []
        with httpx.stream("POST", s.url + "/v1/messages", json={**body, "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("event: "):
                    names.append(line[7:])
                elif line.startswith("data: ") and names[-1] == "content_block_delta":
                    text.append(json.loads(line[6:])["delta"].get("text", ""))
        assert "ping" in names and names[0] == "message_start" and names[-1] == "message_stop", names
        whole = client.messages.create(
            **{k: v for k, v in body.items() if k not in ("temperature", "seed")},
            extra_body={"temperature": 1.0, "seed": 9},
        )
        assert "".join(text) == text_of(whole)
        comments = 0
        with httpx.stream(
            "POST",
            s.url + "/v1/responses",
            timeout=120,
            json={"model": "agent", "input": ASK, "max_output_tokens": 24, "stream": True},
        ) as r:
            for line in r.iter_lines():
                comments += line.startswith(": keep-alive")
        assert comments > 0
        code, err = s.stop()
        assert code == 0 and "Traceback" not in err, err
