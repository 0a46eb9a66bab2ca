"""OpenAI request bodies: which fields exist, which Colibri implements, and what they ask of the engine.

Design
------
A client that sends a field and gets a 200 believes it was honoured. So every field of OpenAI's
chat and completions requests is in exactly one of three sets here: implemented (the engine does
what it says), accepted because it means nothing on a local server (`user`, `metadata`, ...), or
refused with a 400 naming it (audio, `prediction`, `suffix`, ...). A field in none of them is
unknown and refused the same way, so a typo (`max_token`) is an error, not a silent default.
Colibri's own extensions (top_k, min_p, repetition_penalty, ignore_eos, chat_template_kwargs)
are those vLLM and llama-server accept under the same names.

The functions below turn the agent-facing fields into engine settings: `tools` and `tool_choice`
(validated as OpenAI validates them), `response_format` (the constraint keywords Model.generate
takes), `reasoning_effort` (a template keyword, found by probing what the template reacts to),
`logit_bias` and `seed` (a fresh random one when the request has none, reported back).
"""
from __future__ import annotations

import json
import re
import secrets

from .apierror import APIError
from .sampling import LOGIT_BIAS_LIMIT, SEED_BITS

# OpenAI's own fields that Colibri implements, by endpoint
CHAT_IMPLEMENTED = frozenset({
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream",
    "stream_options", "stop", "seed", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
    "top_logprobs", "tools", "tool_choice", "parallel_tool_calls", "response_format", "reasoning_effort"})
COMPLETIONS_IMPLEMENTED = frozenset({
    "model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
    "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "echo", "best_of"})
# the same names as vLLM's and llama-server's extensions
EXTENSIONS = frozenset({"top_k", "min_p", "repetition_penalty", "ignore_eos"})
CHAT_EXTENSIONS = EXTENSIONS | {"chat_template_kwargs"}
# accepted and meaningless here: identifiers for the provider's own bookkeeping, and the hint of a
# prompt cache (Colibri reuses the longest cached prefix of every request by itself)
ACCEPTED_MEANINGLESS = frozenset({"user", "metadata", "safety_identifier", "prompt_cache_key", "service_tier",
                                  "store"})
# OpenAI's fields that Colibri does not implement, with what to do instead
REFUSED = {
    "audio": "audio output is not supported (this is a text model)",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported yet",
    "web_search_options": "web search is not supported",
    "functions": "the deprecated 'functions' field is not supported; send 'tools'",
    "function_call": "the deprecated 'function_call' field is not supported; send 'tool_choice'",
    "verbosity": "'verbosity' is not supported",
    "suffix": "'suffix' (insertion) is not supported",
}
# values of the meaningless fields that would promise something: refused
STORE_REFUSED = "'store': true is not supported (this server keeps no completions)"
SERVICE_TIERS = ("auto", "default")

TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
# harmony (gpt-oss) knows low, medium and high: the others map to the nearest
HARMONY_EFFORT = {"none": "low", "minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "high"}


def check_fields(body: dict, chat: bool) -> None:
    """400 naming the first field that is unknown or not implemented."""
    implemented = (CHAT_IMPLEMENTED | CHAT_EXTENSIONS) if chat else (COMPLETIONS_IMPLEMENTED | EXTENSIONS)
    for name in body:
        if name in implemented:
            continue
        if name in ACCEPTED_MEANINGLESS:
            if name == "store" and body[name] not in (None, False):
                raise APIError(400, STORE_REFUSED, param="store", code="unsupported_parameter")
            if name == "service_tier" and body[name] not in (None, *SERVICE_TIERS):
                raise APIError(400, f"'service_tier' must be one of {', '.join(SERVICE_TIERS)} (one tier here)",
                               param="service_tier", code="unsupported_parameter")
            continue
        if name in REFUSED:
            if name == "modalities" and body[name] in (None, ["text"]):
                continue
            if body[name] is None:
                continue
            raise APIError(400, REFUSED[name], param=name, code="unsupported_parameter")
        raise APIError(400, f"unknown field '{str(name)[:64]}' (docs/SERVING.md lists the fields this server accepts)",
                       param=str(name)[:64], code="unknown_parameter")


# ---- tools ----------------------------------------------------------------------------------------------

def tools_of(body: dict):
    """(tools as the template takes them or None, tool_choice, parallel_tool_calls).

    tool_choice is "none", "auto", "required" or {"name": NAME}; absent it is "auto" with tools and
    "none" without (OpenAI's defaults)."""
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise APIError(400, "'tools' must be a list of tools", param="tools")
        seen = set()
        for i, tool in enumerate(tools):
            where = f"tools[{i}]"
            if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
                kind = tool.get("type") if isinstance(tool, dict) else None
                raise APIError(400, f"{where} must be {{'type': 'function', 'function': {{...}}}}" +
                               (f" (tools of type {str(kind)[:30]!r} are not supported)" if isinstance(kind, str) else ""),
                               param=where)
            fn = tool["function"]
            name = fn.get("name")
            if not isinstance(name, str) or not TOOL_NAME.match(name):
                raise APIError(400, f"{where}.function.name must be 1-64 letters, digits, '_', '-', '.' or ':'",
                               param=f"{where}.function.name")
            if name in seen:
                raise APIError(400, f"{where}: the function '{name}' is defined twice", param=f"{where}.function.name")
            seen.add(name)
            if fn.get("description") is not None and not isinstance(fn["description"], str):
                raise APIError(400, f"{where}.function.description must be a string", param=f"{where}.function.description")
            params = fn.get("parameters")
            if params is not None and not isinstance(params, dict):
                raise APIError(400, f"{where}.function.parameters must be a JSON schema (an object)",
                               param=f"{where}.function.parameters")
            if fn.get("strict") not in (None, True, False):
                raise APIError(400, f"{where}.function.strict must be true or false", param=f"{where}.function.strict")
        if not tools:
            tools = None
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    elif isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise APIError(400, "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', "
                                "'function': {'name': ...}}", param="tool_choice")
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict) \
            and isinstance(choice["function"].get("name"), str):
        choice = {"name": choice["function"]["name"]}
    else:
        raise APIError(400, "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', "
                            "'function': {'name': ...}}", param="tool_choice")
    if choice != "none" and not tools:
        if choice == "auto":
            choice = "none"
        else:
            raise APIError(400, "'tool_choice' asks for a tool call but 'tools' is empty", param="tool_choice")
    if isinstance(choice, dict) and choice["name"] not in {t["function"]["name"] for t in tools}:
        raise APIError(400, f"'tool_choice' names the function '{choice['name'][:64]}', which is not in 'tools'",
                       param="tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise APIError(400, "'parallel_tool_calls' must be true or false", param="parallel_tool_calls")
    return tools, choice, parallel


# ---- response_format ------------------------------------------------------------------------------------

def response_constraint(body: dict) -> dict:
    """Model.generate's constraint keywords for `response_format` ({} for text)."""
    fmt = body.get("response_format")
    if fmt is None:
        return {}
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise APIError(400, "'response_format' must be {'type': 'text' | 'json_object' | 'json_schema', ...}",
                       param="response_format")
    kind = fmt["type"]
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise APIError(400, "'response_format.json_schema' must be {'name': ..., 'schema': {...}}",
                           param="response_format.json_schema")
        schema = spec.get("schema")
        if schema is None:
            return {"json_object": True}
        if not isinstance(schema, dict):
            raise APIError(400, "'response_format.json_schema.schema' must be a JSON schema (an object)",
                           param="response_format.json_schema.schema")
        if spec.get("strict") not in (None, True, False):
            raise APIError(400, "'response_format.json_schema.strict' must be true or false",
                           param="response_format.json_schema.strict")
        return {"json_schema": schema}
    raise APIError(400, f"'response_format.type' {kind[:40]!r} is not supported (text, json_object, json_schema)",
                   param="response_format.type")


# ---- reasoning_effort -----------------------------------------------------------------------------------

def reasoning_keywords(body: dict, reacts) -> dict:
    """The template keywords for `reasoning_effort`. `reacts(name, values)` says whether the
    template renders differently for those values of keyword `name` (a probe, cached by the
    caller): a template with `reasoning_effort` gets it (harmony's three levels); one with
    `enable_thinking` gets False for "none"/"minimal", else True; one with neither cannot honour
    the field: a 400."""
    effort = body.get("reasoning_effort")
    if effort is None:
        return {}
    if effort not in REASONING_EFFORTS:
        raise APIError(400, f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}", param="reasoning_effort")
    if reacts("reasoning_effort", ("low", "high")):
        return {"reasoning_effort": HARMONY_EFFORT[effort]}
    if reacts("enable_thinking", (False, True)):
        return {"enable_thinking": effort not in ("none", "minimal")}
    raise APIError(400, "this model's chat template has no reasoning setting: 'reasoning_effort' cannot be honoured "
                        "(leave it out)", param="reasoning_effort", code="unsupported_parameter")


# ---- logit_bias, seed -----------------------------------------------------------------------------------

def logit_bias_of(body: dict, vocab_size: int) -> dict | None:
    """{token id: bias} from OpenAI's {"id": bias in [-100, 100]}, or None."""
    bias = body.get("logit_bias")
    if bias is None or bias == {}:
        return None
    if not isinstance(bias, dict):
        raise APIError(400, "'logit_bias' must be an object {token id: bias}", param="logit_bias")
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if not 0 <= token < vocab_size or str(token) != str(key).strip():
            raise APIError(400, f"'logit_bias' key {str(key)[:30]!r} is not a token id in [0, {vocab_size})",
                           param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
            raise APIError(400, f"'logit_bias' values must be numbers in [-100, 100], got {json.dumps(value)[:30]}",
                           param="logit_bias")
        out[token] = float(value)
    return out


def seed_of(body: dict) -> int:
    """The request's seed, or a fresh random one (so two requests without a seed differ)."""
    seed = body.get("seed")
    if seed is None:
        return secrets.randbits(SEED_BITS)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise APIError(400, f"'seed' must be a non-negative integer, got {json.dumps(seed)[:40]}", param="seed")
    return seed
