"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) as a translation layer
onto chat completions.

Design
------
One engine path decides tokens, sampling, parsing and constraints: a Messages request becomes
the equivalent chat-completions body (`to_chat`), which serve/openai.py turns into a Job as it
does for /v1/chat/completions; the reply parser's result (content, reasoning_content, tool_calls,
finish reason) becomes Anthropic's content blocks (`document`), and its streamed deltas
become Anthropic's typed events (`Stream`). So the same request with the same seed
generates the same tokens through either API.

Translation: `system` -> a system message; text blocks -> content; an assistant's `tool_use`
blocks -> tool_calls (the input as a JSON string); a user's `tool_result` blocks -> "tool"
messages (is_error prefixes "Error: "); an assistant's `thinking` blocks -> reasoning_content
(the template decides whether earlier reasoning is shown), `redacted_thinking` dropped; a last
assistant message (a prefill to continue) is a 400;
`tools` -> functions (input_schema the parameters); tool_choice auto / any / tool / none ->
auto / required / the named function / none, disable_parallel_tool_use -> parallel_tool_calls
false; `thinking` -> the template's reasoning switch (openai.reasoning_keywords): enabled ->
effort by budget_tokens (< 4096 low, < 16384 medium, else high: harmony's levels; Qwen3's
enable_thinking true), adaptive -> medium, disabled -> "none" where the template has a switch;
`output_config.effort` -> reasoning_effort (max: xhigh), `output_config.format` (a JSON schema)
-> response_format json_schema: the same constrained decoding. budget_tokens is no
separate cap here: reasoning counts against max_tokens. `stop_sequences` are the job's stop
strings (no limit of 4). `seed` is Colibri's extension, as in chat completions. `metadata`, `service_tier` and blocks' `cache_control` are accepted
and mean nothing here (the KV cache reuses prefixes by itself). Anything else is a 400 in
Anthropic's error shape.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from . import openai
from .errors import APIError
from .protocol import MAX_TOOLS, TOOL_NAME_PATTERN, Bool, Integer, Number, Text

MAX_STOP_SEQUENCES = 64
# Anthropic's error types by HTTP status
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    431: "request_too_large",
    501: "invalid_request_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
# chat-completions' names of the fields, as this API calls them (in errors)
FIELD_NAMES = {
    "messages": "messages",
    "max_tokens": "max_tokens",
    "reasoning_effort": "thinking",
    "response_format": "output_config.format",
    "tool_choice": "tool_choice",
    "tools": "tools",
    "stop": "stop_sequences",
}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


# ---- the request --------------------------------------------------------------------------------


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CacheControl(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Text


class TextBlock(Strict):
    type: Literal["text"]
    text: Text
    cache_control: Optional[CacheControl] = Field(None, description="accepted; prefixes are reused by themselves")
    citations: Optional[list[Any]] = Field(None, description="null or [] only")


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: Text
    name: Text
    input: dict[str, Any]
    cache_control: Optional[CacheControl] = None


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: Text
    content: Optional[Union[Text, list[TextBlock]]] = None
    is_error: Optional[Bool] = None
    cache_control: Optional[CacheControl] = None


class ThinkingBlock(Strict):
    type: Literal["thinking"]
    thinking: Text
    signature: Optional[Text] = None


class RedactedThinkingBlock(Strict):
    type: Literal["redacted_thinking"]
    data: Text


Block = Annotated[
    Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock], Field(discriminator="type")
]


class InputMessage(Strict):
    role: Literal["user", "assistant"]
    content: Union[Text, list[Block]]


class ToolDefinition(Strict):
    name: Annotated[Text, Field(pattern=TOOL_NAME_PATTERN)]
    description: Optional[Text] = None
    input_schema: dict[str, Any]
    type: Optional[Literal["custom"]] = None
    cache_control: Optional[CacheControl] = None


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[Text] = None
    disable_parallel_tool_use: Optional[Bool] = None


class Thinking(Strict):
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: Optional[Integer(ge=1024)] = Field(None, description="chooses the effort; no separate cap")
    display: Optional[Literal["summarized"]] = Field(None, description="thinking is returned as it is")


class OutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Strict):
    effort: Optional[Literal["low", "medium", "high", "xhigh", "max"]] = Field(
        None, description="reasoning effort (max: xhigh)"
    )
    format: Optional[OutputFormat] = Field(None, description="the reply constrained to this JSON schema")


class MessagesBase(Strict):
    model: Text
    system: Optional[Union[Text, list[TextBlock]]] = None
    messages: Annotated[list[InputMessage], Field(min_length=1)]
    tools: Optional[Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[Thinking] = None
    output_config: Optional[OutputConfig] = None
    cache_control: Optional[CacheControl] = Field(None, description="accepted; prefixes are reused by themselves")


class CountTokensRequest(MessagesBase):
    """POST /v1/messages/count_tokens: a Messages request without the generation's fields."""


class MessagesRequest(MessagesBase):
    """POST /v1/messages (Anthropic's Messages API)."""

    max_tokens: Integer(ge=1)
    stop_sequences: Optional[Annotated[list[Text], Field(max_length=MAX_STOP_SEQUENCES)]] = None
    temperature: Optional[Number(ge=0, le=1)] = None
    top_p: Optional[Number(gt=0, le=1)] = None
    top_k: Optional[Integer(ge=0)] = None
    stream: Optional[Bool] = None
    seed: Optional[Integer(ge=0)] = Field(
        None,
        description="Colibri's extension, as in chat completions: absent, a fresh seed (reported in X-Colibri-Seed)",
    )
    metadata: Optional[dict[str, Any]] = Field(None, description="accepted, meaningless here")
    service_tier: Optional[Literal["auto", "standard_only"]] = Field(None, description="accepted (one tier here)")


# ---- request -> chat completions ------------------------------------------------------------------


def prepare(served, body) -> openai.Job:
    """The Job of a Messages request: its chat-completions equivalent, prepared as that is."""
    m = served.ready()
    req = openai.validated(MessagesRequest, body)
    chat = to_chat(req, m)
    chat.update(
        max_tokens=req.max_tokens,
        stream=bool(req.stream),
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        seed=req.seed,
    )
    job = openai.renamed_fields(
        FIELD_NAMES, openai.prepare, served, {k: v for k, v in chat.items() if v is not None}, True
    )
    return dataclasses.replace(job, stops=[s for s in req.stop_sequences or () if s])


def count_tokens(served, body) -> dict:
    m = served.ready()
    req = openai.validated(CountTokensRequest, body)
    job = openai.renamed_fields(FIELD_NAMES, openai.prepare, served, to_chat(req, m), True, True)
    return {"input_tokens": len(job.ids)}


def to_chat(req: MessagesBase, m) -> dict:
    """The chat-completions body (without sampling) equivalent to a Messages request."""
    chat = {"model": req.model, "messages": system_messages(req.system) + conversation(req.messages)}
    if req.tools:
        chat["tools"] = [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
            }
            for t in req.tools
        ]
    if req.tool_choice is not None:
        chat["tool_choice"] = tool_choice_of(req.tool_choice)
        if req.tool_choice.disable_parallel_tool_use:
            chat["parallel_tool_calls"] = False
    effort = effort_of(req.thinking, req.output_config, m)
    if effort is not None:
        chat["reasoning_effort"] = effort
    if req.output_config is not None and req.output_config.format is not None:
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": req.output_config.format.schema_},
        }
    for key in [k for k, v in chat.items() if v is None]:
        del chat[key]
    return chat


def system_messages(system) -> list:
    if system is None:
        return []
    text = system if isinstance(system, str) else "\n".join(b.text for b in system)
    return [{"role": "system", "content": text}]


def conversation(messages) -> list:
    if messages[-1].role == "assistant":
        raise APIError(
            400,
            "a last assistant message (a prefill to continue) is not supported: end with a user message",
            param="messages",
        )
    out = []
    for msg in messages:
        blocks = [TextBlock(type="text", text=msg.content)] if isinstance(msg.content, str) else msg.content
        out.extend(assistant_turn(blocks) if msg.role == "assistant" else user_turns(blocks))
    return out


def assistant_turn(blocks) -> list:
    text = "".join(b.text for b in blocks if b.type == "text")
    turn = {"role": "assistant", "content": text}
    thinking = "".join(b.thinking for b in blocks if b.type == "thinking")
    if thinking:
        turn["reasoning_content"] = thinking
    calls = [
        {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
        for b in blocks
        if b.type == "tool_use"
    ]
    if calls:
        turn["tool_calls"] = calls
    return [turn]


def user_turns(blocks) -> list:
    """A user message's blocks in order: tool results as "tool" messages, text as user messages."""
    out, text = [], []

    def flush():
        if text:
            out.append({"role": "user", "content": "".join(text)})
            text.clear()

    for i, b in enumerate(blocks):
        if b.type == "text":
            text.append(b.text)
        elif b.type == "tool_result":
            flush()
            content = b.content if isinstance(b.content, str) else "".join(t.text for t in b.content or ())
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": b.tool_use_id,
                    "content": f"Error: {content}" if b.is_error else content,
                }
            )
        else:
            raise APIError(400, f"a user message cannot hold a '{b.type}' block", param="messages")
    flush()
    return out


def tool_choice_of(choice: ToolChoice):
    if choice.type == "tool":
        if not choice.name:
            raise APIError(400, "tool_choice of type 'tool' needs a 'name'", param="tool_choice")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def effort_of(thinking: Thinking | None, config: OutputConfig | None, m) -> str | None:
    """reasoning_effort for `thinking` and `output_config.effort`: disabled -> "none" where the
    template has a switch (else nothing: no reasoning to turn off); output_config's effort
    (max: xhigh); enabled -> by budget_tokens; adaptive -> medium."""
    if thinking is not None and thinking.type == "disabled":
        try:
            openai.reasoning_keywords("none", m)
        except APIError:
            return None
        return "none"
    if config is not None and config.effort is not None:
        return "xhigh" if config.effort == "max" else config.effort
    if thinking is None:
        return None
    if thinking.type == "adaptive":
        return "medium"
    if thinking.budget_tokens is None:
        raise APIError(400, "'thinking' of type 'enabled' needs 'budget_tokens' (>= 1024)", param="thinking")
    budget = thinking.budget_tokens
    return "low" if budget < 4096 else "medium" if budget < 16384 else "high"


# ---- the reply -----------------------------------------------------------------------------------


def new_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def error_body(e: APIError) -> dict:
    kind = ERROR_TYPES.get(e.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def blocks_of(message: dict) -> list:
    """An assistant message (content, reasoning_content, tool_calls) as Anthropic's blocks."""
    blocks = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        blocks.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": call["function"]["name"],
                "input": tool_input(call["function"]["arguments"]),
            }
        )
    return blocks


def tool_input(arguments) -> dict:
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"value": value}


def stop_of(outcome) -> tuple:
    """(stop_reason, stop_sequence) of a finished generation."""
    if outcome.stop is not None and outcome.finish_reason == "stop":
        return "stop_sequence", outcome.stop
    return STOP_REASONS.get(outcome.finish_reason, "end_turn"), None


def usage_of(outcome, output: bool = True) -> dict:
    """Anthropic's usage: input_tokens are those the KV cache did not hold (cache_read_input_tokens)."""
    cached = outcome.cached_tokens
    return {
        "input_tokens": outcome.prompt_tokens - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": outcome.completion_tokens if output else 0,
    }


def document(outcome, rid: str, model: str, job=None) -> dict:
    reason, sequence = stop_of(outcome)
    return {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks_of(outcome.message),
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage_of(outcome),
    }


class Stream:
    """A streamed reply as Anthropic's events: each method returns [(event name, data)]."""

    def __init__(self, rid: str, model: str, job=None):
        self.rid, self.model = rid, model
        self.index = -1  # the open block's index
        self.open = None  # its kind: "thinking", "text", "tool_use", or None

    def start(self, outcome) -> list:
        """message_start; `outcome` holds the prompt's usage so far (no output yet)."""
        return [
            (
                "message_start",
                {
                    "type": "message_start",
                    "message": {
                        "id": self.rid,
                        "type": "message",
                        "role": "assistant",
                        "model": self.model,
                        "content": [],
                        "stop_reason": None,
                        "stop_sequence": None,
                        "usage": usage_of(outcome, output=False),
                    },
                },
            )
        ]

    @staticmethod
    def ping() -> list:
        return [("ping", {"type": "ping"})]

    def deltas(self, deltas: list) -> list:
        """Events for the reply parser's deltas."""
        out = []
        for delta in deltas:
            if delta.get("reasoning_content"):
                out += self._into("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
            if delta.get("content"):
                out += self._into("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or ():
                fn = call.get("function") or {}
                if call.get("id"):  # a new call: its block
                    out += self._close()
                    out += self._into(
                        "tool_use", {"type": "tool_use", "id": call["id"], "name": fn.get("name", ""), "input": {}}
                    )
                if fn.get("arguments"):
                    out.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return out

    def end(self, outcome) -> list:
        reason, sequence = stop_of(outcome)
        return self._close() + [
            (
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": {"output_tokens": outcome.completion_tokens},
                },
            ),
            ("message_stop", {"type": "message_stop"}),
        ]

    @staticmethod
    def error(e: APIError) -> list:
        return [("error", error_body(e))]

    def _into(self, kind: str, block: dict) -> list:
        if self.open == kind and kind != "tool_use":
            return []
        out = self._close()
        self.index += 1
        self.open = kind
        return out + [
            ("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})
        ]

    def _delta(self, delta: dict) -> tuple:
        return ("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def _close(self) -> list:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})]
