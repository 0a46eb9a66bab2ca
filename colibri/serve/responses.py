"""OpenAI's Responses API (POST /v1/responses), stateless, as a translation layer onto chat
completions.

Design
------
As serve/anthropic.py: a Responses request becomes the equivalent chat-completions body
(`to_chat`), prepared by serve/openai.py into the same Job; the reply parser's result becomes
output items (`document`) and its streamed deltas typed events with sequence numbers (`Stream`).
The same request with the same seed generates the same tokens through either API.

Translation: `instructions` -> a system message; `input` a string -> a user message; input
items: messages (text or input_text / output_text parts) -> messages, `function_call` ->
an assistant's tool_calls (consecutive calls, and the assistant text before them, one turn),
`function_call_output` -> a "tool" message, `reasoning` items dropped (the template renders no
earlier reasoning from them); function `tools` -> chat tools, `tool_choice` as chat's;
`text.format` -> response_format (the same constrained decoding); `reasoning.effort` ->
reasoning_effort; `max_output_tokens` -> max_tokens. The server keeps nothing: `store: true`,
`previous_response_id`, `conversation`, `background` are 400s. Fields meaningless here
(`metadata`, `user`, prompt cache keys, ...) are accepted; fields Colibri does not implement
are refused, naming what to do instead.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from . import openai
from .errors import APIError
from .protocol import MAX_TOOLS, REASONING_EFFORTS, TOOL_NAME_PATTERN, Bool, Integer, Number, Text

STATELESS = "this server is stateless: it keeps no responses or conversations; send the whole input"
REFUSED = {
    "store": STATELESS + " (set 'store': false)",
    "previous_response_id": STATELESS,
    "conversation": STATELESS,
    "background": "background responses are not supported (this server keeps no responses)",
    "prompt": "stored prompt templates are not supported; send 'instructions' and 'input'",
    "include": "'include' is not supported (no extra output data here)",
    "truncation": "'truncation': 'auto' is not supported; the input must fit the context",
    "top_logprobs": "'top_logprobs' is not supported on /v1/responses; use /v1/chat/completions",
    "max_tool_calls": "'max_tool_calls' is not supported",
    "service_tier": "'service_tier' other than 'auto' or 'default' is not supported (one tier here)",
    "moderation": "moderation is not supported (no moderation model here)",
    "image": "image generation is not supported",
    "access_programs": "'access_programs' is not supported",
    "background_options": "background responses are not supported",
    "context_management": "'context_management' is not supported",
}
HARMLESS = {
    "store": (False,),
    "background": (False,),
    "include": ([],),
    "truncation": ("disabled",),
    "top_logprobs": (0,),
    "service_tier": ("auto", "default"),
}
# chat-completions' names of the fields, as this API calls them (in errors)
FIELD_NAMES = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
}


# ---- the request --------------------------------------------------------------------------------


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ContentPart(Strict):
    type: Literal["input_text", "output_text"]
    text: Text
    annotations: Optional[list[Any]] = Field(None, description="accepted (an earlier output's)")
    logprobs: Optional[list[Any]] = None


class MessageItem(Strict):
    type: Optional[Literal["message"]] = None
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[Text, list[ContentPart]]
    id: Optional[Text] = None
    status: Optional[Text] = None
    phase: Optional[Text] = None


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text
    id: Optional[Text] = None
    status: Optional[Text] = None


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: Text
    output: Union[Text, list[ContentPart]]
    id: Optional[Text] = None
    status: Optional[Text] = None


class ReasoningItem(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["reasoning"]


InputItem = Annotated[
    Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem], Field(union_mode="left_to_right")
]


class FunctionTool(Strict):
    type: Literal["function"]
    name: Annotated[Text, Field(pattern=TOOL_NAME_PATTERN)]
    description: Optional[Text] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[Bool] = None


class FunctionChoice(Strict):
    type: Literal["function"]
    name: Text


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[Text] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    description: Optional[Text] = None
    strict: Optional[Bool] = None


class TextOptions(Strict):
    format: Optional[TextFormat] = None
    verbosity: Optional[Literal["medium"]] = Field(None, description="medium only (the model's own length)")


class Reasoning(Strict):
    effort: Optional[Literal[REASONING_EFFORTS]] = None
    summary: Optional[Literal["auto"]] = Field(None, description="auto only: no summaries are written here")
    generate_summary: Optional[Literal["auto"]] = None


class ResponseStreamOptions(Strict):
    include_obfuscation: Optional[Bool] = None


class ResponsesRequest(Strict):
    """POST /v1/responses (OpenAI's Responses API, stateless)."""

    model: Optional[Text] = None
    input: Union[Text, list[InputItem]]
    instructions: Optional[Text] = None
    tools: Optional[Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], FunctionChoice]] = None
    parallel_tool_calls: Optional[Bool] = None
    text: Optional[TextOptions] = None
    reasoning: Optional[Reasoning] = None
    max_output_tokens: Optional[Integer(ge=1)] = None
    temperature: Optional[Number(ge=0, le=2)] = None
    top_p: Optional[Number(gt=0, le=1)] = None
    seed: Optional[Integer(ge=0)] = Field(None, description="Colibri's extension, as in chat completions")
    stream: Optional[Bool] = None
    stream_options: Optional[ResponseStreamOptions] = None
    # accepted, meaningless here
    metadata: Optional[dict[str, Any]] = None
    user: Optional[Text] = None
    safety_identifier: Optional[Text] = None
    prompt_cache_key: Optional[Text] = None
    prompt_cache_retention: Optional[Text] = None
    prompt_cache_options: Optional[dict[str, Any]] = None
    # refused when set (REFUSED), or set to a value that promises nothing (HARMLESS)
    store: Optional[Bool] = None
    previous_response_id: Optional[Any] = None
    conversation: Optional[Any] = None
    background: Optional[Any] = None
    prompt: Optional[Any] = None
    include: Optional[Any] = None
    truncation: Optional[Any] = None
    top_logprobs: Optional[Any] = None
    max_tool_calls: Optional[Any] = None
    service_tier: Optional[Any] = None
    moderation: Optional[Any] = None
    image: Optional[Any] = None
    access_programs: Optional[Any] = None
    background_options: Optional[Any] = None
    context_management: Optional[Any] = None

    @field_validator("*")
    @classmethod
    def _refuse_unimplemented(cls, value, info: ValidationInfo):
        name = info.field_name
        if name in REFUSED and value is not None and value not in HARMLESS.get(name, ()):
            raise PydanticCustomError("unsupported_parameter", REFUSED[name])
        return value


# ---- request -> chat completions ------------------------------------------------------------------


def prepare(served, body) -> openai.Job:
    """The Job of a Responses request: its chat-completions equivalent, prepared as that is."""
    served.ready()
    req = openai.validated(ResponsesRequest, body)
    chat = to_chat(req)
    job = openai.renamed_fields(FIELD_NAMES, openai.prepare, served, chat, True)
    return dataclasses.replace(job, echo=echo_of(req))


def to_chat(req: ResponsesRequest) -> dict:
    chat = {
        "model": req.model,
        "messages": conversation(req.instructions, req.input),
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "seed": req.seed,
        "stream": req.stream,
        "parallel_tool_calls": req.parallel_tool_calls,
    }
    if req.tools:
        chat["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in req.tools
        ]
    if req.tool_choice is not None:
        choice = req.tool_choice
        chat["tool_choice"] = (
            choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice.name}}
        )
    fmt = req.text.format if req.text is not None else None
    if fmt is not None:
        chat["response_format"] = response_format(fmt)
    if req.reasoning is not None:
        chat["reasoning_effort"] = req.reasoning.effort
    return {k: v for k, v in chat.items() if v is not None}


def response_format(fmt: TextFormat) -> dict:
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    if fmt.schema_ is None:
        raise APIError(400, "'text.format' of type 'json_schema' needs a 'schema'", param="text.format")
    spec = {"name": fmt.name or "output", "schema": fmt.schema_, "description": fmt.description, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}


def text_of(content) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def conversation(instructions, items) -> list:
    """The chat messages of `instructions` and `input`."""
    out = [{"role": "system", "content": instructions}] if instructions is not None else []
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    for item in items:
        kind = getattr(item, "type", None) or "message"
        if kind == "message":
            out.append({"role": item.role, "content": text_of(item.content)})
        elif kind == "function_call":  # joins the assistant turn before it (its text, its other calls)
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": text_of(item.output)})
    return out


def echo_of(req: ResponsesRequest) -> dict:
    """The request's fields a Response repeats."""
    fmt = (
        req.text.format.model_dump(by_alias=True, exclude_none=True)
        if req.text and req.text.format
        else {"type": "text"}
    )
    return {
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tool_choice": req.tool_choice
        if isinstance(req.tool_choice, str)
        else "auto"
        if req.tool_choice is None
        else req.tool_choice.model_dump(),
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
        "text": {"format": fmt},
        "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
        "metadata": req.metadata or {},
        "user": req.user,
    }


# ---- the reply -----------------------------------------------------------------------------------


def new_id() -> str:
    return "resp_" + uuid.uuid4().hex[:24]


def item_id(prefix: str) -> str:
    return f"{prefix}_" + uuid.uuid4().hex[:24]


def reasoning_item(iid: str, text: str) -> dict:
    return {"type": "reasoning", "id": iid, "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def message_item(iid: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": iid, "role": "assistant", "status": status, "content": [output_text(text)]}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(iid: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {
        "type": "function_call",
        "id": iid,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def items_of(message: dict, incomplete: bool) -> list:
    """An assistant message (reasoning_content, content, tool_calls) as output items."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(item_id("rs"), message["reasoning_content"]))
    if message.get("content"):
        items.append(message_item(item_id("msg"), message["content"]))
    for call in message.get("tool_calls") or ():
        args = call["function"]["arguments"]
        items.append(
            call_item(
                item_id("fc"), call["id"], call["function"]["name"], args if isinstance(args, str) else json.dumps(args)
            )
        )
    if incomplete and items and items[-1]["type"] != "reasoning":
        items[-1]["status"] = "incomplete"
    return items


def usage_of(outcome) -> dict:
    return {
        "input_tokens": outcome.prompt_tokens,
        "input_tokens_details": {"cached_tokens": outcome.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": outcome.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
    }


def response_doc(rid: str, model: str, created: int, job, status: str, output: list, usage=None) -> dict:
    doc = {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": model,
        "output": output,
        "previous_response_id": None,
        "store": False,
        "truncation": "disabled",
        "usage": usage,
        **(job.echo or {}),
        "seed": job.gen["seed"],
    }
    return doc


def status_of(outcome) -> str:
    return "incomplete" if outcome.finish_reason == "length" else "completed"


def document(outcome, rid: str, model: str, job) -> dict:
    status = status_of(outcome)
    return response_doc(
        rid, model, int(time.time()), job, status, items_of(outcome.message, status != "completed"), usage_of(outcome)
    )


def error_body(e: APIError) -> dict:
    return e.body()


@dataclasses.dataclass
class _Open:
    item: dict  # the output item as it grows
    index: int  # its output_index


class Stream:
    """A streamed reply as the Responses API's typed events: each method returns [(event name, data)],
    each with its sequence_number."""

    def __init__(self, rid: str, model: str, job):
        self.rid, self.model, self.job = rid, model, job
        self.created = int(time.time())
        self.seq = 0
        self.items = []  # the output items, done or growing
        self.open = None  # the growing one (_Open)

    def start(self, outcome) -> list:
        snapshot = response_doc(self.rid, self.model, self.created, self.job, "in_progress", [])
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    @staticmethod
    def ping() -> list:
        return []  # none: an SSE comment line does (app.py)

    def deltas(self, deltas: list) -> list:
        out = []
        for delta in deltas:
            if delta.get("reasoning_content"):
                out += self._into("reasoning", lambda: reasoning_item(item_id("rs"), ""))
                out += self._text(delta["reasoning_content"], "response.reasoning_text.delta")
            if delta.get("content"):
                out += self._into("message", lambda: message_item(item_id("msg"), "", "in_progress"))
                out += self._text(delta["content"], "response.output_text.delta")
            for call in delta.get("tool_calls") or ():
                fn = call.get("function") or {}
                if call.get("id"):
                    out += self._close()
                    out += self._into(
                        "function_call",
                        lambda call=call, fn=fn: call_item(
                            item_id("fc"), call["id"], fn.get("name", ""), "", "in_progress"
                        ),
                    )
                if fn.get("arguments"):
                    self.open.item["arguments"] += fn["arguments"]
                    out.append(
                        self._event(
                            "response.function_call_arguments.delta",
                            item_id=self.open.item["id"],
                            output_index=self.open.index,
                            delta=fn["arguments"],
                        )
                    )
        return out

    def end(self, outcome) -> list:
        status = status_of(outcome)
        out = self._close("incomplete" if status != "completed" else "completed")
        final = response_doc(self.rid, self.model, self.created, self.job, status, self.items, usage_of(outcome))
        return out + [
            self._event("response.completed" if status == "completed" else "response.incomplete", response=final)
        ]

    def error(self, e: APIError) -> list:
        return [self._event("error", code=e.code, message=e.message, param=e.param)]

    # -- the items

    def _event(self, kind: str, **fields) -> tuple:
        doc = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return kind, doc

    def _into(self, kind: str, make) -> list:
        if self.open is not None and self.open.item["type"] == kind and kind != "function_call":
            return []
        out = self._close()
        item = make()
        self.open = _Open(item, len(self.items))
        self.items.append(item)
        out.append(self._event("response.output_item.added", output_index=self.open.index, item=_copy(item)))
        if kind == "message":
            out.append(self._part_event("response.content_part.added", output_text("")))
        elif kind == "reasoning":
            out.append(self._part_event("response.content_part.added", {"type": "reasoning_text", "text": ""}))
        return out

    def _part_event(self, kind: str, part: dict) -> tuple:
        return self._event(
            kind, item_id=self.open.item["id"], output_index=self.open.index, content_index=0, part=_copy(part)
        )

    def _text(self, text: str, kind: str) -> list:
        part = self.open.item["content"][0]
        part["text"] += text
        extra = {"logprobs": []} if kind == "response.output_text.delta" else {}
        return [
            self._event(
                kind, item_id=self.open.item["id"], output_index=self.open.index, content_index=0, delta=text, **extra
            )
        ]

    def _close(self, status: str = "completed") -> list:
        if self.open is None:
            return []
        item, index, out = self.open.item, self.open.index, []
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            if item["type"] == "message":
                out.append(
                    self._event(
                        "response.output_text.done",
                        item_id=item["id"],
                        output_index=index,
                        content_index=0,
                        text=part["text"],
                        logprobs=[],
                    )
                )
            else:
                out.append(
                    self._event(
                        "response.reasoning_text.done",
                        item_id=item["id"],
                        output_index=index,
                        content_index=0,
                        text=part["text"],
                    )
                )
            out.append(self._part_event("response.content_part.done", part))
        else:
            out.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        if item["type"] != "reasoning":
            item["status"] = status
        out.append(self._event("response.output_item.done", output_index=index, item=_copy(item)))
        self.open = None
        return out


def _copy(doc: dict) -> dict:
    return {k: ([dict(p) for p in v] if isinstance(v, list) else v) for k, v in doc.items()}
