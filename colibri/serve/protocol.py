"""The request bodies the server accepts, as pydantic models: one definition of every field's type,
range and meaning, which validates each request and documents it at /openapi.json.

Design
------
Numbers are JSON numbers only (a string "0.5" or true is refused, as OpenAI refuses them), finite,
within OpenAI's ranges; every body forbids fields it does not define, so a typo is a 400, not a
default. OpenAI's fields that Colibri does not implement are defined too (so the schema shows
them) and refused when set (REFUSED, with what to do instead); fields meaningless on a local
server (`user`, `metadata`, ...) are accepted. What a field needs beyond its type — a named tool
that exists, a prompt that fits the context — is checked where the request becomes engine work
(serve/openai.py). A validation error becomes OpenAI's 400 with `param` (serve/app.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..sampling import LOGIT_BIAS_LIMIT, MAX_LOGPROBS, REPETITION_PENALTY_RANGE
from ..speculate import DRAFT_SOURCES, MAX_DRAFT_MAX

MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_CHOICES = 8  # n: generations of one request, run one after another
MAX_TOOLS = 128  # tools a request may define: OpenAI's limit, applied to every API's tools
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default
TOOL_NAME_PATTERN = r"^[A-Za-z0-9_.:-]{1,64}$"
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
ROLES = ("system", "developer", "user", "assistant", "tool")
# OpenAI's fields that Colibri does not implement, with what to do instead
REFUSED = {
    "audio": "audio output is not supported (this is a text model)",
    "modalities": "only text output is supported",
    "web_search_options": "web search is not supported",
    "functions": "the deprecated 'functions' field is not supported; send 'tools'",
    "function_call": "the deprecated 'function_call' field is not supported; send 'tool_choice'",
    "verbosity": "'verbosity' is not supported",
    "moderation": "moderation is not supported (no moderation model here)",
    "suffix": "'suffix' (insertion) is not supported",
    "store": "'store': true is not supported (this server keeps no completions)",
    "service_tier": "'service_tier' other than 'auto' or 'default' is not supported (one tier here)",
    "echo": "'echo' is not supported",
    "best_of": "'best_of' other than n is not supported (no ranking of candidates)",
}
# values of the refused fields that promise nothing, accepted
HARMLESS = {"modalities": (["text"],), "store": (False,), "service_tier": ("auto", "default"), "echo": (False,)}


def _json_number(v):
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError("must be a number")
    return v


def _json_integer(v):
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError("must be an integer")
    return v


def _json_bool(v):
    if not isinstance(v, bool):
        raise ValueError("must be true or false")
    return v


def _json_string(v):
    if not isinstance(v, str):
        raise ValueError("must be a string")
    return v


# the Field before the validator: so /openapi.json documents the range as JSON Schema's minimum and
# maximum (after a BeforeValidator it came out as pydantic's own "ge"/"le" keys, which say nothing)
def Number(**range_):  # noqa: N802 - a type
    return Annotated[float, Field(allow_inf_nan=False, **range_), BeforeValidator(_json_number)]


def Integer(**range_):  # noqa: N802 - a type
    return Annotated[int, Field(**range_), BeforeValidator(_json_integer)]


Bool = Annotated[bool, BeforeValidator(_json_bool)]
Text = Annotated[str, BeforeValidator(_json_string)]


class Body(BaseModel):
    """A request body: unknown fields refused; OpenAI's unimplemented ones refused when set (an
    error of type "unsupported_parameter" at the field)."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("*")
    @classmethod
    def _refuse_unimplemented(cls, value, info: ValidationInfo):
        name = info.field_name
        if name in REFUSED and value is not None and value not in HARMLESS.get(name, ()):
            if not (name == "best_of" and value == (info.data.get("n") or 1)):
                raise PydanticCustomError("unsupported_parameter", REFUSED[name])
        return value


# ---- messages ---------------------------------------------------------------------------------------


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "refusal"]
    text: Optional[Text] = None
    refusal: Optional[Text] = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Text
    arguments: Union[Text, dict] = Field("{}", description="a JSON string (what the SDKs send) or an object")


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: Optional[Text] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    """One turn. Other keys are passed to the chat template as they are (templates read some)."""

    model_config = ConfigDict(extra="allow")
    role: Literal[ROLES]
    content: Optional[Union[Text, list[TextPart]]] = Field(
        None, description="text, or text parts; null only beside tool_calls"
    )
    name: Optional[Text] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[Text] = None
    reasoning_content: Optional[Text] = Field(None, description="an earlier reply's reasoning, for the template")


# ---- tools, formats ---------------------------------------------------------------------------------


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Annotated[Text, Field(pattern=TOOL_NAME_PATTERN)]
    description: Optional[Text] = None
    parameters: Optional[dict] = Field(None, description="a JSON schema of the arguments")
    strict: Optional[Bool] = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Text


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: Optional[Text] = None
    description: Optional[Text] = None
    schema_: Optional[dict] = Field(None, alias="schema", description="a JSON schema; absent: any JSON object")
    strict: Optional[Bool] = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema: give {'name': ..., 'schema': {...}} with type 'json_schema'")
        return self


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: Optional[Bool] = None
    include_obfuscation: Optional[Bool] = None


Stop = Optional[Union[Text, Annotated[list[Text], Field(max_length=MAX_STOP_STRINGS)]]]


class Sampling(Body):
    """The fields both endpoints share."""

    model: Optional[Text] = Field(None, description="the served model's name (--model-name)")
    stream: Optional[Bool] = None
    stream_options: Optional[StreamOptions] = None
    n: Optional[Integer(ge=1, le=MAX_CHOICES)] = Field(None, description="choices, generated one after another")
    temperature: Optional[Number(ge=0, le=2)] = None
    top_p: Optional[Number(gt=0, le=1)] = None
    top_k: Optional[Integer(ge=0)] = Field(None, description="extension (vLLM, llama-server); 0: off")
    min_p: Optional[Number(ge=0, le=1)] = Field(None, description="extension (vLLM, llama-server)")
    # bounded so that logits divided or multiplied by it stay finite (else the sampler fails mid-generation)
    repetition_penalty: Optional[Number(ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])] = None
    presence_penalty: Optional[Number(ge=-2, le=2)] = None
    frequency_penalty: Optional[Number(ge=-2, le=2)] = None
    seed: Optional[Integer(ge=0)] = Field(None, description="absent: a fresh seed, reported in X-Colibri-Seed")
    stop: Stop = None
    logit_bias: Optional[dict[str, Number(ge=-LOGIT_BIAS_LIMIT, le=LOGIT_BIAS_LIMIT)]] = None
    ignore_eos: Optional[Bool] = Field(None, description="extension (vLLM, llama-server)")
    draft: Optional[Literal[DRAFT_SOURCES]] = Field(
        None, description="extension: speculative decoding's drafts (default auto: n-gram lookup; --parallel 1)"
    )
    draft_max: Optional[Integer(ge=1, le=MAX_DRAFT_MAX)] = Field(
        None, description="extension: drafted tokens one engine call verifies at most (default 8)"
    )
    # accepted, meaningless on a local server
    user: Optional[Text] = None
    metadata: Optional[dict[str, Any]] = None
    safety_identifier: Optional[Text] = None
    prompt_cache_key: Optional[Text] = Field(None, description="accepted; the KV cache reuses prefixes by itself")
    prompt_cache_retention: Optional[Text] = Field(None, description="accepted, as prompt_cache_key")
    prompt_cache_options: Optional[dict[str, Any]] = Field(None, description="accepted, as prompt_cache_key")
    service_tier: Optional[Text] = None
    store: Optional[Bool] = None


class Prediction(BaseModel):
    """OpenAI's Predicted Outputs: text the reply is expected to resemble (a file being edited)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["content"]
    content: Union[Text, Annotated[list[TextPart], Field(min_length=1)]]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text or "" for p in self.content)


class ChatCompletionRequest(Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Optional[Integer(ge=1)] = None
    max_completion_tokens: Optional[Integer(ge=1)] = None
    logprobs: Optional[Bool] = None
    top_logprobs: Optional[Integer(ge=0, le=MAX_LOGPROBS)] = None
    tools: Optional[Annotated[list[Tool], Field(max_length=MAX_TOOLS)]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[Bool] = None
    response_format: Optional[ResponseFormat] = None
    reasoning_effort: Optional[Literal[REASONING_EFFORTS]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = Field(None, description="keywords for the chat template")
    prediction: Optional[Prediction] = Field(
        None, description="the reply expected: its tokens are drafted first (speculative decoding; --parallel 1)"
    )
    # OpenAI's, refused when set
    audio: Optional[Any] = None
    modalities: Optional[Any] = None
    web_search_options: Optional[Any] = None
    functions: Optional[Any] = None
    function_call: Optional[Any] = None
    verbosity: Optional[Any] = None
    moderation: Optional[Any] = None


class CompletionRequest(Sampling):
    prompt: Union[Text, Annotated[list[Integer(ge=0)], Field(min_length=1)], list[Text], list[list[Integer()]]]
    max_tokens: Optional[Integer(ge=1)] = Field(None, description=f"default {COMPLETIONS_DEFAULT_MAX_TOKENS}")
    logprobs: Optional[Integer(ge=0, le=MAX_LOGPROBS)] = None
    echo: Optional[Bool] = None
    best_of: Optional[Integer(ge=1)] = None
    suffix: Optional[Any] = None


class TokenizeRequest(BaseModel):
    """llama-server's {content, add_special, with_pieces}; vLLM's {prompt, add_special_tokens} or
    {messages, add_generation_prompt, tools, chat_template_kwargs}."""

    model_config = ConfigDict(extra="forbid")
    model: Optional[Text] = None
    content: Optional[Text] = None
    prompt: Optional[Text] = None
    messages: Optional[Annotated[list[Message], Field(min_length=1)]] = None
    add_special: Optional[Bool] = Field(None, description="llama-server's; default false")
    add_special_tokens: Optional[Bool] = Field(None, description="vLLM's; default true")
    with_pieces: Optional[Bool] = None
    add_generation_prompt: Optional[Bool] = None
    tools: Optional[Annotated[list[Tool], Field(max_length=MAX_TOOLS)]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None

    @model_validator(mode="after")
    def _one_input(self):
        if sum(x is not None for x in (self.content, self.prompt, self.messages)) != 1:
            raise ValueError("give exactly one of 'content' (text), 'prompt' (text) or 'messages' (a conversation)")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Optional[Text] = None
    tokens: list[Integer(ge=0)]
