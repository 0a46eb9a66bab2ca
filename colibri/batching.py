"""Batch: several generations decoding together on one Model loaded with `parallel=N`.

Design
------
A Model loaded with parallel=N holds N sequences side by side in its KV cache. A Batch owns the
Model while it is open (generate() is refused meanwhile) and advances its sequences in steps,
each ONE engine pass (Engine.step: every weight read once for all its tokens, the experts any of
them chose) over at most `step_tokens` tokens:

    one token of every decoding sequence, then
    pieces of the prompts not yet run, in the order they were added, with the tokens left
    (at least one: a prompt always advances); a prompt's first piece goes to a free place in
    the cache after the longest prefix that place still holds (a conversation's next turn) or
    the model's prefix store holds (colibri.kvstore). With a store, a prompt whose first block or
    more a running prompt is still computing waits until that one has run past them (its blocks
    are stored as it goes) and then starts from them: a system prompt shared by requests
    arriving together is computed once.

So a long prompt does not stall the others' tokens: they come every step, and a step costs
about a pass over `step_tokens` tokens (vLLM's chunked prefill; llama-server runs a whole prompt
batch at once). A sequence whose prompt completes samples its first token from that step's
logits (the head runs only for the tokens whose logits are used). Each sequence samples with its
own Sampler (and constraint: json_schema, grammar, ...) and stops at its own EOS, length or
stop string, so its tokens are those generate() gives for it alone: no kernel's arithmetic
depends on the tokens beside it (tests/test_batching.py holds the logits to the same bits). A
step returns its events, (sequence, token, pick, text).
"""

from __future__ import annotations

import numpy as np

from .errors import ColibriError
from .kvstore import BLOCK_TOKENS
from .names import DEFAULT_STEP_TOKENS
from .streaming import GenerationText


class Sequence:
    """One generation of a Batch. `record` is its model.GenerationRecord (tokens, picks,
    finish_reason); `done` once it has finished or was cancelled."""

    def __init__(self, prompt: np.ndarray, max_new_tokens: int, sampler, eos: set, record, text, drafter=None):
        self.prompt, self.max_new_tokens = prompt, max_new_tokens
        self.sampler, self.eos, self.record, self.text = sampler, eos, record, text
        self.drafter = drafter  # speculate.Drafter, or None (no drafts)
        self.slot = None  # its sequence in the model's KV cache, once placed
        self.fed = 0  # prompt tokens in its cache
        self.pos = 0  # the position of `pending`
        self.pending = None  # the sampled token not yet run through the model
        self.done = False
        self.error = None  # what ended it, if its sampling or text failed

    def _take(self, logits: np.ndarray) -> tuple:
        """Sample the next token from logits [vocab]; (token, pick), `done` set at EOS or length."""
        pick = self.sampler.pick(logits)
        self.record.tokens.append(pick.token)
        self.record.picks.append(pick)
        if pick.token in self.eos or self.sampler.finished:  # finished: its constraint's EOS
            self.record.finish_reason = "stop"
            self.done = True
        elif len(self.record.tokens) >= self.max_new_tokens:
            self.done = True
        self.pending = None if self.done else pick.token
        return pick.token, pick


class Batch:
    """Generations on one Model decoded together: add() them, call step() until `running` is
    empty. Use as a context manager (or close()): the Model is held until then. step_tokens:
    the most tokens a step runs (default DEFAULT_STEP_TOKENS, at most the model's prefill chunk).
    One thread drives a Batch (the server's Stepper): it is not safe to share between threads."""

    def __init__(self, model, step_tokens: int | None = None):
        if step_tokens is not None and (
            isinstance(step_tokens, bool) or not isinstance(step_tokens, int) or step_tokens < 1
        ):
            raise ColibriError(f"step_tokens must be a positive integer, got {step_tokens!r}")
        self.model = model
        self.step_tokens = min(step_tokens or DEFAULT_STEP_TOKENS, model._chunk)
        self._hold = model._exclusive()
        self._hold.__enter__()
        try:
            model._begin()
        except BaseException:  # a closed Model: give it back
            self._hold.__exit__(None, None, None)
            raise
        self._free = list(range(model.parallel))  # places in the KV cache, least recently used first
        self._waiting = []  # added, not placed yet
        self._prefilling = []  # placed, prompt partly run
        self._decoding = []  # prompt run, a token pending
        self._closed = False

    @property
    def running(self) -> list:
        """The sequences not finished yet."""
        return self._waiting + self._prefilling + self._decoding

    @property
    def room(self) -> int:
        """How many more sequences add() takes now."""
        return len(self._free) - len(self._waiting)

    def add(
        self,
        ids,
        max_new_tokens: int = 64,
        *,
        stop=None,
        skip_special_tokens: bool = True,
        temperature=None,
        top_k=None,
        top_p=None,
        seed: int | None = 0,
        stop_at_eos: bool = True,
        min_p=None,
        repetition_penalty=None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logprobs=None,
        json_schema=None,
        grammar=None,
        regex=None,
        json_object: bool = False,
        logit_bias=None,
        draft=None,
        draft_max=None,
        prediction=None,
    ) -> Sequence:
        """A new sequence for prompt `ids` (token ids), with generate()'s settings and checks
        (seed=None and at most one of json_schema / json_object / grammar / regex included) and
        stream_tokens()' stop strings; it starts at the next step(). ColibriError when all
        `model.parallel` places are taken (see `room`)."""
        self._check_open()
        m = self.model
        if self.room < 1:
            raise ColibriError(f"all {m.parallel} sequences of this model are running (load it with a larger parallel)")
        prompt, sampler, eos, record = m._prepare_generation(
            ids,
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            stop_at_eos=stop_at_eos,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            logprobs=logprobs,
            json_schema=json_schema,
            grammar=grammar,
            regex=regex,
            json_object=json_object,
            logit_bias=logit_bias,
        )
        drafter = m._drafter(prompt, draft, draft_max, prediction, record, batched=True)
        stops = m._stop_strings(stop)
        if stops.stops:
            m._need_tokenizer()
        text = GenerationText(m.tokenizer, skip_special_tokens, stops, record) if m.tokenizer is not None else None
        seq = Sequence(prompt, int(max_new_tokens), sampler, eos, record, text, drafter)
        record.finish_reason = "length"
        self._waiting.append(seq)
        return seq

    def step(self) -> list:
        """One engine pass: a token of every decoding sequence and pieces of the prompts (see the
        module's design). [(sequence, token, sampling.Pick, text)]: the decoding sequences' tokens,
        then the first tokens of the prompts that completed. `text` is what the token adds to the
        sequence's text (stream_tokens' pieces; "" without a tokenizer), the text held back to
        the end included in its last token's. A sequence whose token ends it (EOS, its length, a
        stop string) is finished and its place freed. A sequence whose sampling or text fails
        is finished with `error` set and its event is (sequence, None, None, ""); the others go
        on. An engine failure raises (the step's sequences stay as they were: cancel them).
        Nothing to run: []."""
        self._check_open()
        m = self.model
        deferred = []
        for seq in self._waiting:  # every waiting sequence has a place by now ...
            if self._waits_for_a_prompt(seq):  # ... unless a running prompt is computing its prefix
                deferred.append(seq)
                continue
            self._place(seq)
            self._prefilling.append(seq)
        self._waiting = deferred
        # a decoding sequence's part: its pending token and its drafts (every row's logits wanted),
        # the drafts within what the step leaves: a token for each other decoding sequence, and one
        # for the prompts waiting, under step_tokens and the chunk
        spare = min(self.step_tokens, m._chunk) - len(self._decoding) - (1 if self._prefilling else 0)
        parts, drafted = [], {}
        for seq in self._decoding:
            draft = []
            if seq.drafter is not None and spare > 0:
                room = min(spare, seq.max_new_tokens - len(seq.record.tokens) - 1, m.n_ctx - seq.pos - 1, m._chunk - 1)
                draft = seq.drafter.propose(room)
                spare -= len(draft)
            drafted[id(seq)] = draft
            parts.append((seq, np.array([seq.pending, *draft], np.int32), seq.pos, True))
        used = sum(len(p[1]) for p in parts)
        quota = min(max(self.step_tokens - used, 1), m._chunk - used)
        for seq in self._prefilling:
            if quota < 1:
                break
            k = min(quota, len(seq.prompt) - seq.fed)
            parts.append((seq, seq.prompt[seq.fed : seq.fed + k], seq.fed, seq.fed + k == len(seq.prompt)))
            quota -= k
        if not parts:
            return []
        tokens = np.concatenate([p[1] for p in parts]).astype(np.int32)
        slots = np.concatenate([np.full(len(p[1]), p[0].slot, np.int32) for p in parts])
        positions = np.concatenate([np.arange(p[2], p[2] + len(p[1]), dtype=np.int32) for p in parts])
        want = np.concatenate(
            [
                np.ones(len(p[1]), bool)
                if p[0].pending is not None
                else np.arange(len(p[1])) == len(p[1]) - 1
                if p[3]
                else np.zeros(len(p[1]), bool)
                for p in parts
            ]
        ).astype(np.uint8)
        logits = np.empty((max(int(want.sum()), 1), m.config.vocab_size), np.float32)
        m._step(tokens, slots, positions, logits, want)
        events, row = [], 0
        for seq, piece, start, last in parts:
            if seq.pending is not None:  # a decoding sequence's token and drafts
                row = self._verify(seq, drafted[id(seq)], logits, row, events)
                continue
            else:  # a prompt's piece
                seq.fed = start + len(piece)
                if not last:
                    if seq.fed // BLOCK_TOKENS > start // BLOCK_TOKENS:
                        m._save_prefix(seq.slot)  # its new blocks, for the prompts that wait for them
                    continue
                self._prefilling.remove(seq)
                seq.pos = len(seq.prompt)
                m._save_prefix(seq.slot)  # the prompt, for the other places
            try:
                events.append(self._emit(seq, logits[row]))
                if seq.drafter is not None and not seq.done:
                    seq.drafter.push(seq.pending)
            except Exception as e:  # noqa: BLE001 - this sequence alone ends, with its error
                seq.error = e
                self._finish(seq)
                events.append((seq, None, None, ""))
            row += 1
        return events

    def _verify(self, seq: Sequence, draft: list, logits: np.ndarray, row: int, events: list) -> int:
        """A decoding sequence's step: its pending token ran at seq.pos and its drafts after it;
        its next token is picked from the pending token's row, and while each pick equals the
        draft after it (whose keys and values are then in the cache) the next from that draft's
        row, as generate() does (colibri.speculate). The picks' events go to `events`; the row
        after this sequence's is returned."""
        seq.pos += 1
        accepted = 0
        last = None  # (index, token) of the last pick
        try:
            for j in range(len(draft) + 1):
                event = self._emit(seq, logits[row + j])
                events.append(event)
                last = (j, event[1])
                if seq.done:
                    break
                if seq.drafter is not None:
                    seq.drafter.push(event[1])
                if j == len(draft) or event[1] != draft[j]:
                    break
                seq.pos += 1  # the draft picked: it already ran at this position
                accepted += 1
        except Exception as e:  # noqa: BLE001 - this sequence alone ends, with its error
            seq.error = e
            self._finish(seq)
            events.append((seq, None, None, ""))
        if seq.drafter is not None:
            if seq.done and last is not None and last[0] < len(draft) and last[1] == draft[last[0]]:
                accepted += 1  # the last token was drafted
            seq.drafter.verified(len(draft), accepted)
        return row + len(draft) + 1

    def cancel(self, seq: Sequence) -> None:
        """Stop `seq` now (a client that left); its place is freed. No-op once it is done."""
        if seq.done:
            return
        if seq in self._waiting:
            self._waiting.remove(seq)
        elif seq in self._prefilling:
            self._prefilling.remove(seq)
        self._finish(seq)

    def close(self) -> None:
        """Cancel what still runs and give the Model back. Idempotent."""
        if self._closed:
            return
        for seq in list(self.running):
            self.cancel(seq)
        self._closed = True
        self._hold.__exit__(None, None, None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- inside --

    def _place(self, seq: Sequence) -> None:
        """Seq's place: the free one whose cache holds the longest prefix of its prompt (a
        conversation's next turn), else the least recently used one; the prompt then runs from
        the end of that prefix, or of a longer one the model's prefix store (colibri.kvstore)
        holds, copied into the place."""
        held = [self.model._reusable_prefix(seq.prompt, slot) for slot in self._free]
        best = max(range(len(held)), key=lambda i: (held[i], -i))
        seq.slot = self._free.pop(best)
        seq.fed = seq.record.reused_tokens = self.model._restore_prefix(seq.prompt, seq.slot, held[best])
        seq.sampler.reset(seq.prompt)

    def _waits_for_a_prompt(self, seq: Sequence) -> bool:
        """Whether seq should wait for a prompt being run that is still computing a block or more
        of seq's first tokens (a shared system prompt): with a prefix store, that prompt's blocks
        are stored as it runs past them and seq then starts from them, so the shared part is
        computed once, not once per place."""
        if self.model.prefix_store is None:
            return False
        for other in self._prefilling:
            n = min(len(seq.prompt), len(other.prompt))
            if n < BLOCK_TOKENS or other.fed >= n // BLOCK_TOKENS * BLOCK_TOKENS:
                continue
            same = seq.prompt[:n] == other.prompt[:n]
            shared = n if same.all() else int(np.argmin(same))
            if other.fed < shared // BLOCK_TOKENS * BLOCK_TOKENS:
                return True
        return False

    def _emit(self, seq: Sequence, logits: np.ndarray) -> tuple:
        token, pick = seq._take(logits)
        shown = ""
        if seq.text is not None:
            shown, stopped = seq.text.push(token)
            if stopped:
                seq.done = True
            elif seq.done:
                shown += seq.text.finish()
        if seq.done:
            self._finish(seq)
        elif seq not in self._decoding:
            self._decoding.append(seq)
        return seq, token, pick, shown

    def _finish(self, seq: Sequence) -> None:
        seq.done = True
        seq.pending = None
        if seq in self._decoding:
            self._decoding.remove(seq)
        if seq.slot is not None:
            self.model._save_prefix(seq.slot)  # its prompt and reply, for whichever place comes next
            self._free.append(seq.slot)

    def _check_open(self) -> None:
        if self._closed:
            raise ColibriError("this Batch is closed")
