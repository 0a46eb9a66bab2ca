"""Text <-> token ids: sentencepiece when the model directory has `tokenizer.model`.

Without one, Colibri works on raw token ids (`run --tokens 1,2,3`, `generate(ids)`).
"""
from __future__ import annotations

from .errors import ColibriError

TOKENIZER_FILE = "tokenizer.model"


class Tokenizer:
    def __init__(self, path):
        import sentencepiece

        self.path = str(path)
        self.sp = sentencepiece.SentencePieceProcessor()
        try:
            self.sp.Load(self.path)
        except (OSError, RuntimeError) as e:
            raise ColibriError(f"{self.path}: not a valid sentencepiece model ({e})") from None

    @classmethod
    def from_dir(cls, model_dir) -> "Tokenizer | None":
        """The tokenizer of a validated ModelDir, or None when it has none."""
        path = model_dir.root / TOKENIZER_FILE
        if TOKENIZER_FILE not in model_dir.files:
            return None
        tok = cls(path)
        if tok.vocab_size > model_dir.config.vocab_size:
            raise ColibriError(f"{path}: tokenizer has {tok.vocab_size} pieces but the model's vocab_size "
                               f"is {model_dir.config.vocab_size}")
        return tok

    @property
    def vocab_size(self) -> int:
        return self.sp.GetPieceSize()

    def encode(self, text: str, bos: int | None = None) -> list:
        ids = list(self.sp.EncodeAsIds(text))
        return ([bos] if bos is not None else []) + ids

    def decode(self, ids) -> str:
        return self.sp.DecodeIds([int(i) for i in ids if 0 <= int(i) < self.vocab_size])
