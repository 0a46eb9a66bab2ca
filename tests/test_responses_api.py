"""OpenAI's Responses API (POST /v1/responses, stateless), a translation onto chat completions:
checked with the official `openai` client against a real server process running test_agents'
random-weight model with Qwen3's chat template, and against /v1/chat/completions for the same
request (the same seed, the same tokens).
"""

from __future__ import annotations

import json
from typing import Annotated

import pytest

from test_agents import PERSON, TIME, WEATHER, agent_dir, schema_of  # noqa: F401  (agent_dir: the model fixture)

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from conftest import sse_events  # noqa: E402
from test_server import Server  # noqa: E402

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOL = {"type": "function", **WEATHER["function"]}
CLOCK = {"type": "function", **TIME["function"]}


@pytest.fixture(scope="module")
def agent(agent_dir):  # noqa: F811
    s = Server(agent_dir, "--model-name", "agent", "--n-ctx", "4096")
    yield s
    code, err = s.stop()
    assert code == 0 and "Traceback" not in err, err


@pytest.fixture(scope="module")
def client(agent):
    return openai.OpenAI(base_url=agent.url + "/v1", api_key="none", max_retries=0, timeout=120)


def chat(server, **body):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "agent", **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def responses(server, **body):
    return httpx.post(server.url + "/v1/responses", json={"model": "agent", **body}, timeout=120)


def events_of(server, **body) -> list:
    return sse_events(server.url + "/v1/responses", {"model": "agent", "stream": True, **body})


# ---- whole and streamed --------------------------------------------------------------------------


def test_a_whole_response_is_the_chat_completions_reply(agent, client):
    out = client.responses.create(
        model="agent", instructions="be brief", input=ASK, max_output_tokens=12, temperature=1.0, extra_body={"seed": 5}
    )
    doc = chat(
        agent, messages=[{"role": "system", "content": "be brief"}, *ASK], max_tokens=12, temperature=1.0, seed=5
    )
    ref = doc["choices"][0]
    assert out.id.startswith("resp_") and out.object == "response" and out.model == "agent"
    assert out.output_text == ref["message"]["content"]
    if ref["finish_reason"] == "length":
        assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    else:
        assert out.status == "completed" and out.incomplete_details is None
    message = [i for i in out.output if i.type == "message"]
    assert len(message) == 1 and message[0].role == "assistant" and message[0].content[0].type == "output_text"
    assert out.usage.output_tokens == doc["usage"]["completion_tokens"]
    assert out.usage.input_tokens == doc["usage"]["prompt_tokens"]
    assert out.usage.total_tokens == out.usage.input_tokens + out.usage.output_tokens
    assert out.instructions == "be brief" and out.temperature == 1.0


def test_a_string_input_is_a_user_message(agent, client):
    out = client.responses.create(
        model="agent", input="What is the weather in Paris?", max_output_tokens=6, temperature=0
    )
    ref = chat(agent, messages=ASK, max_tokens=6, temperature=0)
    assert out.output_text == ref["choices"][0]["message"]["content"]
    assert out.usage.input_tokens == ref["usage"]["prompt_tokens"]


def test_streamed_events_add_up_to_the_whole(agent, client):
    body = dict(input=ASK, max_output_tokens=16, temperature=1.0, seed=8)
    whole = responses(agent, **body).json()
    events = events_of(agent, **body)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == ("response.completed" if whole["status"] == "completed" else "response.incomplete")
    assert kinds[2:5] == ["response.output_item.added", "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    done = next(e for e in events if e["type"] == "response.output_text.done")
    final = events[-1]["response"]
    assert text == done["text"] == whole["output"][0]["content"][0]["text"]
    assert final["output"][0]["content"][0]["text"] == text and final["usage"] == whole["usage"]
    added = next(e for e in events if e["type"] == "response.output_item.added")["item"]["id"]
    assert final["output"][0]["id"] == added


def test_the_sdk_streams(client):
    body = dict(model="agent", input=ASK, max_output_tokens=16, temperature=1.0, extra_body={"seed": 8})
    whole = client.responses.create(**body)
    deltas = []
    for event in client.responses.create(stream=True, **body):
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
    assert "".join(deltas) == whole.output_text
    # the SDK's helper accumulates a completed response (a forced call completes)
    body = dict(
        model="agent",
        input=ASK,
        tools=[TOOL],
        tool_choice="required",
        max_output_tokens=200,
        temperature=0.9,
        extra_body={"seed": 4},
    )
    whole = client.responses.create(**body)
    with client.responses.stream(**body) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.status == whole.status == "completed"
    assert [(i.type, getattr(i, "arguments", None)) for i in final.output] == [
        (i.type, getattr(i, "arguments", None)) for i in whole.output
    ]


# ---- tools -------------------------------------------------------------------------------------


def test_a_function_call_round_trip(client):
    first = client.responses.create(
        model="agent",
        input=ASK,
        tools=[TOOL, CLOCK],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=200,
        temperature=0.8,
        extra_body={"seed": 3},
    )
    calls = [i for i in first.output if i.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1, first
    call = calls[0]
    assert call.id.startswith("fc_") and call.call_id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), schema_of(WEATHER if call.name == "get_weather" else TIME))
    history = (
        ASK
        + [i.model_dump(exclude_none=True) for i in first.output]
        + [{"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny"}]
    )
    second = client.responses.create(
        model="agent", input=history, tools=[TOOL, CLOCK], tool_choice="none", max_output_tokens=8, temperature=0
    )
    assert not [i for i in second.output if i.type == "function_call"]
    assert second.usage.input_tokens > first.usage.input_tokens


def test_a_named_function_is_called(client):
    out = client.responses.create(
        model="agent",
        input=ASK,
        tools=[TOOL, CLOCK],
        tool_choice={"type": "function", "name": "get_time"},
        max_output_tokens=200,
        temperature=0,
    )
    call = next(i for i in out.output if i.type == "function_call")
    assert call.name == "get_time"
    jsonschema.validate(json.loads(call.arguments), schema_of(TIME))


def test_streamed_function_calls_are_the_whole_ones(agent):
    body = dict(input=ASK, tools=[TOOL, CLOCK], tool_choice="required", max_output_tokens=200, temperature=0.9, seed=21)
    whole = responses(agent, **body).json()
    events = events_of(agent, **body)
    args = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    calls = [i for i in whole["output"] if i["type"] == "function_call"]
    assert [(d["name"], json.loads(d["arguments"])) for d in done] == [
        (c["name"], json.loads(c["arguments"])) for c in calls
    ]
    assert args == "".join(d["arguments"] for d in done)
    assert [i["type"] for i in events[-1]["response"]["output"]] == [i["type"] for i in whole["output"]]


# ---- structured output, reasoning -----------------------------------------------------------------


def test_text_format_json_schema_validates(client):
    out = client.responses.create(
        model="agent",
        input=[{"role": "user", "content": "a person"}],
        max_output_tokens=300,
        temperature=1.0,
        extra_body={"seed": 1},
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}},
    )
    assert out.status == "completed", out
    jsonschema.validate(json.loads(out.output_text), PERSON)
    assert out.text.format.type == "json_schema"


def test_the_sdk_parses_into_a_pydantic_model(client):
    pydantic = pytest.importorskip("pydantic")

    class Person(pydantic.BaseModel):
        name: Annotated[str, pydantic.Field(max_length=10)]
        age: Annotated[int, pydantic.Field(ge=0, le=120)]

    out = client.responses.parse(
        model="agent",
        input=[{"role": "user", "content": "a person"}],
        text_format=Person,
        max_output_tokens=300,
        temperature=1.0,
        extra_body={"seed": 1},
    )
    assert isinstance(out.output_parsed, Person)


def test_reasoning_reaches_the_template_and_reasoning_items_are_dropped(agent, client):
    ids_off = httpx.post(
        agent.url + "/tokenize", json={"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}
    ).json()
    out = client.responses.create(model="agent", input=ASK, reasoning={"effort": "none"}, max_output_tokens=2)
    assert out.usage.input_tokens == ids_off["count"]
    dropped = client.responses.create(
        model="agent",
        max_output_tokens=2,
        reasoning={"effort": "none"},
        input=[
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
            *ASK,
        ],
    )
    assert dropped.usage.input_tokens == out.usage.input_tokens


def test_a_parsed_reply_becomes_items():
    """The translation of the reply parser's message (the random model rarely closes </think>)."""
    from colibri.serve import responses as api
    from colibri.serve.openai import Job, Outcome

    echo = api.echo_of(api.ResponsesRequest.model_validate({"input": "hi", "tools": [TOOL]}))
    job = Job(None, [1, 2], {"seed": 1}, [], None, True, False, 1, True, echo=echo)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "P"}'}}
    msg = {
        "role": "assistant",
        "content": "Let me look.",
        "reasoning_content": "they want weather",
        "tool_calls": [call],
    }
    doc = api.document(Outcome(msg, "tool_calls", None, 10, 4, 7), "resp_x", "agent", job)
    assert [i["type"] for i in doc["output"]] == ["reasoning", "message", "function_call"]
    assert doc["output"][0]["content"] == [{"type": "reasoning_text", "text": "they want weather"}]
    assert doc["output"][2]["call_id"] == "call_1" and doc["output"][2]["arguments"] == '{"city": "P"}'
    assert doc["status"] == "completed" and doc["usage"]["input_tokens_details"]["cached_tokens"] == 4
    stream = api.Stream("resp_x", "agent", job)
    events = stream.start(None)
    for delta in (
        {"reasoning_content": "they want"},
        {"reasoning_content": " weather"},
        {"content": "Let me look."},
        {
            "tool_calls": [
                {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "P"}'}}]},
    ):
        events += stream.deltas([delta])
    events += stream.end(Outcome(msg, "tool_calls", None, 10, 4, 7))
    kinds = [k for k, _ in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = events[-1][1]["response"]["output"]
    strip = [{k: v for k, v in i.items() if k != "id"} for i in final]
    assert strip == [{k: v for k, v in i.items() if k != "id"} for i in doc["output"]]
    # the SDK's own accumulation of these events gives the same response
    state_module = pytest.importorskip("openai.lib.streaming.responses._responses")
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    state = state_module.ResponseStreamState(input_tools=openai.omit, text_format=openai.omit)
    for _, data in events:
        state.handle_event(TypeAdapter(ResponseStreamEvent).validate_python(data))


# ---- the stateless server, errors, the schema -------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [("store", True), ("previous_response_id", "resp_1"), ("conversation", "conv_1"), ("background", True)],
)
def test_state_is_refused(agent, field, value):
    r = responses(agent, input="hi", max_output_tokens=2, **{field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["type"] == "invalid_request_error"
    assert field == "background" or "stateless" in err["message"]


def test_the_sdk_sees_a_bad_request(client):
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="agent", input="hi", store=True, max_output_tokens=2)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"bogus": 1}, "bogus"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"text": {"format": {"type": "xml"}}}, "text"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning"),
        ({"model": "other"}, "model"),
        ({"max_output_tokens": 100000}, "max_output_tokens"),
    ],
)
def test_bad_fields_are_400s_naming_them(agent, body, param):
    r = responses(agent, **{"input": "hi", "max_output_tokens": 2, **body})
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param


def test_fields_meaningless_here_are_accepted(agent):
    r = responses(
        agent,
        input="hi",
        max_output_tokens=2,
        store=False,
        metadata={"k": "v"},
        user="u",
        truncation="disabled",
        include=[],
        prompt_cache_key="p",
        service_tier="auto",
    )
    assert r.status_code == 200, r.text
    assert r.json()["metadata"] == {"k": "v"}


def test_every_field_the_sdk_sends_is_classified():
    from openai.types.responses import response_create_params as params

    from colibri.serve import responses as api

    missing = set(params.ResponseCreateParamsBase.__annotations__) - set(api.ResponsesRequest.model_fields)
    assert not missing, f"ResponsesRequest does not classify {sorted(missing)}"


def test_openapi_documents_the_responses_api(agent):
    doc = httpx.get(agent.url + "/openapi.json").json()
    assert "/v1/responses" in doc["paths"]
    schema = doc["components"]["schemas"]["ResponsesRequest"]
    assert {"input", "instructions", "tools", "text", "reasoning", "max_output_tokens"} <= set(schema["properties"])
