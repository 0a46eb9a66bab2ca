"""Constrained decoding: the output follows a JSON schema, any JSON object, a grammar or a regex.

Design
------
llguidance (MIT, optional: `pip install llguidance`) does the grammar work: it compiles a JSON
schema, a Lark grammar or a regex into a matcher that, at each position, says which tokens of the
vocabulary may come next (a bitmask) and advances by the token chosen. This module is the bridge:

    Vocabulary     the model's tokens as llguidance sees them (their bytes, which are special,
                   which end the output), built once per Model and cached on it (~1 s at 150k
                   pieces). tokenizer.json: its text, read by llguidance's own tokenizers code
                   (ByteLevel, and the Llama-style Replace/ByteFallback decoders). tokenizer.model
                   (sentencepiece) and a tokenizer.json whose decoder is Metaspace (which
                   llguidance does not read): each piece's bytes ("▁" is a space, a byte-fallback
                   piece <0xNN> that byte), the control / special pieces special. Ids past the
                   tokenizer's (a vocab_size padded for the matrices) have no bytes and are never
                   allowed. The stop tokens are the model's (config.json's,
                   generation_config.json's and the tokenizer's eos).
    Constraint     one generation's matcher, from exactly one of json_schema (a dict or its JSON
                   text; strict: what llguidance cannot enforce exactly -- an unknown format, a
                   oneOf it cannot prove exclusive, an unsatisfiable schema -- is an error, not
                   approximated), json_object (any JSON object), grammar (Lark, llguidance's
                   dialect: https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md),
                   regex.

Per token (Sampler.pick): the sampler first picks from the logits as they are and asks
`allows(token)`: the mask's bit where the mask is known, else llguidance's check of that one
token (validate_tokens, ~2 us); a model mostly picks what the grammar allows, and then no mask is
computed or applied at that position. Otherwise `apply(logits)` writes the logits into a scratch
array with every forbidden id at -inf (token_mask.h: one branch-free pass over llguidance's
bitmask; the model's array is never written) and the sampler picks again from that (exact:
Sampler._unmasked_pick). `consume(token)` advances the matcher. When the grammar is complete
only the stop tokens are allowed, so the model ends the output itself; consuming one of them
marks the constraint `finished`, which ends the generation even with stop_at_eos=False. A
position where no token is allowed (the grammar needs bytes this vocabulary cannot spell), or a
matcher that fails (a step over its limits), is a ColibriError, never a hang or an
unconstrained token.

Off the critical path: computing a mask (~0.1-1 ms at 150k pieces, more for a rich grammar) is
llguidance's Rust code without the GIL, so with background=True `consume` hands the next mask
to a worker thread and returns; the engine then runs the forward of the token just chosen
(Cython without the GIL) while the mask is computed, and the next pick waits for it. The first
mask is computed the same way during the prompt's prefill. With background=False (or BACKGROUND
= False) a mask is computed inline, only where the first pick was refused: the same decisions
in both modes, so the same tokens. Model uses the worker only where the engine's threads leave
a logical CPU free: where they take every one, the worker would preempt an engine thread and
the whole parallel step would wait for it (tools/bench_constraint.py measures both).

Hostile input: the schema / grammar text is bounded (MAX_SPEC_CHARS), compiled under
llguidance's limits (LIMITS: grammar size, lexer states, fuel per step, which also bound the time
of each later mask) and on a thread the caller waits for at most COMPILE_SECONDS.

JSON whitespace: llguidance allows any run of whitespace between JSON tokens by default; a small
or random model can then spend its whole budget on spaces. The default here is bounded like
llama.cpp's JSON grammars (WHITESPACE: a few spaces, or a newline and an indentation); a schema
may set its own with llguidance's top-level "x-guidance" key (e.g. {"whitespace_flexible": true}).
"""

from __future__ import annotations

import concurrent.futures
import copy
import json
import re
import threading
from pathlib import Path

import numpy as np

from ._kernels import mask_logits
from .errors import ColibriError

KINDS = ("json_schema", "json_object", "grammar", "regex")
MAX_SPEC_CHARS = 1 << 20  # a schema / grammar / regex longer than this is refused
COMPILE_SECONDS = 10.0  # the caller waits at most this long for a compilation
WHITESPACE = r"[ \t]{0,4}|\r?\n[ \t]{0,32}"  # between JSON tokens (llama.cpp: " " | "\n"{1,2} [ \t]{0,20})
LIMITS = dict(  # llguidance.LLParserLimits; its defaults but fewer lexer states (1-2 kB each)
    max_grammar_size=500_000,  # symbols in the grammar's productions
    initial_lexer_fuel=1_000_000,  # building the lexer (~50k / ms)
    step_lexer_fuel=200_000,  # the lexer's work per mask (~14k / ms)
    step_max_items=50_000,  # Earley items per mask (~20k / ms)
    max_lexer_states=100_000,
    verbose_errors=False,  # errors without the parser state and the grammar: one line
)
MASK_WORKERS = 4  # threads computing masks (one per constrained sequence at a time)
BACKGROUND = True  # default of Constraint(background=None)
_NO_TOKEN = "colibri: no token writes byte"
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_INSTALL = "constrained decoding (json_schema, json_object, grammar, regex) needs llguidance: pip install llguidance"

_pool_lock = threading.Lock()
_pool_executor = None


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise ColibriError(_INSTALL) from None
    return llguidance


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _pool_executor
    with _pool_lock:
        if _pool_executor is None:
            _pool_executor = concurrent.futures.ThreadPoolExecutor(MASK_WORKERS, thread_name_prefix="colibri-mask")
        return _pool_executor


def _first_line(text: str, limit: int = 300) -> str:
    line = next((s.strip() for s in str(text).splitlines() if s.strip()), "")
    return line if len(line) <= limit else line[:limit] + "..."


def requested(json_schema=None, json_object=False, grammar=None, regex=None) -> dict | None:
    """The constraint generate() was asked for, checked without llguidance: {kind: value}, or None
    when none was. ColibriError for more than one, or a value of the wrong type or size."""
    if not isinstance(json_object, (bool, np.bool_)):
        raise ColibriError(f"json_object must be True or False, got {json_object!r}")
    given = {
        k: v
        for k, v in (
            ("json_schema", json_schema),
            ("json_object", json_object or None),
            ("grammar", grammar),
            ("regex", regex),
        )
        if v is not None
    }
    if not given:
        return None
    if len(given) > 1:
        raise ColibriError(f"give at most one of json_schema, json_object, grammar, regex; got {', '.join(given)}")
    ((kind, value),) = given.items()
    if kind == "json_object":
        return {kind: True}
    if kind == "json_schema":
        if isinstance(value, (str, bytes)):
            if len(value) > MAX_SPEC_CHARS:
                raise ColibriError(f"json_schema is {len(value)} characters long; the limit is {MAX_SPEC_CHARS}")
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ColibriError(f"json_schema is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ColibriError(
                f"json_schema must be a JSON object (a dict or its JSON text), got {type(value).__name__}"
            )
        try:
            text = json.dumps(value)
        except (TypeError, ValueError, RecursionError) as e:
            raise ColibriError(f"json_schema cannot be written as JSON: {_first_line(e)}") from None
        if len(text) > MAX_SPEC_CHARS:
            raise ColibriError(f"json_schema is {len(text)} characters as JSON; the limit is {MAX_SPEC_CHARS}")
        return {kind: value}
    if not isinstance(value, str):
        raise ColibriError(f"{kind} must be a str, got {type(value).__name__}")
    if len(value) > MAX_SPEC_CHARS:
        raise ColibriError(f"{kind} is {len(value)} characters long; the limit is {MAX_SPEC_CHARS}")
    return {kind: value}


# ---- the vocabulary ------------------------------------------------------------------------------


class _PieceTokens:
    """Sentencepiece-style pieces in the shape llguidance.TokenizerWrapper reads: `tokens` (the
    bytes of each id: "▁" a space, <0xNN> that byte, a special piece its name), `eos_token_id`,
    `bos_token_id`, `special_token_ids`, and a call that tokenizes bytes or text (llguidance uses
    it only to tokenize strings, not for masks). pieces: [n] str (None: an id without a piece);
    byte: [n] bool, the byte-fallback pieces; encode: text -> ids, without BOS / EOS; n_vocab:
    the model's ids (>= n), the ones past the pieces without bytes."""

    def __init__(self, pieces, byte, special, stop_ids, bos_id, encode, n_vocab):
        special = set(special)
        tokens = []  # [n_vocab] bytes
        for i, piece in enumerate(pieces):
            if piece is None:
                tokens.append(b"")
            elif byte[i]:
                tokens.append(bytes([int(piece[3:5], 16)]))
            elif i in special:
                tokens.append(piece.encode("utf-8"))
            else:
                tokens.append(piece.replace("\u2581", " ").encode("utf-8"))
        tokens += [b""] * (n_vocab - len(tokens))
        byte = list(byte) + [False] * (n_vocab - len(byte))
        self.tokens = tokens
        self.eos_token_id = stop_ids[0]
        self.bos_token_id = bos_id
        self.special_token_ids = sorted(special)
        self._encode = encode
        self._longest = max(map(len, tokens), default=1)
        self._by_bytes = {}
        for i in sorted(range(len(tokens)), key=lambda i: (byte[i], i)):  # a piece before a byte
            if i not in special and tokens[i]:
                self._by_bytes.setdefault(tokens[i], i)

    @classmethod
    def of_sentencepiece(cls, tok, stop_ids, n_vocab):
        sp = tok.sp
        n = sp.GetPieceSize()
        special = set(tok.special_ids) | {i for i in range(n) if sp.IsUnused(i)}
        return cls(
            [sp.IdToPiece(i) for i in range(n)],
            [sp.IsByte(i) for i in range(n)],
            special,
            stop_ids,
            tok.bos_token_id,
            sp.EncodeAsIds,
            n_vocab,
        )

    @classmethod
    def of_metaspace_json(cls, tok, stop_ids, n_vocab):
        inner = tok._tok
        pieces = [inner.id_to_token(i) for i in range(tok.vocab_size)]
        byte = [p is not None and _BYTE_PIECE.fullmatch(p) is not None for p in pieces]
        return cls(
            pieces,
            byte,
            tok.special_ids,
            stop_ids,
            tok.bos_token_id,
            lambda text: tok.encode(text, add_special_tokens=False),  # (a tokenizers panic: one line)
            n_vocab,
        )

    def __call__(self, text) -> list:
        data = text if isinstance(text, bytes) else str(text).encode("utf-8")
        try:
            ids = [int(i) for i in self._encode(data.decode("utf-8"))]
            if b"".join(self.tokens[i] for i in ids) == data:
                return ids
        except Exception:  # noqa: BLE001 - a partial character, an id past the pieces
            pass
        ids, at = [], 0  # a dummy prefix space, or a partial character: longest pieces
        while at < len(data):
            for n in range(min(self._longest, len(data) - at), 0, -1):
                i = self._by_bytes.get(data[at : at + n])
                if i is not None:
                    ids.append(i)
                    at += n
                    break
            else:  # llguidance turns this into an error state (_compute reports it)
                raise ValueError(f"{_NO_TOKEN} {data[at]:#04x}")
        return ids


class Vocabulary:
    """The model's vocabulary for llguidance; build once per Model (Model caches it) and share."""

    def __init__(self, tokenizer, n_vocab: int, stop_ids):
        llg = _llguidance()
        if tokenizer is None:
            raise ColibriError("constrained decoding needs the model's tokenizer (tokenizer.json or tokenizer.model)")
        self.n_vocab = int(n_vocab)  # the model's vocab_size (logits)
        self.stop_ids = tuple(dict.fromkeys(int(i) for i in stop_ids if 0 <= int(i) < self.n_vocab))
        if not self.stop_ids:
            raise ColibriError(
                "constrained decoding needs a stop token (eos_token_id in config.json, "
                "generation_config.json or the tokenizer's eos_token): this model has none"
            )
        if tokenizer.kind == "tokenizer.json":
            source = _tokenizer_json(tokenizer)
            if _metaspace_decoder(source) and getattr(tokenizer, "_tok", None) is not None:
                source = llg.TokenizerWrapper(_PieceTokens.of_metaspace_json(tokenizer, self.stop_ids, self.n_vocab))
        elif tokenizer.kind == "tokenizer.model":
            source = llg.TokenizerWrapper(_PieceTokens.of_sentencepiece(tokenizer, self.stop_ids, self.n_vocab))
        else:
            raise ColibriError(f"constrained decoding reads tokenizer.json or tokenizer.model, not {tokenizer.kind}")
        try:
            self.ll = llg.LLTokenizer(source, n_vocab=self.n_vocab, eos_token=list(self.stop_ids))
        except Exception as e:  # noqa: BLE001 - llguidance raises plain exceptions for what it cannot read
            raise ColibriError(f"{tokenizer.path}: llguidance cannot read this tokenizer ({_first_line(e)})") from None
        if self.ll.vocab_size != self.n_vocab:
            raise ColibriError(
                f"{tokenizer.path}: llguidance sees {self.ll.vocab_size} token ids, the model has {self.n_vocab}"
            )
        self.words = (self.n_vocab + 31) // 32  # int32 words of a bitmask

    def decode(self, ids) -> str:
        return self.ll.decode_str([int(i) for i in ids])


def _metaspace_decoder(text: str) -> bool:
    """Whether a tokenizer.json's decoder is Metaspace (alone or in a Sequence)."""
    try:
        decoder = json.loads(text).get("decoder") or {}
    except ValueError:
        return False
    if not isinstance(decoder, dict):
        return False
    parts = decoder.get("decoders") or [decoder]
    return any(isinstance(d, dict) and d.get("type") == "Metaspace" for d in parts)


def _tokenizer_json(tok) -> str:
    """The tokenizer.json text, with the added tokens the tokenizer loaded from tokenizer_config."""
    inner = getattr(tok, "_tok", None)
    if inner is not None:
        inner = copy.copy(inner)
        inner.no_padding()
        inner.no_truncation()
        return inner.to_str()
    return Path(tok.path).read_text(encoding="utf-8")


# ---- one generation's constraint ----------------------------------------------------------------


def _compile(vocab: Vocabulary, kind: str, value):
    """An llguidance.LLMatcher for the constraint, or a one-line ColibriError naming what is wrong."""
    llg = _llguidance()
    box = {}

    def work():
        try:
            if kind in ("json_schema", "json_object"):
                schema = {"type": "object"} if kind == "json_object" else value
                text = llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_pattern": WHITESPACE})
            elif kind == "grammar":
                text = llg.LLMatcher.grammar_from_lark(value)
            else:
                text = llg.LLMatcher.grammar_from_regex(value)
            box["matcher"] = llg.LLMatcher(vocab.ll, text, log_level=0, limits=llg.LLParserLimits(**LIMITS))
        except Exception as e:  # noqa: BLE001 - reported below, on the caller's thread
            box["error"] = e

    worker = threading.Thread(target=work, name="colibri-grammar", daemon=True)
    worker.start()
    worker.join(COMPILE_SECONDS)
    if worker.is_alive():
        raise ColibriError(f"{kind} took longer than {COMPILE_SECONDS:g} s to compile; simplify it")
    if "error" in box:
        raise ColibriError(f"{kind} cannot be compiled: {_first_line(box['error'])}")
    matcher = box["matcher"]
    if matcher.is_error():
        raise ColibriError(f"{kind} cannot be compiled: {_first_line(matcher.get_error())}")
    return matcher


class Constraint:
    """One generation's grammar state. Sampler(constraint=...) calls apply() then consume() per
    token; reset() starts again (Sampler.reset). Not shared between threads: only its own worker
    touches the matcher, while a mask is being computed."""

    def __init__(
        self,
        vocabulary: Vocabulary,
        *,
        json_schema=None,
        json_object=False,
        grammar=None,
        regex=None,
        background: bool | None = None,
    ):
        spec = requested(json_schema=json_schema, json_object=json_object, grammar=grammar, regex=regex)
        if spec is None:
            raise ColibriError("give one of json_schema, json_object, grammar, regex")
        ((self.kind, value),) = spec.items()
        self.vocab = vocabulary
        self.n_vocab = vocabulary.n_vocab
        self.background = BACKGROUND if background is None else bool(background)
        self._matcher = _compile(vocabulary, self.kind, value)
        self._bits = np.zeros(vocabulary.words, np.uint32)  # [ceil(vocab / 32)] bit i & 31 of word i >> 5:
        self._known = False  # token i allowed; computed for this position
        self._allowed = None  # bool [vocab] unpacked from it, on request
        self._validated = None  # a token validate_tokens allowed here, unmasked
        self._future = None  # the worker computing the mask
        self._tokens = []  # ids consumed so far
        self.finished = False  # a stop token ended the output
        self._start()

    # -- the mask --

    def _compute(self):
        """The mask of the current position into self._bits: None, or an error message. Runs on
        a worker (or inline) and is then the only code touching the matcher and the bits."""
        m = self._matcher
        m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)  # without the GIL
        if m.is_error():
            error = _first_line(m.get_error())
            if error in ("NoExtension", "NoExtensionBias"):  # no token continues the output
                return self._no_token(f" (llguidance: {error})")
            if _NO_TOKEN in m.get_error():  # bytes it must write have no token
                return self._no_token("")
            return f"the {self.kind} constraint failed after {len(self._tokens)} tokens: {error}"
        if not self._bits.any():
            return self._no_token("")
        return None

    def _no_token(self, why: str) -> str:
        return (
            f"the {self.kind} constraint allows no token of this vocabulary after {len(self._tokens)} tokens "
            f"(output so far: {self.text()[-80:]!r}): it needs text this tokenizer cannot write, or it cannot "
            f"be satisfied{why}"
        )

    def _start(self) -> None:
        self._known = False
        self._allowed = None
        self._validated = None
        self._future = _pool().submit(self._compute) if self.background else None

    def _result(self):
        """Wait for the mask being computed (or compute it now): None or an error message."""
        future, self._future = self._future, None
        return future.result() if future is not None else self._compute()

    def _mask(self) -> np.ndarray:
        """uint32 [ceil(vocab / 32)]: the bitmask of this position, computed (or waited for)."""
        if not self._known:
            if self.finished:
                raise ColibriError(f"the {self.kind} constraint has ended (a stop token was consumed)")
            error = self._result()
            if error is not None:
                raise ColibriError(error)
            self._known = True
        return self._bits

    def _bit(self, token: int) -> bool:
        return 0 <= token < self.n_vocab and bool((int(self._bits[token >> 5]) >> (token & 31)) & 1)

    def allowed(self) -> np.ndarray:
        """bool [vocab]: the tokens the grammar allows next (only the stop tokens once it is
        complete). ColibriError when none is, or when the matcher failed."""
        if self._allowed is None:
            bits = self._mask()
            self._allowed = np.unpackbits(bits.view(np.uint8), count=self.n_vocab, bitorder="little").view(np.bool_)
        return self._allowed

    def allows(self, token: int) -> bool:
        """Whether the grammar allows `token` next: the mask's bit where it is computed or being
        computed (the worker's); else llguidance's check of that one token, without a mask
        (~2 us against ~0.1-1 ms), remembered so that consume(token) needs none either."""
        token = int(token)
        if self._known or self._future is not None or self.finished:
            self._mask()
            return self._bit(token)
        if not 0 <= token < self.n_vocab:
            return False
        if self._validated == token:
            return True
        if token in self.vocab.stop_ids:  # validate_tokens never takes one; the mask, when complete
            ok = self._matcher.is_accepting()
        else:
            ok = self._matcher.validate_tokens([token]) == 1
        ok = ok and not self._matcher.is_error()
        if ok:
            self._validated = token
        return ok

    def apply(self, logits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """logits [vocab] -> out [vocab] (a new array when None; never `logits` itself): the
        logits where the grammar allows the token (the same values), -inf elsewhere."""
        bits = self._mask()
        if logits.shape != (self.n_vocab,):
            raise ColibriError(f"logits have shape {logits.shape}; the constraint's vocabulary has {self.n_vocab} ids")
        if out is None or out is logits or out.dtype != logits.dtype or out.shape != logits.shape:
            out = np.empty_like(logits)
        if logits.dtype == np.float32 and logits.flags.c_contiguous:
            mask_logits(logits, bits, out)
            return out
        np.copyto(out, logits)  # float64 (or strided) logits: the rare path
        out[~self.allowed()] = -np.inf
        return out

    def consume(self, token: int) -> None:
        """Advance by the chosen token and start computing the next mask (on the worker)."""
        token = int(token)
        if not self.allows(token):  # (a token allows() validated needs no mask)
            raise ColibriError(
                f"token {token} is not allowed by the {self.kind} constraint here "
                f"(output so far: {self.text()[-80:]!r})"
            )
        if not self._matcher.consume_token(token):  # a mask llguidance could not keep (it happens
            raise ColibriError(  # where the grammar needs bytes no token has)
                f"the {self.kind} constraint cannot continue after {len(self._tokens)} tokens (output so far: "
                f"{self.text()[-80:]!r}); llguidance refused token {token}: {_first_line(self._matcher.get_error())}"
            )
        self._tokens.append(token)
        if token in self.vocab.stop_ids and self._matcher.is_stopped():
            self.finished = True
            self._known = False
            self._allowed = None
            self._validated = None
        else:
            self._start()

    def reset(self) -> None:
        """Back to the start of the grammar (a new generation); the first mask is computed on
        the worker meanwhile."""
        if not self._tokens and not self.finished:
            return  # nothing consumed: the first mask stands
        if self._future is not None:
            try:
                self._result()  # the matcher must be idle (an error is moot now)
            except Exception:  # noqa: BLE001
                pass
        self._matcher.reset()
        self._tokens = []
        self.finished = False
        self._start()

    def text(self) -> str:
        """The bytes consumed so far as text (stop tokens shown as their names)."""
        return self.vocab.decode(self._tokens)

    def __repr__(self):
        return f"Constraint({self.kind}, {len(self._tokens)} tokens{', finished' if self.finished else ''})"
