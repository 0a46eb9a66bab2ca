"""Replies: a model's generated text -> an OpenAI assistant message (content, reasoning, tool calls).

Design
------
Each model family writes its reasoning and its tool calls with its own markers. A family is one
row of data (`ReplyFormat`): the reasoning block's opener and closer, the call syntax (the
markers that open and close a call, a pattern that splits a call's body into name, arguments and
id, and how the arguments are written: JSON, XML-style parameters, GLM's key/value pairs, Gemma's
own notation), markers to drop, end-of-turn markers, and which markers are tokens of the family's
vocabulary (for grammars). One engine (`ReplyStream`) runs every row:

- it reads the text as it arrives and keeps a mode: content, reasoning, or a captured block (a
  call; gpt-oss's message headers and bodies). In each mode a table maps the markers that matter
  there to an action, and one regex finds the earliest (longest) one. Text that could be the start
  of a marker is held back until the next piece says which it is, so the result never depends on
  how the text was split into pieces;
- content and reasoning are sent as they come; a call is sent whole when its block closes (its
  name delta, then its arguments), because only then is it known to parse: a block that does
  not parse goes to content as the text it was, never lost;
- content and reasoning are trimmed of surrounding whitespace, and the separate segments of one
  field (content before and after a call, several reasoning blocks) are joined with a newline
  where no whitespace separates them. Trailing whitespace is therefore held back while streaming;
- an end-of-turn marker (<|im_end|>, </s>, ...) is dropped only at the very end of the reply;
  followed by more text it is text.

`parse_reply` is that engine run over the whole text, so a stream's message always equals it.

Where a reply starts: some templates open the reasoning block in the generation prompt (QwQ,
DeepSeek-R1, GLM-4.7, Qwen3-2507-thinking), so the reply starts inside reasoning, without the
opener. That is read from the prompt itself when the caller passes it, else from a probe
conversation rendered once per `enable_thinking` value: the reply starts in reasoning when the
prompt ends inside an open block, and its reasoning runs to the closer. Elsewhere a closer with
no opener only separates content: a stream cannot take back the content it has sent. gpt-oss
(harmony) replies start in a message header.

Which family: `detect_format` looks for each row's markers in the template's text (the string
literals of the compiled template), first match wins, as llama.cpp's common/chat.cpp does. A row
keeps its reasoning block only where the template mentions it (Qwen2.5 vs Qwen3). No match is
the plain format: all text is content.

Tools: calls are parsed where the request has tools; with none (or tool_choice "none"), the call
markers are text. A call's name is not checked against the tools (a constrained reply cannot
name another; an unconstrained one is the client's to refuse). XML-style parameter values are
typed by the tool's JSON schema: JSON where the schema allows a non-string type and the value
parses as one, else the text (as vLLM's and llama.cpp's parsers do). Call ids are `call_` + 24
random alphanumerics, the model's own where the format carries one (Kimi K2's
`functions.NAME:IDX`, Mistral's), and 9 alphanumerics for Mistral, whose templates refuse any
other id when the conversation is rendered again.

Grammars (`tool_call_grammar`): an llguidance Lark grammar for the whole reply in the family's
syntax, built from the same row: reasoning first (optional, or required where the prompt left a
block open), then the call(s), each call's arguments under the tool's JSON schema (`%json`),
XML/GLM/Gemma parameters typed by the schema (the required ones first; Gemma's in sorted order,
as its template writes them). "auto" lets free text
through and constrains a call once its opener appears (a special token ends free text by itself;
a text opener is a lazy trigger, as llguidance.StructTag writes it). Markers that are tokens of
the model's vocabulary must be written as token references: pass the vocabulary's added tokens
(text -> id) to be exact; without them the family's known tokens are assumed, and one that
llguidance cannot name without its id (Mistral's [TOOL_CALLS]) is written as its text.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Mapping
from dataclasses import dataclass, replace

from .constraint import WHITESPACE as JSON_WHITESPACE
from .errors import ColibriError

# -- the table of formats ------------------------------------------------------------------------


class Slot(str):
    """A placeholder in a grammar shape (the call's name, its arguments, ...), not literal text."""


MAX_WHITESPACE = 4  # WS between a grammar's blocks: bounded, as JSON's is (a model cannot pad forever)
NAME = Slot("name")  # the function's name
ARGS = Slot("args")  # the arguments as JSON under the tool's schema
NAMED_JSON = Slot("named_json")  # {"name": NAME, "arguments": ARGS} as one JSON object
CALL_LIST = Slot("call_list")  # [NAMED_JSON, ...] (the whole run of calls)
XML_PARAMS = Slot("xml_params")  # <parameter=KEY>\nVALUE\n</parameter>\n ...
ARG_PAIRS = Slot("arg_pairs")  # <arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n ...
GEMMA_ARGS = Slot("gemma_args")  # {key:value,...} in Gemma's notation
INDEX = Slot("index")  # a call's number (Kimi K2)
CALL_ID = Slot("call_id")  # an optional [CALL_ID]ID (Mistral)
FREE = Slot("free")  # any text up to the next piece
OPT_NL = Slot("opt_nl")  # an optional newline


@dataclass(frozen=True)
class CallSyntax:
    """How one family writes a tool call.

    A call is a block: it starts at one of `openers` (consumed) or `body_openers` (the marker is the
    body's own start), and ends at one of `closers` (consumed), at one of `stops` (left to be read
    again: the next call's opener, a section's end) or at the end of the reply. Its body is read by
    `body` (patterns with the groups name, args and optionally id; the first that matches whole
    wins) and its args by `args` ("json", "xml", "pairs", "gemma"); `args` "calls" means the body is
    JSON naming its calls itself ({"name", "arguments"} or a list of them)."""

    openers: tuple
    closers: tuple = ()
    stops: tuple = ()
    body_openers: tuple = ()
    body: tuple = ()
    args: str = "json"
    section: tuple = ()  # (begin, end) around a run of calls: dropped when read
    in_reasoning: bool = False  # a call opener also ends an open reasoning block (Kimi K2)
    ids: str = "random"  # "random": call_ + 24; "mistral": 9 alphanumerics
    shape: tuple = ()  # one call, for grammars (str: marker or text; Slot: placeholder)


@dataclass(frozen=True)
class HarmonySyntax:
    """gpt-oss's harmony messages: `<|start|>assistant` header `<|message|>` body terminator, where
    the header names the channel (`<|channel|>analysis`) and the recipient (` to=functions.NAME`)."""

    start: str = "<|start|>"
    channel: str = "<|channel|>"
    message: str = "<|message|>"
    constrain: str = "<|constrain|>"
    terminators: tuple = ("<|end|>", "<|call|>", "<|return|>")
    reasoning_channels: tuple = ("analysis",)
    function_prefix: str = "functions."


@dataclass(frozen=True)
class ReplyFormat:
    """One family's reply syntax. `detect`: substrings of the template that identify it (all
    needed); `reasoning`: (opener, closer) or None; `drop`: markers dropped wherever they stand
    (stray ones); `end`: end-of-turn markers dropped at the end; `tokens`: markers that are tokens
    of the family's vocabulary."""

    name: str
    detect: tuple = ()
    reasoning: tuple | None = None
    call: CallSyntax | None = None
    harmony: HarmonySyntax | None = None
    drop: tuple = ()
    end: tuple = ()
    tokens: tuple = ()


THINK = ("<think>", "</think>")
COMMON_END = (
    "<|im_end|>",
    "<|endoftext|>",
    "</s>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<end_of_turn>",
    "<eos>",
    "<｜end▁of▁sentence｜>",
)

GPT_OSS = ReplyFormat(
    "gpt-oss",
    detect=("<|channel|>", "<|message|>"),
    harmony=HarmonySyntax(),
    end=("<|return|>", "<|call|>", "<|endoftext|>"),
    tokens=("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>"),
)

GEMMA4 = ReplyFormat(
    "gemma4",
    detect=("<|tool_call>",),
    reasoning=("<|channel>thought", "<channel|>"),
    call=CallSyntax(
        openers=("<|tool_call>",),
        closers=("<tool_call|>",),
        body=(r"\s*call:(?P<name>[^{\s]+)\s*(?P<args>\{.*\})\s*",),
        args="gemma",
        shape=("<|tool_call>", "call:", NAME, GEMMA_ARGS, "<tool_call|>"),
    ),
    drop=("<|channel>",),
    end=("<turn|>", "<|tool_response>", "<eos>"),
    tokens=("<|tool_call>", "<tool_call|>", '<|"|>', "<|channel>", "<channel|>", "<turn|>", "<|tool_response>"),
)

KIMI_K2 = ReplyFormat(
    "kimi-k2",
    detect=("<|tool_call_begin|>",),
    reasoning=THINK,
    call=CallSyntax(
        openers=("<|tool_call_begin|>",),
        closers=("<|tool_call_end|>",),
        stops=("<|tool_call_begin|>", "<|tool_calls_section_end|>"),
        body=(r"\s*(?P<id>(?:functions\.)?(?P<name>[^\s:<]+)(?::\d+)?)\s*<\|tool_call_argument_begin\|>(?P<args>.*)",),
        section=("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
        in_reasoning=True,
        shape=(
            "<|tool_call_begin|>",
            "functions.",
            NAME,
            ":",
            INDEX,
            "<|tool_call_argument_begin|>",
            ARGS,
            "<|tool_call_end|>",
        ),
    ),
    end=("<|im_end|>",),
    tokens=(
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
        "<think>",
        "</think>",
        "<|im_end|>",
    ),
)

_DS_CALL_V31 = r"\s*(?P<name>[^\s<]+)\s*<｜tool▁sep｜>(?P<args>.*)"
_DS_CALL_V3 = r"\s*function\s*<｜tool▁sep｜>\s*(?P<name>[^\n]+?)\s*\n\s*```(?:json)?\s*(?P<args>.*?)\s*```\s*"
_DS_TOKENS = (
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
    "<think>",
    "</think>",
    "<｜end▁of▁sentence｜>",
)

# DeepSeek V3 / R1 (a "function" type and a fenced JSON block) and V3.1 (NAME<sep>JSON) read the
# same; the grammar writes the template's own variant.
DEEPSEEK_V3 = ReplyFormat(
    "deepseek-v3",
    detect=("<｜tool▁call▁begin｜>", "```json"),
    reasoning=THINK,
    call=CallSyntax(
        openers=("<｜tool▁call▁begin｜>",),
        closers=("<｜tool▁call▁end｜>",),
        stops=("<｜tool▁calls▁end｜>",),
        body=(_DS_CALL_V3, _DS_CALL_V31),
        section=("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),
        shape=(
            "<｜tool▁call▁begin｜>",
            "function",
            "<｜tool▁sep｜>",
            NAME,
            "\n```json\n",
            ARGS,
            "\n```",
            "<｜tool▁call▁end｜>",
        ),
    ),
    end=("<｜end▁of▁sentence｜>",),
    tokens=_DS_TOKENS,
)

DEEPSEEK_V31 = replace(
    DEEPSEEK_V3,
    name="deepseek-v3.1",
    detect=("<｜tool▁call▁begin｜>",),
    call=replace(
        DEEPSEEK_V3.call,
        body=(_DS_CALL_V31, _DS_CALL_V3),
        shape=("<｜tool▁call▁begin｜>", NAME, "<｜tool▁sep｜>", ARGS, "<｜tool▁call▁end｜>"),
    ),
)

_MISTRAL_TOKENS = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[THINK]", "[/THINK]", "</s>")

# Mistral Small 3.2 / Devstral / Magistral: [TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{...}, repeated.
MISTRAL = ReplyFormat(
    "mistral",
    detect=("[TOOL_CALLS]", "[ARGS]"),
    reasoning=("[THINK]", "[/THINK]"),
    call=CallSyntax(
        openers=("[TOOL_CALLS]",),
        stops=("[TOOL_CALLS]",),
        body=(r"\s*(?P<name>[^\s\[\]]+)\s*(?:\[CALL_ID\]\s*(?P<id>[^\s\[\]]+)\s*)?\[ARGS\](?P<args>.*)",),
        ids="mistral",
        shape=("[TOOL_CALLS]", NAME, CALL_ID, "[ARGS]", ARGS),
    ),
    end=("</s>",),
    tokens=_MISTRAL_TOKENS,
)

# Mistral 7B v0.3 / Mixtral 8x22B / Nemo: [TOOL_CALLS][{"name", "arguments", "id"}, ...].
MISTRAL_LIST = replace(
    MISTRAL,
    name="mistral-list",
    detect=("[TOOL_CALLS]",),
    call=CallSyntax(
        openers=("[TOOL_CALLS]",),
        stops=("[TOOL_CALLS]",),
        args="calls",
        ids="mistral",
        shape=("[TOOL_CALLS]", CALL_LIST),
    ),
)

# Qwen3-Coder / Qwen3.5: <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>;
# some replies leave out the first <tool_call>.
QWEN3_CODER = ReplyFormat(
    "qwen3-coder",
    detect=("<function=", "<parameter="),
    reasoning=THINK,
    call=CallSyntax(
        openers=("<tool_call>",),
        closers=("</tool_call>",),
        body_openers=("<function=",),
        body=(r"\s*<function=(?P<name>[^>\n]+)>(?P<args>.*?)(?:</function>\s*)?",),
        args="xml",
        shape=("<tool_call>", "\n<function=", NAME, ">\n", XML_PARAMS, "</function>\n", "</tool_call>"),
    ),
    end=("<|im_end|>", "<|endoftext|>"),
    tokens=("<tool_call>", "</tool_call>", "<think>", "</think>", "<|im_end|>"),
)

# GLM-4.5 / 4.6 / 4.7: <tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n</tool_call>.
GLM = ReplyFormat(
    "glm",
    detect=("<arg_key>",),
    reasoning=THINK,
    call=CallSyntax(
        openers=("<tool_call>",),
        closers=("</tool_call>",),
        body=(r"\s*(?P<name>[^\s<]+)\s*(?P<args><arg_key>.*)?",),
        args="pairs",
        shape=("<tool_call>", NAME, OPT_NL, ARG_PAIRS, "</tool_call>"),
    ),
    end=("<|user|>", "<|observation|>", "<|endoftext|>"),
    tokens=(
        "<tool_call>",
        "</tool_call>",
        "<arg_key>",
        "</arg_key>",
        "<arg_value>",
        "</arg_value>",
        "<think>",
        "</think>",
        "<|user|>",
        "<|observation|>",
    ),
)

# Qwen2.5 / Qwen3 / QwQ / Hermes: <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>.
HERMES = ReplyFormat(
    "hermes",
    detect=("<tool_call>",),
    reasoning=THINK,
    call=CallSyntax(
        openers=("<tool_call>",),
        closers=("</tool_call>",),
        args="calls",
        shape=("<tool_call>", "\n", NAMED_JSON, "\n", "</tool_call>"),
    ),
    end=("<|im_end|>", "<|endoftext|>"),
    tokens=("<tool_call>", "</tool_call>", "<think>", "</think>", "<|im_end|>"),
)

# Reasoning without a known call syntax (DeepSeek-R1 distills without tools, ...).
THINKING = ReplyFormat("thinking", detect=("</think>",), reasoning=THINK, end=COMMON_END, tokens=THINK)

PLAIN = ReplyFormat("plain", end=COMMON_END)

# first match wins: the more specific rows first
FORMATS = (
    GPT_OSS,
    GEMMA4,
    KIMI_K2,
    DEEPSEEK_V3,
    DEEPSEEK_V31,
    MISTRAL,
    MISTRAL_LIST,
    QWEN3_CODER,
    GLM,
    HERMES,
    THINKING,
)


def detect_format(text: str) -> ReplyFormat:
    """The reply format of a chat template, from its text; the plain format when no row matches.
    A row keeps its reasoning block only where the template mentions the block's markers."""
    for fmt in FORMATS:
        if all(marker in text for marker in fmt.detect):
            if fmt.reasoning is not None and not any(marker in text for marker in fmt.reasoning):
                fmt = replace(fmt, reasoning=None)
            return fmt
    return PLAIN


def template_text(template) -> str:
    """The literal text of a ChatTemplate: the string constants of its compiled Jinja code (every
    marker a template writes is a literal in it); the template keeps no copy of its source."""
    out = []
    for compiled in getattr(template, "_compiled", {}).values():
        stack = [compiled.root_render_func.__code__]
        stack.extend(f.__code__ for f in compiled.blocks.values())
        while stack:
            code = stack.pop()
            for const in code.co_consts:
                if isinstance(const, str):
                    out.append(const)
                elif hasattr(const, "co_consts"):
                    stack.append(const)
    return "\n".join(out)


# -- arguments -----------------------------------------------------------------------------------


def _reject_constant(name):
    raise ValueError(f"{name} is not JSON")


def _json_loads(text: str, strict: bool = True):
    return json.loads(text, parse_constant=_reject_constant, strict=strict)


def _json_object_text(text: str) -> str | None:
    """`text` as a JSON object's text: itself where it is strict JSON, re-written where it only
    parses leniently (raw control characters in strings), None where it is no JSON object."""
    text = text.strip()
    try:
        value = _json_loads(text)
    except ValueError:
        try:
            value = _json_loads(text, strict=False)
        except ValueError:
            return None
        return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None
    return text if isinstance(value, dict) else None


def _schema_types(schema) -> set | None:
    """The JSON types a parameter's schema allows, or None where it does not say."""
    if not isinstance(schema, dict):
        return None
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    if "enum" in schema and isinstance(schema["enum"], list):
        return {_json_type(v) for v in schema["enum"]}
    if "const" in schema:
        return {_json_type(schema["const"])}
    union = [s for key in ("anyOf", "oneOf") for s in schema.get(key) or () if isinstance(s, dict)]
    if union:
        kinds = [_schema_types(s) for s in union]
        return None if any(k is None for k in kinds) else set().union(*kinds)
    if "properties" in schema:
        return {"object"}
    if "items" in schema:
        return {"array"}
    return None


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def typed_value(text: str, schema):
    """A parameter written as text, typed by its schema: the JSON value where the schema allows a
    non-string type and the text parses as one the schema allows (or as anything, where it allows
    no string), else the text itself. Booleans also read as Python spells them (True/False)."""
    types = _schema_types(schema)
    if not types or types == {"string"}:
        return text
    stripped = text.strip()
    if "boolean" in types and stripped in ("True", "False"):
        return stripped == "True"
    try:
        value = _json_loads(stripped)
    except ValueError:
        return text
    kind = _json_type(value)
    allowed = kind in types or (kind == "integer" and "number" in types)
    if allowed or "string" not in types:
        return value
    return text


def _tool_schemas(tools) -> dict:
    """{name: parameters schema} of an OpenAI tools list ({"type": "function", "function": {...}}
    or the bare function objects)."""
    out = {}
    for tool in tools or ():
        if not isinstance(tool, dict):
            continue
        fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
        name = fn.get("name")
        if isinstance(name, str):
            params = fn.get("parameters")
            out[name] = params if isinstance(params, dict) else {"type": "object", "properties": {}}
    return out


def _property(schemas: dict, name: str, key: str):
    params = schemas.get(name) or {}
    props = params.get("properties") if isinstance(params, dict) else None
    return props.get(key) if isinstance(props, dict) else None


_XML_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)
_ARG_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.S)


def _xml_args(text: str, name: str, schemas: dict) -> dict | None:
    """Qwen3-Coder's parameters: each value between one leading and one trailing newline."""
    out, end = {}, 0
    for m in _XML_PARAM.finditer(text):
        if text[end : m.start()].strip():
            return None
        value = m.group(2)
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        key = m.group(1).strip()
        out[key] = typed_value(value, _property(schemas, name, key))
        end = m.end()
    return out if not text[end:].strip() else None


def _pair_args(text: str, name: str, schemas: dict) -> dict | None:
    """GLM's <arg_key>/<arg_value> pairs; nothing else may stand between them."""
    out, end = {}, 0
    for m in _ARG_PAIR.finditer(text):
        if m.start() != end:
            return None
        key = m.group(1).strip()
        out[key] = typed_value(m.group(2), _property(schemas, name, key))
        end = m.end()
    return out if end == len(text) else None


_GEMMA_QUOTE = '<|"|>'
_GEMMA_BARE = re.compile(r"[^,}\]\s]+")


def _gemma_value(text: str, at: int):
    """One value of Gemma 4's call notation from `at`: (value, end). Strings are quoted with
    <|"|>, keys are bare, numbers / true / false / null as in JSON."""
    while at < len(text) and text[at].isspace():
        at += 1
    if text.startswith(_GEMMA_QUOTE, at):
        end = text.find(_GEMMA_QUOTE, at + len(_GEMMA_QUOTE))
        if end < 0:
            raise ValueError("unterminated string")
        return text[at + len(_GEMMA_QUOTE) : end], end + len(_GEMMA_QUOTE)
    if text.startswith("{", at):
        out, at = {}, at + 1
        while True:
            while at < len(text) and text[at] in " \n\t,":
                at += 1
            if text.startswith("}", at):
                return out, at + 1
            if text.startswith(_GEMMA_QUOTE, at):
                key, at = _gemma_value(text, at)
            else:
                colon = text.find(":", at)
                if colon < 0:
                    raise ValueError("a key without a value")
                key, at = text[at:colon].strip(), colon
            if not text.startswith(":", at) or not key:
                raise ValueError("a key without a value")
            out[key], at = _gemma_value(text, at + 1)
    if text.startswith("[", at):
        out, at = [], at + 1
        while True:
            while at < len(text) and text[at] in " \n\t,":
                at += 1
            if text.startswith("]", at):
                return out, at + 1
            if at >= len(text):
                raise ValueError("unterminated list")
            item, at = _gemma_value(text, at)
            out.append(item)
    m = _GEMMA_BARE.match(text, at)
    if not m:
        raise ValueError("no value")
    return _json_loads(m.group()), m.end()


def _gemma_args(text: str) -> dict | None:
    try:
        value, end = _gemma_value(text, 0)
    except (ValueError, IndexError):
        return None
    return value if isinstance(value, dict) and not text[end:].strip() else None


def _named_calls(body: str) -> list | None:
    """A JSON body that names its calls: {"name", "arguments"} or a list of them; `arguments`
    (or `parameters`) an object or a JSON string of one; an `id` kept."""
    try:
        value = _json_loads(body.strip(), strict=False)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"].strip():
            return None
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):
            args = _json_object_text(args)
            args = None if args is None else _json_loads(args)
        if not isinstance(args, dict):
            return None
        call_id = item.get("id") if isinstance(item.get("id"), str) and item["id"] else None
        calls.append((item["name"].strip(), json.dumps(args, ensure_ascii=False), call_id))
    return calls or None


def _read_calls(syntax: CallSyntax, body: str, schemas: dict) -> list | None:
    """A call block's body -> [(name, arguments JSON text, id or None)], or None where it does not
    parse."""
    if syntax.args == "calls":
        return _named_calls(body)
    for pattern in syntax.body:
        m = re.fullmatch(pattern, body, re.S)
        if m:
            break
    else:
        return None
    name = m.group("name").strip()
    raw = m.group("args") or ""
    call_id = m.groupdict().get("id")
    if syntax.args == "json":
        args = _json_object_text(raw)
    else:
        read = {"xml": _xml_args, "pairs": _pair_args}.get(syntax.args)
        obj = read(raw, name, schemas) if read else _gemma_args(raw)
        args = None if obj is None else json.dumps(obj, ensure_ascii=False)
    if not name or args is None:
        return None
    return [(name, args, call_id)]


_ID_CHARS = string.ascii_letters + string.digits


def new_call_id(style: str = "random") -> str:
    if style == "mistral":
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


# -- the engine ----------------------------------------------------------------------------------


class _Field:
    """One text field of the message (content or reasoning) as it is streamed: leading whitespace
    dropped, trailing whitespace held until more text follows (so dropped at the end), segments
    joined by a newline where no whitespace separates them."""

    def __init__(self):
        self.parts = []
        self._held = ""
        self._started = False
        self._segment_break = False

    def add(self, text: str) -> str:
        if not text:
            return ""
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        elif self._segment_break and not self._held and not text[0].isspace():
            self._held = "\n"
        self._segment_break = False
        body = text.rstrip()
        if not body:
            self._held += text
            return ""
        out = self._held + body
        self._held = text[len(body) :]
        self.parts.append(out)
        return out

    def new_segment(self) -> None:
        if self._started:
            self._segment_break = True

    @property
    def value(self) -> str | None:
        return "".join(self.parts) or None


class _Markers:
    """The markers that matter in one mode: action by marker, one regex finding the earliest (and
    there the longest) of them, and every proper prefix of one (text to hold back at the end)."""

    def __init__(self, actions: dict):
        self.actions = actions
        ordered = sorted(actions, key=len, reverse=True)
        self.regex = re.compile("|".join(map(re.escape, ordered))) if ordered else None
        self.prefixes = {m[:k] for m in actions for k in range(1, len(m))}
        self.longest = max(map(len, actions), default=0)

    def partial_start(self, text: str, start: int) -> int:
        """Where the text's end may be the start of a marker; len(text) where it cannot."""
        for at in range(max(start, len(text) - self.longest + 1), len(text)):
            if text[at:] in self.prefixes:
                return at
        return len(text)


def _mode_tables(fmt: ReplyFormat, with_calls: bool) -> dict:
    """mode -> _Markers for one format. Actions: reason / unreason (enter, leave a reasoning
    block), drop, call (a call block starts after the marker), call_here (one starts at the
    marker), end (end-of-turn), yield (leave reasoning, read the marker again), close / stop (a
    block ends after / before the marker), header (harmony: the header ends)."""
    call = fmt.call if with_calls else None
    end = {m: "end" for m in fmt.end}
    if fmt.harmony is not None:
        h = fmt.harmony
        body = {**{t: "close" for t in h.terminators}, h.start: "stop", h.channel: "stop"}
        text = {**end, **body}
        return {
            "header": _Markers({h.message: "header"}),
            "content": _Markers(text),
            "reasoning": _Markers(text),
            "call": _Markers(body),
            "drop": _Markers(body),
        }
    content = {**end, **{m: "drop" for m in fmt.drop}}
    reasoning = dict(end)
    if fmt.reasoning:
        # a closer without an opener only separates content: the reply did not start in reasoning
        # (else the stream would have been in it), and content already sent cannot become reasoning
        opener, closer = fmt.reasoning
        content.update({opener: "reason", closer: "unreason"})
        reasoning.update({opener: "drop", closer: "unreason"})
    tables = {"content": content, "reasoning": reasoning}
    if call is not None:
        content.update({m: "drop" for m in call.section})
        content.update({m: "call" for m in call.openers})
        content.update({m: "call_here" for m in call.body_openers})
        if call.in_reasoning:
            reasoning.update({m: "yield" for m in (*call.section[:1], *call.openers)})
        tables["call"] = {**{m: "stop" for m in call.stops}, **{m: "close" for m in call.closers}}
    return {mode: _Markers(actions) for mode, actions in tables.items()}


class ReplyStream:
    """The reply parser of one format, fed the generated text piece by piece.

    push(piece) -> deltas; finish() -> the last deltas; then `message` is the whole assistant
    message (equal to parse_reply of the whole text) and `has_tool_calls` says whether it calls."""

    def __init__(
        self, fmt: ReplyFormat, tools=None, *, starts_in_reasoning: bool = False, parallel_tool_calls: bool = True
    ):
        self.format = fmt
        self.parallel_tool_calls = parallel_tool_calls  # the grammar enforces it; every call read is kept
        self._schemas = _tool_schemas(tools)
        self._calls_on = bool(self._schemas) and (fmt.harmony is not None or fmt.call is not None)
        self._tables = _mode_tables(fmt, self._calls_on)
        self._content = _Field()
        self._reasoning = _Field()
        self._calls = []
        self._buf = ""  # text read but not yet decided
        self._scan = 0  # in a block: where the marker search goes on
        self._opener = ""  # the marker that opened the current block
        self._header = ""  # harmony: the current message's header
        self._done = False
        if fmt.harmony is not None:
            self._mode = "header"
        elif starts_in_reasoning and fmt.reasoning is not None:
            self._mode = "reasoning"
        else:
            self._mode = "content"

    # -- the public side

    def push(self, piece: str) -> list:
        if self._done:
            raise ColibriError("the reply stream is finished; no more text can be pushed")
        if not piece:
            return []
        self._buf += piece
        return self._run(final=False)

    def finish(self) -> list:
        if self._done:
            return []
        out = self._run(final=True)
        self._done = True
        return out

    @property
    def has_tool_calls(self) -> bool:
        return bool(self._calls)

    @property
    def message(self) -> dict:
        msg = {"role": "assistant", "content": self._content.value, "reasoning_content": self._reasoning.value}
        if self._calls:
            msg["tool_calls"] = [dict(c, function=dict(c["function"])) for c in self._calls]
        return msg

    # -- the engine

    def _emit(self, field: str, text: str, out: list) -> None:
        piece = (self._reasoning if field == "reasoning" else self._content).add(text)
        if piece:
            key = "reasoning_content" if field == "reasoning" else "content"
            if out and set(out[-1]) == {key}:
                out[-1][key] += piece
            else:
                out.append({key: piece})

    def _run(self, final: bool) -> list:
        out = []
        while True:
            table = self._tables[self._mode]
            block = self._mode in ("call", "drop", "header")
            m = table.regex.search(self._buf, self._scan) if table.regex else None
            hold = len(self._buf) if final else table.partial_start(self._buf, self._scan)
            if m is None or m.start() >= hold:
                if block:
                    self._scan = hold
                else:
                    self._emit(self._mode, self._buf[:hold], out)
                    self._buf, self._scan = self._buf[hold:], 0
                break
            at, marker = m.start(), m.group()
            action = table.actions[marker]
            after = at + len(marker)
            if action == "end":
                verdict = self._end_of_reply(after, final)
                if verdict == "literal":
                    self._emit(self._mode, self._buf[:after], out)
                    self._buf, self._scan = self._buf[after:], 0
                    continue
                self._emit(self._mode, self._buf[:at], out)
                self._buf, self._scan = ("" if verdict == "drop" else self._buf[at:]), 0
                break
            if block:
                body = self._buf[:at]
                closer = marker if action in ("close", "header") else ""
                self._buf, self._scan = self._buf[at + len(closer) :], 0
                self._end_block(body, closer, out)
                continue
            self._emit(self._mode, self._buf[:at], out)
            self._buf, self._scan = self._buf[after:], 0
            if action == "reason":
                self._mode = "reasoning"
                self._reasoning.new_segment()
            elif action == "unreason":
                self._mode = "content"
                self._content.new_segment()
            elif action in ("call", "call_here"):
                self._mode, self._opener = "call", marker
                if action == "call_here":
                    self._buf, self._opener = marker + self._buf, ""
            elif action == "yield":
                self._mode = "content"
                self._buf = marker + self._buf
            elif action == "close":  # harmony: a message ends
                self._mode = "header"
            elif action == "stop":
                self._mode = "header"
                self._buf = marker + self._buf
        if final and self._buf and self._mode in ("call", "drop", "header"):
            body, self._buf = self._strip_end(self._buf), ""
            self._end_block(body, "", out, at_end=True)
        return out

    def _end_of_reply(self, after: int, final: bool) -> str:
        """An end-of-turn marker ends the reply where only whitespace and other such markers follow
        it: "drop" (at the end), "wait" (more text may still come), else "literal" (it is text)."""
        rest = self._buf[after:]
        while True:
            rest = rest.lstrip()
            found = next((m for m in self.format.end if rest.startswith(m)), None)
            if found is None:
                break
            rest = rest[len(found) :]
        if not rest:
            return "drop" if final else "wait"
        if not final and any(m.startswith(rest) for m in self.format.end):
            return "wait"
        return "literal"

    def _strip_end(self, text: str) -> str:
        while True:
            stripped = text.rstrip()
            found = next((m for m in self.format.end if stripped.endswith(m)), None)
            if found is None:
                return text
            text = stripped[: -len(found)]

    def _end_block(self, body: str, closer: str, out: list, at_end: bool = False) -> None:
        mode = self._mode
        after = "header" if self.format.harmony is not None else "content"
        if mode == "header":
            self._read_header(body, closer, at_end, out)
            return
        self._mode = after
        if mode == "drop":
            return
        harmony = self.format.harmony
        if harmony is not None:
            name = self._header_recipient()[len(harmony.function_prefix) :]
            args = _json_object_text(body)
            calls = [(name.strip(), args, None)] if args is not None and name.strip() else None
            raw = self._header + harmony.message + body + closer
        else:
            calls = _read_calls(self.format.call, body, self._schemas)
            raw = self._opener + body + closer
        if calls is None:
            self._emit("content", raw, out)
            return
        for name, args, call_id in calls:
            index = len(self._calls)
            call_id = call_id or new_call_id(self.format.call.ids if self.format.call else "random")
            self._calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
            out.append(
                {
                    "tool_calls": [
                        {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
                    ]
                }
            )
            out.append({"tool_calls": [{"index": index, "function": {"arguments": args}}]})
        self._content.new_segment()

    _RECIPIENT = re.compile(r"\bto=([^\s<]+)")
    _CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")

    def _header_recipient(self) -> str:
        found = self._RECIPIENT.findall(self._header)
        names = [r for r in found if r != "assistant"]
        return names[-1] if names else ""

    def _read_header(self, header: str, closer: str, at_end: bool, out: list) -> None:
        """harmony: a message's header decides where its body goes: a call to functions.NAME, a
        built-in tool's call (dropped: it is no function of the request), the analysis channel
        (reasoning), else content. A header the reply ends in is text only where it has no markers."""
        h = self.format.harmony
        if at_end:
            if "<|" not in header:
                self._emit("content", header, out)
            return
        self._header = header
        recipient = self._header_recipient()
        channels = self._CHANNEL.findall(header)
        if recipient.startswith(h.function_prefix) and self._calls_on:
            self._mode = "call"
        elif recipient and not recipient.startswith(h.function_prefix):
            self._mode = "drop"
        elif channels and channels[-1] in h.reasoning_channels:
            self._mode = "reasoning"
            self._reasoning.new_segment()
        else:
            self._mode = "content"
            self._content.new_segment()


def parse_reply(fmt: ReplyFormat, text: str, tools=None, *, starts_in_reasoning: bool = False) -> dict:
    """The assistant message of a whole reply (the stream run over it at once)."""
    stream = ReplyStream(fmt, tools, starts_in_reasoning=starts_in_reasoning)
    stream.push(text)
    stream.finish()
    return stream.message


# -- grammars ------------------------------------------------------------------------------------

_REGEX_META = set("\\.+*?()|[]{}^$#&-~/")


def _regex_literal(text: str) -> str:
    """`text` inside a Lark /regex/ (Rust regex syntax): meta characters and the slash escaped."""
    return "".join("\\n" if c == "\n" else "\\t" if c == "\t" else "\\" + c if c in _REGEX_META else c for c in text)


class _Lark:
    """Writes one Lark grammar: rules by name, markers as token references or text."""

    def __init__(self, fmt: ReplyFormat, added_tokens):
        if isinstance(added_tokens, Mapping):
            self._ids = {str(k): int(v) for k, v in added_tokens.items()}
            self._tokens = set(self._ids)
        else:
            self._ids = {}
            self._tokens = set(fmt.tokens if added_tokens is None else added_tokens)
        self._by_first = {}  # first character -> the nameable tokens, longest first
        for t in sorted(self._tokens, key=len, reverse=True):
            if t and self.is_token(t):
                self._by_first.setdefault(t[0], []).append(t)
        self.rules = []
        self._count = 0

    def is_token(self, piece) -> bool:
        """Whether `piece` is one token that a grammar can name."""
        return (
            isinstance(piece, str)
            and not isinstance(piece, Slot)
            and piece in self._tokens
            and (piece in self._ids or piece.startswith("<") and piece.endswith(">"))
        )

    def _split(self, text: str) -> list:
        """[(is_token, text)]: the vocabulary's tokens in `text` (longest first, as a tokenizer
        matches added tokens) and the literal runs between them."""
        out, literal, at = [], "", 0
        while at < len(text):
            found = next((t for t in self._by_first.get(text[at], ()) if text.startswith(t, at)), None)
            if found is None:
                literal += text[at]
                at += 1
                continue
            if literal:
                out.append((False, literal))
                literal = ""
            out.append((True, found))
            at += len(found)
        if literal:
            out.append((False, literal))
        return out

    def _write(self, is_token: bool, text: str) -> str:
        if is_token:
            return f"<[{self._ids[text]}]>" if text in self._ids else text
        return json.dumps(text, ensure_ascii=False)

    def piece(self, text: str) -> str:
        """A marker or text: each token of the vocabulary in it as `<[id]>` / `<name>`, the rest as
        literals (Gemma's reasoning opener is the token <|channel> then the text "thought").
        llguidance names tokens only as <...>, so a token spelled otherwise needs its id."""
        return " ".join(self._write(*part) for part in self._split(text))

    def opens_with_token(self, text: str) -> bool:
        parts = self._split(text)
        return bool(parts) and parts[0][0]

    def rule(self, hint: str, body: str, options: str = "") -> str:
        self._count += 1
        name = f"{hint}_{self._count}"
        self.rules.append(f"{name}{options}: {body}")
        return name

    def text_until(self, marker) -> tuple:
        """Free text, then `marker` (a str, or None for the end): (fragment, marker consumed). Before
        a token the text ends by itself (text cannot hold a special token); before a literal it is a
        lazy lexeme that takes the literal (up to the marker's first token) as its end."""
        parts = self._split(marker) if marker else []
        if not parts or parts[0][0]:
            return "ANY", False
        lazy = self.rule("text", f"/(?s:.*){_regex_literal(parts[0][1])}/", "[lazy]")
        return " ".join([lazy, *(self._write(*part) for part in parts[1:])]), True

    def sequence(self, pieces, fill) -> str:
        """Lark for a run of pieces; `fill(slot)` writes a Slot."""
        out, i = [], 0
        while i < len(pieces):
            p = pieces[i]
            if p is FREE:
                frag, consumed = self.text_until(pieces[i + 1] if i + 1 < len(pieces) else None)
                out.append(frag)
                i += 2 if consumed else 1
                continue
            out.append(fill(p) if isinstance(p, Slot) else self.piece(p))
            i += 1
        return " ".join(o for o in out if o)

    def text(self, start: str) -> str:
        return (
            "\n".join(
                [
                    "%llguidance {}",
                    f"start: {start}",
                    "ANY: /(.|\\n)*/",
                    f"WS: /[ \\t\\r\\n]{{1,{MAX_WHITESPACE}}}/",
                    "INDEX: /[0-9]+/",
                    *self.rules,
                ]
            )
            + "\n"
        )


def _tool_list(tools) -> list:
    schemas = _tool_schemas(tools)
    return [(name, params if params else {"type": "object"}) for name, params in schemas.items()]


def _chosen_tools(tools: list, mode) -> list:
    """The tools a tool_choice allows: all ("auto", "required") or the named one."""
    if isinstance(mode, dict):
        fn = mode.get("function") if isinstance(mode.get("function"), dict) else mode
        name = fn.get("name")
        chosen = [t for t in tools if t[0] == name]
        if not chosen:
            raise ColibriError(
                f"tool_choice names the function {name!r}, which is not among the tools "
                f"({', '.join(t[0] for t in tools) or 'none'})"
            )
        return chosen
    if mode in ("auto", "required"):
        if not tools:
            raise ColibriError(f"tool_choice {mode!r} needs at least one tool")
        return tools
    raise ColibriError(
        f"tool_choice must be 'auto', 'required', 'none' or {{'type': 'function', "
        f"'function': {{'name': ...}}}}, got {mode!r}"
    )


def _properties(schema: dict) -> list:
    """[(key, schema, required)] in the schema's order."""
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = set(schema.get("required") or ())
    return [(k, v if isinstance(v, dict) else {}, k in required) for k, v in props.items()]


def _is_text(schema: dict) -> bool:
    """A parameter written as plain text (not JSON): a string, or a type the schema does not name."""
    types = _schema_types(schema)
    return not types or "string" in types


def _json_schema(schema) -> str:
    """An argument schema as a %json block, with the bounded whitespace of every JSON constraint
    (a schema's own "x-guidance" wins)."""
    schema = {**schema, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE, **(schema.get("x-guidance") or {})}}
    return "%json " + json.dumps(schema, ensure_ascii=False)


def _xml_params_lark(lark: _Lark, name: str, schema: dict) -> str:
    """Qwen3-Coder's parameters: the required ones, then the optional ones, in the schema's order."""
    parts = []
    for key, prop, required in _properties(schema):
        head = lark.piece(f"<parameter={key}>\n")
        if _is_text(prop):
            frag, _ = lark.text_until("\n</parameter>\n")
            body = f"{head} {frag}"
        else:
            body = f'{head} {_json_schema(prop)} "\\n</parameter>\\n"'
        parts.append((required, lark.rule("param", body)))
    ordered = [r for req, r in parts if req] + [f"{r}?" for req, r in parts if not req]
    return " ".join(ordered)


def _arg_pairs_lark(lark: _Lark, name: str, schema: dict) -> str:
    """GLM's key/value pairs: the required ones, then the optional ones, in the schema's order."""
    parts = []
    for key, prop, required in _properties(schema):
        value = [FREE, "</arg_value>"] if _is_text(prop) else [Slot("value"), "</arg_value>"]
        pieces = ["<arg_key>", key, "</arg_key>", OPT_NL, "<arg_value>", *value, OPT_NL]
        body = lark.sequence(pieces, lambda s, prop=prop: _json_schema(prop) if s == "value" else '"\\n"?')
        parts.append((required, lark.rule("pair", body)))
    ordered = [r for req, r in parts if req] + [f"{r}?" for req, r in parts if not req]
    return " ".join(ordered)


def _gemma_value_lark(lark: _Lark, schema: dict) -> str:
    types = _schema_types(schema) or set()
    quote = lark.piece(_GEMMA_QUOTE)
    options = []
    if "string" in types:
        frag, consumed = lark.text_until(_GEMMA_QUOTE)
        options.append(f"{quote} {frag}" + ("" if consumed else f" {quote}"))
    if "integer" in types and "number" not in types:
        options.append("/-?[0-9]+/")
    if "number" in types:
        options.append("/-?[0-9]+(\\.[0-9]+)?([eE][+-]?[0-9]+)?/")
    if "boolean" in types:
        options.append('"true" | "false"')
    if "null" in types:
        options.append('"null"')
    if not options or types & {"array", "object"}:
        options.append("gemma_any")
    return " | ".join(options)


def _gemma_args_lark(lark: _Lark, name: str, schema: dict) -> str:
    """Gemma 4's {key:value,...}: keys in sorted order (the template writes them so), the optional
    ones optional, commas between those present."""
    props = sorted(_properties(schema), key=lambda p: p[0])
    items = [
        lark.rule("gitem", f"{json.dumps(key + ':', ensure_ascii=False)} ({_gemma_value_lark(lark, prop)})")
        for key, prop, _ in props
    ]
    rest, first = "", ""  # the items from i on: after an item (each behind a comma) / first
    for i in reversed(range(len(props))):
        with_comma = f'"," {items[i]} {rest}'.strip()
        leading = f"{items[i]} {rest}".strip()
        if props[i][2]:  # required
            rest, first = lark.rule("grest", with_comma), lark.rule("gfirst", leading)
        else:
            rest = lark.rule("grest", f'("," {items[i]})? {rest}'.strip())
            first = lark.rule("gfirst", f"{leading} | {first}" if first else f"({leading})?")
    return f'"{{" {first} "}}"' if first else '"{" "}"'


def _gemma_any_rules(lark: _Lark) -> None:
    quote = lark.piece(_GEMMA_QUOTE)
    frag, consumed = lark.text_until(_GEMMA_QUOTE)
    string_ = f"{quote} {frag}" + ("" if consumed else f" {quote}")
    lark.rules.append(
        f'gemma_any: {string_} | /-?[0-9]+(\\.[0-9]+)?([eE][+-]?[0-9]+)?/ | "true" | "false" | "null" '
        f'| "[" (gemma_any ("," gemma_any)*)? "]" '
        f'| "{{" (/[A-Za-z_][A-Za-z0-9_]*/ ":" gemma_any ("," /[A-Za-z_][A-Za-z0-9_]*/ ":" gemma_any)*)? "}}"'
    )


def _named_schema(name: str, params: dict, with_id: bool = False) -> dict:
    schema = {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
    if with_id:
        schema["properties"]["id"] = {"type": "string", "pattern": "^[A-Za-z0-9]{9}$"}
    return schema


def _call_rules(lark: _Lark, fmt: ReplyFormat, tools: list, parallel: bool) -> tuple:
    """(block, rest): the Lark for a run of calls, and for that run after its first piece (the
    text after a lazy trigger); rest is None where the first piece is a token."""
    call = fmt.call
    if CALL_LIST in call.shape:
        items = {"anyOf": [_named_schema(n, p, with_id=True) for n, p in tools]}
        array = {"type": "array", "items": items, "minItems": 1, **({} if parallel else {"maxItems": 1})}
        first = call.shape[0]
        block = f"{lark.piece(first)} {_json_schema(array)}"
        return block, (None if lark.opens_with_token(first) else (lark.piece(first), _json_schema(array)))
    fillers = {
        ARGS: lambda n, p: _json_schema(p),
        NAMED_JSON: lambda n, p: _json_schema(_named_schema(n, p)),
        NAME: lambda n, p: json.dumps(n, ensure_ascii=False),
        INDEX: lambda n, p: "INDEX",
        CALL_ID: lambda n, p: f"({lark.piece('[CALL_ID]')} /[A-Za-z0-9]{{9}}/)?",
        OPT_NL: lambda n, p: '"\\n"?',
        XML_PARAMS: lambda n, p: _xml_params_lark(lark, n, p),
        ARG_PAIRS: lambda n, p: _arg_pairs_lark(lark, n, p),
        GEMMA_ARGS: lambda n, p: _gemma_args_lark(lark, n, p),
    }
    if GEMMA_ARGS in call.shape:
        _gemma_any_rules(lark)
    first = call.section[0] if call.section else call.shape[0]
    triggered = not lark.opens_with_token(first)  # a text opener: "auto" needs the call without it
    whole, tails = [], []
    for name, params in tools:
        fill = lambda slot, n=name, p=params: fillers[slot](n, p)
        whole.append(lark.rule("call", lark.sequence(call.shape, fill)))
        if triggered and not call.section:
            tails.append(lark.rule("call_tail", lark.sequence(call.shape[1:], fill)))
    one = lark.rule("one_call", " | ".join(whole))
    run = f"{one} (WS? {one})*" if parallel else one
    if call.section:
        begin, end = (lark.piece(m) for m in call.section)
        block, rest = f"{begin} WS? {run} WS? {end}", f"WS? {run} WS? {end}"
    else:
        block = run
        if triggered:
            tail = lark.rule("tail", " | ".join(tails))
            rest = f"{tail} (WS? {one})*" if parallel else tail
    return block, ((lark.piece(first), rest) if triggered else None)


def _harmony_grammar(lark: _Lark, fmt: ReplyFormat, tools: list, mode) -> str:
    """gpt-oss: analysis / commentary messages, then the call (or, with "auto", a final message)."""
    h = fmt.harmony
    end, start, channel, message = h.terminators[0], h.start, h.channel, h.message
    note = lark.rule(
        "note",
        lark.sequence(
            [channel, Slot("kind"), message, FREE, end, start, "assistant"], lambda s: '("analysis" | "commentary")'
        ),
    )
    constrain = f'(" "? {lark.piece(h.constrain)} "json")?'
    calls = []
    for name, params in tools:
        to = json.dumps(f" to={h.function_prefix}{name}", ensure_ascii=False)
        head = (
            f'{lark.piece(channel)} "commentary" {to} {constrain} | {to} {lark.piece(channel)} "commentary" {constrain}'
        )
        calls.append(
            lark.rule("call", f"({head}) {lark.piece(message)} {_json_schema(params)} {lark.piece(h.terminators[1])}?")
        )
    last = " | ".join(calls)
    if mode == "auto":
        final = lark.sequence([channel, "final", message, FREE], lambda s: "")
        last = f"{last} | {lark.rule('final', final)}"
    return f"{note}* ({last})"


def tool_call_grammar(
    fmt: ReplyFormat,
    tools,
    mode,
    parallel_tool_calls: bool = True,
    added_tokens=None,
    starts_in_reasoning: bool = False,
) -> str | None:
    """An llguidance Lark grammar for a whole reply that calls tools in `fmt`'s syntax, or None
    where the format has no call syntax (or tool_choice is "none").

    mode: "required" (at least one call; with parallel_tool_calls=False exactly one), a named
    function ({"type": "function", "function": {"name": ...}}: calls of it only), or "auto" (free
    text; a call is constrained once its opener appears). Reasoning may come first where the family
    reasons (it must come first where the prompt left a reasoning block open: starts_in_reasoning).
    added_tokens: the vocabulary's added tokens (a text -> id mapping, or their texts)."""
    if mode == "none" or (fmt.call is None and fmt.harmony is None):
        return None
    tools = _chosen_tools(_tool_list(tools), mode)
    lark = _Lark(fmt, added_tokens)
    if fmt.harmony is not None:
        return lark.text(_harmony_grammar(lark, fmt, tools, mode))
    think = ""
    if fmt.reasoning is not None:
        # the reasoning block: closing the one the prompt opened, or opened by the reply (optional).
        # Free text cannot hold a special token, so a token opener is needed to let reasoning through
        # "auto"'s free text; a text opener is free text already.
        opener, closer = fmt.reasoning
        if starts_in_reasoning:
            think = lark.rule("think", lark.sequence([FREE, closer], None)) + " WS?"
        elif mode != "auto" or lark.opens_with_token(opener):
            think = lark.rule("think", lark.sequence([opener, FREE, closer], None)) + "? WS?"
    block, trigger = _call_rules(lark, fmt, tools, parallel_tool_calls)
    if mode != "auto":
        return lark.text(f"{think} {block} WS?".strip())
    if trigger is None:  # a special token opens a call: text stops there
        calls = f"(ANY {block})*" if parallel_tool_calls else f"(ANY {block})?"
        return lark.text(f"{think} {calls} ANY".strip())
    first, rest = trigger
    hook = lark.rule("trigger", f"ANY {first}", "[lazy]")
    segment = lark.rule("segment", f"{hook} {rest}")
    calls = f"{segment}*" if parallel_tool_calls else f"{segment}?"
    return lark.text(f"{think} {calls} ANY".strip())


# -- one chat template's replies -----------------------------------------------------------------

_PROBE = "Colibri reply probe: where does the reply start?"


def ends_inside(prompt: str, reasoning: tuple) -> bool:
    """Whether a prompt ends inside an open reasoning block (its last opener after its last closer)."""
    opener, closer = reasoning
    at = prompt.rfind(opener)
    return at >= 0 and at > prompt.rfind(closer)


class TemplateReplies:
    """The reply side of a ChatTemplate: its format (detected once from the template's text) and
    where its replies start (reasoning already open or not, probed once per enable_thinking)."""

    def __init__(self, template):
        self.template = template
        self.format = detect_format(template_text(template))
        self._starts = {}

    def starts_in_reasoning(self, enable_thinking=None, prompt: str | None = None) -> bool:
        if self.format.reasoning is None:
            return False
        if prompt is not None:
            return ends_inside(prompt, self.format.reasoning)
        key = None if enable_thinking is None else bool(enable_thinking)
        if key not in self._starts:
            self._starts[key] = self._probe(key)
        return self._starts[key]

    def _probe(self, enable_thinking) -> bool:
        kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        try:
            text = self.template.render([{"role": "user", "content": _PROBE}], add_generation_prompt=True, **kwargs)
        except ColibriError:
            return False
        return ends_inside(text[text.rfind(_PROBE) + len(_PROBE) :] if _PROBE in text else text, self.format.reasoning)

    def stream(
        self, tools=None, *, enable_thinking=None, parallel_tool_calls: bool = True, prompt: str | None = None
    ) -> ReplyStream:
        return ReplyStream(
            self.format,
            tools,
            parallel_tool_calls=parallel_tool_calls,
            starts_in_reasoning=self.starts_in_reasoning(enable_thinking, prompt),
        )

    def parse(
        self,
        text: str,
        tools=None,
        *,
        enable_thinking=None,
        parallel_tool_calls: bool = True,
        prompt: str | None = None,
    ) -> dict:
        stream = self.stream(
            tools, enable_thinking=enable_thinking, parallel_tool_calls=parallel_tool_calls, prompt=prompt
        )
        stream.push(text)
        stream.finish()
        return stream.message

    def grammar(
        self,
        tools,
        mode,
        parallel_tool_calls: bool = True,
        added_tokens=None,
        *,
        enable_thinking=None,
        prompt: str | None = None,
    ) -> str | None:
        return tool_call_grammar(
            self.format,
            tools,
            mode,
            parallel_tool_calls,
            added_tokens,
            starts_in_reasoning=self.starts_in_reasoning(enable_thinking, prompt),
        )
