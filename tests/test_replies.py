"""Reply parsing (colibri/replies.py): a model's generated text -> content, reasoning_content and
tool_calls, whole and streamed, for every model family, with the families' real chat templates.

Cases follow each family's documented reply format; many are those of llama.cpp's
tests/test-chat.cpp, written again here. Templates: tests/fixtures/text/chat/*.jinja, and
tests/fixtures/text/chat/replies/*.jinja (llama.cpp's models/templates copies of Qwen3-Coder,
QwQ, GLM-4.7-Flash, DeepSeek-R1-Distill, Kimi-K2-Thinking, Mistral Small 3.2, Ministral-3
Reasoning). Streaming is checked over random splits of every case (hypothesis); grammars are
compiled and run with llguidance over the Qwen3 vocabulary (skipped where llguidance is missing).
"""

import functools
import json
import lzma
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colibri import replies
from colibri.chat import ChatTemplate
from colibri.errors import ColibriError

CHAT = Path(__file__).parent / "fixtures" / "text" / "chat"
QWEN3_VOCAB = Path(__file__).parent / "fixtures" / "text" / "vocab" / "qwen3" / "tokenizer.json.xz"


@functools.lru_cache(maxsize=None)
def template(name: str) -> ChatTemplate:
    path = CHAT / f"{name}.jinja"
    if not path.exists():
        path = CHAT / "replies" / f"{name}.jinja"
    return ChatTemplate(path.read_text(encoding="utf-8"), where=path.name)


def tool(name: str, properties: dict | None = None, required=()) -> dict:
    params = {"type": "object", "properties": properties or {}}
    if required:
        params["required"] = list(required)
    return {"type": "function", "function": {"name": name, "description": name, "parameters": params}}


SPECIAL = tool("special_function", {"arg1": {"type": "integer"}}, ["arg1"])
WITH_OPT = tool("special_function_with_opt", {"arg1": {"type": "integer"}, "arg2": {"type": "integer"}}, ["arg1"])
PYTHON = tool("python", {"code": {"type": "string"}}, ["code"])
GET_TIME = tool("get_time", {"city": {"type": "string"}}, ["city"])
GET_WEATHER = tool("get_weather", {"city": {"type": "string"}, "days": {"type": "integer"}}, ["city"])
TODO = tool("todo_list", {"todos": {"type": "array"}}, ["todos"])
EMPTY = tool("empty_args")
TOGGLE = tool("toggle", {"enabled": {"type": "boolean"}}, ["enabled"])
CONFIG = tool("set_config", {"config": {"type": "object"}}, ["config"])
NULLABLE = tool("set_nullable_str", {"name": {"type": ["string", "null"]}}, ["name"])
UNION = tool("set_union", {"value": {"type": ["string", "object"]}, "amount": {"type": ["string", "integer"]}})
UNIT = tool("set_unit", {"unit": {"enum": ["celsius", "fahrenheit"]}}, ["unit"])
SAY = tool("say", {"text": {"type": "string"}}, ["text"])
TOOLS = [SPECIAL, WITH_OPT, PYTHON, GET_TIME, GET_WEATHER, TODO, EMPTY, TOGGLE, CONFIG, NULLABLE, UNION, UNIT, SAY]

HELLO = "Hello, world!\nWhat's up?"
THINKING = "I'm\nthinking"
UNICODE_ARGS = {"text": 'say "hi" \\ — 你好 🙂'}


def expect(content=None, reasoning=None, calls=()) -> dict:
    """The message a case expects; calls are (name, arguments object[, id])."""
    return {"content": content, "reasoning_content": reasoning, "calls": [tuple(c) for c in calls]}


def summary(message: dict, with_ids: bool) -> dict:
    """A message in expect()'s shape (arguments read as JSON: each must parse)."""
    calls = []
    for c in message.get("tool_calls") or ():
        assert c["type"] == "function"
        call = (c["function"]["name"], json.loads(c["function"]["arguments"]))
        calls.append(call + ((c["id"],) if with_ids else ()))
    return {"content": message["content"], "reasoning_content": message["reasoning_content"], "calls": calls}


def check(message: dict, want: dict) -> None:
    with_ids = any(len(c) == 3 for c in want["calls"])
    assert message["role"] == "assistant"
    assert summary(message, with_ids) == want


# (template, reply text, expected message, parse keywords)
CASES = [
    # -- Qwen3 (Hermes calls, <think>)
    ("Qwen-Qwen3-0.6B", HELLO, expect(HELLO), {}),
    ("Qwen-Qwen3-0.6B", f"<think>\n{THINKING}\n</think>\n\n{HELLO}<|im_end|>", expect(HELLO, THINKING), {}),
    (
        "Qwen-Qwen3-0.6B",
        '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call><|im_end|>',
        expect(calls=[("special_function", {"arg1": 1})]),
        {},
    ),
    (
        "Qwen-Qwen3-0.6B",
        f"<think>\n{THINKING}\n</think>\n\n{HELLO}\n<tool_call>\n"
        '{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call>',
        expect(HELLO, THINKING, [("special_function", {"arg1": 1})]),
        {},
    ),
    (
        "Qwen-Qwen3-0.6B",
        '<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
        expect(calls=[("get_time", {"city": "Paris"}), ("get_weather", {"city": "Paris", "days": 3})]),
        {},
    ),
    (
        "Qwen-Qwen3-0.6B",
        '<tool_call>\n{"name": "set_config", "arguments": {"config": {"a": [1, {"b": null}], "c": "}"}}}\n</tool_call>',
        expect(calls=[("set_config", {"config": {"a": [1, {"b": None}], "c": "}"}})]),
        {},
    ),
    (
        "Qwen-Qwen3-0.6B",
        "<tool_call>\n" + json.dumps({"name": "say", "arguments": UNICODE_ARGS}) + "\n</tool_call>",
        expect(calls=[("say", UNICODE_ARGS)]),
        {},
    ),
    (
        "Qwen-Qwen3-0.6B",
        "<tool_call>\n" + json.dumps({"name": "say", "arguments": UNICODE_ARGS}, ensure_ascii=False) + "\n</tool_call>",
        expect(calls=[("say", UNICODE_ARGS)]),
        {},
    ),
    # arguments as a JSON string (some Qwen2.5 replies)
    (
        "Qwen-Qwen3-0.6B",
        '<tool_call>\n{"name": "special_function", "arguments": "{\\"arg1\\": 1}"}\n</tool_call>',
        expect(calls=[("special_function", {"arg1": 1})]),
        {},
    ),
    # a malformed call stays content, the text as it was
    (
        "Qwen-Qwen3-0.6B",
        'Let me see <tool_call>\n{"name": "special_function", "arguments": {"arg1": }\n</tool_call>',
        expect('Let me see <tool_call>\n{"name": "special_function", "arguments": {"arg1": }\n</tool_call>'),
        {},
    ),
    (
        "Qwen-Qwen3-0.6B",
        '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1',
        expect('<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1'),
        {},
    ),
    # a call inside the reasoning is reasoning; a marker as text in content stays text
    (
        "Qwen-Qwen3-0.6B",
        "<think>I could write <tool_call> here</think>Done.",
        expect("Done.", "I could write <tool_call> here"),
        {},
    ),
    ("Qwen-Qwen3-0.6B", "Use <|im_end|> to end a turn.<|im_end|>", expect("Use <|im_end|> to end a turn."), {}),
    # with thinking disabled the prompt holds an empty block; a reply still may reason
    ("Qwen-Qwen3-0.6B", HELLO, expect(HELLO), {"enable_thinking": False}),
    # tools=None (or tool_choice "none"): call markers are text
    (
        "Qwen-Qwen3-0.6B",
        '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call>',
        expect('<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call>'),
        {"tools": None},
    ),
    # -- Qwen2.5 (Hermes, no reasoning)
    ("Qwen-Qwen2.5-7B-Instruct", "<think>not a block</think>", expect("<think>not a block</think>"), {}),
    (
        "Qwen-Qwen2.5-7B-Instruct",
        '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call>',
        expect(calls=[("special_function", {"arg1": 1})]),
        {},
    ),
    # -- QwQ (the prompt opens <think>)
    (
        "Qwen-QwQ-32B",
        "Let me think about this...\n</think>\nThe answer is 42.",
        expect("The answer is 42.", "Let me think about this..."),
        {"enable_thinking": True},
    ),
    ("Qwen-QwQ-32B", "</think>Hello, world!", expect("Hello, world!"), {"enable_thinking": True}),
    (
        "Qwen-QwQ-32B",
        f'{THINKING}</think>\n<tool_call>\n{{"name": "get_time", "arguments": {{"city": "Rome"}}}}\n</tool_call>',
        expect(None, THINKING, [("get_time", {"city": "Rome"})]),
        {"enable_thinking": True},
    ),
    # -- Qwen3-Coder (XML parameters)
    ("Qwen3-Coder", HELLO, expect(HELLO), {}),
    (
        "Qwen3-Coder",
        "<tool_call>\n<function=special_function>\n<parameter=arg1>\n1\n</parameter>\n</function>\n</tool_call>",
        expect(calls=[("special_function", {"arg1": 1})]),
        {},
    ),
    (
        "Qwen3-Coder",
        "Let me call it.\n<function=special_function>\n<parameter=arg1>\n1\n</parameter>\n</function>\n</tool_call>",
        expect("Let me call it.", calls=[("special_function", {"arg1": 1})]),
        {},
    ),
    (
        "Qwen3-Coder",
        "<tool_call>\n<function=special_function>\n<parameter=arg1>\n1\n</parameter>\n</function>\n"
        "</tool_call>\n<tool_call>\n<function=special_function_with_opt>\n<parameter=arg1>\n1\n"
        "</parameter>\n<parameter=arg2>\n2\n</parameter>\n</function>\n</tool_call>",
        expect(calls=[("special_function", {"arg1": 1}), ("special_function_with_opt", {"arg1": 1, "arg2": 2})]),
        {},
    ),
    (
        "Qwen3-Coder",
        '<tool_call>\n<function=python>\n<parameter=code>\ndef hello():\n    print("Hello, world!")\n\n'
        "hello()\n</parameter>\n</function>\n</tool_call>",
        expect(calls=[("python", {"code": 'def hello():\n    print("Hello, world!")\n\nhello()'})]),
        {},
    ),
    (
        "Qwen3-Coder",
        "<tool_call>\n<function=say>\n<parameter=text>\n"
        + UNICODE_ARGS["text"]
        + "\n</parameter>\n</function>\n</tool_call>",
        expect(calls=[("say", UNICODE_ARGS)]),
        {},
    ),
    (
        "Qwen3-Coder",
        "<tool_call>\n<function=todo_list>\n<parameter=todos>\n"
        '[{"item": "Check stuff", "selected": false}]\n</parameter>\n</function>\n</tool_call>',
        expect(calls=[("todo_list", {"todos": [{"item": "Check stuff", "selected": False}]})]),
        {},
    ),
    (
        "Qwen3-Coder",
        "<tool_call>\n<function=set_nullable_str>\n<parameter=name>\nnull\n</parameter>\n</function>\n</tool_call>",
        expect(calls=[("set_nullable_str", {"name": None})]),
        {},
    ),
    (
        "Qwen3-Coder",
        '<tool_call>\n<function=set_union>\n<parameter=value>\n{"a": 1}\n</parameter>\n<parameter=amount>\n'
        "2 dollars\n</parameter>\n</function>\n</tool_call>",
        expect(calls=[("set_union", {"value": {"a": 1}, "amount": "2 dollars"})]),
        {},
    ),
    (
        "Qwen3-Coder",
        "<tool_call>\n<function=set_union>\n<parameter=value>\n{not valid json\n</parameter>\n"
        "<parameter=amount>\n42\n</parameter>\n</function>\n</tool_call>",
        expect(calls=[("set_union", {"value": "{not valid json", "amount": 42})]),
        {},
    ),
    (
        "Qwen3-Coder",
        "<tool_call>\n<function=set_unit>\n<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>",
        expect(calls=[("set_unit", {"unit": "celsius"})]),
        {},
    ),
    # Python's spelling of booleans (the template writes values with |string)
    (
        "Qwen3-Coder",
        "<tool_call>\n<function=toggle>\n<parameter=enabled>\nTrue\n</parameter>\n</function>\n</tool_call>",
        expect(calls=[("toggle", {"enabled": True})]),
        {},
    ),
    (
        "Qwen3-Coder",
        "<tool_call>\n<function=special_function>\nstray text\n</function>\n</tool_call>",
        expect("<tool_call>\n<function=special_function>\nstray text\n</function>\n</tool_call>"),
        {},
    ),
    # -- GLM-4.6 / 4.7 (key/value pairs)
    (
        "GLM-4.6",
        "<tool_call>special_function\n<arg_key>arg1</arg_key>\n<arg_value>1</arg_value>\n</tool_call>",
        expect(calls=[("special_function", {"arg1": 1})]),
        {},
    ),
    ("GLM-4.6", f"<think>{THINKING}</think>\n{HELLO}<|user|>", expect(HELLO, THINKING), {}),
    (
        "GLM-4.6",
        "<tool_call>say\n<arg_key>text</arg_key>\n<arg_value>" + UNICODE_ARGS["text"] + "</arg_value>\n</tool_call>",
        expect(calls=[("say", UNICODE_ARGS)]),
        {},
    ),
    (
        "GLM-4.6",
        "<tool_call>special_function\n<arg_value>1</arg_value>\n</tool_call>",
        expect("<tool_call>special_function\n<arg_value>1</arg_value>\n</tool_call>"),
        {},
    ),
    ("GLM-4.7-Flash", f"{THINKING}</think>{HELLO}", expect(HELLO, THINKING), {"enable_thinking": True}),
    ("GLM-4.7-Flash", HELLO, expect(HELLO), {"enable_thinking": False}),
    (
        "GLM-4.7-Flash",
        f"{THINKING}</think><tool_call>special_function<arg_key>arg1</arg_key><arg_value>1</arg_value></tool_call>",
        expect(None, THINKING, [("special_function", {"arg1": 1})]),
        {"enable_thinking": True},
    ),
    (
        "GLM-4.7-Flash",
        "<tool_call>special_function<arg_key>arg1</arg_key><arg_value>1</arg_value></tool_call>"
        "<tool_call>special_function_with_opt<arg_key>arg1</arg_key><arg_value>1</arg_value>"
        "<arg_key>arg2</arg_key><arg_value>2</arg_value></tool_call>",
        expect(calls=[("special_function", {"arg1": 1}), ("special_function_with_opt", {"arg1": 1, "arg2": 2})]),
        {"enable_thinking": False},
    ),
    (
        "GLM-4.7-Flash",
        "Let me read the diff.</think><tool_call>empty_args</tool_call>",
        expect(None, "Let me read the diff.", [("empty_args", {})]),
        {"enable_thinking": True},
    ),
    (
        "GLM-4.7-Flash",
        '<tool_call>set_config<arg_key>config</arg_key><arg_value>{"source": "spark", '
        '"options": {"strict": true}}</arg_value></tool_call>',
        expect(calls=[("set_config", {"config": {"source": "spark", "options": {"strict": True}}})]),
        {"enable_thinking": False},
    ),
    # -- DeepSeek V3.1 (NAME<sep>JSON) and R1 (function<sep>NAME + fenced JSON)
    (
        "deepseek-ai-DeepSeek-V3.1",
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"city": "XYZCITY"}'
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
        expect(calls=[("get_time", {"city": "XYZCITY"})]),
        {"enable_thinking": False},
    ),
    (
        "deepseek-ai-DeepSeek-V3.1",
        "REASONING</think>CONTENT<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time"
        '<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_weather'
        '<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        expect("CONTENT", "REASONING", [("get_time", {"city": "Paris"}), ("get_weather", {"city": "Paris"})]),
        {"enable_thinking": True},
    ),
    (
        "deepseek-ai-DeepSeek-V3.1",
        "REASONING</think>\nCONTENT",
        expect("CONTENT", "REASONING"),
        {"enable_thinking": True},
    ),
    ("deepseek-ai-DeepSeek-V3.1", "CONTENT", expect("CONTENT"), {"enable_thinking": False}),
    (
        "deepseek-ai-DeepSeek-V3.1",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        expect("<｜tool▁call▁begin｜>get_time{}<｜tool▁call▁end｜>"),
        {"enable_thinking": False},
    ),
    (
        "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
        f"{THINKING}</think>{HELLO}",
        expect(HELLO, THINKING),
        {"enable_thinking": True},
    ),
    (
        "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
        'special_function\n```json\n{"arg1": 1}```<｜tool▁call▁end｜>'
        "<｜tool▁calls▁end｜>",
        expect(calls=[("special_function", {"arg1": 1})]),
        {"enable_thinking": False},
    ),
    (
        "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
        "Plan.</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"
        '<｜tool▁sep｜>get_time\n```json\n{"city": "Oslo"}\n```'
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
        expect(None, "Plan.", [("get_time", {"city": "Oslo"})]),
        {"enable_thinking": True},
    ),
    # -- Kimi K2 (ids functions.NAME:IDX; calls may stand inside the reasoning, end markers may be missing)
    ("moonshotai-Kimi-K2", HELLO, expect(HELLO), {}),
    (
        "moonshotai-Kimi-K2",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.special_function:0"
        '<|tool_call_argument_begin|>{"arg1": 1}<|tool_call_end|><|tool_calls_section_end|>',
        expect(calls=[("special_function", {"arg1": 1}, "functions.special_function:0")]),
        {},
    ),
    (
        "moonshotai-Kimi-K2",
        HELLO + "<|tool_calls_section_begin|><|tool_call_begin|>functions.special_function:0"
        '<|tool_call_argument_begin|>{"arg1": 1}<|tool_call_end|><|tool_call_begin|>'
        'functions.python:1<|tool_call_argument_begin|>{"code": "print(\'hey\')"}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>",
        expect(
            HELLO,
            calls=[
                ("special_function", {"arg1": 1}, "functions.special_function:0"),
                ("python", {"code": "print('hey')"}, "functions.python:1"),
            ],
        ),
        {},
    ),
    (
        "Kimi-K2-Thinking",
        "<think>I'm thinking about this</think><|tool_calls_section_begin|><|tool_call_begin|>"
        'functions.special_function:0<|tool_call_argument_begin|>{"arg1": 1}<|tool_call_end|>'
        "<|tool_calls_section_end|>",
        expect(None, "I'm thinking about this", [("special_function", {"arg1": 1}, "functions.special_function:0")]),
        {},
    ),
    (
        "Kimi-K2-Thinking",
        "<think>I need to call two functions<|tool_call_begin|>functions.special_function:0"
        '<|tool_call_argument_begin|>{"arg1": 1}<|tool_call_begin|>functions.python:1'
        '<|tool_call_argument_begin|>{"code": "print(\'hey\')"}',
        expect(
            None,
            "I need to call two functions",
            [
                ("special_function", {"arg1": 1}, "functions.special_function:0"),
                ("python", {"code": "print('hey')"}, "functions.python:1"),
            ],
        ),
        {},
    ),
    (
        "moonshotai-Kimi-K2",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.special_function:0"
        "<|tool_call_argument_begin|>{arg1: 1}<|tool_call_end|><|tool_calls_section_end|>",
        expect("<|tool_call_begin|>functions.special_function:0<|tool_call_argument_begin|>{arg1: 1}<|tool_call_end|>"),
        {},
    ),
    # -- gpt-oss (harmony messages)
    ("openai-gpt-oss-120b", f"<|channel|>final<|message|>{HELLO}<|return|>", expect(HELLO), {}),
    ("openai-gpt-oss-120b", f"<|channel|>commentary<|message|>{HELLO}", expect(HELLO), {}),
    (
        "openai-gpt-oss-120b",
        f"<|channel|>analysis<|message|>{THINKING}<|end|><|start|>assistant<|channel|>final"
        f"<|message|>{HELLO}<|return|>",
        expect(HELLO, THINKING),
        {},
    ),
    ("openai-gpt-oss-120b", f"<|channel|>analysis<|message|>{THINKING}", expect(None, THINKING), {}),
    (
        "openai-gpt-oss-120b",
        ' to=functions.special_function<|channel|>analysis<|message|>{"arg1": 1}',
        expect(calls=[("special_function", {"arg1": 1})]),
        {},
    ),
    (
        "openai-gpt-oss-120b",
        '<|channel|>commentary to=functions.special_function <|constrain|>json<|message|>{"arg1": 1}<|call|>',
        expect(calls=[("special_function", {"arg1": 1})]),
        {},
    ),
    (
        "openai-gpt-oss-120b",
        f"<|channel|>analysis<|message|>{THINKING}<|end|><|start|>assistant to=functions.say"
        "<|channel|>commentary <|constrain|>json<|message|>" + json.dumps(UNICODE_ARGS) + "<|call|>",
        expect(None, THINKING, [("say", UNICODE_ARGS)]),
        {},
    ),
    (
        "openai-gpt-oss-120b",
        "<|channel|>analysis<|message|>First.<|end|><|start|>assistant<|channel|>analysis"
        "<|message|>Second.<|end|><|start|>assistant<|channel|>final<|message|>Done.",
        expect("Done.", "First.\nSecond."),
        {},
    ),
    (
        "openai-gpt-oss-120b",
        "<|channel|>analysis<|message|>I will run python<|end|><|start|>assistant"
        '<|channel|>commentary to=python <|constrain|>code<|message|>print("hello")',
        expect(None, "I will run python"),
        {},
    ),
    (
        "openai-gpt-oss-120b",
        f"<|channel|>commentary to=assistant<|channel|>analysis<|message|>{THINKING}<|end|>"
        f"<|start|>assistant<|channel|>final<|message|>{HELLO}",
        expect(HELLO, THINKING),
        {},
    ),
    (
        "openai-gpt-oss-120b",
        '<|channel|>commentary to=functions.special_function <|constrain|>json<|message|>{"arg1": oops}<|call|>',
        expect(
            '<|channel|>commentary to=functions.special_function <|constrain|>json<|message|>{"arg1": oops}<|call|>'
        ),
        {},
    ),
    # -- Gemma 4
    ("google-gemma-4-31B-it", HELLO, expect(HELLO), {}),
    ("google-gemma-4-31B-it", f"<|channel>thought\n{THINKING}<channel|>{HELLO}<turn|>", expect(HELLO, THINKING), {}),
    ("google-gemma-4-31B-it", f"<|channel>thought<channel|>{HELLO}", expect(HELLO), {}),
    (
        "google-gemma-4-31B-it",
        '<|tool_call>call:get_time{city:<|"|>London<|"|>}<tool_call|>',
        expect(calls=[("get_time", {"city": "London"})]),
        {},
    ),
    (
        "google-gemma-4-31B-it",
        f'{HELLO}<|tool_call>call:get_time{{city:<|"|>Paris<|"|>}}<tool_call|>',
        expect(HELLO, calls=[("get_time", {"city": "Paris"})]),
        {},
    ),
    (
        "google-gemma-4-31B-it",
        f"<|channel>thought\n{THINKING}<channel|>"
        '<|tool_call>call:get_time{city:<|"|>Paris<|"|>}<tool_call|>'
        '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>'
        "<|tool_response>",
        expect(None, THINKING, [("get_time", {"city": "Paris"}), ("get_weather", {"city": "Paris", "days": 3})]),
        {},
    ),
    ("google-gemma-4-31B-it", "<|tool_call>call:empty_args{}<tool_call|>", expect(calls=[("empty_args", {})]), {}),
    (
        "google-gemma-4-31B-it",
        '<|tool_call>call:todo_list{todos:[<|"|>buy milk<|"|>,<|"|>walk dog<|"|>]}<tool_call|>',
        expect(calls=[("todo_list", {"todos": ["buy milk", "walk dog"]})]),
        {},
    ),
    (
        "google-gemma-4-31B-it",
        '<|tool_call>call:set_config{config:{theme:<|"|>dark<|"|>,count:3,ok:true,x:null,f:1.5e10}}<tool_call|>',
        expect(calls=[("set_config", {"config": {"theme": "dark", "count": 3, "ok": True, "x": None, "f": 1.5e10}})]),
        {},
    ),
    (
        "google-gemma-4-31B-it",
        '<|tool_call>call:say{text:<|"|>' + UNICODE_ARGS["text"] + '<|"|>}<tool_call|>',
        expect(calls=[("say", UNICODE_ARGS)]),
        {},
    ),
    ("google-gemma-4-31B-it", f"<|channel>thought\n<channel|>{HELLO}<channel|>", expect(HELLO), {}),
    ("google-gemma-4-31B-it", f"<|channel><|channel>thought\n<channel|>{HELLO}", expect(HELLO), {}),
    (
        "google-gemma-4-31B-it",
        '<|tool_call>call:get_time{city:<|"|>Paris}<tool_call|>',
        expect('<|tool_call>call:get_time{city:<|"|>Paris}<tool_call|>'),
        {},
    ),
    # -- Mistral: the JSON list (Nemo) and NAME[ARGS] (Small 3.2, Ministral 3), [THINK]
    ("mistralai-Mistral-Nemo-Instruct-2407", HELLO, expect(HELLO), {}),
    (
        "mistralai-Mistral-Nemo-Instruct-2407",
        '[TOOL_CALLS][{"name": "special_function", "arguments": {"arg1": 1}, "id": "123456789"}]</s>',
        expect(calls=[("special_function", {"arg1": 1}, "123456789")]),
        {},
    ),
    (
        "mistralai-Mistral-Nemo-Instruct-2407",
        '[TOOL_CALLS][{"name": "get_time", "arguments": {"city": "Paris"}}, '
        '{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        expect(calls=[("get_time", {"city": "Paris"}), ("get_weather", {"city": "Paris"})]),
        {},
    ),
    (
        "mistralai-Mistral-Nemo-Instruct-2407",
        '[TOOL_CALLS][{"name": "special_function", "arguments": {"arg1": 1}',
        expect('[TOOL_CALLS][{"name": "special_function", "arguments": {"arg1": 1}'),
        {},
    ),
    (
        "Mistral-Small-3.2-24B-Instruct-2506",
        '[TOOL_CALLS]special_function[CALL_ID]000000001[ARGS]{"arg1": 1}'
        "[TOOL_CALLS]special_function_with_opt[CALL_ID]000000002[ARGS]"
        '{"arg1": 1, "arg2": 2}</s>',
        expect(
            calls=[
                ("special_function", {"arg1": 1}, "000000001"),
                ("special_function_with_opt", {"arg1": 1, "arg2": 2}, "000000002"),
            ]
        ),
        {},
    ),
    (
        "Mistral-Small-3.2-24B-Instruct-2506",
        HELLO + '[TOOL_CALLS]special_function[ARGS]{"arg1": 1}',
        expect(HELLO, calls=[("special_function", {"arg1": 1})]),
        {},
    ),
    ("mistralai-Ministral-3-14B-Reasoning-2512", f"[THINK]{THINKING}[/THINK]{HELLO}", expect(HELLO, THINKING), {}),
    (
        "mistralai-Ministral-3-14B-Reasoning-2512",
        "[THINK]Let me think about [TOOL_CALLS]special_function[ARGS]"
        '{"arg1":1} and more[/THINK][TOOL_CALLS]special_function[ARGS]'
        '{"arg1": 1}',
        expect(
            None,
            'Let me think about [TOOL_CALLS]special_function[ARGS]{"arg1":1} and more',
            [("special_function", {"arg1": 1})],
        ),
        {},
    ),
    # -- plain (no known syntax): all text is content
    (
        "mistralai-Mixtral-8x7B-Instruct-v0.1",
        f"<think>{THINKING}</think>{HELLO}</s>",
        expect(f"<think>{THINKING}</think>{HELLO}"),
        {},
    ),
]

CASE_IDS = [f"{i}-{c[0]}" for i, c in enumerate(CASES)]


def parse_keywords(kwargs: dict) -> dict:
    return {"tools": TOOLS, **kwargs}


@pytest.mark.parametrize("name, text, want, kwargs", CASES, ids=CASE_IDS)
def test_parse_reply(name, text, want, kwargs):
    check(template(name).parse_reply(text, **parse_keywords(kwargs)), want)


def stream_over(t: ChatTemplate, pieces, **kwargs) -> tuple:
    """(deltas, message) of a reply stream fed `pieces`; checks each delta's shape on the way."""
    stream = t.reply_stream(**kwargs)
    deltas = []
    for piece in pieces:
        deltas += stream.push(piece)
    deltas += stream.finish()
    for d in deltas:
        assert len(d) == 1 and set(d) <= {"content", "reasoning_content", "tool_calls"}
        assert all(isinstance(v, str) and v for k, v in d.items() if k != "tool_calls")
    return deltas, stream


def joined(deltas: list) -> dict:
    """The message that a client rebuilds from the deltas."""
    content = "".join(d.get("content", "") for d in deltas)
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    calls = {}
    for d in deltas:
        for c in d.get("tool_calls", ()):
            if "id" in c:
                assert c["index"] == len(calls) and c["type"] == "function" and c["function"]["arguments"] == ""
                calls[c["index"]] = {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["function"]["name"], "arguments": ""},
                }
            else:
                calls[c["index"]]["function"]["arguments"] += c["function"]["arguments"]
    msg = {"role": "assistant", "content": content or None, "reasoning_content": reasoning or None}
    if calls:
        msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    return msg


def without_random_ids(message: dict) -> dict:
    """A message with call ids of the generated shapes blanked (call_ + 24, Mistral's 9)."""
    out = dict(message)
    if message.get("tool_calls"):
        generated = r"call_[A-Za-z0-9]{24}|[A-Za-z0-9]{9}"
        out["tool_calls"] = [
            dict(c, id="" if re.fullmatch(generated, c["id"]) else c["id"]) for c in message["tool_calls"]
        ]
    return out


def splits(text: str):
    """Pieces of a text at random cut points."""
    return st.lists(st.integers(0, len(text)), max_size=12).map(
        lambda cuts: [text[a:b] for a, b in zip([0, *sorted(cuts)], [*sorted(cuts), len(text)])]
    )


@pytest.mark.parametrize("name, text, want, kwargs", CASES, ids=CASE_IDS)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_stream_is_the_whole_reply(name, text, want, kwargs, data):
    """Over any split of the text the deltas rebuild the whole message, and the stream's message
    is parse_reply's (the same ids as its deltas)."""
    t = template(name)
    pieces = data.draw(splits(text))
    deltas, stream = stream_over(t, pieces, **parse_keywords(kwargs))
    assert joined(deltas) == stream.message
    assert stream.has_tool_calls == bool(want["calls"])
    whole = t.parse_reply(text, **parse_keywords(kwargs))
    assert without_random_ids(stream.message) == without_random_ids(whole)


# every family's markers and some text, in any order: what a model might emit, broken or not
FAMILY_TEMPLATES = [
    "Qwen-Qwen3-0.6B",
    "Qwen3-Coder",
    "GLM-4.6",
    "GLM-4.7-Flash",
    "deepseek-ai-DeepSeek-V3.1",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
    "moonshotai-Kimi-K2",
    "Kimi-K2-Thinking",
    "openai-gpt-oss-120b",
    "google-gemma-4-31B-it",
    "mistralai-Mistral-Nemo-Instruct-2407",
    "Mistral-Small-3.2-24B-Instruct-2506",
    "mistralai-Ministral-3-14B-Reasoning-2512",
    "mistralai-Mixtral-8x7B-Instruct-v0.1",
]


def alphabet(fmt: replies.ReplyFormat) -> list:
    pieces = ["a", "b c", " ", "\n", "{", "}", '"arg1": 1', ":", "special_function", "functions.", "[", "]"]
    markers = list(fmt.tokens) + list(fmt.end) + list(fmt.drop) + list(fmt.reasoning or ())
    if fmt.call:
        markers += [*fmt.call.openers, *fmt.call.closers, *fmt.call.body_openers, *fmt.call.section]
        markers += [p for p in fmt.call.shape if isinstance(p, str) and not isinstance(p, replies.Slot)]
    if fmt.harmony:
        markers += [" to=functions.special_function", "<|start|>assistant", "analysis", "final", " to=python"]
    return pieces + markers + [m[: len(m) // 2] for m in markers if len(m) > 2]


@pytest.mark.parametrize("name", FAMILY_TEMPLATES)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_text_streams_as_it_parses(name, data):
    """Arbitrary mixes of a family's markers never raise, and stream as they parse whole."""
    t = template(name)
    text = "".join(data.draw(st.lists(st.sampled_from(alphabet(t.reply_format)), max_size=25)))
    start = data.draw(st.sampled_from([None, True, False]))
    whole = t.parse_reply(text, tools=TOOLS, enable_thinking=start)
    deltas, stream = stream_over(t, data.draw(splits(text)), tools=TOOLS, enable_thinking=start)
    assert joined(deltas) == stream.message
    assert without_random_ids(stream.message) == without_random_ids(whole)
    for c in whole.get("tool_calls") or ():
        assert isinstance(json.loads(c["function"]["arguments"]), dict)


# -- detection and where replies start


@pytest.mark.parametrize(
    "name, family, reasons",
    [
        ("Qwen-Qwen3-0.6B", "hermes", True),
        ("Qwen-Qwen2.5-7B-Instruct", "hermes", False),
        ("Qwen-QwQ-32B", "hermes", True),
        ("Qwen3-Coder", "qwen3-coder", False),
        ("GLM-4.6", "glm", True),
        ("GLM-4.7-Flash", "glm", True),
        ("deepseek-ai-DeepSeek-V3.1", "deepseek-v3.1", True),
        ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "deepseek-v3", True),
        ("moonshotai-Kimi-K2", "kimi-k2", False),
        ("Kimi-K2-Thinking", "kimi-k2", True),
        ("openai-gpt-oss-120b", "gpt-oss", False),
        ("google-gemma-4-31B-it", "gemma4", True),
        ("mistralai-Mistral-Nemo-Instruct-2407", "mistral-list", False),
        ("Mistral-Small-3.2-24B-Instruct-2506", "mistral", False),
        ("mistralai-Ministral-3-14B-Reasoning-2512", "mistral", True),
        ("mistralai-Mixtral-8x7B-Instruct-v0.1", "plain", False),
    ],
)
def test_family_detected_from_the_template(name, family, reasons):
    fmt = template(name).reply_format
    assert isinstance(fmt, replies.ReplyFormat)
    assert (fmt.name, fmt.reasoning is not None) == (family, reasons)
    assert template(name).reply_format is fmt  # detected once


@pytest.mark.parametrize(
    "name, starts",
    [
        ("Qwen-Qwen3-0.6B", {None: False, True: False, False: False}),
        ("Qwen-QwQ-32B", {True: True, False: False}),
        ("GLM-4.7-Flash", {None: True, True: True, False: False}),
        ("deepseek-ai-DeepSeek-V3.1", {None: False, True: True, False: False}),
        ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", {True: True, False: False}),
        ("google-gemma-4-31B-it", {None: False, True: False, False: False}),
    ],
)
def test_where_replies_start(name, starts):
    """A reply starts inside reasoning where the generation prompt leaves a block open."""
    t = template(name)
    for enable_thinking, inside in starts.items():
        assert t.replies.starts_in_reasoning(enable_thinking) is inside, enable_thinking
        prompt = t.render(
            [{"role": "user", "content": "Hi"}],
            add_generation_prompt=True,
            **({} if enable_thinking is None else {"enable_thinking": enable_thinking}),
        )
        assert t.replies.starts_in_reasoning(prompt=prompt) is inside


def test_the_prompt_decides_where_a_reply_starts():
    t = template("Qwen-Qwen3-0.6B")
    text = f"{THINKING}</think>{HELLO}"
    check(t.parse_reply(text, tools=TOOLS, prompt="<|im_start|>assistant\n<think>\n"), expect(HELLO, THINKING))
    # not opened by the prompt: the stray closer only separates the content (a stream cannot take back
    # content it has sent)
    check(t.parse_reply(text, tools=TOOLS, prompt="<|im_start|>assistant\n"), expect(f"{THINKING}\n{HELLO}"))


# -- the shape of what the server sends


def test_call_deltas_and_ids():
    t = template("Qwen-Qwen3-0.6B")
    text = (
        '<think>Plan</think>Checking.<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call>'
    )
    deltas, stream = stream_over(t, [text], tools=TOOLS)
    first, second = stream.message["tool_calls"]
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", first["id"]) and first["id"] != second["id"]
    assert deltas == [
        {"reasoning_content": "Plan"},
        {"content": "Checking."},
        {
            "tool_calls": [
                {"index": 0, "id": first["id"], "type": "function", "function": {"name": "get_time", "arguments": ""}}
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]},
        {
            "tool_calls": [
                {
                    "index": 1,
                    "id": second["id"],
                    "type": "function",
                    "function": {"name": "special_function", "arguments": ""},
                }
            ]
        },
        {"tool_calls": [{"index": 1, "function": {"arguments": '{"arg1": 1}'}}]},
    ]
    assert stream.has_tool_calls


def test_text_is_held_back_only_where_a_marker_may_start():
    stream = template("Qwen-Qwen3-0.6B").reply_stream(tools=TOOLS)
    assert stream.push("Hello") == [{"content": "Hello"}]
    assert stream.push(" there <tool") == [{"content": " there"}]  # " <tool" may open a call
    assert stream.push("box> ok\n") == [{"content": " <toolbox> ok"}]
    assert stream.push("<|im_") == []
    assert stream.finish() == [{"content": "\n<|im_"}]
    assert not stream.has_tool_calls
    with pytest.raises(ColibriError):
        stream.push("more")


def test_mistral_call_ids_fit_its_template():
    """Mistral's templates refuse ids other than 9 letters or digits when the conversation is
    rendered again, so generated ids have that shape; the reply feeds back into the template."""
    path = CHAT / "mistralai-Mistral-Nemo-Instruct-2407.jinja"
    t = ChatTemplate(path.read_text(encoding="utf-8"), path.name, {"bos_token": "<s>", "eos_token": "</s>"})
    msg = t.parse_reply('[TOOL_CALLS][{"name": "get_time", "arguments": {"city": "Paris"}}]', tools=TOOLS)
    (call,) = msg["tool_calls"]
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call["id"])
    history = [
        {"role": "user", "content": "Time?"},
        {**msg, "content": None},
        {"role": "tool", "tool_call_id": call["id"], "content": "12:00"},
    ]
    assert call["id"] in t.render(history, tools=TOOLS)


def test_plain_format_has_no_grammar():
    t = template("mistralai-Mixtral-8x7B-Instruct-v0.1")
    assert t.reply_format is replies.PLAIN
    assert t.tool_call_grammar(TOOLS, "required") is None
    assert template("Qwen-Qwen3-0.6B").tool_call_grammar(TOOLS, "none") is None


def test_grammar_refuses_unknown_choices():
    t = template("Qwen-Qwen3-0.6B")
    with pytest.raises(ColibriError, match="not among the tools"):
        t.tool_call_grammar(TOOLS, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ColibriError, match="at least one tool"):
        t.tool_call_grammar([], "required")
    with pytest.raises(ColibriError, match="tool_choice"):
        t.tool_call_grammar(TOOLS, "sometimes")


# -- grammars (llguidance)


def qwen3_vocabulary(extra=()) -> tuple:
    """(tokenizer.json text, added token texts) of the Qwen3 fixture vocabulary, with `extra`
    strings as added special tokens (those that are no token of it yet)."""
    doc = json.loads(lzma.decompress(QWEN3_VOCAB.read_bytes()))
    have = {t["content"] for t in doc["added_tokens"]} | set(doc["model"]["vocab"])
    next_id = max(t["id"] for t in doc["added_tokens"]) + 1
    # llguidance counts the vocabulary up to the last id, leaving it out: one more id closes the list
    for text in [*sorted(set(extra) - have), "<|padding|>"]:
        doc["added_tokens"].append(
            {
                "id": next_id,
                "content": text,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        )
        next_id += 1
    return json.dumps(doc), [t["content"] for t in doc["added_tokens"]]


@pytest.fixture(scope="module")
def vocabularies():
    """{"qwen3": (tokenizer, added tokens text -> id), "families": ...}: the Qwen3 vocabulary as it
    is (other families' markers are text in it), and with every family's marker tokens added."""
    llguidance = pytest.importorskip("llguidance", reason="grammars need llguidance (pip install llguidance)")
    out = {}
    for key, extra in (("qwen3", ()), ("families", [m for f in replies.FORMATS for m in f.tokens])):
        doc, added = qwen3_vocabulary(extra)
        tokenizer = llguidance.LLTokenizer(doc)
        ids = {text: tokenizer.tokenize_str(text) for text in added}
        out[key] = (tokenizer, {text: found[0] for text, found in ids.items() if len(found) == 1})
    return out


def accepts(vocab, grammar: str, text: str) -> bool:
    import llguidance

    tokenizer, _ = vocab
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    assert not is_error, messages
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    return matcher.consume_tokens(tokenizer.tokenize_str(text)) and matcher.is_accepting()


GRAMMAR_TOOLS = [GET_WEATHER, TOGGLE]
WEATHER = {"type": "function", "function": {"name": "get_weather"}}
PARIS = [("get_weather", {"city": "Paris", "days": 3})]


def gemma(value) -> str:
    if isinstance(value, str):
        return f'<|"|>{value}<|"|>'
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{gemma(v)}" for k, v in sorted(value.items())) + "}"
    return json.dumps(value)


def xml_value(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


# each family's calls as its model writes them: [(name, arguments)] -> text
WRITE_CALLS = {
    "hermes": lambda calls: "\n".join(
        "<tool_call>\n" + json.dumps({"name": n, "arguments": a}) + "\n</tool_call>" for n, a in calls
    ),
    "qwen3-coder": lambda calls: "\n".join(
        f"<tool_call>\n<function={n}>\n"
        + "".join(f"<parameter={k}>\n{xml_value(v)}\n</parameter>\n" for k, v in a.items())
        + "</function>\n</tool_call>"
        for n, a in calls
    ),
    "glm": lambda calls: "".join(
        f"<tool_call>{n}\n"
        + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{xml_value(v)}</arg_value>\n" for k, v in a.items())
        + "</tool_call>"
        for n, a in calls
    ),
    "deepseek-v3.1": lambda calls: (
        "<｜tool▁calls▁begin｜>"
        + "".join(f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{json.dumps(a)}<｜tool▁call▁end｜>" for n, a in calls)
        + "<｜tool▁calls▁end｜>"
    ),
    "deepseek-v3": lambda calls: (
        "<｜tool▁calls▁begin｜>"
        + "".join(
            f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{json.dumps(a)}\n```<｜tool▁call▁end｜>"
            for n, a in calls
        )
        + "<｜tool▁calls▁end｜>"
    ),
    "kimi-k2": lambda calls: (
        "<|tool_calls_section_begin|>"
        + "".join(
            f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{json.dumps(a)}<|tool_call_end|>"
            for i, (n, a) in enumerate(calls)
        )
        + "<|tool_calls_section_end|>"
    ),
    "gpt-oss": lambda calls: "".join(
        f"<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>{json.dumps(a)}<|call|>" for n, a in calls
    ),
    "gemma4": lambda calls: "".join(f"<|tool_call>call:{n}{gemma(a)}<tool_call|>" for n, a in calls),
    "mistral-list": lambda calls: (
        "[TOOL_CALLS]"
        + json.dumps([{"name": n, "arguments": a, "id": f"abcdefgh{i}"} for i, (n, a) in enumerate(calls)])
    ),
    "mistral": lambda calls: "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in calls),
}

# (template, enable_thinking, reasoning as the model writes it before a call)
GRAMMAR_CASES = [
    ("Qwen-Qwen3-0.6B", None, "<think>\nhmm\n</think>\n\n"),
    ("Qwen-QwQ-32B", True, "hmm\n</think>\n\n"),
    ("Qwen3-Coder", None, ""),
    ("GLM-4.6", None, "<think>hmm</think>"),
    ("GLM-4.7-Flash", True, "hmm</think>"),
    ("deepseek-ai-DeepSeek-V3.1", False, ""),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", True, "hmm</think>\n\n"),
    ("Kimi-K2-Thinking", None, "<think>hmm</think>"),
    ("openai-gpt-oss-120b", None, "<|channel|>analysis<|message|>hmm<|end|><|start|>assistant"),
    ("google-gemma-4-31B-it", True, "<|channel>thought\nhmm<channel|>"),
    ("mistralai-Mistral-Nemo-Instruct-2407", None, ""),
    ("Mistral-Small-3.2-24B-Instruct-2506", None, ""),
    ("mistralai-Ministral-3-14B-Reasoning-2512", None, "[THINK]hmm[/THINK]"),
]
GRAMMAR_IDS = [c[0] for c in GRAMMAR_CASES]


@pytest.mark.parametrize("vocab_name", ["families", "qwen3"])
@pytest.mark.parametrize("name, enable_thinking, reasoning", GRAMMAR_CASES, ids=GRAMMAR_IDS)
def test_required_and_named_grammars(vocabularies, vocab_name, name, enable_thinking, reasoning):
    """With the family's markers as tokens (as its own vocabulary has them) and as text (the Qwen3
    vocabulary lacks most): a well-formed call is accepted, after reasoning too, and parses back;
    a wrong function name, a missing required argument, text before the call, two calls where one
    is allowed are not."""
    vocab = vocabularies[vocab_name]
    t = template(name)
    write = WRITE_CALLS[t.reply_format.name]
    grammar = functools.partial(
        t.tool_call_grammar, GRAMMAR_TOOLS, added_tokens=vocab[1], enable_thinking=enable_thinking
    )
    call = write(PARIS)
    parsed = t.parse_reply(reasoning + call, tools=GRAMMAR_TOOLS, enable_thinking=enable_thinking)
    assert summary(parsed, False)["calls"] == PARIS
    for mode in ("required", WEATHER):
        g = grammar(mode)
        assert accepts(vocab, g, reasoning + call)
        assert accepts(vocab, g, call) is not t.replies.starts_in_reasoning(enable_thinking)
        assert not accepts(vocab, g, reasoning + write([("get_weathex", {"city": "Paris"})]))
        assert not accepts(vocab, g, reasoning + write([("get_weather", {"days": 3})]))
        assert not accepts(vocab, g, reasoning + "Sure! " + call)
    assert not accepts(vocab, grammar({"type": "function", "function": {"name": "toggle"}}), reasoning + call)
    assert accepts(
        vocab,
        grammar({"type": "function", "function": {"name": "toggle"}}),
        reasoning + write([("toggle", {"enabled": True})]),
    )
    if t.reply_format.harmony is None:  # gpt-oss: a call ends the reply
        two = write(PARIS + [("toggle", {"enabled": False})])
        assert (
            len(t.parse_reply(reasoning + two, tools=GRAMMAR_TOOLS, enable_thinking=enable_thinking)["tool_calls"]) == 2
        )
        assert accepts(vocab, grammar("required", parallel_tool_calls=True), reasoning + two)
        assert not accepts(vocab, grammar("required", parallel_tool_calls=False), reasoning + two)


@pytest.mark.parametrize("vocab_name", ["families", "qwen3"])
@pytest.mark.parametrize("name, enable_thinking, reasoning", GRAMMAR_CASES, ids=GRAMMAR_IDS)
def test_auto_grammars(vocabularies, vocab_name, name, enable_thinking, reasoning):
    """ "auto": free text (gpt-oss: a final answer), or a call once its opener appears, constrained."""
    vocab = vocabularies[vocab_name]
    t = template(name)
    write = WRITE_CALLS[t.reply_format.name]
    g = t.tool_call_grammar(GRAMMAR_TOOLS, "auto", added_tokens=vocab[1], enable_thinking=enable_thinking)
    answer = "<|channel|>final<|message|>It is fine." if t.reply_format.harmony else "It is fine."
    assert accepts(vocab, g, reasoning + answer)
    assert accepts(vocab, g, reasoning + write(PARIS))
    if t.reply_format.harmony is None:
        assert accepts(vocab, g, reasoning + "Let me check.\n" + write(PARIS))
    assert not accepts(vocab, g, reasoning + write([("get_weathex", {"city": "Paris"})]))
    assert t.parse_reply(reasoning + answer, tools=GRAMMAR_TOOLS, enable_thinking=enable_thinking)["content"]


def test_grammar_writes_tokens_by_id(vocabularies):
    """Given the vocabulary's ids, markers are token references by id: llguidance can name no
    token spelled without <...> (Mistral's [TOOL_CALLS]) any other way."""
    _, added = vocabularies["families"]
    g = template("Mistral-Small-3.2-24B-Instruct-2506").tool_call_grammar(GRAMMAR_TOOLS, "required", added_tokens=added)
    assert f"<[{added['[TOOL_CALLS]']}]>" in g and '"[TOOL_CALLS]"' not in g
    default = template("Qwen-Qwen3-0.6B").tool_call_grammar(GRAMMAR_TOOLS, "required")
    assert "<tool_call>" in default and '"<tool_call>"' not in default
