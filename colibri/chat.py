"""Chat templates: a conversation -> the prompt text, rendered the way transformers renders it.

Design
------
A checkpoint's chat template is a Jinja program (from the Hub: untrusted code). transformers 5.x
compiles it in an ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the
loopcontrols extension and a `{% generation %}` block tag, a `tojson` filter that does not
escape HTML (ensure_ascii=False), and the globals `raise_exception`, `strftime_now`, `dict` and a
namespace that refuses underscore names. It renders with `messages`, `tools`, `documents`,
`add_generation_prompt`, the tokenizer's special tokens (`bos_token`, `eos_token`, ...) and every
other keyword the caller passes (`enable_thinking`, ...), keys whose value is None dropped from
each message. The rendered text is tokenized with add_special_tokens=False (the template writes
BOS itself). All of that is reproduced here; `continue_final_message` too. Beyond transformers,
what OpenAI-style clients send (tool-call arguments as JSON strings, `content: null` beside tool
calls, the `developer` role, reasoning under another field name) is handed to each template in the
shape it renders, found by probing it once, as llama.cpp does (see _TemplateProbe).

Where the template comes from, first found wins (transformers' order): chat_template.jinja,
chat_template.json's "chat_template", tokenizer_config.json's "chat_template" (a string, or a
list of named templates: "tool_use" when tools are given, else "default").
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import threading
from datetime import datetime
from functools import cached_property
from pathlib import Path

from .errors import ColibriError
from .config import read_json
from .tokenizer import MAX_TEXT_FILE_BYTES, TOKENIZER_CONFIG

CHAT_TEMPLATE_JINJA = "chat_template.jinja"
CHAT_TEMPLATE_JSON = "chat_template.json"
ROLES_HINT = "each message must be an object with a string 'role' and a 'content'"
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


# What a chat template may compute: integers of this many bits (a power beyond it is refused), and
# sequences of this many items made by repetition ("-" * 80 is common; "x" * 10 ** 9 is an attack).
TEMPLATE_MAX_INT_BITS = 4096
TEMPLATE_MAX_ITEMS = 1_000_000
# What one render may do: steps (loop iterations, range() items, items made by repetition) and
# characters written. Templates take a few steps a message (Qwen3, GLM-4.6, DeepSeek, Kimi: 1 to 3),
# some a step for each pair of messages (Gemma 4: 9 million for 3000 messages with tool calls),
# hence the steps of a render: TEMPLATE_MAX_STEPS + TEMPLATE_STEPS_PER_PAIR * n^2 with n messages
# and tools. Counted, not timed: a template and a conversation pass or fail on any machine.
TEMPLATE_MAX_STEPS = 10_000_000
TEMPLATE_STEPS_PER_PAIR = 2
TEMPLATE_MAX_CHARS = 64 << 20  # 4 times the server's largest request


def _huge_power(base, exponent) -> bool:
    """Whether int base ** exponent would exceed TEMPLATE_MAX_INT_BITS (floats overflow by themselves)."""
    if not (isinstance(base, int) and isinstance(exponent, int)) or exponent <= 0 or abs(base) < 2:
        return False
    return exponent * math.log2(abs(base)) > TEMPLATE_MAX_INT_BITS


def _huge_repetition(left, right) -> bool:
    """Whether a sequence * int (either order) would exceed TEMPLATE_MAX_ITEMS items."""
    seq, n = (left, right) if isinstance(right, int) else (right, left)
    if not (isinstance(n, int) and isinstance(seq, (str, list, tuple))):
        return False
    return len(seq) * n > TEMPLATE_MAX_ITEMS


def _huge_width(fmt) -> bool:
    """Whether a format string names a number past TEMPLATE_MAX_CHARS (a width or precision:
    "%0400000000d" % 1, "{:>400000000}".format(1) build that many characters)."""
    return isinstance(fmt, str) and any(len(m) > 9 or int(m) > TEMPLATE_MAX_CHARS for m in re.findall(r"\d+", fmt))


_PADDING = ("center", "ljust", "rjust", "zfill", "expandtabs")  # str methods whose int argument is a width


def _bounded_filter(env, f, formats: bool):
    """Filter f refusing a width past TEMPLATE_MAX_CHARS (or, where it formats, a format string
    naming one) before it builds the text."""

    def bounded(value, *args, **kwargs):
        if not formats:
            env.check_widths(*args, *kwargs.values())
        elif _huge_width(value):
            raise env.past_a_bound(f"a format width of more than {TEMPLATE_MAX_CHARS:,} characters")
        return f(value, *args, **kwargs)

    return bounded


def _environment():
    import jinja2
    import jinja2.ext
    from jinja2.runtime import LoopContext
    from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` renders its body (transformers tracks assistant spans with it)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot set the attribute {name!r}")

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    class PastABound(jinja2.exceptions.SecurityError):
        """A template that computes more than a chat template may (ChatTemplate.render names it)."""

    class BoundedTemplate(jinja2.Template):
        """A template whose render counts its steps and characters (BoundedSandbox.step): a
        nested loop of 100000 x 100000 would run for hours, writing gigabytes."""

        def render(self, *args, **kwargs):
            values = dict(*args, **kwargs)
            n = sum(len(values[k]) for k in ("messages", "tools") if isinstance(values.get(k), (list, tuple)))
            budget = self.environment.budget
            budget.limit = budget.steps = TEMPLATE_MAX_STEPS + TEMPLATE_STEPS_PER_PAIR * n * n
            pieces, size = [], 0
            stream = self.generate(values)
            try:
                for piece in stream:
                    size += len(piece)
                    if size > TEMPLATE_MAX_CHARS:
                        raise PastABound(f"a text of more than {TEMPLATE_MAX_CHARS:,} characters")
                    pieces.append(piece)
            finally:
                stream.close()
            return "".join(pieces)

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        """The sandbox with the power and repetition operators bounded: `2 ** (2 ** 40)` or
        `"x" * 10 ** 10` in a template would take minutes and gigabytes, at load (jinja folds
        constant expressions when it compiles) or at every render. An intercepted operator is
        neither folded nor run unchecked; a template that goes past a bound is refused. Each
        render has a budget of steps (a thread's own: the server renders on several): every
        item a loop takes (compile() wraps each loop's iterable, call() a recursive loop's),
        every item of a range() and of a repetition."""

        intercepted_binops = frozenset({"**", "*", "%"})
        template_class = BoundedTemplate

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.budget = threading.local()
            self.globals["range"] = self.bounded_range

        def step(self, n: int = 1) -> None:
            """Take n steps of the render's budget (BoundedTemplate.render sets it)."""
            left = self.budget.steps = getattr(self.budget, "steps", TEMPLATE_MAX_STEPS) - n
            if left < 0:
                limit = getattr(self.budget, "limit", TEMPLATE_MAX_STEPS)
                raise PastABound(f"more than {limit:,} steps (loop iterations, range and repeated items) in one render")

        def counted(self, iterable):
            """`iterable`, each item taken counted as a step."""
            for item in iterable:
                self.step()
                yield item

        def bounded_range(self, *args):
            r = safe_range(*args)
            self.step(len(r))
            return r

        def compile(self, source, name=None, filename=None, raw=False, defer_init=False):
            if isinstance(source, str):
                source = self.parse(source, name, filename)
            for loop in source.find_all(jinja2.nodes.For):
                counted = jinja2.nodes.EnvironmentAttribute("counted", lineno=loop.iter.lineno)
                loop.iter = jinja2.nodes.Call(counted, [loop.iter], [], None, None, lineno=loop.iter.lineno)
            return super().compile(source, name, filename, raw, defer_init)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's signature
            if isinstance(__obj, LoopContext) and args:  # loop(children) in a recursive loop
                args = (__self.counted(args[0]), *args[1:])
            if isinstance(getattr(__obj, "__self__", None), str) and getattr(__obj, "__name__", "") in _PADDING:
                __self.check_widths(*args, *kwargs.values())  # "x".center(10 ** 9)
            return super().call(__context, __obj, *args, **kwargs)

        def check_widths(self, *values) -> None:
            """A width past TEMPLATE_MAX_CHARS (an int argument of a str method or a padding
            filter) is refused before the string is built."""
            if any(isinstance(v, int) and v > TEMPLATE_MAX_CHARS for v in values):
                raise PastABound(f"a text of more than {TEMPLATE_MAX_CHARS:,} characters")

        def wrap_str_format(self, value):
            if _huge_width(getattr(value, "__self__", None)):
                raise PastABound(f"a format width of more than {TEMPLATE_MAX_CHARS:,} characters")
            return super().wrap_str_format(value)

        def call_binop(self, context, operator, left, right):
            if operator == "**" and _huge_power(left, right):
                raise PastABound(
                    f"a power of more than {TEMPLATE_MAX_INT_BITS} bits ({_short(left)} ** {_short(right)})"
                )
            if operator == "*" and _huge_repetition(left, right):
                raise PastABound(f"a repetition of more than {TEMPLATE_MAX_ITEMS:,} items")
            if operator == "%" and _huge_width(left):
                raise PastABound(f"a format width of more than {TEMPLATE_MAX_CHARS:,} characters")
            result = super().call_binop(context, operator, left, right)
            if operator == "*" and isinstance(result, (str, list, tuple)):
                self.step(len(result))
            return result

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    for name in ("center", "indent", "format"):  # their widths bounded (check_widths, _huge_width)
        env.filters[name] = _bounded_filter(env, env.filters[name], name == "format")
    env.globals.update(
        raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(), namespace=Namespace
    )
    env.past_a_bound = PastABound
    return env


def check_messages(messages) -> list:
    """A conversation as the template sees it: a list of dicts, None-valued keys dropped."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, (list, tuple)):
        raise ColibriError(f"messages must be a list of messages ({ROLES_HINT}), got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or "content" not in m
            and "tool_calls" not in m
        ):
            raise ColibriError(f"messages[{i}] is {_short(m)}: {ROLES_HINT}")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ColibriError(
                f"messages[{i}]['content'] must be a string or a list of parts, got {type(content).__name__}"
            )
        calls = m.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
            raise ColibriError(
                f"messages[{i}]['tool_calls'] must be a list of tool calls (objects), got {_short(calls)}"
            )
        out.append({k: v for k, v in m.items() if v is not None})
    return out


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---- what a template makes of the conversations clients send ----------------------------------------
# OpenAI-style clients send shapes many chat templates were not written for: tool-call arguments as a
# JSON string (templates that `tojson` them encode them twice, GLM-4.6 refuses them), `content: null`
# beside tool_calls (dropped, as transformers drops None; Qwen3 then fails on the missing content),
# the `developer` role, reasoning under another name than the template reads. As llama.cpp does
# (minja's capabilities probe), each compiled template is asked once, by rendering small
# conversations, what it does with each shape; render() then hands it the shapes it handles.

_PROBE_USER = {"role": "user", "content": "Probe question"}
_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "probe_tool",
            "description": "A probe tool",
            "parameters": {
                "type": "object",
                "properties": {"location": {"type": "string", "description": "A place"}},
                "required": ["location"],
            },
        },
    }
]
_PROBE_ARGUMENTS = {"argument_needle": "needle value"}  # names the tool schema above does not use
_PROBE_CALL_ID = "probecall"  # 9 letters and digits: the only ids Mistral's templates accept
_OPENAI_CALL_ID = "call_probe_1"
_REASONING_NAMES = ("reasoning_content", "thinking", "reasoning")  # Qwen3, GLM; gpt-oss; Gemma 4 (and vLLM)
_MISTRAL_CALL_ID = re.compile(r"[A-Za-z0-9]{9}")


def _probe_call(arguments, call_id: str = _PROBE_CALL_ID, **fields) -> dict:
    return {
        "role": "assistant",
        **fields,
        "tool_calls": [{"id": call_id, "type": "function", "function": {"name": "probe_tool", "arguments": arguments}}],
    }


def _shows_arguments(text) -> bool:
    """The probe's arguments are in the text, neither encoded twice (\\"key\\") nor as a Python dict ('key')."""
    return (
        text is not None
        and "argument_needle" in text
        and "needle value" in text
        and '\\"argument_needle' not in text
        and "'argument_needle'" not in text
    )


class _TemplateProbe:
    """What one compiled template does with each shape a client may send; each answer is found on first
    need (by rendering small conversations) and kept."""

    def __init__(self, template, special_tokens: dict):
        self._template = template
        self._special_tokens = special_tokens

    def _render(self, messages, tools=None):
        """The text, or None where the template refuses or fails: a probe never raises."""
        try:
            return self._template.render(
                messages=messages, tools=tools, documents=None, add_generation_prompt=False, **self._special_tokens
            )
        except Exception:
            return None

    def _renders_call(self, call_id: str = _PROBE_CALL_ID, **fields) -> bool:
        arguments = _arguments_as(dict(_PROBE_ARGUMENTS), self.arguments_form)
        return _shows_arguments(self._render([_PROBE_USER, _probe_call(arguments, call_id, **fields)], _PROBE_TOOLS))

    @cached_property
    def arguments_form(self):
        """ "object" where the template renders an object's keys, else "string" where it renders a JSON
        string as it is, else None: it renders no tool calls."""
        as_object = self._render([_PROBE_USER, _probe_call(dict(_PROBE_ARGUMENTS), content="")], _PROBE_TOOLS)
        if _shows_arguments(as_object):
            return "object"
        as_string = self._render([_PROBE_USER, _probe_call(json.dumps(_PROBE_ARGUMENTS), content="")], _PROBE_TOOLS)
        return "string" if _shows_arguments(as_string) else None

    @cached_property
    def needs_content(self) -> bool:
        """A message without content fails where one with content "" renders (Qwen: `message.content + ...`)."""
        if (
            self._render([_PROBE_USER, {"role": "assistant"}]) is None
            and self._render([_PROBE_USER, {"role": "assistant", "content": ""}]) is not None
        ):
            return True
        return self.arguments_form is not None and not self._renders_call() and self._renders_call(content="")

    @cached_property
    def needs_short_call_ids(self) -> bool:
        """Tool-call ids must be 9 letters or digits (Mistral's templates refuse OpenAI's `call_...`)."""
        return (
            self.arguments_form is not None
            and self._renders_call(content="")
            and not self._renders_call(_OPENAI_CALL_ID, content="")
        )

    @cached_property
    def knows_developer(self) -> bool:
        """The template treats `developer` otherwise than a role it has never heard of (gpt-oss, Gemma 4)."""
        instructions = "Probe instructions"
        as_developer = self._render([{"role": "developer", "content": instructions}, _PROBE_USER])
        if as_developer is None or instructions not in as_developer:
            return False
        as_unknown = self._render([{"role": "probe_role", "content": instructions}, _PROBE_USER])
        return as_unknown is None or as_unknown.replace("probe_role", "developer") != as_developer

    @cached_property
    def renders_tool_role(self) -> bool:
        """A `tool` message after a tool call shows its content."""
        result = "Probe result"
        if self.arguments_form is not None:
            call = _probe_call(_arguments_as(dict(_PROBE_ARGUMENTS), self.arguments_form), content="")
        else:
            call = {"role": "assistant", "content": "Probe call"}
        text = self._render(
            [_PROBE_USER, call, {"role": "tool", "tool_call_id": _PROBE_CALL_ID, "content": result}], _PROBE_TOOLS
        )
        return text is not None and result in text

    @cached_property
    def reasoning_names(self) -> tuple:
        """Which of an assistant turn's reasoning fields the template renders."""

        def renders(name) -> bool:
            reasoning = "Probe reasoning"
            texts = [self._render([_PROBE_USER, {"role": "assistant", "content": "Probe answer", name: reasoning}])]
            if self.arguments_form is not None:
                arguments = _arguments_as(dict(_PROBE_ARGUMENTS), self.arguments_form)
                texts.append(
                    self._render([_PROBE_USER, _probe_call(arguments, content="", **{name: reasoning})], _PROBE_TOOLS)
                )
            return any(text is not None and reasoning in text for text in texts)

        if renders("probe_field"):  # it prints whole messages: every field shows, none is read
            return ()
        return tuple(name for name in _REASONING_NAMES if renders(name))


def _arguments_as(arguments, form):
    """Tool-call arguments in the form the template renders: a JSON object string parsed ("object"),
    an object encoded ("string"); anything else (a string that is not a JSON object) as it came."""
    if form == "object" and isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except (ValueError, RecursionError):
            return arguments
        return parsed if isinstance(parsed, dict) else arguments
    if form == "string" and isinstance(arguments, (dict, list)):
        try:
            return json.dumps(arguments, ensure_ascii=False)
        except (TypeError, ValueError, RecursionError):  # not JSON data (from Python): left to the template
            return arguments
    return arguments


def _short_call_id(call_id):
    """A tool-call id as Mistral's templates demand (9 letters or digits): kept if it is one, else a
    digest, the same for the call and its result so that they still match."""
    if isinstance(call_id, str) and _MISTRAL_CALL_ID.fullmatch(call_id):
        return call_id
    return hashlib.sha256(str(call_id).encode("utf-8", "surrogatepass")).hexdigest()[:9]


def _fit_call(call: dict, form, short_ids: bool) -> dict:
    call = dict(call)
    if short_ids and "id" in call:
        call["id"] = _short_call_id(call["id"])
    function = call.get("function")
    if isinstance(function, dict) and "arguments" in function:
        call["function"] = {**function, "arguments": _arguments_as(function["arguments"], form)}
    elif "arguments" in call:  # {"name", "arguments"} without the "function" wrapper
        call["arguments"] = _arguments_as(call["arguments"], form)
    return call


def _call_as_text(message: dict) -> str:
    """Tool calls written into the content, as JSON, for a template that renders none (minja's polyfill)."""
    calls = []
    for call in message["tool_calls"]:
        function = call.get("function") if isinstance(call.get("function"), dict) else call
        entry = {"name": function.get("name"), "arguments": _arguments_as(function.get("arguments"), "object")}
        if "id" in call:
            entry["id"] = call["id"]
        calls.append(entry)
    shown = {"content": message["content"]} if message.get("content") else {}
    return json.dumps({**shown, "tool_calls": calls}, ensure_ascii=False, default=str)


def _fit_to_template(chat: list, probe: _TemplateProbe) -> list:
    """The conversation (from check_messages) in the shapes this template renders."""
    names_of_calls = {}  # tool-call id -> function name, for results sent without a name
    out = []
    for m in chat:
        m = dict(m)
        # OpenAI's newer name for the system role: a template that does not know it gets `system`.
        if m["role"] == "developer" and not probe.knows_developer:
            m["role"] = "system"
        if m.get("tool_calls"):
            for call in m["tool_calls"]:
                function = call.get("function") if isinstance(call.get("function"), dict) else call
                if isinstance(call.get("id"), str):
                    names_of_calls[call["id"]] = function.get("name")
            # Arguments come as a JSON string (every SDK) or an object: the template gets the form it renders.
            if probe.arguments_form is not None:
                short_ids = probe.needs_short_call_ids
                m["tool_calls"] = [_fit_call(c, probe.arguments_form, short_ids) for c in m["tool_calls"]]
            else:  # a template without tool calls still shows them, as text
                m["content"] = _call_as_text(m)
                del m["tool_calls"]
        if m["role"] == "tool":
            call_id = m.get("tool_call_id")
            if "tool_call_id" in m and probe.arguments_form is not None and probe.needs_short_call_ids:
                m["tool_call_id"] = _short_call_id(call_id)
            # A template without the tool role shows the result as a user turn (minja's polyfill).
            if not probe.renders_tool_role:
                name = m.get("name", names_of_calls.get(call_id) if isinstance(call_id, str) else None)
                result = {"tool": name} if name is not None else {}
                result["content"] = m.get("content")
                if "tool_call_id" in m:
                    result["tool_call_id"] = m["tool_call_id"]
                m = {"role": "user", "content": json.dumps({"tool_response": result}, ensure_ascii=False, default=str)}
        # `content: null` (beside tool_calls) was dropped; a template that reads it anyway gets "".
        if "content" not in m and probe.needs_content:
            m["content"] = ""
        # Reasoning sent under one name reaches a template that reads another (gpt-oss reads `thinking`).
        if m["role"] == "assistant":
            reasoning = next((m[n] for n in _REASONING_NAMES if isinstance(m.get(n), str)), None)
            if reasoning is not None:
                for name in probe.reasoning_names:
                    m.setdefault(name, reasoning)
        out.append(m)
    return out


class ChatTemplate:
    """A compiled chat template. `render(messages, ...) -> str`."""

    def __init__(self, source, where: str, special_tokens: dict | None = None):
        import jinja2

        self.where = where  # the file it came from, for messages
        self.special_tokens = dict(special_tokens or {})
        if isinstance(source, str):
            named = {"default": source}
        elif isinstance(source, dict) and source and all(isinstance(v, str) for v in source.values()):
            named = dict(source)
        else:
            raise ColibriError(f"{where}: the chat template must be a string or named templates")
        self.names = sorted(named)
        self._compiled = {}
        env = _environment()
        self._past_a_bound = env.past_a_bound
        for name, text in named.items():
            try:
                self._compiled[name] = env.from_string(text)
            except jinja2.exceptions.TemplateSyntaxError as e:
                raise ColibriError(
                    f"{where}: the chat template{'' if name == 'default' else f' {name!r}'} "
                    f"does not parse (line {e.lineno}: {e.message})"
                ) from None
        # id(compiled template) -> what it makes of the shapes clients send, probed on first need
        self._probes = {id(t): _TemplateProbe(t, self.special_tokens) for t in self._compiled.values()}

    def _pick(self, tools):
        if tools and "tool_use" in self._compiled:
            return self._compiled["tool_use"]
        if "default" in self._compiled:
            return self._compiled["default"]
        raise ColibriError(f"{self.where}: several chat templates ({', '.join(self.names)}) and none named 'default'")

    def render(
        self,
        messages,
        add_generation_prompt: bool = True,
        tools=None,
        documents=None,
        continue_final_message: bool = False,
        **kwargs,
    ) -> str:
        import jinja2

        chat = check_messages(messages)
        if continue_final_message:
            if add_generation_prompt:
                raise ColibriError("continue_final_message and add_generation_prompt cannot both be set")
            if not chat or not isinstance(chat[-1].get("content"), str):
                raise ColibriError("continue_final_message needs a last message with text content")
            final = chat[-1]["content"]
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise ColibriError("tools must be a list of JSON schemas (objects)")
        template = self._pick(tools)
        chat = _fit_to_template(chat, self._probes[id(template)])
        if continue_final_message:
            if chat[-1].get("content") != final:  # its tool calls were written into it
                raise ColibriError(f"the chat template ({self.where}) cannot continue this final message")
            chat[-1] = {**chat[-1], "content": final + _CONTINUE_TAG}
        try:
            text = template.render(
                messages=chat,
                tools=tools,
                documents=documents,
                add_generation_prompt=bool(add_generation_prompt),
                **{**self.special_tokens, **kwargs},
            )
        except self._past_a_bound as e:
            raise ColibriError(
                f"the chat template ({self.where}) was stopped: {e}, more than a chat template needs (fix "
                "the template, or import another: python -m colibri tokenizer --from DIR)"
            ) from None
        except jinja2.exceptions.TemplateError as e:
            raise ColibriError(f"the chat template ({self.where}) refused the conversation: {e}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, ArithmeticError, RecursionError) as e:
            raise ColibriError(
                f"the chat template ({self.where}) failed on this conversation: {type(e).__name__}: {e}"
            ) from None
        if continue_final_message:
            tag = _CONTINUE_TAG.strip()
            if final.strip() not in text or tag not in text:
                raise ColibriError(
                    f"the chat template ({self.where}) dropped part of the final message; it cannot be continued"
                )
            at = text.rindex(tag)
            text = text[:at] if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
        return text

    # -- the reply side (colibri/replies.py): generated text -> an assistant message

    @property
    def replies(self):
        """This template's reply parser and tool-call grammars (its format detected once)."""
        from .replies import TemplateReplies

        found = self.__dict__.get("_reply_side")
        if found is None:
            found = self.__dict__["_reply_side"] = TemplateReplies(self)
        return found

    @property
    def reply_format(self):
        """The colibri.replies.ReplyFormat of this template's family (the plain format if unknown)."""
        return self.replies.format

    def parse_reply(
        self,
        text: str,
        tools=None,
        *,
        enable_thinking=None,
        parallel_tool_calls: bool = True,
        prompt: str | None = None,
    ) -> dict:
        """A whole reply (decoded with its special tokens) -> {"role", "content", "reasoning_content",
        "tool_calls"}. enable_thinking / prompt: how the prompt was rendered (the prompt's own text,
        where given, says whether the reply starts inside reasoning)."""
        return self.replies.parse(
            text, tools, enable_thinking=enable_thinking, parallel_tool_calls=parallel_tool_calls, prompt=prompt
        )

    def reply_stream(
        self, tools=None, *, enable_thinking=None, parallel_tool_calls: bool = True, prompt: str | None = None
    ):
        """A colibri.replies.ReplyStream: push(piece) -> deltas, finish() -> deltas, .message."""
        return self.replies.stream(
            tools, enable_thinking=enable_thinking, parallel_tool_calls=parallel_tool_calls, prompt=prompt
        )

    def tool_call_grammar(
        self,
        tools,
        mode,
        parallel_tool_calls: bool = True,
        *,
        added_tokens=None,
        enable_thinking=None,
        prompt: str | None = None,
    ) -> str | None:
        """An llguidance Lark grammar for a reply calling `tools` (mode "required", "auto" or a named
        function), or None where the family has no known call syntax. added_tokens: the
        vocabulary's added tokens (text -> id) so that markers are written as the tokens they are;
        enable_thinking / prompt as for parse_reply (whether the reply must first close reasoning)."""
        return self.replies.grammar(
            tools, mode, parallel_tool_calls, added_tokens, enable_thinking=enable_thinking, prompt=prompt
        )

    def reacts_to(self, keyword: str, values: tuple) -> bool:
        """Whether the template renders a one-turn conversation's generation prompt differently
        for these values of `keyword` (enable_thinking, reasoning_effort): rendering is the only
        reliable test of what a template reads. Cached per keyword."""
        cache = self.__dict__.setdefault("_reacts", {})
        if keyword not in cache:
            probe = [{"role": "user", "content": "Probe question"}]
            try:
                texts = {self.render(probe, add_generation_prompt=True, **{keyword: v}) for v in values}
            except ColibriError:
                texts = set()
            cache[keyword] = len(texts) > 1
        return cache[keyword]


def find_template(root: Path, files, special_tokens: dict | None = None) -> ChatTemplate | None:
    """The chat template of a model directory (from the files its table lists), or None."""
    root = Path(root)
    if CHAT_TEMPLATE_JINJA in files:
        path = root / CHAT_TEMPLATE_JINJA
        if path.stat().st_size > MAX_TEXT_FILE_BYTES:
            raise ColibriError(f"{path} is larger than {MAX_TEXT_FILE_BYTES >> 20} MB; refusing to parse it")
        try:
            source = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ColibriError(f"{path} is not valid UTF-8 ({e})") from None
        return ChatTemplate(source, str(path), special_tokens)
    for name in (CHAT_TEMPLATE_JSON, TOKENIZER_CONFIG):
        if name not in files:
            continue
        path = root / name
        doc = read_json(path, name, MAX_TEXT_FILE_BYTES)
        source = doc.get("chat_template") if isinstance(doc, dict) else None
        if source is None:
            continue
        if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
            try:
                source = {t["name"]: t["template"] for t in source}
            except (TypeError, KeyError):
                raise ColibriError(
                    f"{path}: 'chat_template' must be a string or a list of {{'name', 'template'}} objects"
                ) from None
        return ChatTemplate(source, str(path), special_tokens)
    return None
