"""A GGUF's tokenizer metadata -> the text files of a Colibri model directory.

Design
------
A GGUF carries no tokenizer.json: it carries the vocabulary as llama.cpp reads it (keys
`tokenizer.ggml.*`, llama.cpp's gguf-py `Keys.Tokenizer`). `tokenizer_files` writes the
tokenizer.json that makes the `tokenizers` library cut text the way llama.cpp's
`llama-vocab.cpp` does, so a model imported from a GGUF gets llama.cpp's token ids, and with
them the original Hugging Face tokenizer's (llama.cpp's references are made with it):

  tokenizer.ggml.model "llama"   sentencepiece-style BPE. Merges are not stored: they follow from
                                 the scores (a pair merges when the joined piece is in the
                                 vocabulary; the higher the joined piece's score, the earlier, as
                                 llama.cpp's llm_tokenizer_spm does and transformers'
                                 generate_merges orders them). Spaces become "▁", each chunk of
                                 text between added tokens gets a "▁" in front
                                 (tokenizer.ggml.add_space_prefix, default on), a character
                                 missing from the vocabulary is spelled in byte pieces <0xNN>.
                                 Decoding undoes it and drops that one leading space.
  tokenizer.ggml.model "gpt2"    byte-level BPE with the file's merges; the text is first split
                                 by the regexes llama.cpp uses for tokenizer.ggml.pre
                                 (PRE_TOKENIZERS, written as the original tokenizer.json spells
                                 them), then each piece's UTF-8 bytes are spelled in GPT-2's byte
                                 alphabet. A file without tokenizer.ggml.pre gets "default", as
                                 in llama.cpp.
  tokenizer.ggml.model "gemma4"  BPE over raw UTF-8 with the file's merges: spaces become "▁",
                                 byte pieces <0xNN> for what the merges do not reach, no split
                                 (Gemma 4's tokenizer.json; llama.cpp cuts at newline runs first,
                                 which gives the same ids on every string tested).
  others ("bert", "t5", "rwkv", ...) are refused with a ColibriError.

Every token of the file keeps its id: the model's vocabulary is tokens[i] -> i, so ids never
shift. Token types (tokenizer.ggml.token_type) decide what else a token is:
  3 control, 2 unknown   an added token with special: true (matched whole in the text, dropped
                         by decode(skip_special_tokens=True)), as llama.cpp's special tokens;
  4 user-defined         an added token with special: false (matched whole, kept by decode);
  1 normal, 5 unused, 6 byte   vocabulary only.
The "[PAD<id>]" placeholders convert_hf_to_gguf.py writes to round the vocabulary up to the
embedding size are vocabulary only too, whatever their type: they are not tokens of the real
tokenizer, and text spelling "[PAD151646]" stays text.

BOS/EOS are added by the post-processor exactly when llama.cpp adds them: add_bos_token /
add_eos_token when the file says, else llama.cpp's default for the vocabulary ("llama" adds BOS;
"gpt2" does not, except the pre-tokenizers llama.cpp turns it on for, e.g. llama-bpe; "gemma4"
always adds BOS, as llama.cpp forces and Gemma 4's own tokenizer.json does). tokenizer_config.json
names the special tokens the file names (bos/eos/unk/pad/sep/cls/mask), says the same add flags
and tokenizer_class PreTrainedTokenizerFast (transformers then uses tokenizer.json as it is).

Where llama.cpp and the original Hugging Face tokenizer differ:
  - Unicode normalization: Qwen2's and GPT-NeoX's tokenizer.json put NFC first, llama.cpp has
    none; this follows llama.cpp, so decomposed text ("e" + U+0301) keeps its code points (the
    qwen35 references, made with the real Qwen3.5 tokenizer, agree with llama.cpp there);
  - llama.cpp rewrote some regexes for std::regex ("'[sS]|'[tT]|..." for "(?i:'s|'t|...)"); the
    original is kept: over every code point the two differ only on an apostrophe followed by
    U+017F LATIN SMALL LETTER LONG S, which case-folds to "s".
Not reproduced, as the GGUF does not record them: llama.cpp's per-model token attributes keyed on
general.name or on a token's text (the whitespace it strips after Phi-3's chat tokens, to match Phi-3's
tokenizer.json; the end-of-turn and fill-in-the-middle tokens it turns into control
tokens by name).
"""

from __future__ import annotations

import bisect
import json
import operator
import re

from .config import shown
from .errors import ColibriError

KEY = "tokenizer.ggml."
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # sentencepiece's "▁"
PAD_PLACEHOLDER = re.compile(r"\[PAD(\d+)\]")
# tokenizer_config.json name -> GGUF key (llama.cpp spells "seperator")
SPECIAL_TOKEN_KEYS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
    "sep_token": "seperator_token_id",
    "cls_token": "cls_token_id",
    "mask_token": "mask_token_id",
}
SPM_DEFAULT_IDS = {"bos_token": 1, "eos_token": 2, "unk_token": 0}  # llama.cpp's, for "llama" files
SUPPORTED_MODELS = ("llama", "gpt2", "gemma4")

# ---------------------------------------------------------------------------------------------
# Pre-tokenizers of byte-level BPE (tokenizer.ggml.pre): the regexes llama.cpp applies one after
# the other, each splitting every piece and keeping what it does not match as pieces of their
# own (tokenizers' Split "Isolated"), then the byte alphabet.
# ---------------------------------------------------------------------------------------------
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_KIMI_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_KIMI_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
KIMI_K2 = (
    r"[\p{Han}]+"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_KIMI_UPPER}*{_KIMI_LOWER}+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_KIMI_UPPER}+{_KIMI_LOWER}*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")
DEEPSEEK_LLM = (
    r"[\r\n]",
    # escaped: NFC would fold some of these letters (U+212A KELVIN SIGN, U+1FBE ...) into others
    (
        "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
        "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
        "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
        "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
        "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-"
        "\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
        "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
        "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
        "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
        "\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
        "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+"
    ),
    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
    r"\s+$",
    r"[一-龥ࠀ-一가-퟿]+",
    r"\p{N}+",
)
DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}")
DEEPSEEK_V3 = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
)
FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]")
STARCODER = (r"\p{N}", GPT2)


class PreTokenizer:
    """What llama.cpp does for one family of tokenizer.ggml.pre names."""

    def __init__(self, splits, ignore_merges: bool = False, add_bos: bool = False):
        self.splits = tuple(splits)  # regexes, applied in order
        self.ignore_merges = ignore_merges  # a piece that is a whole token is that token (Llama 3)
        self.add_bos = add_bos  # llama.cpp's add_bos default for these files


def _family(names, splits, **flags) -> dict:
    spec = PreTokenizer(splits, **flags)
    return {name: spec for name in names}


# names as llama.cpp's llama_vocab::impl::load spells them, with the settings it gives them
PRE_TOKENIZERS = {
    **_family(["default"], DEFAULT),
    **_family(
        [
            "gpt-2",
            "phi-2",
            "mpt",
            "olmo",
            "jais",
            "exaone4",
            "trillion",
            "gigachat",
            "a.x-4.0",
            "mellum",
            "granite-docling",
        ],
        (GPT2,),
    ),
    **_family(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"],
        (LLAMA3,),
        ignore_merges=True,
        add_bos=True,
    ),
    **_family(["dbrx", "smaug-bpe", "chatglm-bpe"], (LLAMA3,)),
    **_family(["glm4", "glm5"], (LLAMA3,), ignore_merges=True),
    **_family(
        ["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open"], (QWEN2,)
    ),
    **_family(["qwen35"], (QWEN35,)),
    **_family(["deepseek-llm"], DEEPSEEK_LLM),
    **_family(["deepseek-coder"], DEEPSEEK_CODER),
    **_family(["deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"], DEEPSEEK_V3),
    **_family(["falcon"], FALCON),
    **_family(
        ["starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"], STARCODER
    ),
    **_family(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], (GPT4O,)),
    **_family(["tekken"], (TEKKEN,), ignore_merges=True, add_bos=True),
    **_family(["kimi-k2"], (KIMI_K2,)),
}


# ---------------------------------------------------------------------------------------------
def tokenizer_files(meta: dict, source: str) -> dict:
    """The text files of a model directory from a GGUF's tokenizer metadata.

    meta: GGUF key -> Python value for the keys starting with "tokenizer." (and
    "general.architecture"), arrays as lists (tokens: list[str], scores: list[float],
    token_type: list[int], merges: list[str]). source: the GGUF path, for messages.
    Returns {file name: contents}: "tokenizer.json" (the tokenizers library's JSON),
    "tokenizer_config.json" (bos_token, eos_token, unk_token, pad_token as strings where the
    GGUF names them, add_bos_token, add_eos_token, model_max_length absent), and
    "chat_template.jinja" when tokenizer.chat_template is present ("chat_template.json" with
    every template by name when the file also has named ones, tokenizer.chat_template.<name>)."""
    vocab = _Vocab(meta, str(source))
    files = {
        "tokenizer.json": json.dumps(vocab.tokenizer_json(), ensure_ascii=False, separators=(",", ":")),
        "tokenizer_config.json": json.dumps(vocab.tokenizer_config(), ensure_ascii=False, indent=2, sort_keys=True)
        + "\n",
    }
    files.update(_chat_template_files(meta, str(source)))
    return files


class _Vocab:
    """The metadata of one file, checked: tokens, types, special ids, BOS/EOS behaviour."""

    def __init__(self, meta: dict, source: str):
        self.meta, self.source = meta, source
        self.model = self._string(KEY + "model", required=True)
        if self.model not in SUPPORTED_MODELS:
            raise ColibriError(
                f"{source}: tokenizer.ggml.model {shown(self.model)} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODELS)}); this file's text cannot be tokenized"
            )
        self.tokens = self._tokens()  # [n] piece strings
        n = len(self.tokens)
        types = self._list(KEY + "token_type", n, int) if KEY + "token_type" in meta else [TOKEN_NORMAL] * n
        self.types = [
            TOKEN_NORMAL if _is_placeholder(t, i) else ty for i, (t, ty) in enumerate(zip(self.tokens, types))
        ]
        self.scores = self._list(KEY + "scores", n, float) if self.model == "llama" else None
        self.pre = self._pre_tokenizer() if self.model == "gpt2" else None
        self.ids = self._special_ids()  # {"bos_token": id, ...} where named
        self.add_bos, self.add_eos = self._add_flags()

    # ---- reading the metadata ----------------------------------------------------------------
    def _missing(self, key: str):
        raise ColibriError(
            f"{self.source}: the tokenizer metadata has no {key} "
            f"(needed for tokenizer.ggml.model {self.model!r}); the file is incomplete"
        )

    def _string(self, key: str, required: bool = False):
        value = self.meta.get(key)
        if value is None:
            if required:
                raise ColibriError(
                    f"{self.source}: the tokenizer metadata has no {key}; not a vocabulary Colibri can read"
                )
            return None
        if not isinstance(value, str):
            raise ColibriError(f"{self.source}: {key} must be a string, got {shown(value)}")
        return value

    def _list(self, key: str, n: int | None, kind):
        value = self.meta.get(key)
        if value is None:
            self._missing(key)
        if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
            raise ColibriError(f"{self.source}: {key} must be an array, got {shown(value)}")
        if n is not None and len(value) != n:
            raise ColibriError(
                f"{self.source}: {key} has {len(value)} entries but tokenizer.ggml.tokens has {n}; "
                f"the file is inconsistent"
            )
        out = []
        for i, v in enumerate(value):
            try:
                if kind is str:
                    if not isinstance(v, str):
                        raise TypeError
                    out.append(v)
                elif kind is int:
                    if isinstance(v, bool):
                        raise TypeError
                    out.append(operator.index(v))
                else:
                    if isinstance(v, (str, bytes, bool)):
                        raise TypeError
                    out.append(float(v))
            except (TypeError, ValueError):
                raise ColibriError(f"{self.source}: {key}[{i}] must be a {kind.__name__}, got {shown(v)}") from None
        return out

    def _tokens(self) -> list:
        tokens = self._list(KEY + "tokens", None, str)
        if not tokens:
            raise ColibriError(f"{self.source}: tokenizer.ggml.tokens is empty")
        seen = {}
        for i, t in enumerate(tokens):
            if t == "":
                t = tokens[i] = f"[EMPTY_{i}]"  # as llama.cpp names an empty piece
            if t in seen:
                raise ColibriError(
                    f"{self.source}: tokenizer.ggml.tokens has {shown(t)} twice (ids {seen[t]} and {i}); "
                    f"llama.cpp refuses such a file too"
                )
            seen[t] = i
        return tokens

    def _pre_tokenizer(self) -> PreTokenizer:
        name = self._string(KEY + "pre")
        if name is None:
            name = "default"  # llama.cpp: "missing pre-tokenizer type"
        if name not in PRE_TOKENIZERS:
            raise ColibriError(
                f"{self.source}: tokenizer.ggml.pre {shown(name)} is not a pre-tokenizer Colibri knows "
                f"(known: {', '.join(sorted(PRE_TOKENIZERS))})"
            )
        return PRE_TOKENIZERS[name]

    def _id(self, key: str):
        value = self.meta.get(key)
        if value is None:
            return None
        try:
            if isinstance(value, bool):
                raise TypeError
            value = operator.index(value)
        except TypeError:
            raise ColibriError(f"{self.source}: {key} must be an integer, got {shown(value)}") from None
        if not 0 <= value < len(self.tokens):
            raise ColibriError(f"{self.source}: {key} is {value}, outside the vocabulary of {len(self.tokens)} tokens")
        return int(value)

    def _flag(self, key: str, default: bool) -> bool:
        value = self.meta.get(key)
        if value is None:
            return default
        if value not in (True, False):  # bool, or 0/1
            raise ColibriError(f"{self.source}: {key} must be true or false, got {shown(value)}")
        return bool(value)

    def _special_ids(self) -> dict:
        ids = {name: self._id(KEY + key) for name, key in SPECIAL_TOKEN_KEYS.items()}
        if self.model == "llama":
            # no unknown_token_id: the token typed unknown is the one sentencepiece emits (a
            # fixture's 128-piece model has <unk> at 3); llama.cpp's default 0 only without one
            typed = [i for i, ty in enumerate(self.types) if ty == TOKEN_UNKNOWN]
            if ids["unk_token"] is None and typed:
                ids["unk_token"] = typed[0]
            for name, default in SPM_DEFAULT_IDS.items():
                if ids[name] is None and default < len(self.tokens):
                    ids[name] = default
        return {name: i for name, i in ids.items() if i is not None}

    def _add_flags(self) -> tuple:
        default_bos = self.model in ("llama", "gemma4") or (self.pre is not None and self.pre.add_bos)
        add_bos = self._flag(KEY + "add_bos_token", default_bos)
        if self.model == "gemma4":
            add_bos = True  # llama.cpp overrides a false flag for Gemma 4
        add_eos = self._flag(KEY + "add_eos_token", False)
        for on, name, flag in ((add_bos, "bos_token", "add_bos_token"), (add_eos, "eos_token", "add_eos_token")):
            if on and name not in self.ids:
                why = f"{KEY}{flag} is true" if KEY + flag in self.meta else f"llama.cpp's default without {KEY}{flag}"
                raise ColibriError(
                    f"{self.source}: the tokenizer adds {name[:3].upper()} ({why}) but the metadata "
                    f"has no {KEY}{SPECIAL_TOKEN_KEYS[name]}"
                )
        return add_bos, add_eos

    def _merges(self) -> list:
        """[[left, right], ...] best first: the file's (split at the first space after the first
        character, as llama.cpp does), or for "llama" the ones the scores imply."""
        if self.model == "llama":
            return _merges_from_scores(self.tokens, self.scores)
        merges = self._list(KEY + "merges", None, str)
        out = []
        for i, m in enumerate(merges):
            cut = m.find(" ", 1)
            if cut < 0:
                raise ColibriError(
                    f"{self.source}: tokenizer.ggml.merges[{i}] is {shown(m)}, not two pieces joined by a space"
                )
            out.append([m[:cut], m[cut + 1 :]])
        return out

    # ---- the files ---------------------------------------------------------------------------
    def tokenizer_json(self) -> dict:
        byte_level = self.model == "gpt2"
        unk = self.tokens[self.ids["unk_token"]] if "unk_token" in self.ids and not byte_level else None
        model = {
            "type": "BPE",
            "dropout": None,
            "unk_token": unk,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": not byte_level,
            "byte_fallback": not byte_level,
            "ignore_merges": bool(byte_level and self.pre.ignore_merges),
            "vocab": {t: i for i, t in enumerate(self.tokens)},
            "merges": self._merges(),
        }
        if byte_level:
            normalizer = None
            pre_tokenizer = {
                "type": "Sequence",
                "pretokenizers": [
                    *(
                        {"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": False}
                        for r in self.pre.splits
                    ),
                    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
                ],
            }
            decoder = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
        else:
            # "llama": llama.cpp puts a space before every chunk of text (add_space_prefix);
            # "gemma4" is BPE, where llama.cpp never does
            prefix = self.model == "llama" and self._flag(KEY + "add_space_prefix", True)
            normalizer = {
                "type": "Sequence",
                "normalizers": [
                    *([{"type": "Prepend", "prepend": SPACE}] if prefix else []),
                    {"type": "Replace", "pattern": {"String": " "}, "content": SPACE},
                ],
            }
            pre_tokenizer = None
            decoder = {
                "type": "Sequence",
                "decoders": [
                    {"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
                    {"type": "ByteFallback"},
                    {"type": "Fuse"},
                    *([{"type": "Strip", "content": " ", "start": 1, "stop": 0}] if prefix else []),
                ],
            }
        return {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": self._added_tokens(),
            "normalizer": normalizer,
            "pre_tokenizer": pre_tokenizer,
            "post_processor": self._post_processor(),
            "decoder": decoder,
            "model": model,
        }

    def _added_tokens(self) -> list:
        special = (TOKEN_CONTROL, TOKEN_UNKNOWN)
        return [
            {
                "id": i,
                "content": t,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": ty in special,
            }
            for i, (t, ty) in enumerate(zip(self.tokens, self.types))
            if ty in special or ty == TOKEN_USER_DEFINED
        ]

    def _post_processor(self) -> dict:
        """TemplateProcessing: "[bos] $A [eos]" with whichever the file adds (transformers' pair form)."""

        def piece(name, type_id):
            return [{"SpecialToken": {"id": self.tokens[self.ids[name]], "type_id": type_id}}]

        def part(seq, type_id):
            return (
                (piece("bos_token", type_id) if self.add_bos else [])
                + [{"Sequence": {"id": seq, "type_id": type_id}}]
                + (piece("eos_token", type_id) if self.add_eos else [])
            )

        specials = {}
        for on, name in ((self.add_bos, "bos_token"), (self.add_eos, "eos_token")):
            if on:
                t = self.tokens[self.ids[name]]
                specials[t] = {"id": t, "ids": [self.ids[name]], "tokens": [t]}
        return {
            "type": "TemplateProcessing",
            "single": part("A", 0),
            "pair": part("A", 0) + part("B", 1),
            "special_tokens": specials,
        }

    def tokenizer_config(self) -> dict:
        cfg = {name: self.tokens[i] for name, i in self.ids.items()}
        cfg.update(
            {
                "add_bos_token": self.add_bos,
                "add_eos_token": self.add_eos,
                "clean_up_tokenization_spaces": False,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
        return cfg


def _is_placeholder(token: str, i: int) -> bool:
    m = PAD_PLACEHOLDER.fullmatch(token)
    return m is not None and int(m.group(1)) == i


def _merges_from_scores(tokens: list, scores: list) -> list:
    """The merges a sentencepiece BPE vocabulary implies: every split of a piece into two pieces of
    the vocabulary, best first by the joined piece's score, then the longer left part, then the
    longer right part, then vocabulary order (transformers' generate_merges)."""
    ids = {t: i for i, t in enumerate(tokens)}
    # a split's two parts are pieces of the vocabulary, so only the lengths pieces have are tried:
    # a piece of a million characters costs as many tries as there are lengths, not a million slices
    lengths = sorted({len(t) for t in tokens} - {0})
    found = []  # (score, len left, len right, order, left, right)
    for token, score in zip(tokens, scores):
        local = [
            (ids[token[:k]], ids[token[k:]], token[:k], token[k:])
            for k in lengths[: bisect.bisect_left(lengths, len(token))]
            if token[:k] in ids and token[k:] in ids
        ]
        for _, _, left, right in sorted(local):
            found.append((-score, -len(left), -len(right), len(found), left, right))
    found.sort()
    return [[left, right] for *_, left, right in found]


def _chat_template_files(meta: dict, source: str) -> dict:
    prefix = "tokenizer.chat_template."
    named = {k[len(prefix) :]: v for k, v in sorted(meta.items()) if k.startswith(prefix)}
    default = meta.get("tokenizer.chat_template")
    for key, value in [("tokenizer.chat_template", default), *((prefix + n, v) for n, v in named.items())]:
        if value is not None and not isinstance(value, str):
            raise ColibriError(f"{source}: {key} must be a string, got {shown(value)}")
    if not named:
        return {} if default is None else {"chat_template.jinja": default}
    templates = ([{"name": "default", "template": default}] if default is not None else []) + [
        {"name": n, "template": t} for n, t in named.items()
    ]
    return {"chat_template.json": json.dumps({"chat_template": templates}, ensure_ascii=False, indent=2) + "\n"}
