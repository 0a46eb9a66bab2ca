"""Batch: several generations decoding together on one Model loaded with `parallel=N`.

Design
------
A Model loaded with parallel=N holds N sequences side by side in its KV cache. A Batch owns the
Model while it is open (generate() is refused meanwhile) and advances its sequences in steps:

    step():  the prompts of the sequences added since the last step, each in a free sequence of
             the cache (a prefill chunk at a time, after the longest prefix that sequence still
             holds), each then sampling its first token;
             one token of every other running sequence, all in one engine pass (Engine.step:
             every weight read once for all of them, the experts any of them chose).

Each sequence samples with its own Sampler and stops at its own EOS, length or stop string, so
its tokens are those generate() gives for it alone: no kernel's arithmetic depends on the tokens
beside it (tests/test_batching.py holds the logits to the same bits). A step returns its events,
(sequence, token, pick); a finished sequence frees its place in the cache for the next add()
(whose prompt may share a prefix with what that place holds: a conversation's next turn).
"""
from __future__ import annotations

import numpy as np

from .errors import ColibriError
from .streaming import GenerationText, StopStrings


class Sequence:
    """One generation of a Batch. `record` is its model.GenerationRecord (tokens, picks,
    finish_reason); `done` once it has finished or was cancelled."""

    def __init__(self, prompt: np.ndarray, max_new_tokens: int, sampler, eos: set, record, text):
        self.prompt, self.max_new_tokens = prompt, max_new_tokens
        self.sampler, self.eos, self.record, self.text = sampler, eos, record, text
        self.slot = None                 # its sequence in the model's KV cache while it runs
        self.pos = 0                     # the position of `pending`
        self.pending = None              # the sampled token not yet run through the model
        self.done = False

    def _take(self, logits: np.ndarray) -> tuple:
        """Sample the next token from logits [vocab]; (token, pick), `done` set at EOS or length."""
        pick = self.sampler.pick(logits)
        self.record.tokens.append(pick.token)
        self.record.picks.append(pick)
        if pick.token in self.eos:
            self.record.finish_reason = "stop"
            self.done = True
        elif len(self.record.tokens) >= self.max_new_tokens:
            self.done = True
        self.pending = None if self.done else pick.token
        return pick.token, pick


class Batch:
    """Generations on one Model decoded together: add() them, call step() until `running` is
    empty. Use as a context manager (or close()): the Model is held until then."""

    def __init__(self, model):
        self.model = model
        self._hold = model._exclusive()
        self._hold.__enter__()
        model._begin()
        self._free = list(range(model.parallel))      # places in the KV cache, least recently used first
        self._new = []                                # added, prompt not run yet
        self._running = []                            # prompt run, decoding
        self._closed = False

    @property
    def running(self) -> list:
        """The sequences not finished yet, in the order they were added."""
        return self._new + self._running

    @property
    def room(self) -> int:
        """How many more sequences add() takes now."""
        return len(self._free) - len(self._new)

    def add(self, ids, max_new_tokens: int = 64, *, stop=None, skip_special_tokens: bool = True,
            temperature=None, top_k=None, top_p=None, seed: int = 0, stop_at_eos: bool = True, min_p=None,
            repetition_penalty=None, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
            logprobs=None) -> Sequence:
        """A new sequence for prompt `ids` (token ids), with generate()'s settings and checks and
        stream_tokens()' stop strings; it starts at the next step(). ColibriError when all
        `model.parallel` places are taken (see `room`)."""
        self._check_open()
        m = self.model
        if self.room < 1:
            raise ColibriError(f"all {m.parallel} sequences of this model are running (load it with a larger parallel)")
        prompt, sampler, eos, record = m._prepare_generation(
            ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
            stop_at_eos=stop_at_eos, min_p=min_p, repetition_penalty=repetition_penalty,
            presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, logprobs=logprobs)
        stops = StopStrings(stop)
        if not all(isinstance(s, str) for s in stops.stops):
            raise ColibriError(f"stop must be a string or a list of strings, got {stop!r}")
        text = GenerationText(m.tokenizer, skip_special_tokens, stops, record) if m.tokenizer is not None else None
        if stops.stops and text is None:
            m._need_tokenizer()
        seq = Sequence(prompt, int(max_new_tokens), sampler, eos, record, text)
        record.finish_reason = "length"
        self._new.append(seq)
        return seq

    def step(self) -> list:
        """Run the new sequences' prompts and one token of every other running sequence:
        [(sequence, token, sampling.Pick, text)], the new sequences' first. `text` is what the
        token adds to the sequence's text (stream_tokens' pieces; "" without a tokenizer), the
        text held back to the end included in its last token's. A sequence whose token ends it
        (EOS, its length, a stop string) is finished and its place freed."""
        self._check_open()
        m = self.model
        events = []
        new, self._new = self._new, []
        for seq in new:
            seq.slot = self._place_for(seq.prompt)
            common = m._reusable_prefix(seq.prompt, seq.slot)
            seq.record.reused_tokens = common
            seq.sampler.reset(seq.prompt)
            logits = np.empty((1, m.config.vocab_size), np.float32)
            m._run(seq.prompt[common:], common, logits, all_logits=False, seq=seq.slot)
            seq.pos = len(seq.prompt)
            events.append(self._emit(seq, logits[0]))
        decoding = [s for s in self._running if s not in new]
        if decoding:
            tokens = np.array([s.pending for s in decoding], np.int32)
            slots = np.array([s.slot for s in decoding], np.int32)
            positions = np.array([s.pos for s in decoding], np.int32)
            logits = np.empty((len(decoding), m.config.vocab_size), np.float32)
            m._step(tokens, slots, positions, logits)
            for i, seq in enumerate(decoding):
                seq.pos += 1
                events.append(self._emit(seq, logits[i]))
        return events

    def cancel(self, seq: Sequence) -> None:
        """Stop `seq` now (a client that left); its place is freed. No-op once it is done."""
        if seq in self._new:
            self._new.remove(seq)
            seq.done = True
        elif not seq.done:
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
        elif seq not in self._running:
            self._running.append(seq)
        return seq, token, pick, shown

    def _finish(self, seq: Sequence) -> None:
        seq.done = True
        if seq in self._running:
            self._running.remove(seq)
        if seq.slot is not None:
            self._free.append(seq.slot)

    def _place_for(self, prompt: np.ndarray) -> int:
        """The free place whose cache holds the longest prefix of `prompt` (a conversation's next
        turn), else the least recently used one."""
        best = max(self._free, key=lambda slot: (self.model._reusable_prefix(prompt, slot), -self._free.index(slot)))
        self._free.remove(best)
        return best

    def _check_open(self) -> None:
        if self._closed:
            raise ColibriError("this Batch is closed")
