"""Text as it is generated: an incremental detokenizer that never shows a broken character, and
stop strings matched across token boundaries.

Design
------
TextStream: the pieces it returns concatenate to exactly `tokenizer.decode(all ids)`. Decoding a
prefix of the ids is not always a prefix of the full decode:
  - a character split over several tokens (byte-level BPE) decodes to U+FFFD until complete;
  - a run of byte-fallback pieces (<0xE6><0x97><0xA5>) is decoded as one unit, and a byte that
    makes the run invalid turns every byte of it into U+FFFD (tokenizers' ByteFallback);
  - sentencepiece's "▁" and the Metaspace/Strip decoders drop the leading space of the first
    visible token of a decode call.
So text is held back while the decode ends in U+FFFD or the last token is a byte piece, and the
window that is decoded again each step starts at a boundary that was clean when it was emitted
(vLLM's prefix/read offsets): decode(ids[prefix:]) minus decode(ids[prefix:read]). A step whose
new text is empty does not move the window (a skipped special token must not become the window's
first token, or the next token's leading space would be stripped). The cost per token is the
decode of a few tokens, not of the whole sequence.

StopStrings: text that could be the beginning of a stop string is held back until it cannot be;
the first stop string to complete ends the text (of two completing at the same character, the
one that starts earlier), and it and everything after it are cut — the same whatever pieces the
text arrives in.
"""

from __future__ import annotations


class TextStream:
    """push(token id) -> the new text (possibly ""); finish() -> whatever was held back."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = []
        self.text = ""  # everything returned so far
        self._prefix = 0  # token index where the decoded window starts
        self._read = 0  # token index up to which the window's text was returned
        self._byte_ids = tokenizer.byte_piece_ids

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _shown(self, token: int) -> bool:
        """Whether decode keeps this id (skipped specials and unknown ids vanish, and a byte run
        goes on across them)."""
        return 0 <= token < self.tokenizer.vocab_size and not (
            self.skip_special_tokens and token in self.tokenizer.special_ids
        )

    def push(self, token: int) -> str:
        token = int(token)
        self.ids.append(token)
        if not self._shown(token):
            token = next((t for t in reversed(self.ids) if self._shown(t)), None)
        if token in self._byte_ids:
            return ""  # a byte run decodes as a whole: wait for its end
        window = self.ids[self._prefix :]
        before = self._decode(self.ids[self._prefix : self._read])
        now = self._decode(window)
        if now.endswith("\ufffd") or len(now) <= len(before) or not now.startswith(before):
            return ""
        piece = now[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += piece
        return piece

    def finish(self) -> str:
        """The rest of the text, held-back characters included (as decode would show them)."""
        before = self._decode(self.ids[self._prefix : self._read])
        now = self._decode(self.ids[self._prefix :])
        piece = now[len(before) :] if now.startswith(before) else ""
        self._prefix = self._read = len(self.ids)
        self.text += piece
        return piece


class StopStrings:
    """feed(text) -> (text safe to show, stopped); finish() -> the text held back at the end."""

    def __init__(self, stops):
        stops = [stops] if isinstance(stops, str) else list(stops or [])
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = None  # the stop string that ended the text, once found

    def feed(self, text: str) -> tuple:
        if self.stopped is not None:
            return "", True
        buf = self._held + text
        first = None  # (end, start, stop): the stop a token-by-token stream meets first
        for s in self.stops:
            at = buf.find(s)
            if at >= 0 and (first is None or (at + len(s), at) < first[:2]):
                first = (at + len(s), at, s)
        if first is not None:
            self._held = ""
            self.stopped = first[2]
            return buf[: first[1]], True
        keep = 0  # the longest end of buf that begins some stop string
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:n]):
                    keep = n
                    break
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def finish(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped is not None else held


class GenerationText:
    """One generation's text, token by token: push(token) -> (new text, stopped), finish() -> the
    text held back at its end. A stop string ends it and is written into `record` (a
    model.GenerationRecord: finish_reason "stop", stop) — Model.stream_tokens and a
    batching.Batch's sequences share it."""

    def __init__(self, tokenizer, skip_special_tokens: bool, stops: StopStrings, record):
        self.text = TextStream(tokenizer, skip_special_tokens)
        self.stops, self.record = stops, record

    def push(self, token: int) -> tuple:
        shown, stopped = self.stops.feed(self.text.push(token))
        if stopped:
            self._stopped()
        return shown, stopped

    def finish(self) -> str:
        shown, stopped = self.stops.feed(self.text.finish())
        if stopped:
            self._stopped()
        return shown + self.stops.finish()

    def _stopped(self) -> None:
        self.record.finish_reason, self.record.stop = "stop", self.stops.stopped
