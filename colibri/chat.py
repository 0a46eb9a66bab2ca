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
BOS itself). All of that is reproduced here; `continue_final_message` too.

Where the template comes from, first found wins (transformers' order): chat_template.jinja,
chat_template.json's "chat_template", tokenizer_config.json's "chat_template" (a string, or a
list of named templates: "tool_use" when tools are given, else "default").
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from .errors import ColibriError
from .config import read_json
from .tokenizer import MAX_TEXT_FILE_BYTES, TOKENIZER_CONFIG

CHAT_TEMPLATE_JINJA = "chat_template.jinja"
CHAT_TEMPLATE_JSON = "chat_template.json"
ROLES_HINT = "each message must be an object with a string 'role' and a 'content'"
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _environment():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

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

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                       namespace=Namespace)
    return env


def check_messages(messages) -> list:
    """A conversation as the template sees it: a list of dicts, None-valued keys dropped."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, (list, tuple)):
        raise ColibriError(f"messages must be a list of messages ({ROLES_HINT}), got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m and "tool_calls" not in m:
            raise ColibriError(f"messages[{i}] is {_short(m)}: {ROLES_HINT}")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ColibriError(f"messages[{i}]['content'] must be a string or a list of parts, "
                               f"got {type(content).__name__}")
        out.append({k: v for k, v in m.items() if v is not None})
    return out


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class ChatTemplate:
    """A compiled chat template. `render(messages, ...) -> str`."""

    def __init__(self, source, where: str, special_tokens: dict | None = None):
        import jinja2

        self.where = where                        # the file it came from, for messages
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
        for name, text in named.items():
            try:
                self._compiled[name] = env.from_string(text)
            except jinja2.exceptions.TemplateSyntaxError as e:
                raise ColibriError(f"{where}: the chat template{'' if name == 'default' else f' {name!r}'} "
                                   f"does not parse (line {e.lineno}: {e.message})") from None

    def _pick(self, tools):
        if tools and "tool_use" in self._compiled:
            return self._compiled["tool_use"]
        if "default" in self._compiled:
            return self._compiled["default"]
        raise ColibriError(f"{self.where}: several chat templates ({', '.join(self.names)}) and none named 'default'")

    def render(self, messages, add_generation_prompt: bool = True, tools=None, documents=None,
               continue_final_message: bool = False, **kwargs) -> str:
        import jinja2

        chat = check_messages(messages)
        if continue_final_message:
            if add_generation_prompt:
                raise ColibriError("continue_final_message and add_generation_prompt cannot both be set")
            if not chat or not isinstance(chat[-1].get("content"), str):
                raise ColibriError("continue_final_message needs a last message with text content")
            final = chat[-1]["content"]
            chat[-1] = {**chat[-1], "content": final + _CONTINUE_TAG}
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise ColibriError("tools must be a list of JSON schemas (objects)")
        template = self._pick(tools)
        try:
            text = template.render(messages=chat, tools=tools, documents=documents,
                                   add_generation_prompt=bool(add_generation_prompt),
                                   **{**self.special_tokens, **kwargs})
        except jinja2.exceptions.TemplateError as e:
            raise ColibriError(f"the chat template ({self.where}) refused the conversation: {e}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, ZeroDivisionError) as e:
            raise ColibriError(f"the chat template ({self.where}) failed on this conversation: "
                               f"{type(e).__name__}: {e}") from None
        if continue_final_message:
            tag = _CONTINUE_TAG.strip()
            if final.strip() not in text or tag not in text:
                raise ColibriError(f"the chat template ({self.where}) dropped part of the final message; "
                                   f"it cannot be continued")
            at = text.rindex(tag)
            text = text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
        return text


def find_template(root: Path, files, special_tokens: dict | None = None) -> ChatTemplate | None:
    """The chat template of a model directory (from the files its table lists), or None."""
    root = Path(root)
    if CHAT_TEMPLATE_JINJA in files:
        path = root / CHAT_TEMPLATE_JINJA
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
        if isinstance(source, list):          # [{"name": ..., "template": ...}, ...]
            try:
                source = {t["name"]: t["template"] for t in source}
            except (TypeError, KeyError):
                raise ColibriError(f"{path}: 'chat_template' must be a string or a list of "
                                   f"{{'name', 'template'}} objects") from None
        return ChatTemplate(source, str(path), special_tokens)
    return None
