"""The text side of a checkpoint: tokenizer, chat template and generation config files.

Design
------
A Hugging Face checkpoint carries, beside its weights, the files that turn text into ids and back
(TEXT_FILES). `convert` copies the ones present, `python -m colibri tokenizer` adds or replaces
them in an existing model directory, and `load` reads them — each only from the directory's file
table (size and sha256, like every weight file), so a copied-in file never changes a model
silently: `unlisted()` names it and the CLI says how to add it. Before a file is copied it is
validated by the very code that later loads it (`TextSide.load`): it parses, the tokenizer's ids
fit the model's vocab_size, the chat template compiles, the generation config's stop tokens are
in the vocabulary.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from .chat import CHAT_TEMPLATE_JINJA, CHAT_TEMPLATE_JSON, ChatTemplate, find_template
from .errors import ColibriError
from .generation import GENERATION_CONFIG, GenerationDefaults
from .interrupts import signals_deferred, sigterm_cleans_up
from .tokenizer import (
    MAX_TEXT_FILE_BYTES,
    SPECIAL_TOKENS_MAP,
    TOKENIZER_CONFIG,
    TOKENIZER_JSON,
    TOKENIZER_MODEL,
    Tokenizer,
    load_tokenizer,
)

TEXT_FILES = (
    TOKENIZER_JSON,
    TOKENIZER_MODEL,
    TOKENIZER_CONFIG,
    SPECIAL_TOKENS_MAP,
    CHAT_TEMPLATE_JINJA,
    CHAT_TEMPLATE_JSON,
    GENERATION_CONFIG,
)
STAGING_NAME = ".colibri-text-import"  # import_text_files' copies, in the model directory while it runs


class TextSide:
    """What a model directory's text files give: tokenizer, chat template, generation defaults."""

    def __init__(self, tokenizer: Tokenizer | None, template: ChatTemplate | None, generation: GenerationDefaults):
        self.tokenizer = tokenizer
        self.template = template
        self.generation = generation

    @classmethod
    def load(cls, root: Path, files, vocab_size: int) -> "TextSide":
        root = Path(root)
        names = [n for n in TEXT_FILES if n in files]
        tokenizer = load_tokenizer(root, names, vocab_size)
        special = tokenizer.special_tokens_map if tokenizer else {}
        template = find_template(root, names, special)
        generation = (
            GenerationDefaults.from_file(root / GENERATION_CONFIG, vocab_size)
            if GENERATION_CONFIG in names
            else GenerationDefaults.empty()
        )
        return cls(tokenizer, template, generation)

    def stop_token_ids(self, config_eos) -> list:
        """The ids that end a generation: config.json's and generation_config.json's eos_token_id
        (transformers' generate) and the tokenizer's eos_token (llama.cpp's EOS; a chat
        checkpoint's end-of-turn token when its configs name only the end of text)."""
        tok_eos = [] if self.tokenizer is None or self.tokenizer.eos_token_id is None else [self.tokenizer.eos_token_id]
        return list(dict.fromkeys([*config_eos, *self.generation.eos_token_id, *tok_eos]))


def present(src: Path) -> list:
    """The text files that exist in a directory, in TEXT_FILES order."""
    return [n for n in TEXT_FILES if (Path(src) / n).is_file()]


def unlisted(root: Path, files) -> list:
    """Text files lying in a model directory that its file table does not list (ignored by load)."""
    return [n for n in present(root) if n not in files]


def file_entry(path: Path) -> dict:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}


def import_text_files(model_dir, source_dir, log=print) -> list:
    """Add or replace the text files of a model directory with those of `source_dir` (a HF
    checkpoint or another model directory); returns the names copied. The model's weights and
    its other text files are untouched; config.json's file table is rewritten atomically."""
    from .modeldir import CONFIG_NAME, ModelDir

    md = ModelDir(model_dir)
    src = Path(source_dir)
    if not src.is_dir():
        raise ColibriError(f"--from {src} is not a directory")
    names = present(src)
    if not names:
        raise ColibriError(f"{src} has none of the text files ({', '.join(TEXT_FILES)})")
    if src.resolve() == md.root.resolve():
        raise ColibriError(f"--from {src} is the model directory itself; nothing to import")
    for n in names:  # before a byte is copied into the model directory
        if (src / n).stat().st_size > MAX_TEXT_FILE_BYTES:
            raise ColibriError(f"{src / n} is larger than {MAX_TEXT_FILE_BYTES >> 20} MB; refusing to import it")
    # the set the model will load after the import, staged beside it: the new files over the kept ones
    origins = {n: src / n if n in names else md.root / n for n in TEXT_FILES if n in names or n in md.files}
    staged = md.root / STAGING_NAME
    with sigterm_cleans_up():  # SIGTERM, like Ctrl-C, leaves the model directory as it was
        try:
            with signals_deferred():  # the directory exists <=> the finally below removes it
                shutil.rmtree(staged, ignore_errors=True)  # left by a process killed outright
                staged.mkdir()
            for n, origin in origins.items():
                shutil.copyfile(origin, staged / n)
            try:
                TextSide.load(staged, present(staged), md.config.vocab_size)  # validates, or raises
            except ColibriError as e:
                raise ColibriError(_named_as(str(e), {staged / n: origin for n, origin in origins.items()})) from None
            raw = dict(md.raw)
            files = dict(raw["files"])
            for n in names:
                files[n] = file_entry(staged / n)
            raw["files"] = dict(sorted(files.items()))
            with signals_deferred():  # the files and the table that lists them change together
                for n in names:
                    os.replace(staged / n, md.root / n)
                tmp = md.root / (CONFIG_NAME + ".tmp")
                tmp.write_text(json.dumps(raw, indent=1) + "\n", encoding="utf-8")
                os.replace(tmp, md.root / CONFIG_NAME)
        finally:
            with signals_deferred():
                shutil.rmtree(staged, ignore_errors=True)
    log(f"[INFO] {md.root}: imported {', '.join(names)} from {src}")
    return names


def _named_as(message: str, shown: dict) -> str:
    """An error message with each staged copy's path written as its origin's (the user's file)."""
    for copy, origin in shown.items():
        message = message.replace(str(copy), str(origin))
    return message


def validate(src: Path, vocab_size: int) -> list:
    """convert's first step: the checkpoint's text files, each checked as load will read it."""
    names = present(src)
    if names:
        TextSide.load(src, names, vocab_size)
    return names
