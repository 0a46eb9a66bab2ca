"""Conversations as OpenAI-style clients send them reach every real chat template (issue 63, item 3).

Clients send tool-call arguments as a JSON string (every SDK) or as an object (transformers' docs),
`content: null` beside tool_calls, the `developer` role, and reasoning as `reasoning_content`,
`thinking` or `reasoning`. Each template (tests/fixtures/text/chat) is probed once for what it makes
of these shapes, and render() hands it the shape it renders; the expected fragments below are read
from the templates themselves. No torch, no transformers: only the templates and the special
tokens of the fixture vocabularies they were rendered with.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import colibri.chat
from colibri.chat import ChatTemplate, check_messages
from colibri.errors import ColibriError
from conftest import render_on_the_fixture_day

TEXT = Path(__file__).parent / "fixtures" / "text"
SPECS = {p.stem: json.loads(p.read_text(encoding="utf-8")) for p in sorted((TEXT / "chat").glob("*.json"))}
TEMPLATES = sorted(p.stem for p in (TEXT / "chat").glob("*.jinja"))
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "The city"}},
                "required": ["city"],
            },
        },
    }
]
USER = {"role": "user", "content": "Weather?"}
NEMO_ID = "74196fe72"  # sha256("call_1")[:9]: Mistral-Nemo accepts only 9 letters or digits


def special_tokens(vocab: str) -> dict:
    """{"bos_token": ..., "eos_token": ...} as the fixture vocabulary's tokenizer_config.json sets them."""
    cfg = json.loads((TEXT / "vocab" / vocab / "tokenizer_config.json").read_text(encoding="utf-8"))
    return {
        k: v if isinstance(v, str) else v["content"]
        for k, v in cfg.items()
        if k.endswith("_token") and (isinstance(v, str) or isinstance(v, dict) and "content" in v)
    }


@functools.lru_cache(maxsize=None)
def template(name: str) -> ChatTemplate:
    """The fixture template with the special tokens of the vocabulary its fixture was rendered with."""
    spec = next(s for s in SPECS.values() if s["template_file"] == f"{name}.jinja")
    source = (TEXT / "chat" / f"{name}.jinja").read_text(encoding="utf-8")
    return ChatTemplate(source, f"{name}.jinja", special_tokens(spec["vocab"]))


def probe_of(t: ChatTemplate):
    (probe,) = t._probes.values()
    return probe


def call(arguments, content=None, call_id="call_1", **fields) -> dict:
    """An assistant turn as the OpenAI SDK sends it back: content null beside tool_calls."""
    return {
        "role": "assistant",
        "content": content,
        **fields,
        "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
        ],
    }


def history(arguments, **fields) -> list:
    return [USER, call(arguments, **fields), {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]


# ---- what each template is found to do ------------------------------------------------------------------

# arguments form, needs content "", needs 9-character ids, knows `developer`, renders `tool`, reasoning read
PROBES = {
    "GLM-4.6": ("object", False, False, False, True, ("reasoning_content",)),
    "Qwen-Qwen2.5-7B-Instruct": ("object", True, False, False, True, ()),
    "Qwen-Qwen3-0.6B": ("object", True, False, False, True, ("reasoning_content",)),
    "deepseek-ai-DeepSeek-V3.1": ("object", True, False, False, True, ()),
    "google-gemma-4-31B-it": ("object", False, False, True, True, ("reasoning_content", "reasoning")),
    "mistralai-Mistral-Nemo-Instruct-2407": ("object", True, True, False, True, ()),
    "mistralai-Mixtral-8x7B-Instruct-v0.1": (None, True, False, False, False, ()),
    "moonshotai-Kimi-K2": ("object", False, False, False, True, ()),
    "openai-gpt-oss-120b": ("object", True, False, True, True, ("thinking",)),
}

# the tool call {"city": "Paris"} and its result "18C", as each template writes them
FRAGMENTS = {
    "GLM-4.6": (
        "<|assistant|>\n<think></think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
        "<arg_value>Paris</arg_value>\n</tool_call>",
        "<|observation|>\n<tool_response>\n18C\n</tool_response>",
    ),
    "Qwen-Qwen2.5-7B-Instruct": (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call><|im_end|>',
        "<|im_start|>user\n<tool_response>\n18C\n</tool_response><|im_end|>",
    ),
    "Qwen-Qwen3-0.6B": (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call><|im_end|>',
        "<|im_start|>user\n<tool_response>\n18C\n</tool_response><|im_end|>",
    ),
    "deepseek-ai-DeepSeek-V3.1": (
        "<｜Assistant｜><think></think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
        'get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>'
        "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
        "<｜tool▁output▁begin｜>18C<｜tool▁output▁end｜>",
    ),
    "google-gemma-4-31B-it": (
        '<|turn>model\n<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>',
        '<|tool_response>response:get_weather{value:<|"|>18C<|"|>}<tool_response|>',
    ),
    "mistralai-Mistral-Nemo-Instruct-2407": (
        f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {{"city": "Paris"}}, "id": "{NEMO_ID}"}}]</s>',
        f'[TOOL_RESULTS]{{"content": 18C, "call_id": "{NEMO_ID}"}}[/TOOL_RESULTS]',
    ),
    # no tool calls, no tool role: both written as JSON text into the turns (minja's polyfill)
    "mistralai-Mixtral-8x7B-Instruct-v0.1": (
        '[/INST]{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call_1"}]}</s>',
        '[INST] {"tool_response": {"tool": "get_weather", "content": "18C", "tool_call_id": "call_1"}} [/INST]',
    ),
    "moonshotai-Kimi-K2": (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>',
        "<|im_system|>tool<|im_middle|>## Return of call_1\\n18C<|im_end|>",
    ),
    "openai-gpt-oss-120b": (
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>',
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"18C"<|end|>',
    ),
}

# templates that write the arguments as JSON (tojson): the object's json.dumps is in their text
JSON_ARGUMENTS = {
    "Qwen-Qwen2.5-7B-Instruct",
    "Qwen-Qwen3-0.6B",
    "deepseek-ai-DeepSeek-V3.1",
    "mistralai-Mistral-Nemo-Instruct-2407",
    "mistralai-Mixtral-8x7B-Instruct-v0.1",
    "moonshotai-Kimi-K2",
    "openai-gpt-oss-120b",
}


def test_every_fixture_template_is_in_the_tables():
    assert TEMPLATES and set(TEMPLATES) == set(PROBES) == set(FRAGMENTS)


@pytest.mark.parametrize("name", TEMPLATES)
def test_probes_find_what_each_template_reads(name):
    p = probe_of(template(name))
    found = (
        p.arguments_form,
        p.needs_content,
        p.needs_short_call_ids,
        p.knows_developer,
        p.renders_tool_role,
        p.reasoning_names,
    )
    assert found == PROBES[name]


def test_each_template_is_probed_once(monkeypatch):
    t = ChatTemplate((TEXT / "chat" / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8"), "t")
    renders = []
    real = colibri.chat._TemplateProbe._render
    monkeypatch.setattr(colibri.chat._TemplateProbe, "_render", lambda self, *a: renders.append(1) or real(self, *a))
    t.render([USER], tools=TOOLS)
    assert renders == []  # a plain conversation asks nothing
    first = t.render(history('{"city": "Paris"}') + [{"role": "developer", "content": "Be brief."}], tools=TOOLS)
    asked = len(renders)
    assert asked > 0
    assert (
        t.render(history('{"city": "Paris"}') + [{"role": "developer", "content": "Be brief."}], tools=TOOLS) == first
    )
    assert len(renders) == asked


# ---- tool calls -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", TEMPLATES)
def test_string_and_object_arguments_render_the_same_text(name):
    t = template(name)
    as_string = t.render(history('{"city": "Paris"}'), tools=TOOLS)
    as_object = t.render(history({"city": "Paris"}), tools=TOOLS)
    compact = t.render(history('{"city":"Paris"}'), tools=TOOLS)
    assert as_string == as_object == compact
    tool_call, tool_result = FRAGMENTS[name]
    assert tool_call in as_string and tool_result in as_string
    assert as_string.count("Paris") == 1  # neither lost nor repeated
    assert '\\"' not in as_string  # nor encoded twice


@pytest.mark.parametrize("name", TEMPLATES)
def test_no_content_beside_tool_calls_renders_as_empty_content(name):
    t = template(name)
    missing = history({"city": "Paris"})
    del missing[1]["content"]
    texts = {
        t.render(msgs, tools=TOOLS)
        for msgs in (history({"city": "Paris"}, content=None), missing, history({"city": "Paris"}, content=""))
    }
    assert len(texts) == 1 and FRAGMENTS[name][0] in texts.pop()


@pytest.mark.parametrize("name", TEMPLATES)
def test_the_callers_messages_are_left_as_they_were(name):
    msgs = history('{"city": "Paris"}', reasoning_content="Look it up.") + [{"role": "developer", "content": "x"}]
    before = copy.deepcopy(msgs)
    try:
        template(name).render(msgs, tools=TOOLS)
    except ColibriError:
        pass  # Mixtral refuses a system turn there
    assert msgs == before


def test_arguments_that_are_not_a_json_object_stay_as_sent():
    qwen3 = template("Qwen-Qwen3-0.6B")  # writes a string as it is
    for arguments in ("not json {", "[1, 2]", "42"):
        text = qwen3.render(history(arguments), tools=TOOLS)
        assert f'"arguments": {arguments}}}' in text
    with pytest.raises(ColibriError, match="refused the conversation: Invalid tool call arguments passed") as e:
        template("GLM-4.6").render(history("not json {"), tools=TOOLS)  # GLM-4.6 takes objects only
    assert "\n" not in str(e.value)


def test_mistral_ids_are_shortened_alike_for_the_call_and_its_result():
    nemo = template("mistralai-Mistral-Nemo-Instruct-2407")
    text = nemo.render(history({"city": "Paris"}), tools=TOOLS)
    assert text.count(NEMO_ID) == 2
    kept = [
        USER,
        call({"city": "Paris"}, call_id="abcDEF123"),
        {"role": "tool", "tool_call_id": "abcDEF123", "content": "18C"},
    ]
    assert nemo.render(kept, tools=TOOLS).count('"abcDEF123"') == 2


def test_a_template_without_the_tool_role_gets_the_result_as_a_user_turn():
    mixtral = template("mistralai-Mixtral-8x7B-Instruct-v0.1")
    msgs = [
        USER,
        call({"city": "Paris"}),
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
        {"role": "assistant", "content": "It is 18C."},
    ]
    text = mixtral.render(msgs, tools=TOOLS, add_generation_prompt=False)
    assert text.endswith(
        '[INST] {"tool_response": {"tool": "get_weather", "content": "18C", '
        '"tool_call_id": "call_1"}} [/INST]It is 18C.</s>'
    )


def test_tool_calls_of_the_wrong_shape_are_one_line_errors():
    for bad in ("get_weather()", [["get_weather"]], {"name": "get_weather"}):
        with pytest.raises(ColibriError, match=r"messages\[1\]\['tool_calls'\] must be a list") as e:
            check_messages([USER, {"role": "assistant", "content": None, "tool_calls": bad}])
        assert "\n" not in str(e.value)


# nested JSON with unicode, quotes and backslashes in keys and values
unicode_text = st.characters(blacklist_categories=("Cs",))
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(10**20), 10**20)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(unicode_text, max_size=12)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
keys = st.text(unicode_text, min_size=1, max_size=8) | st.sampled_from(['"q"', "é", "\\"])
tricky_strings = st.sampled_from(['say "hi"', "a\\b", "ünï 😀", "</tool_call>", '{"x": 1}'])
argument_objects = st.dictionaries(keys, json_values | tricky_strings, max_size=4)


@pytest.mark.parametrize("name", TEMPLATES)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arguments=argument_objects)
def test_any_arguments_render_alike_as_a_string_and_as_an_object(name, arguments):
    t = template(name)
    as_object = t.render(history(arguments), tools=TOOLS)
    assert t.render(history(json.dumps(arguments)), tools=TOOLS) == as_object
    assert t.render(history(json.dumps(arguments, ensure_ascii=False, indent=1)), tools=TOOLS) == as_object
    if name in JSON_ARGUMENTS:  # written once, encoded once
        assert json.dumps(arguments, ensure_ascii=False) in as_object


# ---- developer and reasoning ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", TEMPLATES)
def test_developer_renders_as_system(name):
    t = template(name)
    as_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    as_developer = [{"role": "developer", "content": "Be brief."}, as_system[1]]
    try:
        expected = t.render(as_system)
    except ColibriError:  # Mixtral has no system role: the same refusal
        with pytest.raises(ColibriError, match="must alternate"):
            t.render(as_developer)
        return
    assert "Be brief." in expected and t.render(as_developer) == expected


def test_a_template_printing_any_role_gets_system_for_developer():
    t = ChatTemplate("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}", "t")
    assert (
        t.render([{"role": "developer", "content": "Be brief."}], add_generation_prompt=False)
        == "<|im_start|>system\nBe brief.<|im_end|>\n"
    )


REASONING = {  # where the turn's reasoning "Checked the map." lands, for templates that render it
    "GLM-4.6": "<|assistant|>\n<think>Checked the map.</think>\nParis.",
    "Qwen-Qwen3-0.6B": "<|im_start|>assistant\n<think>\nChecked the map.\n</think>\n\nParis.<|im_end|>",
    "openai-gpt-oss-120b": "<|start|>assistant<|channel|>analysis<|message|>Checked the map.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Paris.<|return|>",
}


@pytest.mark.parametrize("name", TEMPLATES)
@pytest.mark.parametrize("field", ["reasoning_content", "thinking", "reasoning"])
def test_reasoning_under_any_name_reaches_the_template(name, field):
    t = template(name)
    msgs = [
        {"role": "user", "content": "Where?"},
        {"role": "assistant", "content": "Paris.", field: "Checked the map."},
    ]
    text = t.render(msgs, add_generation_prompt=False)
    if name in REASONING:
        assert REASONING[name] in text
    else:  # it renders no reasoning: the field changes nothing
        assert "Checked the map." not in text
        assert text == t.render(msgs[:1] + [{"role": "assistant", "content": "Paris."}], add_generation_prompt=False)


@pytest.mark.parametrize("field", ["reasoning_content", "thinking", "reasoning"])
def test_gemma_shows_reasoning_beside_tool_calls(field):
    text = template("google-gemma-4-31B-it").render(
        [USER, call({"city": "Paris"}, **{field: "Checked the map."})], tools=TOOLS
    )
    assert "<|turn>model\n<|channel>thought\nChecked the map.\n<channel|><|tool_call>call:get_weather" in text


# ---- transformers' text for everything else -------------------------------------------------------------


@pytest.mark.parametrize("spec_name", sorted(SPECS))
def test_fixture_conversations_render_as_transformers_did(spec_name, monkeypatch):
    spec = SPECS[spec_name]
    render_on_the_fixture_day(monkeypatch, spec)
    source = (TEXT / "chat" / spec["template_file"]).read_text(encoding="utf-8")
    t = ChatTemplate(source, spec["template_file"], special_tokens(spec["vocab"]))
    for c in spec["cases"]:
        if "error" in c:
            with pytest.raises(ColibriError):
                t.render(c["messages"], add_generation_prompt=c["add_generation_prompt"], **c["kwargs"])
        else:
            text = t.render(c["messages"], add_generation_prompt=c["add_generation_prompt"], **c["kwargs"])
            assert text == c["text"], (c["messages"], c["kwargs"])
