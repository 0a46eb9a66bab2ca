"""Speculative decoding's drafts: which tokens to verify together, and how many.

Design
------
A decoded token reads every active weight once; verifying k drafted tokens in one engine call (a
prompt chunk of the pending token and the drafts, every weight read once for all of them) costs
about one token's reads when the drafts share their experts, and yields up to k + 1 tokens. The
Model (model.Model._generate) picks each token from the logits of the position before it, with
the generation's own sampler, exactly as plain decoding does; a draft token is kept only while it
equals the token picked, and the first one that differs ends the chunk (its position onward is
overwritten by the next call). So the tokens are plain decoding's, greedy or sampled: the same
picks from the same logits (a chunk's logits are decoding's bit for bit) in the same order, the
sampler's random stream and penalties included. A draft is a point guess, so this acceptance
equals standard speculative sampling's (a draft d is accepted with probability p(d) either way).

Drafts come from text the generation is likely to repeat (prompt lookup, as llama.cpp's
`--spec-type ngram` and vLLM's `[ngram]`): the longest suffix of the context (max_n down to
min_n tokens) that occurred before, and the tokens that followed its most recent occurrence;
with a `prediction` (OpenAI's Predicted Outputs: the text the reply is expected to resemble,
such as a file being edited) the draft is what follows in it while the reply follows it token for
token, and where the reply leaves it, the prediction is searched for the reply's suffix first. The draft length adapts: after a chunk whose drafts were all accepted the
next may be as long as draft_max, after a miss it is one more than what was accepted; when the
recent acceptance falls below MIN_ACCEPTANCE drafting pauses for PAUSE_TOKENS tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# "auto": the prediction when given, else n-gram prompt lookup, else the model's multi-token-
# prediction block where it has one (colibri.nextn); "mtp": that block alone
DRAFT_SOURCES = ("none", "ngram", "mtp", "auto")
DEFAULT_DRAFT = "auto"
DEFAULT_DRAFT_MAX = 8  # draft tokens a chunk at most (llama.cpp's --draft-max is 16; MoE chunks widen the experts read)
MAX_DRAFT_MAX = 64
NGRAM_MIN, NGRAM_MAX = 2, 4  # suffix lengths looked up, longest first
MIN_ACCEPTANCE = 0.3  # recent accepted / drafted below which drafting pauses ...
PAUSE_TOKENS = 16  # ... for this many tokens
RECENT = 0.7  # the acceptance's moving average keeps this much of its past at each chunk


class NgramIndex:
    """The most recent position after each n-gram (min_n..max_n tokens) of a growing token list."""

    def __init__(self, min_n: int = NGRAM_MIN, max_n: int = NGRAM_MAX):
        self.min_n, self.max_n = min_n, max_n
        self.after = {}  # tuple of n tokens -> the index just after its latest occurrence
        self.indexed = 0  # n-grams ending before this index are in `after`

    def extend(self, tokens: list, upto: int) -> None:
        """Index the n-grams of tokens that end at indices indexed+1 .. upto (exclusive end)."""
        for end in range(max(self.indexed, 1), upto):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.after[tuple(tokens[end - n : end])] = end
        self.indexed = max(self.indexed, upto)

    def position(self, suffix_of: list, length: int) -> int | None:
        """The index just after the latest occurrence of the longest suffix of `suffix_of` this
        index holds that has a token after it (below `length`, the indexed list's); None if none."""
        for n in range(min(self.max_n, len(suffix_of)), self.min_n - 1, -1):
            at = self.after.get(tuple(suffix_of[-n:]))
            if at is not None and at < length:
                return at
        return None

    def follow(self, suffix_of: list, corpus: list, k: int) -> list:
        """Up to k tokens of `corpus` (the list this index holds) after position(); [] if none."""
        at = self.position(suffix_of, len(corpus))
        return [] if at is None else corpus[at : at + k]


@dataclass
class SpeculationStats:
    """What one generation's speculation did: engine calls that verified drafts, tokens drafted,
    tokens accepted."""

    chunks: int = 0
    drafted: int = 0
    accepted: int = 0

    def as_dict(self) -> dict:
        return {"draft_chunks": self.chunks, "drafted_tokens": self.drafted, "accepted_tokens": self.accepted}


@dataclass
class Drafter:
    """The drafts of one generation. `context`: the prompt's tokens, then each token as it is
    generated (`push`); `prediction`: the expected reply's tokens, or None."""

    context: list
    source: str = DEFAULT_DRAFT
    draft_max: int = DEFAULT_DRAFT_MAX
    prediction: list | None = None
    stats: SpeculationStats = field(default_factory=SpeculationStats)
    block: object = None  # nextn.NextnBlock: the model's multi-token-prediction block, or None

    def __post_init__(self):
        self.generated = 0
        self.length = self.draft_max
        self.recent = 1.0  # moving average of the acceptance
        self.paused = 0  # tokens left before drafting again
        self.index = NgramIndex()
        self.prediction_index = None
        self.prediction_at = None  # the prediction's index the next token is expected at, while aligned
        self.block_drafts = None  # nextn.NextnDrafter, from start_block
        if self.prediction:
            self.prediction_index = NgramIndex()
            self.prediction_index.extend(self.prediction, len(self.prediction))
            self.prediction_at = 0

    def start_block(self, start: int):
        """The block's drafter for a generation whose main-model positions start at `start`
        (nextn.NextnDrafter, fed by the caller), or None without a block."""
        if self.block is not None:
            from .nextn import NextnDrafter

            self.block_drafts = NextnDrafter(self.block, self.context, start)
        return self.block_drafts

    def push(self, token: int) -> None:
        self.context.append(int(token))
        self.generated += 1
        at = self.prediction_at
        if at is not None:  # still following the prediction, or lost until a lookup finds it again
            self.prediction_at = at + 1 if at < len(self.prediction) and self.prediction[at] == token else None
        if self.paused:
            self.paused -= 1

    def propose(self, room: int) -> list:
        """The draft to verify after the context's last token: at most min(room, the adaptive
        length) tokens; [] when there is none (or drafting is paused)."""
        k = min(room, self.length)
        if self.source == "none" or k < 1 or self.paused:
            return []
        block = self.block_drafts
        if self.source == "mtp":
            return block.propose(k) if block is not None else []
        if self.prediction_index is not None:
            if self.prediction_at is None:  # the reply left the prediction: find where it rejoins
                self.prediction_at = self.prediction_index.position(self.context, len(self.prediction))
            if self.prediction_at is not None and self.prediction_at < len(self.prediction):
                return self.prediction[self.prediction_at : self.prediction_at + k]
        self.index.extend(self.context, len(self.context))
        return self.index.follow(self.context, self.context, k) or (block.propose(k) if block is not None else [])

    def verified(self, drafted: int, accepted: int) -> None:
        """A chunk's outcome: the next draft's length and whether drafting pauses."""
        if not drafted:
            return
        self.stats.chunks += 1
        self.stats.drafted += drafted
        self.stats.accepted += accepted
        self.length = self.draft_max if accepted == drafted else max(1, accepted + 1)
        self.recent = RECENT * self.recent + (1 - RECENT) * (accepted / drafted)
        if self.recent < MIN_ACCEPTANCE:
            self.paused, self.recent = PAUSE_TOKENS, MIN_ACCEPTANCE  # try again later, from the threshold
