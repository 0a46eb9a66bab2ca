"""OpenAI requests -> the engine's work: a validated body becomes a Job (prompt ids, generate
keywords, how to parse the reply), shared by every route that speaks OpenAI's shapes.

Design
------
serve/protocol.py says what each field may be; this module says what it means. A client that
sends a field and gets a 200 believes it was honoured, so each field the protocol admits is
either implemented here or refused there. The agent-facing fields turn into engine settings:
`tools` and `tool_choice` (the tools rendered by the chat template, the reply parsed by the
family's ReplyStream, a required / named / auto call constrained by the family's tool-call
grammar), `response_format` (the constraint keywords Model.generate takes), `reasoning_effort`
(a template keyword, found by probing what the template reacts to), `logit_bias` and `seed` (a
fresh random one when the request has none, reported back). Everything here runs on a
preparation thread (Served.off_loop): rendering a template and tokenizing are the request's own
code and time, never the event loop's.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import secrets

from pydantic import ValidationError

from ..errors import ColibriError
from ..sampling import SEED_BITS
from . import protocol
from .errors import APIError

# apply_chat_template's own keywords: chat_template_kwargs cannot set them (the request's fields do)
RESERVED_TEMPLATE_KEYWORDS = frozenset(
    {"messages", "add_generation_prompt", "tokenize", "tools", "documents", "continue_final_message"}
)
# harmony (gpt-oss) knows low, medium and high: the others map to the nearest
HARMONY_EFFORT = {"none": "low", "minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "high"}


@dataclasses.dataclass
class Job:
    """A request, checked and turned into engine work."""

    m: object  # the Model
    ids: list  # the prompt's token ids
    gen: dict  # Model.generate keywords (sampling, constraint, max_new_tokens, ...)
    stops: list  # stop strings
    logprobs: int | None  # top logprobs per token, None: off
    stream: bool
    include_usage: bool
    n: int  # choices, each its own generation
    chat: bool
    reply: dict | None = None  # chat: how to parse the reply (ChatTemplate.reply_stream keywords)
    echo: dict | None = None  # a translated API's request fields that its answer repeats


@dataclasses.dataclass
class Outcome:
    """A finished chat generation as every API's formatter reads it: the parsed assistant message
    (content, reasoning_content, tool_calls), chat completions' finish_reason, the stop string
    that ended it (or None) and the token counts."""

    message: dict
    finish_reason: str
    stop: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


def validated(model_class, body):
    """body as `model_class`, or OpenAI's 400 naming the field at fault."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model_class.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        loc = [str(p) for p in err["loc"]]
        where = "".join(f"[{p}]" if p.isdigit() else (f".{p}" if i else p) for i, p in enumerate(loc))
        kind = err["type"]
        if kind == "extra_forbidden":
            raise APIError(
                400,
                f"unknown field '{where[:80]}' (docs/serve.md lists the fields this server accepts)",
                param=where[:80],
                code="unknown_parameter",
            ) from None
        if kind == "unsupported_parameter":
            raise APIError(400, err["msg"], param=where, code="unsupported_parameter") from None
        message = err["msg"].removeprefix("Value error, ")
        raise APIError(
            400, f"'{where}' {message[:1].lower() + message[1:]}" if where else message, param=loc[0] if loc else None
        ) from None


def renamed_fields(names: dict, fn, *args):
    """fn(*args), an APIError it raises naming another API's field (names: chat completions' name
    -> that API's) in its param and message: for the APIs translated onto chat completions."""
    try:
        return fn(*args)
    except APIError as e:
        if e.param in names and names[e.param] != e.param:
            e.message = e.message.replace(f"'{e.param}'", f"'{names[e.param]}'")
            e.param = names[e.param]
        raise


def prepare(served, body, chat: bool, counting: bool = False) -> Job:
    """The request's Job, or an APIError naming the field at fault. `counting`: the Job only
    counts the prompt's tokens (a count_tokens request), so a prompt longer than the context is
    no error: counting is how a client learns that it is too long."""
    m = served.ready()
    req = validated(protocol.ChatCompletionRequest if chat else protocol.CompletionRequest, body)
    if req.model is not None and req.model != served.name:
        raise APIError(
            404,
            f"the model '{req.model[:100]}' does not exist; this server serves '{served.name}'",
            param="model",
            code="model_not_found",
        )
    gen = sampling_options(req)
    bias = logit_bias_of(req, m.config.vocab_size)
    if bias:
        gen["logit_bias"] = bias
    gen.update(speculation_options(served, req))
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    reply = None
    if chat:
        tools, choice, parallel = tools_of(req)
        constraint = response_constraint(req)
        if constraint and choice != "none":
            raise APIError(
                400,
                "'response_format' cannot be combined with tool calls: set tool_choice 'none' or leave out 'tools'",
                param="response_format",
            )
        kwargs = template_kwargs(req.chat_template_kwargs)
        for key, value in reasoning_keywords(req.reasoning_effort, m).items():
            kwargs.setdefault(key, value)  # chat_template_kwargs, the more specific, wins
        prompt, ids = chat_prompt(m, messages_of(req.messages), tools, kwargs)
        thinking = kwargs.get("enable_thinking")
        reply = {
            "tools": tools if choice != "none" else None,
            "enable_thinking": thinking,
            "parallel_tool_calls": parallel,
            "prompt": prompt,
        }
        if choice != "none":
            grammar = tool_grammar(m, tools, choice, parallel, thinking, prompt)
            if grammar is not None:
                constraint = {"grammar": grammar}
        gen.update(constraint)
        # the reply parser reads the family's markers, which are special tokens in most vocabularies
        gen["skip_special_tokens"] = plain_replies(m.chat_template)
        want = req.max_tokens if req.max_tokens is not None else req.max_completion_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        ids = completion_prompt(m, req.prompt)
        want = req.max_tokens if req.max_tokens is not None else protocol.COMPLETIONS_DEFAULT_MAX_TOKENS
        logprobs = req.logprobs
    room = m.n_ctx - len(ids)
    if counting:
        want = max(room, 0)
    elif room < 1:
        raise APIError(
            400,
            f"the prompt has {len(ids)} tokens; the context is {m.n_ctx}",
            param="messages" if chat else "prompt",
            code="context_length_exceeded",
        )
    elif want is None:
        want = room
    elif want > room:
        raise APIError(
            400,
            f"max_tokens {want} + the prompt's {len(ids)} tokens exceed the context of {m.n_ctx}",
            param="max_tokens",
            code="context_length_exceeded",
        )
    include_usage = bool(req.stream_options is not None and req.stream_options.include_usage)
    return Job(
        m,
        ids,
        dict(gen, max_new_tokens=want, logprobs=logprobs),
        [s for s in stops if s],
        logprobs,
        bool(req.stream),
        include_usage,
        req.n or 1,
        chat,
        reply,
    )


def sampling_options(req) -> dict:
    """The Model.generate keywords a request asks for (the seed: the request's, or a fresh one)."""
    return dict(
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        repetition_penalty=req.repetition_penalty,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        seed=req.seed if req.seed is not None else secrets.randbits(SEED_BITS),
        stop_at_eos=not req.ignore_eos,
    )


def speculation_options(served, req) -> dict:
    """The Model.generate (and Batch.add) keywords of speculative decoding a request asks for
    (draft, draft_max, prediction's text), the server's --draft / --draft-max where it asks none."""
    out = {}
    if req.draft is not None:
        out["draft"] = req.draft
    if req.draft_max is not None:
        out["draft_max"] = req.draft_max
    prediction = getattr(req, "prediction", None)
    if prediction is not None:
        out["prediction"] = prediction.text()
        out.setdefault("draft", "auto")
        if out["draft"] != "auto":
            raise APIError(400, "'prediction' needs 'draft' auto (its tokens are the first drafts)", param="draft")
    for key, value in served.draft.items():  # the server's --draft / --draft-max
        out.setdefault(key, value)
    return out


def logit_bias_of(req, vocab_size: int) -> dict | None:
    """{token id: bias} from OpenAI's {"id": bias}, or None."""
    if not req.logit_bias:
        return None
    out = {}
    for key, value in req.logit_bias.items():
        token = int(key) if key.strip().isdigit() else -1
        if not 0 <= token < vocab_size:
            raise APIError(
                400, f"'logit_bias' key {key[:30]!r} is not a token id in [0, {vocab_size})", param="logit_bias"
            )
        out[token] = value
    return out


# ---- the conversation -------------------------------------------------------------------------------


def messages_of(messages) -> list:
    """The conversation as the chat template takes it: dicts, text parts joined, None dropped;
    `arguments` passed on as sent (a JSON string or an object): the template's own
    normalisation (chat.py) turns it into what the template expects."""
    out = []
    for i, msg in enumerate(messages):
        turn = msg.model_dump(exclude_none=True)
        if msg.tool_calls and msg.role != "assistant":
            raise APIError(400, f"messages[{i}]: only assistant messages carry tool_calls", param="messages")
        if msg.content is None and not msg.tool_calls:
            raise APIError(400, f"messages[{i}] has no 'content'", param="messages")
        if isinstance(msg.content, list):
            turn["content"] = "".join((p.text if p.type == "text" else p.refusal) or "" for p in msg.content)
        out.append(turn)
    return out


def template_kwargs(kwargs) -> dict:
    reserved = sorted(RESERVED_TEMPLATE_KEYWORDS & (kwargs or {}).keys())
    if reserved:
        raise APIError(
            400,
            f"'chat_template_kwargs' cannot set '{reserved[0]}' (a field of the request or of the server)",
            param="chat_template_kwargs",
        )
    return dict(kwargs or {})


def reasoning_keywords(effort, m) -> dict:
    """The template keywords for `reasoning_effort`: a template with `reasoning_effort` gets it
    (harmony's three levels); one with `enable_thinking` gets False for "none"/"minimal", else
    True; one with neither cannot honour the field: a 400."""
    if effort is None:
        return {}
    template = m.chat_template
    if template is not None and template.reacts_to("reasoning_effort", ("low", "high")):
        return {"reasoning_effort": HARMONY_EFFORT[effort]}
    if template is not None and template.reacts_to("enable_thinking", (False, True)):
        return {"enable_thinking": effort not in ("none", "minimal")}
    raise APIError(
        400,
        "this model's chat template has no reasoning setting: 'reasoning_effort' cannot be honoured (leave it out)",
        param="reasoning_effort",
        code="unsupported_parameter",
    )


def chat_prompt(m, messages: list, tools, kwargs: dict) -> tuple:
    """(the prompt's text, its token ids) of a conversation; the template's refusal is a 422."""
    if m.chat_template is None:
        raise APIError(
            422,
            "the model has no chat template; use /v1/completions, or add one with: python -m colibri "
            "tokenizer --model-dir DIR --from HF_DIR",
            param="messages",
            code="chat_template_error",
        )
    try:
        text = m.apply_chat_template(messages, add_generation_prompt=True, tools=tools, tokenize=False, **kwargs)
        return text, m.encode(text, add_special_tokens=False)
    except ColibriError as e:
        raise APIError(422, str(e), param="messages", code="chat_template_error") from None


def completion_prompt(m, prompt) -> list:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        try:
            ids = m.encode(prompt)
        except ColibriError as e:
            raise APIError(400, str(e), param="prompt") from None
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = prompt
        vocab = m.config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(
                422,
                f"token id {str(bad)[:30]} is outside the model's vocabulary [0, {vocab})",
                param="prompt",
                code="token_out_of_vocabulary",
            )
    else:
        raise APIError(
            400, "'prompt' must be a string, or a list of token ids (one prompt per request)", param="prompt"
        )
    if not ids:
        raise APIError(400, "the prompt is empty (it encodes to no tokens)", param="prompt")
    return ids


# ---- tools, formats -----------------------------------------------------------------------------------


def tools_of(req) -> tuple:
    """(tools as the template takes them or None, tool_choice, parallel_tool_calls). tool_choice
    is "none", "auto", "required" or {"name": NAME}; absent it is "auto" with tools and "none"
    without (OpenAI's defaults)."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    names = [t["function"]["name"] for t in tools or ()]
    if len(set(names)) != len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise APIError(400, f"'tools' defines the function '{twice}' twice", param="tools")
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    elif not isinstance(choice, str):
        choice = {"name": choice.function.name}
    if choice != "none" and not tools:
        if choice != "auto":
            raise APIError(400, "'tool_choice' asks for a tool call but 'tools' is empty", param="tool_choice")
        choice = "none"
    if isinstance(choice, dict) and choice["name"] not in names:
        raise APIError(
            400,
            f"'tool_choice' names the function '{choice['name'][:64]}', which is not in 'tools'",
            param="tool_choice",
        )
    return tools, choice, req.parallel_tool_calls is not False


def response_constraint(req) -> dict:
    """Model.generate's constraint keywords for `response_format` ({} for text)."""
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return {}
    if fmt.type == "json_object" or fmt.json_schema.schema_ is None:
        return {"json_object": True}
    return {"json_schema": fmt.json_schema.schema_}


def plain_replies(template) -> bool:
    """True when the template's replies carry no reasoning or tool markers to parse."""
    fmt = getattr(template, "reply_format", None)
    return fmt is None or getattr(fmt, "name", "plain") == "plain"


def tool_grammar(m, tools, choice, parallel: bool, thinking, prompt: str):
    """The constraint on a reply for tool_choice (required / named: a call in the family's syntax;
    auto: free text, the call constrained once its opener appears), or None where the family
    has no known call syntax (auto) — for required / named that is a 400."""
    if choice == "auto" and importlib.util.find_spec("llguidance") is None:
        return None  # auto works without the constraint: the reply is still parsed
    grammar = m.chat_template.tool_call_grammar(
        tools,
        choice,
        parallel_tool_calls=parallel,
        added_tokens=m.tokenizer.added_tokens,
        enable_thinking=thinking,
        prompt=prompt,
    )
    if grammar is None and choice != "auto":
        raise APIError(
            400,
            "this model's chat template has no known tool-call syntax: tool_choice "
            f"{choice if isinstance(choice, str) else choice['name']!r} cannot be enforced (use "
            "'auto')",
            param="tool_choice",
            code="unsupported_parameter",
        )
    return grammar


# ---- /tokenize, /detokenize ---------------------------------------------------------------------------


def tokenize(served, body) -> dict:
    m = served.ready()
    req = validated(protocol.TokenizeRequest, body)
    if req.messages is not None:
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        if m.chat_template is None:
            raise APIError(422, "the model has no chat template", param="messages", code="chat_template_error")
        try:
            ids = m.apply_chat_template(
                messages_of(req.messages),
                add_generation_prompt=req.add_generation_prompt is not False,
                tools=tools,
                **template_kwargs(req.chat_template_kwargs),
            )
        except ColibriError as e:
            raise APIError(422, str(e), param="messages", code="chat_template_error") from None
    else:
        field = "content" if req.content is not None else "prompt"
        # llama-server adds no special tokens unless asked; vLLM adds them unless told not to
        add = field == "prompt"
        add = req.add_special if req.add_special is not None else add
        add = req.add_special_tokens if req.add_special_tokens is not None else add
        try:
            ids = m.encode(getattr(req, field), add_special_tokens=add)
        except ColibriError as e:
            raise APIError(400, str(e), param=field) from None
    tokens = [{"id": t, "piece": m.tokenizer.decode([t])} for t in ids] if req.with_pieces else list(ids)
    return {"tokens": tokens, "count": len(ids), "max_model_len": m.n_ctx}


def detokenize(served, body) -> dict:
    m = served.ready()
    req = validated(protocol.DetokenizeRequest, body)
    vocab = m.config.vocab_size
    bad = next((t for t in req.tokens if t >= vocab), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the model's vocabulary [0, {vocab})", param="tokens")
    if m.tokenizer is None:
        raise APIError(422, "the model has no tokenizer", param="tokens")
    text = m.tokenizer.decode(req.tokens)
    return {"content": text, "prompt": text}
