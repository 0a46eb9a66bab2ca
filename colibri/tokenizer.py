"""Text <-> token ids, with transformers' semantics, for both kinds of tokenizer a checkpoint ships.

Design
------
One interface (`Tokenizer`), two backends chosen by the files of the model directory:

  tokenizer.json    Hugging Face's `tokenizers` library (Qwen2/Qwen3-MoE, OLMoE, Gemma 4, ...):
                    the file's normalizer, pre-tokenizer, model, decoder and added tokens as they are.
  tokenizer.model   sentencepiece (Mixtral/Llama-style, the bundled demo), used when there is no
                    tokenizer.json (transformers also prefers tokenizer.json when both exist).

What transformers 5.x does on top of the raw backends, reproduced here (`tokenizer_config.json`):
  - BOS/EOS: tokenizer.json's post-processor decides (transformers 5 ignores tokenizer_config's
    `add_bos_token` / `add_eos_token` then — checked for the Llama, Gemma, Qwen2, GPT-NeoX and
    generic classes); only a tokenizer.json without one takes those flags ("[bos] $A [eos]",
    TokenizersBackend.update_post_processor). A sentencepiece model adds BOS unless
    `add_bos_token` is false (LlamaTokenizer's default).
  - special tokens written in the text are recognised (the added tokens of tokenizer.json, the
    control pieces of a sentencepiece model), each chunk of text between them encoded on its own
    (sentencepiece: each with its dummy-prefix space, transformers' legacy behaviour).
  - `added_tokens_decoder` entries of tokenizer_config that tokenizer.json lacks are added.
  - decode: `skip_special_tokens` drops special tokens; `clean_up_tokenization_spaces` applies
    only to non-BPE models (transformers 5 skips it for BPE). The sentencepiece decode is the
    chain transformers builds from a tokenizer.model: "▁" -> " ", runs of byte pieces <0xNN>
    joined into UTF-8 (each byte a U+FFFD when the run is not valid UTF-8), one leading space
    stripped.
Ids the tokenizer does not know (a model's vocab_size may exceed the tokenizer's) decode to "".
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
import tempfile
import threading
from pathlib import Path

from .config import read_json
from .errors import ColibriError

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_MODEL = "tokenizer.model"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
MAX_TEXT_FILE_BYTES = 256 << 20  # a tokenizer or config file larger than this is refused
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_CLEANUP = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)  # transformers' clean_up_tokenization
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _token_content(value):
    """A special token as tokenizer_config / special_tokens_map write it: "x" or {"content": "x", ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def is_panic(e: BaseException) -> bool:
    """A Rust panic in `tokenizers`: pyo3's PanicException, a BaseException that `except Exception`
    misses (and not importable by name)."""
    return type(e).__name__ == "PanicException" and type(e).__module__ == "pyo3_runtime"


def _panic_text(e: BaseException) -> str:
    text = " ".join(str(e).split())[:200] or type(e).__name__
    if "retry-limit" in text:  # oniguruma's bound on backtracking (10 million retries) in a regex
        text += ": a regular expression of its normalizer, pre-tokenizer or decoder backtracks past its limit"
    return text


_RUST_STDERR = threading.RLock()  # one redirection of fd 2 at a time (see _rust_call)
_PANIC_LINE = b"thread '"  # how Rust's panic hook starts its message
_sink = {}  # pid -> the file descriptor of an unlinked temporary file that takes fd 2 during a call


def _rust_call(fn, *args, **kwargs):
    """fn(*args, **kwargs) with fd 2 sent to a temporary file meanwhile: Rust's panic hook writes
    its message and backtrace there (several lines, on fd 2, before pyo3 raises PanicException),
    the caller says it in one line. What the process wrote to fd 2 meanwhile is written after, a
    panic's own lines dropped. A few system calls a call (the file is made once a process)."""
    with _RUST_STDERR:
        sink = _sink.get(os.getpid())
        if sink is None:
            f = tempfile.TemporaryFile()
            sink = _sink[os.getpid()] = os.dup(f.fileno())
            f.close()
        with contextlib.suppress(AttributeError, ValueError, OSError):
            sys.stderr.flush()
        saved = os.dup(2)
        panicked = False
        try:
            os.dup2(sink, 2)
            return fn(*args, **kwargs)
        except BaseException as e:
            panicked = is_panic(e)
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            if os.lseek(sink, 0, os.SEEK_CUR):
                os.lseek(sink, 0, os.SEEK_SET)
                data = b"".join(iter(lambda: os.read(sink, 1 << 16), b""))
                os.lseek(sink, 0, os.SEEK_SET)
                os.ftruncate(sink, 0)
                if panicked and _PANIC_LINE in data:
                    data = data[: data.index(_PANIC_LINE)].rstrip(b"\n")
                with contextlib.suppress(OSError):
                    while data:
                        data = data[os.write(2, data) :]


def check_text(text, what: str = "text") -> str:
    if not isinstance(text, str):
        raise ColibriError(f"{what} must be a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ColibriError(f"{what} is not valid UTF-8 (character {e.start}: {text[e.start : e.end]!r})") from None
    return text


class Tokenizer:
    """The interface both backends implement (transformers' names and semantics)."""

    kind: str  # the file it was read from: "tokenizer.json" or "tokenizer.model"
    path: str
    vocab_size: int  # the number of ids it can produce (largest id + 1)
    special_tokens_map: dict  # {"bos_token": "<s>", "eos_token": "</s>", ...} where set
    special_ids: frozenset  # ids that skip_special_tokens drops
    add_bos_token: bool
    add_eos_token: bool

    @property
    def bos_token(self):
        return self.special_tokens_map.get("bos_token")

    @property
    def eos_token(self):
        return self.special_tokens_map.get("eos_token")

    @property
    def bos_token_id(self):
        return None if self.bos_token is None else self.token_to_id(self.bos_token)

    @property
    def eos_token_id(self):
        return None if self.eos_token is None else self.token_to_id(self.eos_token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list:
        raise NotImplementedError

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        raise NotImplementedError

    def token_to_id(self, token: str):
        raise NotImplementedError

    @functools.cached_property
    def byte_piece_ids(self) -> frozenset:
        """Ids of the byte-fallback pieces <0x00>..<0xFF>: decode joins a run of them into UTF-8."""
        ids = (self.token_to_id(f"<0x{b:02X}>") for b in range(256))
        return frozenset(int(i) for i in ids if i is not None)

    @functools.cached_property
    def added_tokens(self) -> dict:
        """{text: id} of the tokens matched whole in text (added tokens, special pieces): the
        markers a reply parser or grammar must treat as one token each."""
        return {}

    def describe(self) -> str:
        """One line for `info`: kind, size, BOS/EOS behaviour."""
        adds = [n for n, on in (("BOS", self.add_bos_token), ("EOS", self.add_eos_token)) if on]
        return (
            f"{self.kind} ({self.vocab_size} ids; adds {' and '.join(adds) or 'no BOS/EOS'}"
            + (f"; bos {self.bos_token!r}" if self.bos_token else "")
            + (f", eos {self.eos_token!r}" if self.eos_token else "")
            + ")"
        )


class HFTokenizer(Tokenizer):
    """A tokenizer.json through Hugging Face's `tokenizers`."""

    kind = TOKENIZER_JSON

    def __init__(self, path, tokenizer_config: dict | None = None, special_tokens_map: dict | None = None):
        try:
            import tokenizers
        except ImportError:  # pragma: no cover - a declared dependency
            raise ColibriError(
                "reading tokenizer.json needs the 'tokenizers' package: pip install tokenizers"
            ) from None
        self.path = str(path)
        try:
            if Path(path).stat().st_size > MAX_TEXT_FILE_BYTES:
                raise ColibriError(f"{path} is larger than {MAX_TEXT_FILE_BYTES >> 20} MB; refusing to parse it")
            self._tok = self._run(None, tokenizers.Tokenizer.from_file, self.path)
        except ColibriError:
            raise
        except Exception as e:  # tokenizers raises its own Exception type for a bad file
            raise ColibriError(f"{path}: not a valid tokenizer.json ({str(e).splitlines()[0][:200]})") from None
        self._run(None, self._set_up, tokenizer_config or {}, special_tokens_map)

    def _set_up(self, cfg: dict, special_tokens_map) -> None:
        """What runs the file's components (a probe encode among them): the rest of the load."""
        self._add_missing_added_tokens(cfg.get("added_tokens_decoder"))
        self.special_tokens_map = _special_tokens(cfg, special_tokens_map)
        if self._tok.post_processor is None:
            self.add_bos_token = bool(cfg.get("add_bos_token", False)) and self.bos_token_id is not None
            self.add_eos_token = bool(cfg.get("add_eos_token", False)) and self.eos_token_id is not None
            self._set_post_processor()
        else:
            probe = self._tok.encode("", add_special_tokens=True).ids
            self.add_bos_token = self.bos_token_id is not None and self.bos_token_id in probe[:1]
            self.add_eos_token = self.eos_token_id is not None and self.eos_token_id in probe[-1:]
        self._cleanup = bool(cfg.get("clean_up_tokenization_spaces", False)) and type(self._tok.model).__name__ != "BPE"
        added = self._tok.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values(), default=-1) + 1

    def _add_missing_added_tokens(self, decoder) -> None:
        if not isinstance(decoder, dict):
            return
        from tokenizers import AddedToken

        have = self._tok.get_vocab(with_added_tokens=True)
        new = []
        for _, t in sorted(decoder.items(), key=lambda kv: int(kv[0]) if str(kv[0]).isdigit() else 0):
            content = _token_content(t)
            if content is None or content in have:
                continue
            spec = t if isinstance(t, dict) else {}
            new.append(
                AddedToken(
                    content,
                    special=bool(spec.get("special", True)),
                    lstrip=bool(spec.get("lstrip", False)),
                    rstrip=bool(spec.get("rstrip", False)),
                    normalized=bool(spec.get("normalized", False)),
                    single_word=bool(spec.get("single_word", False)),
                )
            )
        if new:
            self._tok.add_tokens(new)

    def _set_post_processor(self) -> None:
        from tokenizers import processors

        bos, eos = self.bos_token, self.eos_token
        single = (f"{bos}:0 " if self.add_bos_token else "") + "$A:0" + (f" {eos}:0" if self.add_eos_token else "")
        pair = (
            single + (f" {bos}:1" if self.add_bos_token else "") + " $B:1" + (f" {eos}:1" if self.add_eos_token else "")
        )
        special = ([(bos, self.bos_token_id)] if self.add_bos_token else []) + (
            [(eos, self.eos_token_id)] if self.add_eos_token else []
        )
        self._tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)

    def _run(self, what, fn, *args, **kwargs):
        """fn(*args, **kwargs), a call into tokenizers, whose panic becomes a ColibriError naming the
        file: at load (what None) the file's fault, else the input's (`what`: "text", ...)."""
        try:
            return _rust_call(fn, *args, **kwargs)
        except BaseException as e:
            if not is_panic(e):
                raise
            if what is None:
                raise ColibriError(
                    f"{self.path}: not a usable tokenizer.json, the tokenizers library fails on it ({_panic_text(e)}; "
                    "a component names a token the file lacks, or is damaged)"
                ) from None
            raise ColibriError(f"the tokenizer ({self.path}) failed on this {what}: {_panic_text(e)}") from None

    def encode(self, text: str, add_special_tokens: bool = True) -> list:
        encoding = self._run("text", self._tok.encode, check_text(text), add_special_tokens=bool(add_special_tokens))
        return list(encoding.ids)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        known = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]
        text = self._run("sequence of ids", self._tok.decode, known, skip_special_tokens=bool(skip_special_tokens))
        if self._cleanup:
            for a, b in _CLEANUP:
                text = text.replace(a, b)
        return text

    def token_to_id(self, token: str):
        return self._tok.token_to_id(token)

    @functools.cached_property
    def added_tokens(self) -> dict:
        return {t.content: int(i) for i, t in self._tok.get_added_tokens_decoder().items() if t.content}


class SentencePieceTokenizer(Tokenizer):
    """A tokenizer.model through sentencepiece, with transformers' LlamaTokenizer semantics."""

    kind = TOKENIZER_MODEL

    def __init__(self, path, tokenizer_config: dict | None = None, special_tokens_map: dict | None = None):
        import sentencepiece

        self.path = str(path)
        cfg = tokenizer_config or {}
        self.sp = sentencepiece.SentencePieceProcessor()
        try:
            self.sp.Load(self.path)
        except (OSError, RuntimeError) as e:
            raise ColibriError(
                f"{self.path}: not a valid sentencepiece model ({str(e).splitlines()[0][:200]})"
            ) from None
        sp = self.sp
        n = sp.GetPieceSize()
        self.vocab_size = n
        self._pieces = [sp.IdToPiece(i) for i in range(n)]  # [vocab] piece strings
        self._byte = [sp.IsByte(i) for i in range(n)]  # [vocab] <0xNN> byte-fallback pieces
        special = {i for i in range(n) if sp.IsControl(i) or sp.IsUnknown(i)}
        self._piece_ids = {p: i for i, p in enumerate(self._pieces)}
        for _, t in (cfg.get("added_tokens_decoder") or {}).items():  # added tokens that are pieces
            content = _token_content(t)
            if content in self._piece_ids and (not isinstance(t, dict) or t.get("special", True)):
                special.add(self._piece_ids[content])
        self.special_ids = frozenset(special)
        names = {"bos_token": sp.bos_id(), "eos_token": sp.eos_id(), "unk_token": sp.unk_id(), "pad_token": sp.pad_id()}
        defaults = {k: self._pieces[i] for k, i in names.items() if 0 <= i < n}
        self.special_tokens_map = {**defaults, **_special_tokens(cfg, special_tokens_map)}
        self.add_bos_token = bool(cfg.get("add_bos_token", True)) and self.bos_token_id is not None
        self.add_eos_token = bool(cfg.get("add_eos_token", False)) and self.eos_token_id is not None
        # text is split on the special pieces' strings (longest first), as transformers matches added tokens
        strings = sorted({self._pieces[i] for i in special if self._pieces[i]}, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, strings)) + ")") if strings else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list:
        text = check_text(text)
        ids = []
        chunks = self._split.split(text) if self._split else [text]
        for k, chunk in enumerate(chunks):
            if k % 2:  # a special token written in the text
                ids.append(self._piece_ids[chunk])
            elif chunk:
                ids.extend(self.sp.EncodeAsIds(chunk))
        if add_special_tokens:
            ids = (
                ([self.bos_token_id] if self.add_bos_token else [])
                + ids
                + ([self.eos_token_id] if self.add_eos_token else [])
            )
        return ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        out = []
        run = bytearray()  # consecutive byte pieces, joined as UTF-8
        run_len = 0

        def flush():
            nonlocal run, run_len
            if run_len:
                try:
                    out.append(run.decode("utf-8"))
                except UnicodeDecodeError:
                    out.append("\ufffd" * run_len)
                run, run_len = bytearray(), 0

        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size or (skip_special_tokens and i in self.special_ids):
                continue
            if self._byte[i]:
                run.append(int(_BYTE_PIECE.fullmatch(self._pieces[i]).group(1), 16))
                run_len += 1
                continue
            flush()
            out.append(self._pieces[i].replace("\u2581", " "))
        flush()
        text = "".join(out)
        return text[1:] if text.startswith(" ") else text

    def token_to_id(self, token: str):
        return self._piece_ids.get(token)

    @functools.cached_property
    def added_tokens(self) -> dict:
        return {self._pieces[i]: i for i in sorted(self.special_ids) if self._pieces[i]}


def _special_tokens(cfg: dict, special_tokens_map: dict | None) -> dict:
    """{"bos_token": str, ...} from tokenizer_config, falling back to special_tokens_map.json."""
    out = {}
    for source in (special_tokens_map or {}, cfg):
        for name in SPECIAL_TOKEN_NAMES:
            if name in source:
                content = _token_content(source[name])
                if content is None:
                    out.pop(name, None)
                else:
                    out[name] = content
    return out


def load_tokenizer(root: Path, files, vocab_size: int | None = None) -> Tokenizer | None:
    """The tokenizer of a model directory from the files its table lists, or None when it has none.

    `files`: the names in the directory's file table; `vocab_size`: the model's, which the
    tokenizer's ids must fit."""
    root = Path(root)
    cfg = (
        read_json(root / TOKENIZER_CONFIG, "tokenizer_config.json", MAX_TEXT_FILE_BYTES)
        if TOKENIZER_CONFIG in files
        else {}
    )
    if not isinstance(cfg, dict):
        raise ColibriError(f"{root / TOKENIZER_CONFIG} must hold a JSON object")
    stm = (
        read_json(root / SPECIAL_TOKENS_MAP, "special_tokens_map.json", MAX_TEXT_FILE_BYTES)
        if SPECIAL_TOKENS_MAP in files
        else {}
    )
    if not isinstance(stm, dict):
        raise ColibriError(f"{root / SPECIAL_TOKENS_MAP} must hold a JSON object")
    if TOKENIZER_JSON in files:
        tok = HFTokenizer(root / TOKENIZER_JSON, cfg, stm)
    elif TOKENIZER_MODEL in files:
        tok = SentencePieceTokenizer(root / TOKENIZER_MODEL, cfg, stm)
    else:
        return None
    if vocab_size is not None and tok.vocab_size > vocab_size:
        raise ColibriError(
            f"{tok.path}: the tokenizer has {tok.vocab_size} ids but the model's vocab_size is "
            f"{vocab_size} (a tokenizer of another model?)"
        )
    return tok
