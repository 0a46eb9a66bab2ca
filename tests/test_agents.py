"""The server as agents use it: tool calls, reasoning, structured outputs, and no field silently
ignored — through raw HTTP and the official `openai` client, against a real server process.

The model is a random-weight OLMoE-shaped checkpoint made here with numpy (no torch), with a
byte-level BPE tokenizer (every byte spellable, so a grammar can force any text) and Qwen3's real
chat template (Hermes-style `<tool_call>` calls, `<think>` reasoning). Its words are random: what
these tests check is what only the server's machinery can make true — a forced call that parses
into valid arguments, JSON that validates against the schema, deltas that add up to the whole.
"""

from __future__ import annotations

import json
import shutil
import string
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import FIXTURES, write_safetensors

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
llguidance = pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from test_server import Server  # noqa: E402  (the real-process server harness)

CHAT_DIR = FIXTURES / "text" / "chat"
AGENT_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]
AGENT_VOCAB = 512
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"type": "string", "enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def agent_checkpoint(root) -> None:
    """OLMoE-shaped random weights (vocab AGENT_VOCAB), a byte-level BPE tokenizer.json with
    Qwen3's added tokens, and Qwen3-0.6B's chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    cfg = json.loads((FIXTURES / "olmoe_a" / "hf" / "config.json").read_text())
    d, f, experts, layers = 64, 32, 4, 2
    cfg.update(
        vocab_size=AGENT_VOCAB,
        hidden_size=d,
        intermediate_size=f,
        num_experts=experts,
        num_hidden_layers=layers,
        bos_token_id=None,
        pad_token_id=None,
    )
    rng = np.random.default_rng(7)
    t = {
        "model.embed_tokens.weight": rng.standard_normal((AGENT_VOCAB, d), np.float32),
        "lm_head.weight": 0.5 * rng.standard_normal((AGENT_VOCAB, d), np.float32),
        "model.norm.weight": np.ones(d, np.float32),
    }
    for layer in range(layers):
        p = f"model.layers.{layer}."
        for n in ("input_layernorm", "post_attention_layernorm"):
            t[p + n + ".weight"] = np.ones(d, np.float32)
        for n in "qkvo":
            t[p + f"self_attn.{n}_proj.weight"] = 0.15 * rng.standard_normal((d, d), np.float32)
        t[p + "self_attn.q_norm.weight"] = np.ones(d, np.float32)
        t[p + "self_attn.k_norm.weight"] = np.ones(d, np.float32)
        t[p + "mlp.gate.weight"] = rng.standard_normal((experts, d), np.float32)
        for e in range(experts):
            t[p + f"mlp.experts.{e}.gate_proj.weight"] = 0.15 * rng.standard_normal((f, d), np.float32)
            t[p + f"mlp.experts.{e}.up_proj.weight"] = 0.15 * rng.standard_normal((f, d), np.float32)
            t[p + f"mlp.experts.{e}.down_proj.weight"] = 0.15 * rng.standard_normal((d, f), np.float32)
    root.mkdir(parents=True)
    write_safetensors(root / "model.safetensors", t)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [string.printable, '{"city": "Paris", "unit": "C"}', "the weather in a city", "hello world"] * 20
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=AGENT_VOCAB - 8,
            special_tokens=AGENT_SPECIALS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok.save(str(root / "tokenizer.json"))
    end = tok.token_to_id("<|im_end|>")
    (root / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": (CHAT_DIR / "Qwen-Qwen3-0.6B.jinja").read_text(),
                "eos_token": "<|im_end|>",
                "bos_token": None,
                "add_bos_token": False,
            }
        )
    )
    (root / "config.json").write_text(json.dumps({**cfg, "eos_token_id": end}))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [end, tok.token_to_id("<|endoftext|>")]}))


@pytest.fixture(scope="module")
def agent_dir(tmp_path_factory):
    from colibri.convert import convert

    hf = tmp_path_factory.mktemp("agent") / "hf"
    agent_checkpoint(hf)
    out = hf.parent / "model"
    convert(hf, out, log=lambda *a: None)
    return out


@pytest.fixture(scope="module")
def agent(agent_dir):
    s = Server(agent_dir, "--model-name", "agent", "--n-ctx", "4096")
    yield s
    code, err = s.stop()
    assert code == 0 and "Traceback" not in err, err


def chat(server, timeout=120, **body):
    return httpx.post(server.url + "/v1/chat/completions", json={"model": "agent", **body}, timeout=timeout)


def sse(server, **body) -> list:
    """The data events of a streamed chat request, [DONE] excluded."""
    events = []
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", json={"model": "agent", "stream": True, **body}, timeout=120
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def schema_of(tool):
    return tool["function"]["parameters"]


# ---- tool calls -------------------------------------------------------------------------------------


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_forced_tool_call_comes_back_as_tool_calls(agent, choice):
    r = chat(
        agent,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice=choice,
        max_tokens=200,
        temperature=0.8,
        seed=3,
        parallel_tool_calls=False,
    )
    assert r.status_code == 200, r.text
    out = r.json()["choices"][0]
    assert out["finish_reason"] == "tool_calls", out
    calls = out["message"]["tool_calls"]
    assert len(calls) == 1 and calls[0]["type"] == "function" and calls[0]["id"]
    name = calls[0]["function"]["name"]
    assert name == ("get_time" if isinstance(choice, dict) else name) and name in ("get_weather", "get_time")
    args = json.loads(calls[0]["function"]["arguments"])
    jsonschema.validate(args, schema_of(WEATHER if name == "get_weather" else TIME))


def test_streamed_tool_calls_add_up_to_the_whole(agent):
    body = dict(messages=ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=200, temperature=0.0)
    whole = chat(agent, **body).json()["choices"][0]
    events = sse(agent, **body)
    calls, content, reasons = {}, [], []
    for ev in events:
        for c in ev["choices"]:
            delta = c["delta"]
            content.append(delta.get("content") or "")
            for tc in delta.get("tool_calls") or []:
                slot = calls.setdefault(tc["index"], {"id": None, "name": "", "arguments": ""})
                slot["id"] = tc.get("id") or slot["id"]
                fn = tc.get("function") or {}
                slot["name"] += fn.get("name") or ""
                slot["arguments"] += fn.get("arguments") or ""
            if c["finish_reason"]:
                reasons.append(c["finish_reason"])
    assert reasons == ["tool_calls"]
    expected = whole["message"]["tool_calls"]
    assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in expected
    ]
    assert "".join(content) == (whole["message"]["content"] or "")


def test_the_openai_client_runs_a_tool_loop(agent):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=agent.url + "/v1", api_key="none")
    messages = list(ASK)
    first = client.chat.completions.create(
        model="agent", messages=messages, tools=[WEATHER], tool_choice="required", max_tokens=200, temperature=0
    )
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), schema_of(WEATHER))
    # the SDK sends the call back as it received it: content null, arguments a JSON string
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"})
    second = client.chat.completions.create(
        model="agent", messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=8, temperature=0
    )
    assert second.choices[0].finish_reason in ("stop", "length")
    assert second.choices[0].message.tool_calls is None


def test_the_openai_client_streams_tool_calls(agent):
    """The SDK's own accumulation of streamed deltas gives the whole reply's calls."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=agent.url + "/v1", api_key="none")
    body = dict(
        model="agent",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        max_tokens=200,
        temperature=0.9,
        seed=21,
    )
    whole = client.chat.completions.create(**body).choices[0]
    with client.chat.completions.stream(**body) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == whole.finish_reason == "tool_calls"
    # the same seed, the same calls (each run draws its own call ids)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in streamed.message.tool_calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls
    ]
    assert all(c.id and c.type == "function" for c in streamed.message.tool_calls)


def test_tool_choice_none_leaves_calls_unparsed_and_unforced(agent):
    """The call opener forced by logit_bias: with tool_choice none it stays text (no constraint
    completes it, no parser takes it); with auto the same opener starts a call the grammar
    completes and the parser returns."""
    opener = httpx.post(agent.url + "/tokenize", json={"content": "<tool_call>"}).json()["tokens"]
    assert len(opener) == 1
    body = dict(messages=ASK, tools=[WEATHER], max_tokens=3, temperature=0, logit_bias={str(opener[0]): 100})
    none = chat(agent, tool_choice="none", **body).json()["choices"][0]
    assert none["finish_reason"] == "length" and "tool_calls" not in none["message"]
    assert none["message"]["content"].startswith("<tool_call>")
    # (the random model, the opener favoured, calls again and again until max_tokens: the first is whole)
    auto = chat(agent, tool_choice="auto", **{**body, "max_tokens": 120, "logit_bias": {str(opener[0]): 20}}).json()
    call = auto["choices"][0]["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), schema_of(WEATHER))


# ---- structured outputs -----------------------------------------------------------------------------

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("seed", [1, 2])
def test_response_format_json_schema_gives_valid_json(agent, seed):
    r = chat(
        agent,
        messages=[{"role": "user", "content": "a person"}],
        max_tokens=300,
        temperature=1.0,
        seed=seed,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)


def closing_bias(server) -> dict:
    """logit_bias favouring the tokens that close JSON strings and objects: a random model left
    alone writes one string until max_tokens; with these it ends — where the constraint lets it."""
    ids = [httpx.post(server.url + "/tokenize", json={"content": c}).json()["tokens"] for c in ('"', "}")]
    assert all(len(i) == 1 for i in ids)
    return {str(i[0]): 8 for i in ids}


@pytest.mark.parametrize("seed", [4, 5])
def test_response_format_json_object_gives_an_object(agent, seed):
    r = chat(
        agent,
        messages=[{"role": "user", "content": "json please"}],
        max_tokens=200,
        temperature=0.7,
        seed=seed,
        response_format={"type": "json_object"},
        logit_bias=closing_bias(agent),
    )
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert isinstance(json.loads(choice["message"]["content"]), dict)


def test_the_openai_client_parses_into_a_pydantic_model(agent):
    openai = pytest.importorskip("openai")
    pydantic = pytest.importorskip("pydantic")

    class City(pydantic.BaseModel):
        name: str
        population: int

    client = openai.OpenAI(base_url=agent.url + "/v1", api_key="none")
    out = client.chat.completions.parse(
        model="agent",
        messages=[{"role": "user", "content": "a city"}],
        response_format=City,
        max_tokens=300,
        temperature=0,
        logit_bias=closing_bias(agent),
    )
    assert isinstance(out.choices[0].message.parsed, City)


# ---- OpenAI parity ---------------------------------------------------------------------------------


def test_without_a_seed_each_request_draws_its_own_and_reports_it(agent):
    body = dict(messages=ASK, max_tokens=12, temperature=1.5)
    a, b = chat(agent, **body), chat(agent, **body)
    seeds = {a.headers["x-colibri-seed"], b.headers["x-colibri-seed"]}
    assert len(seeds) == 2 and a.json()["seed"] == int(a.headers["x-colibri-seed"])
    again = chat(agent, seed=a.json()["seed"], **body)
    assert again.json()["choices"][0]["message"] == a.json()["choices"][0]["message"]


def test_n_choices_and_cached_tokens(agent):
    """n choices: choice i is the reply a single request with seed + i gets; the next request's
    prompt comes from the KV cache (cached_tokens)."""
    body = dict(messages=[{"role": "user", "content": "tell me two things"}], max_tokens=6, temperature=1.5)
    r = chat(agent, n=3, seed=11, **body).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    singles = [chat(agent, seed=11 + i, **body).json() for i in range(3)]
    assert [c["message"] for c in r["choices"]] == [s["choices"][0]["message"] for s in singles]
    assert r["usage"]["completion_tokens"] == sum(s["usage"]["completion_tokens"] for s in singles)
    assert r["usage"]["prompt_tokens"] == singles[0]["usage"]["prompt_tokens"]
    assert singles[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_logit_bias_forces_a_token(agent):
    ids = httpx.post(agent.url + "/tokenize", json={"content": "Z"}).json()["tokens"]
    assert len(ids) == 1
    r = chat(agent, messages=ASK, max_tokens=4, temperature=0, logit_bias={str(ids[0]): 100})
    assert r.json()["choices"][0]["message"]["content"] == "ZZZZ"


def test_tokenize_and_detokenize(agent):
    text = 'hello world {"a": 1}'
    r = httpx.post(agent.url + "/tokenize", json={"content": text, "with_pieces": True}).json()
    ids = [t["id"] for t in r["tokens"]]
    assert "".join(t["piece"] for t in r["tokens"]) == text and r["count"] == len(ids)
    assert httpx.post(agent.url + "/tokenize", json={"prompt": text}).json()["tokens"] == ids  # vLLM's shape
    assert httpx.post(agent.url + "/detokenize", json={"tokens": ids}).json()["content"] == text
    conv = httpx.post(agent.url + "/tokenize", json={"messages": ASK}).json()
    assert conv["count"] > len(ids)
    bad = httpx.post(agent.url + "/detokenize", json={"tokens": [AGENT_VOCAB + 5]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_a_model_by_its_id(agent):
    assert httpx.get(agent.url + "/v1/models/agent").json()["id"] == "agent"
    r = httpx.get(agent.url + "/v1/models/other")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    "field, value",
    [
        ("audio", {"voice": "alloy", "format": "mp3"}),
        ("modalities", ["text", "audio"]),
        ("prediction", {"type": "code", "content": "x"}),  # only "content" predictions exist
        ("functions", [{"name": "f"}]),
        ("store", True),
        ("max_token", 5),
        ("web_search_options", {}),
        ("service_tier", "flex"),
    ],
)
def test_a_field_not_implemented_is_a_400_naming_it(agent, field, value):
    r = chat(agent, messages=ASK, max_tokens=2, **{field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


@pytest.mark.parametrize("field, value", [("suffix", "x"), ("best_of", 3), ("echo", True), ("top_logprobs", 2)])
def test_completions_refuse_what_they_do_not_implement(agent, field, value):
    r = httpx.post(agent.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, field: value}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_fields_meaningless_here_are_accepted(agent):
    r = chat(
        agent,
        messages=ASK,
        max_tokens=2,
        user="u1",
        metadata={"k": "v"},
        store=False,
        prompt_cache_key="p",
        safety_identifier="s",
        service_tier="auto",
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"1": 500}}, "logit_bias"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ],
)
def test_bad_agent_fields_are_400s(agent, body, param):
    r = chat(agent, **{"messages": ASK, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_reasoning_effort_reaches_the_template(agent):
    # Qwen3's template reads enable_thinking: "none" renders the empty think block into the prompt
    r = chat(agent, messages=ASK, max_tokens=2, reasoning_effort="none")
    assert r.status_code == 200, r.text
    ids_none = httpx.post(
        agent.url + "/tokenize", json={"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}
    ).json()
    assert r.json()["usage"]["prompt_tokens"] == ids_none["count"]


@pytest.mark.parametrize(
    "raw, param",
    [
        (b'{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}', "model"),
        (b'{"model": "agent", "messages": [{"role": "user", "content": "a\\udfff"}], "max_tokens": 1}', "messages"),
        (
            b'{"model": "agent", "messages": [{"role": "user", "content": "hi"}], "metadata": {"\\ud800": 1}}',
            "metadata",
        ),
    ],
)
def test_lone_surrogates_anywhere_are_400(agent, raw, param):
    r = httpx.post(agent.url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == param


# ---- nothing a request triggers stops the server ----------------------------------------------------

LOOPING = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"


def test_a_looping_template_times_out_and_the_server_keeps_answering(agent_dir, tmp_path):
    from colibri.textfiles import import_text_files

    looped, source = tmp_path / "looped", tmp_path / "source"
    shutil.copytree(agent_dir, looped)
    source.mkdir()
    shutil.copy(agent_dir / "tokenizer.json", source / "tokenizer.json")
    cfg = json.loads((agent_dir / "tokenizer_config.json").read_text())
    (source / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": LOOPING}))
    import_text_files(looped, source, log=lambda *a: None)
    with Server(looped, "--model-name", "agent", patch="PREPARE_SECONDS = 2") as s:
        t0 = time.time()
        r = chat(s, messages=ASK, max_tokens=2)
        # the template sandbox stops it at its step limit (ad611fc), or the bound of the request's
        # preparation comes first on a slower machine: either way a 422, and the server goes on
        assert r.status_code == 422 and r.json()["error"]["code"] in ("chat_template_error", "prepare_timeout"), r.text
        assert time.time() - t0 < 30
        assert httpx.get(s.url + "/health", timeout=5).status_code == 200
        done = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert done.status_code == 200
        code, err = s.stop()
        assert "Traceback" not in err


# ---- the schema -------------------------------------------------------------------------------------


def test_every_field_the_openai_sdk_sends_is_classified():
    """A field the SDK knows is implemented, accepted as meaningless or refused, never unknown:
    the SDK's own parameter lists against the protocol's models."""
    openai = pytest.importorskip("openai")
    from colibri.serve import protocol
    from openai.types import completion_create_params as completion
    from openai.types.chat import completion_create_params as chat_params

    assert openai
    for sdk, ours in (
        (chat_params.CompletionCreateParamsBase, protocol.ChatCompletionRequest),
        (completion.CompletionCreateParamsBase, protocol.CompletionRequest),
    ):
        missing = set(sdk.__annotations__) - set(ours.model_fields)
        assert not missing, f"{ours.__name__} does not classify {sorted(missing)}"


def test_openapi_documents_every_route_and_body(agent):
    doc = httpx.get(agent.url + "/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize", "/v1/models", "/health"} <= set(
        doc["paths"]
    )
    schemas = doc["components"]["schemas"]
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    chat_schema = schemas[body["$ref"].rsplit("/", 1)[1]]
    assert {"messages", "tools", "tool_choice", "response_format", "logit_bias", "seed"} <= set(
        chat_schema["properties"]
    )
    assert chat_schema.get("additionalProperties") is False


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 10**6) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
CHAT_FIELDS = [
    "temperature",
    "top_p",
    "n",
    "stop",
    "seed",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "response_format",
    "reasoning_effort",
    "user",
    "stream_options",
    "top_k",
    "audio",
    "max_completion_tokens",
    "parallel_tool_calls",
    "chat_template_kwargs",
    "frequency_penalty",
]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(CHAT_FIELDS) | st.text(max_size=6), JSON_VALUES, max_size=4))
def test_any_body_is_answered_in_openai_shape_never_a_500(agent, extra):
    """Whatever a client puts in the fields, the answer is a 200 or an OpenAI-shaped 4xx."""
    body = {"model": "agent", "messages": ASK, **extra, "max_tokens": 2, "stream": False}
    raw = json.dumps(body).encode()  # Python's JSON: NaN and Infinity too, as some clients send
    r = httpx.post(
        agent.url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}, timeout=120
    )
    assert r.status_code in (200, 400, 404, 422), r.text
    if r.status_code != 200:
        err = r.json()["error"]
        assert err["message"] and err["type"]


def test_more_tools_than_openai_allows_are_a_400_naming_tools(agent):
    """128 tools at most (OpenAI's limit), in each API: beyond it one clear 400, not a template
    rendered over thousands of definitions."""
    many = [{**WEATHER, "function": {**WEATHER["function"], "name": f"tool_{i}"}} for i in range(129)]
    r = chat(agent, messages=ASK, max_tokens=2, tools=many)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    anthropic_tools = [{"name": f"tool_{i}", "input_schema": {"type": "object"}} for i in range(129)]
    r = httpx.post(
        agent.url + "/v1/messages",
        json={"model": "agent", "max_tokens": 2, "messages": ASK, "tools": anthropic_tools},
        timeout=60,
    )
    assert r.status_code == 400 and "tools" in r.json()["error"]["message"], r.text
    response_tools = [{"type": "function", "name": f"tool_{i}", "parameters": {"type": "object"}} for i in range(129)]
    r = httpx.post(
        agent.url + "/v1/responses", json={"model": "agent", "input": "hi", "tools": response_tools}, timeout=60
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    r = chat(agent, messages=ASK, max_tokens=2, tools=many[:128])  # accepted (its prompt may not fit 4,096 tokens)
    assert r.status_code == 200 or r.json()["error"]["param"] != "tools", r.text
