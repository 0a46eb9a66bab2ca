#!/usr/bin/env python3
"""Make the text-side test fixtures: real tokenizers + reference tokenizations + chat renders.

Usage (from the repo root)::

    python tools/make_text_fixtures.py --sdist /tmp/lsdist/llama_cpp_python-0.3.36 \\
        --out tests/fixtures/text [--only qwen2,gemma-4] [--no-chat] [--no-optional]

Needs: transformers (5.x), tokenizers, gguf, sentencepiece, protobuf, jinja2 and torch (CPU;
transformers' GGUF reader imports it). Colibri's tests read the output WITHOUT any of these
except ``tokenizers`` / ``sentencepiece`` / ``jinja2``.

Design
------
Inputs are the llama.cpp test vocabularies shipped in the llama-cpp-python sdist
(``vendor/llama.cpp/models/ggml-vocab-<name>.gguf``: a GGUF holding only tokenizer metadata) and
their reference tokenizations (``.gguf.inp`` / ``.gguf.out``).  Format, as read by llama.cpp's
``tests/test-tokenizer-0.cpp``: the .inp file is the test strings joined by
``"\\n__ggml_vocab_test__\\n"`` (a trailing separator ends the list; older files have one, newer
ones do not); the .out file has one line of space-separated ids per string.  The ids were written
by ``convert_hf_to_gguf_update.py`` with ``AutoTokenizer(<the real HF repo>).encode(text,
add_special_tokens=False)`` and llama.cpp's test checks its own tokenizer reproduces them with
``add_special=false, parse_special=false``: no BOS/EOS, special-token text not parsed.  So they
are "HF on the real repo" == "llama.cpp" references, and ``cases.json`` stores them as
``llama_cpp``.

Per vocabulary:

1. Build a transformers tokenizer from the GGUF.  Mostly transformers' own GGUF tokenizer loader
   (``transformers.integrations.gguf.get_gguf_tokenizer`` + ``convert_gguf_tokenizer``, the code
   behind ``AutoTokenizer.from_pretrained(folder, gguf_file=...)``), with the llama.cpp padding
   pieces ``[PAD<n>]`` (added by llama.cpp to round the vocabulary up to the embedding size; not
   part of the real tokenizers) dropped.  Where that loader cannot or does not reproduce the real
   tokenizer the vocabulary is built with ``tokenizers`` from the GGUF's tokens/merges/types:
     * llama-spm: a real sentencepiece ``tokenizer.model`` (ModelProto from the GGUF's pieces,
       scores and types; BPE, byte_fallback, identity normalizer, add_dummy_prefix,
       escape_whitespaces, no remove_extra_whitespaces, unk 0 / bos 1 / eos 2 -- the
       Llama-2/Mixtral settings) is written and checked with ``sentencepiece`` against every .out
       line; the HF tokenizer is the Hub's "legacy" Llama/Mixtral tokenizer.json pipeline
       (normalizer Prepend("▁")+Replace(" ","▁"), no pre-tokenizer, BPE byte_fallback with merges
       ordered by piece score, decoder Replace/ByteFallback/Fuse/Strip) loaded as
       ``TokenizersBackend`` so transformers keeps that pipeline.  (transformers 5's
       ``LlamaTokenizer`` class rebuilds a Metaspace pipeline instead that eats a user-supplied
       leading space; its ids are recorded separately as ``ids_llama_class``.)
     * gpt-neox: transformers' GGUF loader refuses architecture ``gptneox``; built as
       ``GPTNeoXTokenizer`` (NFC, byte-level BPE) with the 23 multi-space tokens 50254..50276 as
       (non-special, normalized) added tokens, as in EleutherAI/gpt-neox-20b.  The llama.cpp
       ``ggml-vocab-mpt`` vocabulary is token-for-token identical (mosaicml/mpt-7b uses the
       gpt-neox-20b tokenizer), so its .inp/.out serve as gpt-neox's reference.
     * qwen3: not a llama.cpp vocabulary; the qwen2 BPE (identical for Qwen1.5..Qwen3) plus Qwen3's
       added tokens 151646..151668 and Qwen3's tokenizer_config values, so the Qwen3 chat
       template's ``<think>`` etc. are single tokens as in the real model.
     * llama-bpe: ``ignore_merges`` (Llama-3's tokenizer.json has it; without it "Cửa Việt"
       differs from the reference) and BOS on.
   tokenizer_config values that the GGUF does not carry are set as the real model's
   (``CONFIG`` below; e.g. Gemma 4 adds BOS, Qwen adds none and has no bos_token).
2. Save with ``save_pretrained``, reload with ``AutoTokenizer.from_pretrained(dir)``, save and
   reload again; require a fixed point (same tokenizer.json, same results).  The reload matters:
   transformers 5 rebuilds classes with their own ``__init__`` (Qwen2Tokenizer, GemmaTokenizer,
   GPTNeoXTokenizer...) from the file's vocab/merges with the class pipeline, as it does for a real
   Hub repo -- e.g. Qwen2Tokenizer adds the NFC normalizer the GGUF loader leaves out -- so the
   second save is what a real repo behaves like.
3. Write ``vocab/<name>/tokenizer.json.xz`` (lzma, preset 9), ``tokenizer_config.json`` (load-time
   keys ``is_local`` / ``local_files_only`` / ``name_or_path`` dropped, no chat template: the
   chat fixtures carry their own), ``special_tokens_map.json`` if transformers wrote one,
   ``tokenizer.model`` (llama-spm), then reload the tokenizer FROM THOSE FILES and compute
   ``cases.json`` and ``meta.json`` with it.
4. ``cases.json``: every .inp string (with ``llama_cpp`` = the .out ids), then the generated
   strings (``llama_cpp`` null): a fixed hand-written list (whitespace, scripts, combining marks,
   emoji/ZWJ/flags, code, digits, case), a fixed-seed random mix of those fragments, and per
   vocabulary its own special-token strings alone / glued to text / spaced / doubled.
5. Chat fixtures: ``chat/<template>.jinja`` (copied from llama.cpp's models/templates, or written
   out here for Mixtral-8x7B-Instruct-v0.1) and ``chat/<template>.json`` rendered with
   ``apply_chat_template`` (text, and ids with tokenize=True, return_dict=False; transformers
   tokenizes the render with add_special_tokens=False, checked).  A template that raises records
   ``{"error": message}``.

Everything is deterministic: fixed lists, ``random.Random(SEED)``, sorted JSON keys, lzma output
of a byte-identical tokenizer.json.  ``tests/fixtures/text/README.md`` is written too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import lzma
import os
import random
import re
import shutil
import sys
import tempfile
import zlib
from pathlib import Path

SEP = "\n__ggml_vocab_test__\n"
SEED = 20240611
N_RANDOM = 160  # random fragment mixes per vocabulary (same strings for all vocabularies)
PAD_RE = re.compile(r"^\[PAD\d+\]$")

# --------------------------------------------------------------------------------------------
# Vocabularies
# --------------------------------------------------------------------------------------------
# gguf: llama.cpp vocabulary file stem; ref: whose .inp/.out are the reference; build: builder;
# optional: skipped with --no-optional.
VOCABS = {
    "qwen2": dict(gguf="qwen2", ref="qwen2", build="hf_gguf"),
    "qwen3": dict(gguf="qwen2", ref="qwen2", build="qwen3"),
    "gemma-4": dict(gguf="gemma-4", ref="gemma-4", build="hf_gguf"),
    "llama-spm": dict(gguf="llama-spm", ref="llama-spm", build="spm"),
    "gpt-neox": dict(gguf="gpt-neox", ref="mpt", build="neox"),
    "qwen35": dict(gguf="qwen35", ref="qwen35", build="hf_gguf", optional=True, cls="Qwen3_5Tokenizer"),
    "llama-bpe": dict(gguf="llama-bpe", ref="llama-bpe", build="hf_gguf", optional=True),
    "phi-3": dict(gguf="phi-3", ref="phi-3", build="hf_gguf", optional=True),
    "gpt-2": dict(gguf="gpt-2", ref="gpt-2", build="hf_gguf", optional=True),
}

# tokenizer_config.json values of the real models that the GGUF does not say (or says otherwise).
# Keys set to None are written as null.
CONFIG = {
    # Qwen/Qwen1.5-7B (the repo llama.cpp's qwen2 vocabulary comes from)
    "qwen2": {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "add_prefix_space": False,
        "model_max_length": 32768,
    },
    # Qwen3 (e.g. Qwen3-30B-A3B / Qwen3-0.6B tokenizer_config.json)
    "qwen3": {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "add_prefix_space": False,
        "model_max_length": 131072,
    },
    "qwen35": {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "add_prefix_space": False,
    },
    # google/gemma-4-*: tokenizer.json's post-processor is "<bos> $A" (transformers' GGUF loader
    # deliberately sets add_bos_token False for gemma4; the released tokenizer adds BOS).
    "gemma-4": {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "mask_token": "<mask>",
        "clean_up_tokenization_spaces": False,
    },
    # meta-llama/Llama-2-7b-hf / mistralai/Mixtral-8x7B-Instruct-v0.1
    "llama-spm": {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": None,
        "legacy": True,
        "clean_up_tokenization_spaces": False,
    },
    # EleutherAI/gpt-neox-20b (OLMoE's family); pad as OLMoE
    "gpt-neox": {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|padding|>",
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
    },
    # meta-llama/Meta-Llama-3-8B: BOS via the post-processor, clean_up_tokenization_spaces true
    "llama-bpe": {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>",
        "clean_up_tokenization_spaces": True,
    },
    # microsoft/Phi-3-mini-4k-instruct
    "phi-3": {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": "<s>",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<unk>",
        "legacy": False,
        "clean_up_tokenization_spaces": False,
    },
    # openai-community/gpt2
    "gpt-2": {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "add_prefix_space": False,
        "model_max_length": 1024,
    },
}

# The chat end-of-turn token of each vocabulary's chat models (for meta.json).
END_OF_TURN = {
    "qwen2": "<|im_end|>",
    "qwen3": "<|im_end|>",
    "qwen35": "<|im_end|>",
    "gemma-4": "<turn|>",
    "llama-spm": "</s>",
    "gpt-neox": "<|endoftext|>",
    "llama-bpe": "<|eot_id|>",
    "phi-3": "<|end|>",
    "gpt-2": "<|endoftext|>",
}

# Qwen3's added tokens (tokenizer_config.json added_tokens_decoder): (id, content, special)
QWEN3_ADDED = [
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False),
    (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
    (151665, "<tool_response>", False),
    (151666, "</tool_response>", False),
    (151667, "<think>", False),
    (151668, "</think>", False),
]

# Strings tried as "special tokens written in the text"; those that are an added token (special
# or not) of the vocabulary are used, plus a few that are plain text there ([INST] in Llama-2).
SPECIAL_CANDIDATES = [
    "<s>",
    "</s>",
    "<unk>",
    "<pad>",
    "<bos>",
    "<eos>",
    "<mask>",
    "[INST]",
    "[/INST]",
    "<|endoftext|>",
    "<|padding|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|vision_pad|>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<|turn>",
    "<turn|>",
    "<|think|>",
    "<|channel>",
    "<channel|>",
    "<|tool_call>",
    '<|"|>',
    "<|image|>",
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|user|>",
    "<|assistant|>",
    "<|system|>",
    "<|end|>",
]
ALWAYS_TEXT = ["[INST]", "[/INST]", "<s>", "</s>"]  # tried in every vocabulary (text if not tokens)

# --------------------------------------------------------------------------------------------
# Generated strings
# --------------------------------------------------------------------------------------------
FIXED_TEXTS = [
    # empty / whitespace
    "",
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\r\n",
    "\r",
    "\n\n",
    " \n",
    "\n ",
    "\t\t",
    " \t \n",
    "\r\n\r\n",
    "    ",
    "        ",
    "                        ",
    "\u00a0",
    "\u3000",
    "\u200b",
    "\u2028",
    "\u2003x\u2003",
    # leading / trailing / inner whitespace
    "Hello",
    " Hello",
    "Hello ",
    "  Hello  ",
    "\tHello",
    "Hello\n",
    "\nHello",
    "Hello\r\nWorld",
    "Hello\n\nWorld",
    "Hello  World",
    "Hello   World",
    "Hello\tWorld",
    "a \n b",
    "x\r\ny\rz",
    "trailing spaces   ",
    "   leading spaces",
    " \t mixed \t ",
    "line1\nline2\nline3\n",
    "ends with newline\n\n\n",
    "Hello world",
    "hello world!",
    "Hello, world! How are you?",
    # scripts
    "我想在apple工作1314151天～",
    "中华人民共和国",
    "你好，世界！这是一个测试。",
    "繁體中文測試",
    "こんにちは世界",
    "カタカナとひらがなと漢字",
    "東京タワーは333メートルです。",
    "안녕하세요 세계",
    "한국어 텍스트입니다.",
    "مرحبا بالعالم",
    "اللغة العربية جميلة جدا",
    "שלום עולם",
    "नमस्ते दुनिया",
    "हिन्दी में लिखा गया वाक्य।",
    "สวัสดีชาวโลก",
    "ภาษาไทยไม่มีช่องว่างระหว่างคำ",
    "Привет, мир!",
    "Съешь же ещё этих мягких французских булок",
    "нещо на Български",
    "Ελληνικά: Γειά σου Κόσμε",
    "Tiếng Việt có dấu",
    "Cửa Việt",
    "Ünïcödé àccénts çà và",
    "Straße, Äpfel, Öl, Übermut",
    "Zażółć gęślą jaźń",
    "ქართული ენა",
    "Հայերեն",
    "தமிழ் மொழி",
    "বাংলা ভাষা",
    "ಕನ್ನಡ",
    "ગુજરાતી",
    "ਪੰਜਾਬੀ",
    "ລາວ",
    "မြန်မာ",
    "ខ្មែរ",
    "አማርኛ",
    "ᚠᚢᚦᚨᚱᚲ",
    "𠀀𠀁𠀂 (CJK Ext B)",
    "\ue000\uf8ff (private use)",
    "\ufffd replacement",
    "ﬁ ligature ﬀ",
    "Ⅻ ½ ² ³ ™ ©",
    "ｆｕｌｌｗｉｄｔｈ　ＡＢＣ",
    # combining characters / normalization
    "e\u0301",
    "cafe\u0301",
    "café",
    "a\u0308o\u0308u\u0308",
    "n\u0303",
    "A\u030a",
    "\u1100\u1161\u11a8",
    "Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f\u0334a\u0310lgo",
    "\u0915\u094d\u0937",
    "o\u0301\u0302\u0303",
    "\u0301 leading combining mark",
    "ả̀ Vieết Nam",
    "Å Å Å",
    # emoji
    "😀",
    "😁 ?",
    "👍🏽",
    "👨‍👩‍👧‍👦",
    "🏳️‍🌈",
    "🇺🇸🇯🇵🇩🇪",
    "🇫🇷 flag",
    "❤️",
    "1️⃣",
    "🧑🏿‍💻",
    "😶‍🌫️",
    "🚀 (normal) 😶‍🌫️ (multiple emojis concatenated) ✅",
    " this is 🦙.cpp",
    "🦙🦙🦙",
    "emoji😀glued",
    "👩‍❤️‍💋‍👨",
    # code
    "def f(x):\n    return x + 1\n",
    'class A:\n    def __init__(self):\n        self.x = [1, 2, 3]\n\n    def __repr__(self):\n\t\treturn f"A({self.x!r})"\n',
    '#include <stdio.h>\nint main(void) {\n\tprintf("%d\\n", 42);\n\treturn 0;\n}\n',
    "for (int i = 0; i < n; ++i) { a[i] = b[i] * c[i]; }",
    '{"key": "value", "list": [1, 2.5, -3e10, true, null], "nested": {"a": {}}}',
    '{\n  "name": "colibri",\n  "version": "0.1.0"\n}',
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;",
    '<div class="x"><a href="https://example.com/?q=1&b=2">link</a></div>',
    "x != y and a.b == c",
    "a->b, a::b, a<=>b, a && b || !c",
    "$ ls -la | grep '^d' > out.txt",
    "https://huggingface.co/docs/transformers/main/en/chat_templating#advanced",
    "user@example.com",
    "C:\\Users\\name\\file.txt",
    "regex: ^[a-z]+\\d{2,3}$",
    "```python\nprint('hi')\n```",
    "// comment\n/* block */",
    "    indented\n        more\n",
    # digits
    "3",
    "33",
    "333",
    "3333",
    "33333",
    "333333",
    "3333333",
    "1234567890",
    "0000000000000",
    "3.14159265358979",
    "1,000,000",
    "-42",
    "0x1F",
    "1e-10",
    "2024-01-01",
    "12:34:56",
    "١٢٣٤٥",
    "一二三",
    "１２３",
    "v1.2.3",
    "ipv4 192.168.0.1",
    # case / contractions
    "HeLLo WoRLD",
    "ALLCAPS SENTENCE",
    "lowercase sentence",
    "CamelCaseIdentifier",
    "snake_case_name",
    "kebab-case-name",
    "iPhone eBay macOS",
    "I'm",
    "DON'T",
    "it's",
    "We'Ve",
    "' era",
    "y'all",
    "'s",
    "he'd've",
    "'''''",
    "!!!!!!",
    "??!!..",
    "...",
    "---",
    "===",
    "a" * 100,
    "ab" * 40,
    "w048 7tuijk dsdfhu",
    # control characters
    "\x00",
    "a\x00b",
    "\x07\x1b[0m",
    "\x7f",
    "tab\there",
]

# fragments for the random mixes (subset of the above plus a few)
FRAGMENTS = [
    "Hello",
    "world",
    "The quick brown fox",
    "jumps over",
    "the lazy dog.",
    "日本語",
    "中文",
    "한국어",
    "العربية",
    "हिन्दी",
    "ไทย",
    "Русский",
    "Ελληνικά",
    "e\u0301",
    "👨‍👩‍👧",
    "🇯🇵",
    "😀",
    "❤️",
    "def f():",
    "return 0;",
    '{"a": 1}',
    "[1, 2, 3]",
    "12345",
    "3.14",
    "x=y+z",
    "CamelCase",
    "UPPER",
    "lower",
    "I'm",
    "'s",
    "...",
    "!!",
    "?",
    "(",
    ")",
    "<",
    ">",
    "|",
    "#",
    "\u00a0",
    "ß",
    "İ",
    "ﬁ",
    "½",
]
JOINERS = ["", " ", " ", " ", "  ", "\n", "\t", "\r\n", "\n\n", ", "]

# --------------------------------------------------------------------------------------------
# Chat fixtures
# --------------------------------------------------------------------------------------------
# Mixtral-8x7B-Instruct-v0.1's chat template as originally released (December 2023).
MIXTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant "
    "roles are supported!') }}{% endif %}{% endfor %}"
)

CHATS = {
    # name: (template source, vocab, kwargs variants)
    "Qwen-Qwen3-0.6B": ("Qwen-Qwen3-0.6B.jinja", "qwen3", [{}, {"enable_thinking": True}, {"enable_thinking": False}]),
    "Qwen-Qwen3-0.6B@qwen2": ("Qwen-Qwen3-0.6B.jinja", "qwen2", [{}, {"enable_thinking": False}]),
    "Qwen-Qwen2.5-7B-Instruct": ("Qwen-Qwen2.5-7B-Instruct.jinja", "qwen2", [{}]),
    "google-gemma-4-31B-it": (
        "google-gemma-4-31B-it.jinja",
        "gemma-4",
        [{}, {"enable_thinking": True}, {"enable_thinking": False}],
    ),
    "mistralai-Mixtral-8x7B-Instruct-v0.1": (None, "llama-spm", [{}]),
    "mistralai-Mistral-Nemo-Instruct-2407": ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "llama-spm", [{}]),
    # the new families' templates (issue 23), rendered through a vocabulary that is not theirs
    # (the real ones are not in the sdist): the render is the template's, the ids the vocabulary's
    "openai-gpt-oss-120b": ("openai-gpt-oss-120b.jinja", "qwen2", [{}, {"reasoning_effort": "high"}]),
    "deepseek-ai-DeepSeek-V3.1": ("deepseek-ai-DeepSeek-V3.1.jinja", "qwen2", [{}, {"thinking": True}]),
    "moonshotai-Kimi-K2": ("moonshotai-Kimi-K2.jinja", "qwen2", [{}]),
    "GLM-4.6": ("GLM-4.6.jinja", "qwen2", [{}]),
}

CONVERSATIONS = [
    ("user", [{"role": "user", "content": "Hello! What is 2+2?"}]),
    (
        "system_user",
        [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Name three colors."},
        ],
    ),
    (
        "multi_turn_system",
        [
            {"role": "system", "content": "You answer in one sentence."},
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is Paris."},
            {"role": "user", "content": "And of Italy?"},
        ],
    ),
    (
        "multi_turn",
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Tell me a joke."},
        ],
    ),
    (
        "non_ascii",
        [
            {"role": "system", "content": "Réponds en français, s'il te plaît. 🙂"},
            {"role": "user", "content": "你好！Привет! नमस्ते 👨‍👩‍👧 — e\u0301 café?"},
            {"role": "assistant", "content": "Bonjour ! 日本語も少し話せます。"},
            {"role": "user", "content": "  Leading and trailing spaces  \n\tand a tab"},
        ],
    ),
    (
        "assistant_thinking",
        [
            {"role": "user", "content": "What is 7*6?"},
            {"role": "assistant", "content": "<think>\n7 times 6 is 42.\n</think>\n\n42"},
            {"role": "user", "content": "And 6*7?"},
        ],
    ),
    ("assistant_last", [{"role": "user", "content": "Say yes."}, {"role": "assistant", "content": "Yes."}]),
]


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
def log(*a):
    print(*a, file=sys.stderr, flush=True)


def read_reference(models: Path, name: str):
    """[(text, ids)] from ggml-vocab-<name>.gguf.inp/.out, parsed as test-tokenizer-0.cpp does."""
    inp = models / f"ggml-vocab-{name}.gguf.inp"
    out = models / f"ggml-vocab-{name}.gguf.out"
    if not inp.exists():
        return []
    raw = inp.read_bytes().decode("utf-8")
    texts = []
    pos = 0
    while pos < len(raw):  # same loop as read_tests() in test-tokenizer-0.cpp
        nxt = raw.find(SEP, pos)
        if nxt < 0:
            texts.append(raw[pos:])
            break
        texts.append(raw[pos:nxt])
        pos = nxt + len(SEP)
    lines = out.read_bytes().decode("utf-8").split("\n")
    if lines and lines[-1] == "":
        lines = lines[:-1]
    if len(lines) != len(texts):
        raise SystemExit(f"{inp}: {len(texts)} strings but {len(lines)} result lines")
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines)]


def gguf_tokenizer_fields(path: Path) -> dict:
    import gguf

    r = gguf.GGUFReader(str(path))
    out = {}
    for k, f in r.fields.items():
        if k.startswith("tokenizer.ggml."):
            out[k[len("tokenizer.ggml.") :]] = f.contents()
    return out


def strip_padding(tokenizer_dict: dict) -> int:
    """Drop llama.cpp's trailing [PAD<n>] pieces from a transformers GGUF tokenizer dict."""
    toks = tokenizer_dict["tokens"]
    n = len(toks)
    while n and PAD_RE.match(toks[n - 1]):
        n -= 1
    dropped = len(toks) - n
    for key in ("tokens", "scores", "token_type"):
        if key in tokenizer_dict and tokenizer_dict[key] is not None and len(tokenizer_dict[key]) > n:
            tokenizer_dict[key] = list(tokenizer_dict[key])[:n]
    return dropped


def hf_gguf_tokenizer(models: Path, stem: str, cls_name: str | None = None):
    """transformers' GGUF tokenizer loader, [PAD<n>] dropped.  Returns (tokenizer, notes)."""
    from transformers import AutoTokenizer, GemmaTokenizer, TokenizersBackend
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    path = models / f"ggml-vocab-{stem}.gguf"
    architecture, tdict, tconfig = get_gguf_tokenizer(str(path))
    if "token_type" in tdict and not isinstance(tdict["token_type"], list):
        # the reader leaves non-essential arrays as counts; fetch them with gguf-py
        fields = gguf_tokenizer_fields(path)
        for key in ("token_type", "scores"):
            if key in tdict and key in fields:
                tdict[key] = list(fields[key])
    dropped = strip_padding(tdict)
    backend, extra = convert_gguf_tokenizer(architecture, tdict)
    # GPT2Tokenizer (the byte-level builder) brings its default "<|endoftext|>"; where the file has
    # no such piece it lands past the vocabulary (llama-bpe: id 128256).  Drop such extras.
    n_file = len(tdict["tokens"])
    j = json.loads(backend.to_str())
    extra_added = [t for t in j["added_tokens"] if t["id"] >= n_file]
    if extra_added:
        from tokenizers import Tokenizer

        j["added_tokens"] = [t for t in j["added_tokens"] if t["id"] < n_file]
        backend = Tokenizer.from_str(json.dumps(j))
        dropped_extra = [t["content"] for t in extra_added]
    else:
        dropped_extra = []
    # the class transformers' AutoTokenizer picks for this architecture
    # (the GGUF says architecture qwen2 for qwen35 too; its class is given by the caller)
    cls = cls_name or {"qwen2": "Qwen2Tokenizer", "gemma4": "GemmaTokenizer", "gpt2": "GPT2Tokenizer"}.get(architecture)
    if cls is None:
        cls = TokenizersBackend
    else:
        import transformers

        cls = getattr(transformers, cls)
    kwargs = dict(tconfig)
    kwargs.pop("chat_template", None)
    kwargs.update(extra)
    tok = cls(tokenizer_object=backend, **kwargs)
    # cross-check against the public entry point (where it works: it also builds a model config)
    notes = [
        f"transformers GGUF loader: architecture {architecture!r}, class {type(tok).__name__}, "
        f"{dropped} [PAD<n>] pieces dropped"
        + (f"; dropped added tokens beyond the file's vocabulary: {dropped_extra}" if dropped_extra else "")
    ]
    try:
        ref = (GemmaTokenizer if architecture == "gemma4" else AutoTokenizer).from_pretrained(
            str(path.parent), gguf_file=path.name
        )
        probe = "Hello world <|im_end|> 123"
        if ref.encode(probe, add_special_tokens=False) != tok.encode(probe, add_special_tokens=False):
            raise SystemExit(f"{stem}: GGUF tokenizer differs from AutoTokenizer(gguf_file=)")
    except SystemExit:
        raise
    except Exception as e:  # noqa: BLE001 - record, do not fail
        notes.append(
            f"AutoTokenizer.from_pretrained(gguf_file=) failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
        )
    return tok, notes


def build_qwen3(models: Path):
    """qwen2's BPE + Qwen3's added tokens."""
    from tokenizers import AddedToken

    tok, notes = hf_gguf_tokenizer(models, "qwen2")
    have = {t.content: i for i, t in tok.added_tokens_decoder.items()}
    new = []
    for i, content, special in QWEN3_ADDED:
        if content in have:
            if have[content] != i:
                raise SystemExit(f"qwen3: {content} has id {have[content]}, expected {i}")
            continue
        new.append((i, AddedToken(content, normalized=False, special=special)))
    for i, at in sorted(new, key=lambda x: x[0]):
        if len(tok) != i:
            raise SystemExit(f"qwen3: next id would be {len(tok)}, expected {i}")
        if at.special:
            tok.add_special_tokens({"additional_special_tokens": [at]}, replace_extra_special_tokens=False)
        else:
            tok.add_tokens([at])
    got = tok.convert_tokens_to_ids([c for _, c, _ in QWEN3_ADDED])
    if got != [i for i, _, _ in QWEN3_ADDED]:
        raise SystemExit(f"qwen3: added token ids {got}")
    notes.append("qwen2 BPE + Qwen3 added tokens 151646..151668 (from Qwen3's tokenizer_config)")
    return tok, notes


def build_spm(models: Path, out_dir: Path):
    """llama-spm: tokenizer.model (sentencepiece) + the legacy HF pipeline."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb
    from tokenizers import AddedToken, Tokenizer, decoders, models as tmodels, normalizers, processors
    from transformers import TokenizersBackend
    from transformers.tokenization_utils_base import generate_merges

    f = gguf_tokenizer_fields(models / "ggml-vocab-llama-spm.gguf")
    toks, scores, types = list(f["tokens"]), list(f["scores"]), list(f["token_type"])
    m = pb.ModelProto()
    for t, s, ty in zip(toks, scores, types):
        p = m.pieces.add()
        p.piece, p.score, p.type = t, float(s), int(ty)  # GGUF token types == sentencepiece's
    ts = m.trainer_spec
    ts.model_type = pb.TrainerSpec.BPE
    ts.vocab_size = len(toks)
    ts.character_coverage = 0.99995
    ts.max_sentencepiece_length = 16
    ts.split_by_unicode_script = True
    ts.split_by_number = True
    ts.split_by_whitespace = True
    ts.split_digits = True
    ts.treat_whitespace_as_suffix = False
    ts.allow_whitespace_only_pieces = True
    ts.byte_fallback = True
    ts.vocabulary_output_piece_score = True
    ts.hard_vocab_limit = True
    ts.use_all_vocab = False
    ts.unk_id, ts.bos_id, ts.eos_id, ts.pad_id = (
        int(f["unknown_token_id"]),
        int(f["bos_token_id"]),
        int(f["eos_token_id"]),
        -1,
    )
    ts.unk_piece, ts.bos_piece, ts.eos_piece, ts.pad_piece = "<unk>", "<s>", "</s>", "<pad>"
    ts.unk_surface = " \u2047 "
    ns = m.normalizer_spec
    ns.name = "identity"
    ns.precompiled_charsmap = b""
    ns.add_dummy_prefix = True
    ns.remove_extra_whitespaces = False
    ns.escape_whitespaces = True
    ns.normalization_rule_tsv = ""
    blob = m.SerializeToString(deterministic=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.model").write_bytes(blob)
    sp = spm.SentencePieceProcessor(model_proto=blob)
    ref = read_reference(models, "llama-spm")
    bad = [t for t, ids in ref if sp.encode(t) != ids]
    if bad:
        raise SystemExit(f"llama-spm: sentencepiece model disagrees with .out on {bad!r}")
    log(f"  tokenizer.model: sentencepiece reproduces all {len(ref)} .out lines")

    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    piece_scores = {sp.id_to_piece(i): sp.get_score(i) for i in range(sp.get_piece_size())}
    merges = generate_merges(vocab, piece_scores)
    t = Tokenizer(tmodels.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    t.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    t.pre_tokenizer = None
    t.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    t.add_special_tokens([AddedToken(x, normalized=False, special=True) for x in ("<unk>", "<s>", "</s>")])
    t.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    cfg = dict(CONFIG["llama-spm"])
    tok = TokenizersBackend(tokenizer_object=t, **cfg)
    return (
        tok,
        sp,
        [
            "sentencepiece tokenizer.model built from the GGUF pieces/scores/types",
            "HF tokenizer: the legacy Llama/Mixtral tokenizer.json pipeline as TokenizersBackend",
        ],
    )


def build_neox(models: Path):
    from tokenizers import AddedToken
    from transformers import GPTNeoXTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    f = gguf_tokenizer_fields(models / "ggml-vocab-gpt-neox.gguf")
    toks, types, merges = list(f["tokens"]), list(f["token_type"]), list(f["merges"])
    n = len(toks)
    while PAD_RE.match(toks[n - 1]):
        n -= 1
    alphabet = set(bytes_to_unicode().values())
    vocab, added = {}, []
    for i in range(n):
        t, ty = toks[i], types[i]
        if ty == 4:  # USER_DEFINED: an added, non-special token (space runs)
            added.append((i, t))
            continue
        if not set(t) <= alphabet:
            raise SystemExit(f"gpt-neox: token {i} {t!r} not in the byte alphabet")
        vocab[t] = i
    if sorted(vocab.values()) != list(range(len(vocab))):
        raise SystemExit("gpt-neox: BPE ids not contiguous")
    tok = GPTNeoXTokenizer(
        vocab=vocab,
        merges=[tuple(m.split(" ")) for m in merges],
        **{k: v for k, v in CONFIG["gpt-neox"].items() if k not in ("add_bos_token", "add_eos_token")},
    )
    specials = [toks[i] for i in range(n) if types[i] == 3]
    tok.add_special_tokens(
        {"additional_special_tokens": [AddedToken(s, normalized=False, special=True) for s in specials]},
        replace_extra_special_tokens=False,
    )
    for i, t in added:
        if len(tok) != i:
            raise SystemExit(f"gpt-neox: added token {t!r} would get id {len(tok)}, not {i}")
        tok.add_tokens([AddedToken(t, normalized=True, special=False)])
    return tok, [
        f"GPTNeoXTokenizer from the GGUF (architecture gptneox is not in transformers' "
        f"GGUF loader); {len(added)} multi-space added tokens; {len(toks) - n} [PAD<n>] dropped"
    ]


def patch_tokenizer_json(path: Path, name: str):
    j = json.loads(path.read_text(encoding="utf-8"))
    if name == "llama-bpe":
        j["model"]["ignore_merges"] = True
    path.write_text(json.dumps(j, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


def patch_config(path: Path, name: str):
    cfg = json.loads(path.read_text(encoding="utf-8"))
    for k in ("is_local", "local_files_only", "name_or_path", "_name_or_path"):
        cfg.pop(k, None)
    cfg.pop("chat_template", None)
    cfg.update(CONFIG.get(name, {}))
    path.write_text(json.dumps(cfg, ensure_ascii=False, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def drop_chat_template(d: Path):
    for p in ("chat_template.jinja", "chat_template.json"):
        (d / p).unlink(missing_ok=True)


def backend_json(tok) -> str:
    return tok.backend_tokenizer.to_str()


def save(tok, d: Path, name: str):
    if d.exists():
        shutil.rmtree(d)
    tok.chat_template = None
    tok.save_pretrained(str(d))
    drop_chat_template(d)
    patch_config(d / "tokenizer_config.json", name)
    patch_tokenizer_json(d / "tokenizer.json", name)


def load(d: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(d))


def special_strings(tok, name: str):
    vocab_added = {t.content for t in tok.added_tokens_decoder.values()}
    out = [s for s in SPECIAL_CANDIDATES if s in vocab_added]
    for s in [tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token]:
        if s and s not in out:
            out.append(s)
    for s in ALWAYS_TEXT:
        if s not in out:
            out.append(s)
    return out


def generated_texts(name: str, specials: list):
    texts = list(FIXED_TEXTS)
    rng = random.Random(SEED)  # same mixes for every vocabulary
    for _ in range(N_RANDOM):
        k = rng.randint(2, 5)
        parts = [rng.choice(FRAGMENTS) for _ in range(k)]
        s = parts[0]
        for p in parts[1:]:
            s += rng.choice(JOINERS) + p
        if rng.random() < 0.25:
            s = rng.choice([" ", "  ", "\n", "\t"]) + s
        if rng.random() < 0.25:
            s = s + rng.choice([" ", "  ", "\n", "\n\n"])
        texts.append(s)
    # special-token strings written in the text
    for sp in specials:
        texts += [
            sp,
            sp + sp,
            "Hello" + sp,
            sp + "Hello",
            "Hello " + sp + " world",
            " " + sp,
            sp + " ",
            "\n" + sp + "\n",
            "ab" + sp + "cd",
            sp + "\n" + "x",
            sp[:-1] if len(sp) > 2 else sp + "x",
            sp.upper() if sp.upper() != sp else sp.lower(),
        ]
    rng2 = random.Random(zlib.crc32(name.encode()) ^ SEED)  # vocabulary-specific mixes
    for _ in range(24):
        parts = []
        for _ in range(rng2.randint(2, 5)):
            parts.append(rng2.choice(specials) if rng2.random() < 0.4 else rng2.choice(FRAGMENTS))
        texts.append("".join(p + rng2.choice(["", "", " ", "\n"]) for p in parts))
    return texts


def make_cases(tok, ref, texts, sp=None, llama_cls=None):
    seen = set()
    cases = []
    for text, ids_ref in list(ref) + [(t, None) for t in texts]:
        if ids_ref is None and text in seen:
            continue
        seen.add(text)
        ids = tok.encode(text, add_special_tokens=True)
        plain = tok.encode(text, add_special_tokens=False)
        c = {
            "text": text,
            "ids": ids,
            "ids_plain": plain,
            "decoded": tok.decode(ids, skip_special_tokens=False),
            "decoded_skip": tok.decode(ids, skip_special_tokens=True),
            "llama_cpp": ids_ref,
        }
        if sp is not None:
            c["spm_ids_plain"] = sp.encode(text)
            c["spm_decoded"] = sp.decode(c["spm_ids_plain"])
        if llama_cls is not None:
            c["ids_llama_class"] = llama_cls.encode(text, add_special_tokens=True)
        cases.append(c)
    return cases


def write_cases(path: Path, cases):
    lines = [json.dumps(c, ensure_ascii=True, sort_keys=False) for c in cases]
    path.write_text("[\n" + ",\n".join(lines) + "\n]\n", encoding="ascii")


def xz(src: Path, dst: Path):
    data = src.read_bytes()
    dst.write_bytes(lzma.compress(data, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=9))


def unxz_folder(vdir: Path, tmp: Path) -> Path:
    d = tmp / ("load-" + vdir.name)
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    for p in vdir.iterdir():
        if p.name == "tokenizer.json.xz":
            (d / "tokenizer.json").write_bytes(lzma.decompress(p.read_bytes()))
        elif p.name in ("tokenizer_config.json", "special_tokens_map.json", "tokenizer.model"):
            shutil.copy(p, d / p.name)
    return d


def bos_eos_summary(tok):
    probe = tok.encode("Hello", add_special_tokens=False)
    full = tok.encode("Hello", add_special_tokens=True)
    i = full.index(probe[0]) if probe and probe[0] in full else 0
    return {"prefix": full[:i], "suffix": full[i + len(probe) :]}


# --------------------------------------------------------------------------------------------
def do_vocab(name: str, spec: dict, models: Path, out: Path, tmp: Path) -> dict:
    log(f"== {name}")
    vdir = out / "vocab" / name
    if vdir.exists():
        shutil.rmtree(vdir)
    vdir.mkdir(parents=True)
    sp = None
    if spec["build"] == "hf_gguf":
        tok, notes = hf_gguf_tokenizer(models, spec["gguf"], spec.get("cls"))
    elif spec["build"] == "qwen3":
        tok, notes = build_qwen3(models)
    elif spec["build"] == "spm":
        tok, sp, notes = build_spm(models, vdir)
    elif spec["build"] == "neox":
        tok, notes = build_neox(models)
    else:
        raise SystemExit(spec["build"])
    # BOS/EOS: transformers 5 ignores add_bos_token/add_eos_token of tokenizer_config.json when a
    # tokenizer.json exists (its post-processor decides), so set them on the tokenizer, which
    # rewrites the post-processor, before saving; tokenizer_config.json gets them too.
    c = CONFIG.get(name, {})
    if "add_bos_token" in c:
        tok.add_bos_token = c["add_bos_token"]
    if "add_eos_token" in c:
        tok.add_eos_token = c["add_eos_token"]
    ref = read_reference(models, spec["ref"])
    gguf_plain_bad = sum(tok.encode(t, add_special_tokens=False) != ids for t, ids in ref)

    # save -> reload -> save -> reload: fixed point
    d1, d2 = tmp / f"{name}-1", tmp / f"{name}-2"
    save(tok, d1, name)
    t1 = load(d1)
    save(t1, d2, name)
    t2 = load(d2)
    if backend_json(t1) != backend_json(t2):
        raise SystemExit(f"{name}: tokenizer.json is not a fixed point of save/reload")
    if (d1 / "tokenizer.json").read_bytes() != (d2 / "tokenizer.json").read_bytes():
        log("  note: first save differs from the reloaded one (class pipeline rebuilt on load)")

    # final files
    xz(d2 / "tokenizer.json", vdir / "tokenizer.json.xz")
    for p in ("tokenizer_config.json", "special_tokens_map.json"):
        if (d2 / p).exists():
            shutil.copy(d2 / p, vdir / p)
    extra_files = sorted(
        p.name
        for p in d2.iterdir()
        if p.name not in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
    )
    if extra_files and extra_files != ["tokenizer.model"]:
        log(f"  note: save_pretrained also wrote {extra_files} (not kept)")

    # reload from the committed files and compute everything with that tokenizer
    ld = unxz_folder(vdir, tmp)
    tk = load(ld)
    if backend_json(tk) != backend_json(t2):
        raise SystemExit(f"{name}: reloading the written files gives another tokenizer")
    adds = bos_eos_summary(tk)
    want = ([tk.bos_token_id] if c.get("add_bos_token") else [], [tk.eos_token_id] if c.get("add_eos_token") else [])
    if (adds["prefix"], adds["suffix"]) != want:
        raise SystemExit(f"{name}: add_special_tokens=True adds {adds}, config says {want}")
    llama_cls = None
    if name == "llama-spm":
        from transformers import LlamaTokenizer

        llama_cls = LlamaTokenizer.from_pretrained(str(ld))
    specials = special_strings(tk, name)
    texts = generated_texts(name, specials)
    cases = make_cases(tk, ref, texts, sp=sp, llama_cls=llama_cls)
    for c in cases:  # the in-memory tokenizer before saving must agree after the round trip
        if t2.encode(c["text"]) != c["ids"]:
            raise SystemExit(f"{name}: save/reload changed encode({c['text']!r})")
    write_cases(vdir / "cases.json", cases)

    mism = [
        {"text": c["text"], "transformers": c["ids_plain"], "llama_cpp": c["llama_cpp"]}
        for c in cases
        if c["llama_cpp"] is not None and c["ids_plain"] != c["llama_cpp"]
    ]
    unnormalized_gguf = [c["text"] for c in cases if tok.encode(c["text"], add_special_tokens=False) != c["ids_plain"]]
    cfg = json.loads((vdir / "tokenizer_config.json").read_text(encoding="utf-8"))
    eot = END_OF_TURN.get(name)
    meta = {
        "name": name,
        "source": f"vendor/llama.cpp/models/ggml-vocab-{spec['gguf']}.gguf",
        "reference": (f"vendor/llama.cpp/models/ggml-vocab-{spec['ref']}.gguf.inp/.out" if ref else None),
        "build_notes": notes,
        "tokenizer_class_loaded": type(tk).__name__,
        "tokenizer_class_config": cfg.get("tokenizer_class"),
        "len": len(tk),
        "bos_token": tk.bos_token,
        "bos_token_id": tk.bos_token_id,
        "eos_token": tk.eos_token,
        "eos_token_id": tk.eos_token_id,
        "pad_token": tk.pad_token,
        "pad_token_id": tk.pad_token_id,
        "unk_token": tk.unk_token,
        "unk_token_id": tk.unk_token_id,
        "end_of_turn_token": eot,
        "end_of_turn_token_id": (tk.convert_tokens_to_ids(eot) if eot else None),
        "add_bos_token": cfg.get("add_bos_token"),
        "add_eos_token": cfg.get("add_eos_token"),
        "add_special_tokens_adds": bos_eos_summary(tk),
        "special_token_strings_tested": specials,
        "n_cases": len(cases),
        "n_reference_cases": len(ref),
        "reference_mismatches": mism,
        "gguf_loader_mismatches_vs_reference": gguf_plain_bad,
        "in_memory_vs_saved_differs_on": unnormalized_gguf,
    }
    if name == "llama-spm":
        meta["spm_vs_ids_plain_differs_on"] = [c["text"] for c in cases if c["spm_ids_plain"] != c["ids_plain"]]
        # sentencepiece applied chunk by chunk between the special-token strings (each chunk with
        # its dummy prefix), the way llama.cpp (parse_special) and transformers' legacy pipeline work
        added = {t.content: i for i, t in tk.added_tokens_decoder.items()}
        pat = re.compile("(" + "|".join(re.escape(a) for a in sorted(added, key=len, reverse=True)) + ")")

        def seg(text):
            ids = []
            for part in pat.split(text):
                if part in added:
                    ids.append(added[part])
                elif part:
                    ids += sp.encode(part)
            return ids

        meta["spm_chunked_vs_ids_plain_differs_on"] = [c["text"] for c in cases if seg(c["text"]) != c["ids_plain"]]
        meta["llama_class_vs_ids_differs_on"] = [c["text"] for c in cases if c["ids_llama_class"] != c["ids"]]
    (vdir / "meta.json").write_text(json.dumps(meta, ensure_ascii=True, indent=1) + "\n", encoding="ascii")
    log(
        f"  {len(cases)} cases, {len(ref)} reference, {len(mism)} mismatches, "
        f"GGUF-loader mismatches {gguf_plain_bad}, in-memory-vs-saved differs on {len(unnormalized_gguf)}"
    )
    return meta


def do_chat(name: str, src, vocab: str, kwarg_sets, templates: Path, out: Path, tmp: Path, cache: dict):
    from transformers import LlamaTokenizer

    cdir = out / "chat"
    cdir.mkdir(parents=True, exist_ok=True)
    tname = src or (name + ".jinja")
    if src is None:
        template = MIXTRAL_TEMPLATE
    else:
        template = (templates / src).read_text(encoding="utf-8")
    (cdir / tname).write_text(template, encoding="utf-8")
    if vocab not in cache:
        cache[vocab] = load(unxz_folder(out / "vocab" / vocab, tmp))
    tok = cache[vocab]
    llama_cls = None
    if vocab == "llama-spm":
        key = vocab + "@llama_class"
        if key not in cache:
            cache[key] = LlamaTokenizer.from_pretrained(str(unxz_folder(out / "vocab" / vocab, tmp)))
        llama_cls = cache[key]
    cases = []
    for conv_name, messages in CONVERSATIONS:
        for kwargs in kwarg_sets:
            for agp in (False, True):
                c = {"name": conv_name, "messages": messages, "add_generation_prompt": agp, "kwargs": kwargs}
                try:
                    text = tok.apply_chat_template(
                        messages, chat_template=template, add_generation_prompt=agp, tokenize=False, **kwargs
                    )
                    ids = tok.apply_chat_template(
                        messages,
                        chat_template=template,
                        add_generation_prompt=agp,
                        tokenize=True,
                        return_dict=False,
                        **kwargs,
                    )
                    if not (isinstance(ids, list) and all(isinstance(i, int) for i in ids)):
                        raise SystemExit(f"{name}: apply_chat_template returned {type(ids)}")
                    if ids != tok.encode(text, add_special_tokens=False):
                        raise SystemExit(f"{name}: chat ids != encode(text, add_special_tokens=False)")
                    c["text"], c["ids"] = text, ids
                    if llama_cls is not None:
                        c["ids_llama_class"] = llama_cls.encode(text, add_special_tokens=False)
                except SystemExit:
                    raise
                except Exception as e:  # noqa: BLE001 - the template raised: record it
                    c["error"] = str(e)
                cases.append(c)
    # the day transformers rendered the cases: a template's strftime_now (gpt-oss's "Current date")
    # gives it, and the test renders with that day
    doc = {"template_file": tname, "vocab": vocab, "rendered_on": datetime.date.today().isoformat(), "cases": cases}
    (cdir / f"{name}.json").write_text(json.dumps(doc, ensure_ascii=True, indent=1) + "\n", encoding="ascii")
    n_err = sum("error" in c for c in cases)
    log(f"== chat {name}: {len(cases)} cases ({n_err} errors)")
    return {
        "name": name,
        "template_file": tname,
        "vocab": vocab,
        "n_cases": len(cases),
        "n_errors": n_err,
        "errors": sorted({c["error"] for c in cases if "error" in c}),
        "n_llama_class_diff": (
            sum(c["ids"] != c["ids_llama_class"] for c in cases if "ids" in c) if llama_cls is not None else None
        ),
    }


# --------------------------------------------------------------------------------------------
def sizes(out: Path):
    rows = []
    for p in sorted(out.rglob("*")):
        if p.is_file():
            rows.append((str(p.relative_to(out)), p.stat().st_size))
    return rows


def _short(text, n=48):
    s = json.dumps(text)
    return "`" + (s if len(s) <= n else s[:n] + '..."') + "`"


def _short_ids(ids, n=10):
    return str(ids) if len(ids) <= n else str(ids[:n])[:-1] + f", ... ({len(ids)} ids)]"


NOTES = """\
## Notes for a reimplementation (what transformers 5.24 does with these files)

- **BOS/EOS come from tokenizer.json's post-processor.** When a tokenizer.json is present, transformers 5
  drops `add_bos_token` / `add_eos_token` from tokenizer_config.json at load (and does not write them on
  save); the `TemplateProcessing` post-processor decides. The configs here carry both flags anyway, set
  to agree with the post-processor (checked by the generator): BOS is added for gemma-4 (`<bos>` 2),
  llama-spm (`<s>` 1), llama-bpe (`<|begin_of_text|>` 128000), phi-3 (`<s>` 1); nothing is added for
  qwen2/qwen3/qwen35, gpt-neox, gpt-2; no vocabulary adds EOS.
- **Classes with their own `__init__` rebuild the pipeline.** Qwen2Tokenizer, Qwen3_5Tokenizer,
  GemmaTokenizer, GPTNeoXTokenizer, GPT2Tokenizer, LlamaTokenizer take only vocab/merges/added tokens
  (and the post-processor) from tokenizer.json and install their own normalizer/pre-tokenizer/decoder.
  The tokenizer.json here is the result of a save/reload fixed point, so it spells out that pipeline:
  reading it with `tokenizers` alone gives the same ids. `tokenizer_class` TokenizersBackend (llama-spm,
  llama-bpe, phi-3) means "use tokenizer.json as is".
- **NFC.** Qwen2Tokenizer, Qwen3_5Tokenizer and GPTNeoXTokenizer normalize to NFC, so decomposed text
  (`"e\\u0301"`) encodes as the composed character and decodes composed. transformers' GGUF loader does
  not add NFC, and llama.cpp does not normalize: the qwen35 reference (made with the real Qwen3.5 repo)
  was made without NFC, so transformers 5 disagrees with it on the three decomposed .inp strings (listed below).
- **clean_up_tokenization_spaces** is ignored for BPE models by transformers 5.24 (it logs "Ignoring
  clean_up_tokenization_spaces=True for BPE tokenizer"), so llama-bpe's `true` (as in Meta-Llama-3's
  config) has no effect on `decoded`; all other configs say false or leave it out.
- **Special tokens in text** are matched whole (leftmost-longest over the added tokens, special or not)
  before the model runs; `skip_special_tokens=True` drops only the `special: true` ones (Qwen3's
  `<think>`, `<tool_call>`... are added but not special and stay; so do gpt-neox's multi-space tokens).
  gpt-neox's 23 space-run tokens (ids 50254..50276, `normalized: true`) win over BPE: `"a     b"` is
  `a`, `"     "`, `b`.
- **llama-spm (legacy sentencepiece).** The pipeline is the Hub's Llama-2/Mixtral tokenizer.json:
  normalizer Prepend("▁") + Replace(" ", "▁") applied to each chunk of text between special tokens
  (so text after `<s>`/`</s>`/`<unk>` gets its own dummy-prefix space, like llama.cpp with
  parse_special and like sentencepiece run chunk by chunk -- checked equal on every case), BPE with
  byte fallback, decoder Replace/ByteFallback/Fuse/Strip(1 leading space). `<unk>` written in the text
  is id 0. `decode([1, 15043])` is `"<s> Hello"` (the Strip only removes a space at the very start of the
  decoded string). transformers 5's `LlamaTokenizer` class instead rebuilds a Metaspace pre-tokenizer
  (prepend_scheme "always", split false, legacy true) that swallows one user-written leading space:
  `" Hello"` gives `[1, 15043]` where sentencepiece, llama.cpp and the reference give `[1, 29871, 15043]`
  (field `ids_llama_class`; a known transformers 5 bug). This vocabulary is Llama-2's
  (meta-llama/Llama-2-7b-hf): Mixtral's tokenizer.model has the same settings and algorithm but other
  pieces and ids.
- **Gemma 4.** transformers' GGUF loader deliberately sets `add_bos_token` false for gemma4; the released
  google/gemma-4 tokenizer.json prepends `<bos>`, so these files do. The chat template writes `<bos>`
  itself and `apply_chat_template` tokenizes with add_special_tokens=False, so chat ids have one BOS.
  The turn tokens are `<|turn>` (105) / `<turn|>` (106); there is no `<start_of_turn>` in Gemma 4.
- **Qwen.** `bos_token` is null (no BOS ever); Qwen1.5 base (the qwen2 vocabulary) has eos
  `<|endoftext|>`, Qwen3 (the qwen3 vocabulary) eos `<|im_end|>`, pad `<|endoftext|>`; the chat
  end-of-turn is `<|im_end|>` 151645 in all of them. qwen3 is not a llama.cpp vocabulary: the qwen2 BPE
  (the same for Qwen1.5..Qwen3) plus Qwen3's 26 added tokens 151643..151668 as in its tokenizer_config.
- **gpt-neox** is EleutherAI/gpt-neox-20b. OLMoE uses the same BPE (ids 0..50276 identical) but its
  tokenizer has 50280 tokens, eos id 50279, pad id 1 and no BOS.
- **apply_chat_template(tokenize=True)** returns a BatchEncoding by default in transformers 5
  (`return_dict=True`); the fixtures use `return_dict=False` (a plain list of ids).
- **Mixtral-8x7B-Instruct-v0.1's template** is written out in the generator as originally released
  (December 2023; later revisions accept a system message): it rejects a system message
  ("Conversation roles must alternate ..."), recorded as `error` cases. Mistral-Nemo's template is
  rendered with the llama-spm vocabulary only to exercise its `[INST]` layout (Nemo's own vocabulary is
  tekken, not covered).
"""


def write_readme(out: Path, metas: list, chats: list, versions: dict, command: str):
    rows = sizes(out)
    total = sum(s for _, s in rows)
    L = []
    L.append("# Text fixtures: real tokenizers, reference tokenizations, chat renders\n")
    L.append(
        "Generated by `tools/make_text_fixtures.py` (read its docstring for the design). "
        "Colibri's tests read these files without torch or transformers.\n"
    )
    L.append(
        "Regenerate (from the repo root; needs transformers, tokenizers, gguf, sentencepiece, "
        "protobuf, jinja2, and torch CPU because transformers' GGUF reader imports it):\n"
    )
    L.append("    " + command + "\n")
    L.append("Versions used: " + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".\n")
    L.append("The output is deterministic: rerunning with the same versions gives identical files.\n")
    L.append("## Layout\n")
    L.append(
        "    vocab/<name>/tokenizer.json.xz      tokenizer.json as save_pretrained writes it (after a "
        "save/reload fixed point), xz (Python lzma, preset 9)"
    )
    L.append(
        "    vocab/<name>/tokenizer_config.json  as save_pretrained writes it, load-time keys dropped, the "
        "real model's bos/eos/add_bos_token/... set (no chat template)"
    )
    L.append("    vocab/<name>/tokenizer.model        llama-spm only: sentencepiece ModelProto")
    L.append("    vocab/<name>/cases.json             list of cases, see below")
    L.append("    vocab/<name>/meta.json              special tokens, BOS/EOS behaviour, agreement with the reference")
    L.append("    chat/<template>.jinja               the chat template")
    L.append("    chat/<template>.json                renders of that template with a vocabulary\n")
    L.append(
        '`cases.json` entry: `{"text", "ids", "ids_plain", "decoded", "decoded_skip", "llama_cpp"}` '
        "with `ids = tok.encode(text, add_special_tokens=True)`, `ids_plain` the same with False, "
        "`decoded = tok.decode(ids, skip_special_tokens=False)`, `decoded_skip` with True, "
        "`llama_cpp` the reference ids from the `.gguf.out` file (null for generated strings). "
        "`tok` is `AutoTokenizer.from_pretrained` of the folder with tokenizer.json unpacked. "
        "llama-spm cases also have `spm_ids_plain` (sentencepiece `encode(text)` with the tokenizer.model: "
        "no BOS, special-token text not parsed), `spm_decoded` (sentencepiece decode of those) and "
        "`ids_llama_class` (`LlamaTokenizer.from_pretrained(folder).encode(text)`, i.e. what "
        "transformers 5's LlamaTokenizer class does with a repo that names it).\n"
    )
    L.append(
        "The `.gguf.out` references were written by llama.cpp's `convert_hf_to_gguf_update.py` with "
        "`AutoTokenizer(<real HF repo>).encode(text, add_special_tokens=False)`; llama.cpp's "
        "`test-tokenizer-0` checks that llama.cpp reproduces them (`add_special=false`, "
        "`parse_special=false`). gpt-neox uses the `ggml-vocab-mpt` references: that vocabulary is "
        "token-for-token identical (tokens, types, merges) and mosaicml/mpt-7b uses the gpt-neox-20b tokenizer.\n"
    )
    L.append(
        "`meta.json`: `name`, `source` (GGUF), `reference` (.inp/.out used), `build_notes`, "
        "`tokenizer_class_loaded` / `tokenizer_class_config`, `len`, `bos_token`/`_id`, `eos_token`/`_id`, "
        "`pad_token`/`_id`, `unk_token`/`_id`, `end_of_turn_token`/`_id` (the chat models' turn end), "
        "`add_bos_token`, `add_eos_token`, `add_special_tokens_adds` (`{prefix: [...], suffix: [...]}` ids "
        "that add_special_tokens=True adds), `special_token_strings_tested`, `n_cases`, `n_reference_cases`, "
        "`reference_mismatches` (`[{text, transformers, llama_cpp}]`), `gguf_loader_mismatches_vs_reference`, "
        "`in_memory_vs_saved_differs_on`; llama-spm also `spm_vs_ids_plain_differs_on`, "
        "`spm_chunked_vs_ids_plain_differs_on`, `llama_class_vs_ids_differs_on` (lists of texts).\n"
    )
    L.append(
        'Chat fixture: `{"template_file", "vocab", "cases": [{"name", "messages", '
        '"add_generation_prompt", "kwargs", "text", "ids"}]}` (`name` labels the conversation); `text = apply_chat_template(messages, '
        "chat_template=template, add_generation_prompt=..., tokenize=False, **kwargs)`, `ids` the same with "
        "`tokenize=True, return_dict=False` (transformers tokenizes the render with add_special_tokens=False; "
        "checked equal to `encode(text, add_special_tokens=False)`). A case whose template raised has "
        '`"error": message` instead of text/ids. llama-spm chat cases also carry `ids_llama_class`.\n'
    )
    L.append(NOTES)
    L.append("## Vocabularies\n")
    L.append(
        "| name | class | len | bos | eos | end of turn | add_special_tokens adds | cases | reference | mismatches |"
    )
    L.append("|---|---|---|---|---|---|---|---|---|---|")

    def cell(tok):  # a token string in a table cell ("|" would end the cell)
        return "null" if tok is None else "`" + str(tok).replace("|", "\\|") + "`"

    for m in metas:
        adds = m["add_special_tokens_adds"]
        L.append(
            f"| {m['name']} | {m['tokenizer_class_loaded']} | {m['len']} | "
            f"{cell(m['bos_token'])} {m['bos_token_id']} | {cell(m['eos_token'])} {m['eos_token_id']} | "
            f"{cell(m['end_of_turn_token'])} {m['end_of_turn_token_id']} | prefix {adds['prefix']} suffix {adds['suffix']} | "
            f"{m['n_cases']} | {m['n_reference_cases']} | {len(m['reference_mismatches'])} |"
        )
    L.append("")
    for m in metas:
        L.append(f"### {m['name']}\n")
        for n in m["build_notes"]:
            L.append(f"- {n}")
        if m["reference_mismatches"]:
            L.append(
                f"- **transformers disagrees with the llama.cpp reference** on {len(m['reference_mismatches'])} "
                "of the .inp strings:"
            )
            for x in m["reference_mismatches"]:
                L.append(
                    f"  - {_short(x['text'])}: transformers {_short_ids(x['transformers'])}, "
                    f"reference {_short_ids(x['llama_cpp'])}"
                )
        elif m["n_reference_cases"]:
            L.append(f"- transformers agrees with the reference on all {m['n_reference_cases']} .inp strings")
        if m["gguf_loader_mismatches_vs_reference"]:
            L.append(
                f"- the tokenizer as first built (before the save/reload) disagreed with the reference on "
                f"{m['gguf_loader_mismatches_vs_reference']} .inp strings"
            )
        if m["in_memory_vs_saved_differs_on"]:
            L.append(
                f"- the tokenizer as first built differs from the saved/reloaded one on "
                f"{len(m['in_memory_vs_saved_differs_on'])} case strings (e.g. "
                f"{', '.join(_short(t) for t in m['in_memory_vs_saved_differs_on'][:4])})"
            )
        if "spm_vs_ids_plain_differs_on" in m:
            d = m["spm_vs_ids_plain_differs_on"]
            L.append(
                f"- sentencepiece (`spm_ids_plain`) vs transformers (`ids_plain`): differ on {len(d)} strings"
                + (" (" + ", ".join(_short(t) for t in d[:8]) + ")" if d else "")
            )
            d = m["spm_chunked_vs_ids_plain_differs_on"]
            L.append(
                f"- sentencepiece run on each chunk between special-token strings (each chunk with its dummy "
                f"prefix) vs `ids_plain`: differ on {len(d)} strings"
                + (" (" + ", ".join(_short(t) for t in d[:8]) + ")" if d else "")
            )
            d = m["llama_class_vs_ids_differs_on"]
            L.append(
                f"- transformers 5 `LlamaTokenizer` class (`ids_llama_class`) vs `ids`: differ on {len(d)} strings"
                + (" (e.g. " + ", ".join(_short(t) for t in d[:8]) + ")" if d else "")
            )
        L.append("")
    L.append("## Chat fixtures\n")
    L.append("| fixture | template | vocab | cases | errors |")
    L.append("|---|---|---|---|---|")
    for c in chats:
        L.append(f"| {c['name']} | {c['template_file']} | {c['vocab']} | {c['n_cases']} | {c['n_errors']} |")
    L.append("")
    for c in chats:
        for e in c["errors"]:
            L.append(f"- {c['name']} raises: `{e}`")
        if c.get("n_llama_class_diff") is not None:
            L.append(f"- {c['name']}: `ids_llama_class` differs from `ids` in {c['n_llama_class_diff']} cases")
    L.append("")
    L.append("## Sizes\n")
    L.append("| file | bytes |")
    L.append("|---|---|")
    for p, s in rows:
        if p != "README.md":
            L.append(f"| {p} | {s} |")
    L.append(f"\nTotal (without this README): {total - sum(s for p, s in rows if p == 'README.md')} bytes.\n")
    (out / "README.md").write_text("\n".join(L) + "\n", encoding="utf-8")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sdist", required=True, type=Path, help="extracted llama-cpp-python sdist")
    ap.add_argument("--out", required=True, type=Path, help="output folder (tests/fixtures/text)")
    ap.add_argument("--only", default="", help="comma-separated vocabulary names (chat fixtures need theirs)")
    ap.add_argument("--no-optional", action="store_true", help="skip qwen35, llama-bpe, phi-3, gpt-2")
    ap.add_argument("--no-chat", action="store_true")
    args = ap.parse_args(argv)

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers
    from transformers.utils import logging as tlog

    tlog.set_verbosity_error()
    import gguf  # noqa: F401
    import google.protobuf
    import jinja2
    import sentencepiece
    import tokenizers
    from importlib.metadata import version

    versions = {
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "gguf": version("gguf"),
        "sentencepiece": sentencepiece.__version__,
        "protobuf": google.protobuf.__version__,
        "jinja2": jinja2.__version__,
        "llama-cpp-python sdist": args.sdist.name.rsplit("-", 1)[-1],
        "python": sys.version.split()[0],
    }
    try:
        import torch

        versions["torch"] = torch.__version__
    except ImportError:
        pass

    llama = args.sdist / "vendor" / "llama.cpp"
    models, templates = llama / "models", llama / "models" / "templates"
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    only = [x for x in args.only.split(",") if x]
    names = [n for n in VOCABS if (not only or n in only) and not (args.no_optional and VOCABS[n].get("optional"))]
    metas = []
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        for n in names:
            metas.append(do_vocab(n, VOCABS[n], models, out, tmp))
        chats = []
        if not args.no_chat:
            cache = {}
            for cname, (src, vocab, kw) in CHATS.items():
                if not (out / "vocab" / vocab / "tokenizer.json.xz").exists():
                    log(f"skip chat {cname}: no vocab {vocab}")
                    continue
                chats.append(do_chat(cname, src, vocab, kw, templates, out, tmp, cache))
    # metas of vocabularies not rebuilt this run
    have = {m["name"] for m in metas}
    for n in VOCABS:
        mp = out / "vocab" / n / "meta.json"
        if n not in have and mp.exists():
            metas.append(json.loads(mp.read_text(encoding="utf-8")))
    metas.sort(key=lambda m: list(VOCABS).index(m["name"]))
    if args.no_chat or only:
        for c in sorted((out / "chat").glob("*.json")) if (out / "chat").exists() else []:
            if c.stem not in {x["name"] for x in chats}:
                d = json.loads(c.read_text(encoding="utf-8"))
                errs = sorted({x["error"] for x in d["cases"] if "error" in x})
                nd = (
                    sum(x["ids"] != x["ids_llama_class"] for x in d["cases"] if "ids" in x)
                    if any("ids_llama_class" in x for x in d["cases"])
                    else None
                )
                chats.append(
                    {
                        "name": c.stem,
                        "template_file": d["template_file"],
                        "vocab": d["vocab"],
                        "n_cases": len(d["cases"]),
                        "n_errors": sum("error" in x for x in d["cases"]),
                        "errors": errs,
                        "n_llama_class_diff": nd,
                    }
                )
        chats.sort(key=lambda c: list(CHATS).index(c["name"]) if c["name"] in CHATS else 99)
    command = "python tools/make_text_fixtures.py --sdist /tmp/lsdist/llama_cpp_python-0.3.36 --out tests/fixtures/text"
    write_readme(out, metas, chats, versions, command)
    log("done")


if __name__ == "__main__":
    main()
