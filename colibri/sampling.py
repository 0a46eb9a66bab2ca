"""Choosing the next token from logits: greedy or seeded sampling with penalties and truncation.

Runs once per generated token in Python/numpy on a [vocab] float vector (vocabularies up to
262,144); the model's work is in the engine, which decodes a token in about 5-20 ms, so nothing
here sorts the whole vocabulary when it can be avoided.

    s = Sampler(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.1, seed=1, logprobs=5)
    s.reset(prompt_ids)              # start of a generation: the penalty history is the prompt
    p = s.pick(logits)               # Pick(token, logprob, top); records the token in the history
    token = s(logits)                # the same, token id only

Sampler(temperature, top_k, top_p, seed) positionally, as before; min_p, the penalties,
logprobs and constraint are keyword-only. describe() is one line of the non-default settings
("greedy" ...).

Order of operations (as transformers' generate does; 2b is Colibri's)
    1. repetition_penalty (transformers' RepetitionPenaltyLogitsProcessor): for every distinct
       token id in prompt + generated so far, a logit > 0 is divided by the penalty, a logit <= 0
       multiplied by it. 1 = off; any finite value > 0.
    2. presence_penalty, frequency_penalty (OpenAI's definition, over the GENERATED tokens only,
       as vLLM does): logit[j] -= presence * (count[j] > 0) + frequency * count[j]. Each in
       [-2, 2]; 0 = off. The amount is computed in float64 and the result stored in the logits'
       dtype (float32 from the engine). Steps 1-2 touch only the ids in the history.
    2a. logit_bias ({token id: bias in [-100, 100]}, OpenAI's): added to those logits (in the
       penalised copy), after the penalties.
    2b. constraint (colibri.constraint.Constraint; None = off): every token its grammar does not
       allow next becomes -inf (in a scratch copy: the caller's logits are never written), so
       greedy is the argmax over the allowed tokens and sampling draws from the distribution
       renormalised over them; the chosen token is then consumed by the constraint. Only the
       stop tokens are allowed once the grammar is complete; `finished` turns true when one of
       them is chosen. A position where the grammar allows no token is a ColibriError.
    3. temperature: z = (logit - max logit) / temperature, in float64. Temperature 0 is greedy:
       the argmax of the penalised logits, lowest id on ties; steps 3-7 are skipped, the random
       generator is not advanced.
    4. top_k: keep the k most likely tokens (0 or >= vocab: off).
    5. top_p: keep the smallest set of most likely tokens whose probability mass is >= top_p (at
       least one); 1 = off. Probabilities are e = exp(z) over the sum S of e over the tokens
       top_k kept (the whole vocabulary when top_k is off), S summed in id order; the mass is the
       running sum (np.cumsum) of e / S in rank order.
    6. min_p (transformers' MinPLogitsWarper): drop tokens whose probability is below min_p times
       the top probability, i.e. keep e >= min_p (the top token has e = 1, so one always stays).
       In [0, 1]; 0 = off. Renormalising after top_p does not change these ratios.
    7. draw: one uniform u = rng.random() per non-greedy token (even when one token is left);
       the token is the inverse CDF of the survivors' weights e taken in ascending id order at
       u * their sum. Tokens of probability 0 (logit -inf, or exp underflow) are never drawn.

"Most likely" ranks tokens by penalised logit, descending, ties by lower id first (so top_k 1 is
greedy at any temperature). The fast paths give exactly the result of that full-sort definition:
top_k and the top-n logprobs take candidates by a threshold that is at most the k-th largest
value (the k-th largest of strided block maxima), which includes every tie, and sort only those;
top_p without top_k grows such a candidate set (64, 512, 4096, ... most likely) until its mass
reaches top_p (or min_p has already cut inside it); the probabilities and running sums are the
same float64 operations on the same values as the full sort's prefix. `distribution(logits)`
returns the survivors and their probabilities, for tests and inspection. The [vocab] float64
temporaries live in scratch arrays kept by the Sampler (a fresh 2 MB array per token costs page
faults, ~2 ms at 262,144), so one Sampler serves one generation at a time, not several threads.

Logprobs (logprobs = n in 0..20; None = off): the natural log of p(token) under the model's own
distribution, log_softmax of the raw logits (before penalties, the constraint, temperature and
truncation, as vLLM and OpenAI report), in float64; `top` lists the n most likely tokens of that
distribution, most likely first, ties by lower id.

Reproducible: one numpy default_rng(seed) per Sampler; the same seed, settings and sequence of
logits give the same tokens. seed=None draws a fresh seed from the OS (secrets, 63 bits) and
keeps it in `sampler.seed`, so a random generation can be reported and replayed. reset() clears
the penalty history and restarts the constraint, not the generator.

Errors: every bad setting (NaN, inf, bool, wrong type, out of range) raises ColibriError naming
the parameter, the allowed range and the value received; logits containing NaN or +inf (also
after penalties), or only -inf, are an error too, never a silent pick.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import numpy as np

from .errors import ColibriError

MAX_LOGPROBS = 20
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a logit bias: [-100, 100]
SEED_BITS = 63  # seed=None: a random seed that fits a signed 64-bit integer
REPETITION_PENALTY_RANGE = (1e-30, 1e30)  # float32 logits divided or multiplied by it stay finite, non-zero
_GROWTH = (64, 512, 4096)  # top_p candidate set sizes; then x8 until the vocabulary
_DRAW_BLOCK = 1024  # the inverse CDF in two levels beyond this many weights


@dataclass(frozen=True)
class Pick:
    """One chosen token. logprob: natural log p(token) under log_softmax of the raw logits (None
    when logprobs are off); top: ((id, logprob), ...) the `logprobs` most likely tokens of that
    distribution, most likely first, ties by lower id (() when off)."""

    token: int
    logprob: float | None = None
    top: tuple = ()


def _is_real(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _real(name, v, ok, expected):
    if not _is_real(v) or not math.isfinite(v) or not ok(float(v)):
        raise ColibriError(f"{name} must be {expected}, got {v!r}")
    return float(v)


def _fmt(v) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


def _ranked_top(x: np.ndarray, m: int, mask: np.ndarray | None = None) -> np.ndarray:
    """Ids of at least the m largest entries of x (every tie of the m-th included), ranked by
    value descending, id ascending. x has no NaN. Sorts only the candidates. mask: an optional
    bool scratch array like x."""
    n = x.shape[0]
    if m >= n:
        cand = np.arange(n)
    else:
        rows = min(64, n // (16 * m))
        if rows >= 2:
            # the m-th largest of the column maxima is <= the m-th largest entry (m distinct
            # entries reach it), so x >= t keeps the top m and all their ties
            cols = n // rows
            maxima = x[: rows * cols].reshape(rows, cols).max(axis=0)
            t = np.partition(maxima, cols - m)[cols - m]
        else:
            t = np.partition(x, n - m)[n - m]
        cand = np.flatnonzero(np.greater_equal(x, t, out=mask))
    return cand[np.argsort(-x[cand], kind="stable")]


def _draw(w: np.ndarray, u: float) -> int:
    """Index of the inverse CDF of weights w (>= 0, some > 0) at u * their sum, u in [0, 1);
    never an index of weight 0."""
    n = w.shape[0]
    if n <= 2 * _DRAW_BLOCK:
        c = np.cumsum(w)
        j = int(np.searchsorted(c, u * c[-1], side="right"))
        return j if j < n else int(np.flatnonzero(w)[-1])
    starts = np.arange(0, n, _DRAW_BLOCK)
    sums = np.add.reduceat(w, starts)
    cb = np.cumsum(sums)
    target = u * cb[-1]
    b = int(np.searchsorted(cb, target, side="right"))
    if b >= len(cb):
        b = int(np.flatnonzero(sums)[-1])
    lo = int(starts[b])
    wb = w[lo : lo + _DRAW_BLOCK]
    c = np.cumsum(wb)
    j = int(np.searchsorted(c, target - (cb[b - 1] if b else 0.0), side="right"))
    return lo + (j if j < len(wb) else int(np.flatnonzero(wb)[-1]))


def _check_max(value, index_of, what):
    """Raise for a NaN / +inf / -inf maximum of a logits vector (NaN propagates through max)."""
    if math.isnan(value):
        raise ColibriError(f"{what} contain NaN (at id {index_of()}); expected finite numbers or -inf")
    if value == math.inf:
        raise ColibriError(f"{what} contain +inf (at id {index_of()}); expected finite numbers or -inf")
    if value == -math.inf:
        raise ColibriError(f"{what} are all -inf; no token can be chosen")


def _check_bias(logit_bias) -> tuple:
    """(ids int64 [n], biases float64 [n]) of {token id: bias}; None or {} is no bias."""
    if logit_bias is None:
        return np.empty(0, np.int64), np.empty(0, np.float64)
    if not isinstance(logit_bias, dict):
        raise ColibriError(f"logit_bias must be a dict {{token id: bias}}, got {type(logit_bias).__name__}")
    for token, bias in logit_bias.items():
        if not _is_int(token) or token < 0:
            raise ColibriError(f"logit_bias keys must be token ids >= 0, got {token!r}")
        if not _is_real(bias) or not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
            raise ColibriError(
                f"logit_bias values must be numbers in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], "
                f"got {bias!r} for id {token}"
            )
    ids = np.fromiter((int(t) for t in logit_bias), np.int64, len(logit_bias))
    return ids, np.fromiter((float(b) for b in logit_bias.values()), np.float64, len(logit_bias))


class Sampler:
    """Greedy or seeded sampling with penalties, top_k / top_p / min_p and logprobs; see the
    module docstring for the exact semantics."""

    def __init__(
        self,
        temperature=0.0,
        top_k=0,
        top_p=1.0,
        seed=0,
        *,
        min_p=0.0,
        repetition_penalty=1.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        logprobs=None,
        constraint=None,
        logit_bias=None,
    ):
        # seed stays the 4th positional parameter (the original Sampler(temperature, top_k,
        # top_p, seed)); the newer settings are keyword-only. seed None: a random one.
        self.temperature = _real("temperature", temperature, lambda v: v >= 0, "a finite number >= 0 (0: greedy)")
        if not _is_int(top_k) or top_k < 0:
            raise ColibriError(f"top_k must be an integer >= 0 (0: off), got {top_k!r}")
        self.top_k = int(top_k)
        self.top_p = _real("top_p", top_p, lambda v: 0 < v <= 1, "a number in (0, 1] (1: off)")
        self.min_p = _real("min_p", min_p, lambda v: 0 <= v <= 1, "a number in [0, 1] (0: off)")
        # logits are float32: a penalty (or its reciprocal) beyond float32's range would divide
        # them to 0 or infinity
        self.repetition_penalty = _real(
            "repetition_penalty",
            repetition_penalty,
            lambda v: REPETITION_PENALTY_RANGE[0] <= v <= REPETITION_PENALTY_RANGE[1],
            "a number in [1e-30, 1e30] (1: off)",
        )
        self.presence_penalty = _real(
            "presence_penalty", presence_penalty, lambda v: -2 <= v <= 2, "a number in [-2, 2] (0: off)"
        )
        self.frequency_penalty = _real(
            "frequency_penalty", frequency_penalty, lambda v: -2 <= v <= 2, "a number in [-2, 2] (0: off)"
        )
        if seed is None:
            seed = secrets.randbits(SEED_BITS)
        if not _is_int(seed) or seed < 0:
            raise ColibriError(f"seed must be an integer >= 0 or None (random), got {seed!r}")
        self.seed = int(seed)
        if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= MAX_LOGPROBS):
            raise ColibriError(f"logprobs must be None (off) or an integer in [0, {MAX_LOGPROBS}], got {logprobs!r}")
        self.logprobs = None if logprobs is None else int(logprobs)
        if constraint is not None and not all(hasattr(constraint, a) for a in ("apply", "consume", "reset")):
            raise ColibriError(f"constraint must be a colibri.constraint.Constraint, got {type(constraint).__name__}")
        self.constraint = constraint
        self._bias_ids, self._bias = _check_bias(logit_bias)  # [n] token ids, [n] float64 biases
        self.rng = np.random.default_rng(self.seed)
        self._scratch = {}
        self._repeat = self.repetition_penalty != 1.0
        self._count = self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        self.reset(())

    # ---- history -------------------------------------------------------------------------
    def reset(self, prompt_ids) -> None:
        """Start of a generation: the penalty history becomes the prompt (repetition_penalty
        counts it; presence/frequency count generated tokens only). The constraint starts
        again. The generator is kept."""
        ids = prompt_ids if isinstance(prompt_ids, np.ndarray) else np.asarray(list(prompt_ids))
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise ColibriError(
                f"prompt_ids must be a flat sequence of integer token ids, got {ids.ndim}-D values of type {ids.dtype}"
            )
        ids = ids.astype(np.int64)
        if ids.size and ids.min() < 0:
            raise ColibriError(f"prompt_ids must be token ids >= 0, got {int(ids.min())}")
        self._max_id = int(ids.max()) if ids.size else -1
        self._seen_ids = np.empty(0, np.int64)  # distinct ids of prompt + generated
        self._seen_n = 0
        self._seen = set()
        if self._repeat:
            uniq = np.unique(ids)
            self._seen_ids = np.empty(max(64, 2 * uniq.size), np.int64)
            self._seen_ids[: uniq.size] = uniq
            self._seen_n = uniq.size
            self._seen = set(uniq.tolist())
        self._gen_ids = np.empty(64, np.int64)  # distinct generated ids and their counts
        self._gen_counts = np.zeros(64, np.float64)
        self._gen_n = 0
        self._gen_slot = {}
        if self.constraint is not None:
            self.constraint.reset()

    @property
    def finished(self) -> bool:
        """Whether the constraint has ended the output (a stop token after a complete grammar):
        the generation ends there, whatever stop_at_eos says. False without a constraint."""
        return self.constraint is not None and self.constraint.finished

    def _record(self, token: int) -> None:
        self._max_id = max(self._max_id, token)
        if self._repeat and token not in self._seen:
            if self._seen_n == self._seen_ids.size:
                self._seen_ids = np.resize(self._seen_ids, 2 * self._seen_ids.size)
            self._seen_ids[self._seen_n] = token
            self._seen_n += 1
            self._seen.add(token)
        if self._count:
            slot = self._gen_slot.get(token)
            if slot is None:
                slot = self._gen_slot[token] = self._gen_n
                if slot == self._gen_ids.size:
                    self._gen_ids = np.resize(self._gen_ids, 2 * slot)
                    self._gen_counts = np.concatenate([self._gen_counts, np.zeros(slot)])
                self._gen_ids[slot] = token
                self._gen_n += 1
            self._gen_counts[slot] += 1.0

    # ---- the pipeline --------------------------------------------------------------------
    @staticmethod
    def _as_logits(logits) -> np.ndarray:
        a = logits if isinstance(logits, np.ndarray) else np.asarray(logits)
        if a.ndim != 1 or a.size == 0 or a.dtype.kind != "f":
            raise ColibriError(
                f"logits must be a non-empty 1-D float array [vocab], got shape {a.shape} of type {a.dtype}"
            )
        if a.dtype not in (np.float32, np.float64):
            a = a.astype(np.float32)
        return a

    def penalized(self, logits) -> np.ndarray:
        """The logits after repetition and presence/frequency penalties for the current history
        (a new array unless no penalty applies; the history is unchanged)."""
        a = self._as_logits(logits)
        x = self._penalize(a)
        return x.copy() if x is not a else x

    def _buffer(self, name, n, dtype) -> np.ndarray:
        """A scratch array kept between tokens: a fresh [vocab] array per token costs page
        faults (the allocator returns large blocks to the system), up to ~2 ms at 262,144."""
        buf = self._scratch.get(name)
        if buf is None or buf.shape[0] != n or buf.dtype != dtype:
            buf = self._scratch[name] = np.empty(n, dtype)
        return buf

    def _exp(self, x: np.ndarray, shift: float, t: float, name: str = "e") -> np.ndarray:
        """exp((x - shift) / t) in float64 over all of x, into a scratch array."""
        out = self._buffer(name, x.size, np.float64)
        np.subtract(x, shift, out=out, dtype=np.float64)
        if t != 1.0:
            np.divide(out, t, out=out)
        return np.exp(out, out=out)

    def _penalize(self, a: np.ndarray) -> np.ndarray:
        if not ((self._repeat and self._seen_n) or (self._count and self._gen_n) or self._bias.size):
            return a
        if self._bias.size and int(self._bias_ids.max()) >= a.size:
            raise ColibriError(
                f"logit_bias names token id {int(self._bias_ids.max())}, outside the vocabulary: "
                f"the logits have {a.size} entries"
            )
        if self._max_id >= a.size:
            raise ColibriError(
                f"token id {self._max_id} in the penalty history is outside the vocabulary: "
                f"the logits have {a.size} entries"
            )
        out = self._buffer("penalized", a.size, a.dtype)
        np.copyto(out, a)
        a = out
        with np.errstate(over="ignore"):  # an overflow to inf is reported by the caller
            self._apply_penalties(a)
        return a

    def _apply_penalties(self, a: np.ndarray) -> None:
        if self._repeat and self._seen_n:
            ids = self._seen_ids[: self._seen_n]
            v = a[ids]
            a[ids] = np.where(v > 0, v / self.repetition_penalty, v * self.repetition_penalty)
        if self._count and self._gen_n:
            ids = self._gen_ids[: self._gen_n]
            a[ids] = a[ids] - (self.presence_penalty + self.frequency_penalty * self._gen_counts[: self._gen_n])
        if self._bias.size:
            a[self._bias_ids] = a[self._bias_ids] + self._bias

    def _weights(self, x: np.ndarray, what: str):
        """Steps 3-6 for temperature > 0: (ids ascending or None for every id, weights e)."""
        lmax = float(x.max())
        _check_max(lmax, lambda: int(np.argmax(x)), what)
        n, t, tp, mp = x.size, self.temperature, self.top_p, self.min_p
        k = self.top_k if 0 < self.top_k < n else 0
        if k:
            ranked = _ranked_top(x, k, self._buffer("mask", n, np.bool_))[:k]
            e = np.exp((x[ranked].astype(np.float64) - lmax) / t)  # rank order
            if tp < 1.0:
                s = e[np.argsort(ranked)].sum()  # in id order
                keep = min(int(np.searchsorted(np.cumsum(e / s), tp)) + 1, k)
                ranked, e = ranked[:keep], e[:keep]
        elif tp < 1.0:
            e_all = self._exp(x, lmax, t)
            s = e_all.sum()
            sizes = iter(_GROWTH)
            m = next(sizes)
            while True:
                ranked = _ranked_top(x, m, self._buffer("mask", n, np.bool_))
                cum = np.cumsum(e_all[ranked] / s)
                if cum[-1] >= tp or ranked.size == n:
                    break
                if mp > 0.0 and e_all[ranked[-1]] < mp * (1.0 - 1e-9):
                    break  # every token outside fails min_p
                m = next(sizes, m * 8)
            keep = min(int(np.searchsorted(cum, tp)) + 1, ranked.size)
            ranked = ranked[:keep]
            e = e_all[ranked]
        elif mp > 0.0:
            # a superset by logit, then the exact test e >= min_p on it
            bound = lmax + t * math.log(mp)
            ids = np.flatnonzero(
                np.greater_equal(
                    x, bound - 1e-5 * (abs(bound) + abs(lmax) + t) - 1e-30, out=self._buffer("mask", n, np.bool_)
                )
            )
            e = np.exp((x[ids].astype(np.float64) - lmax) / t)
            keep = e >= mp
            return ids[keep], e[keep]
        else:
            return None, self._exp(x, lmax, t)
        if mp > 0.0:
            keep = e >= mp
            ranked, e = ranked[keep], e[keep]
        order = np.argsort(ranked)
        return ranked[order], e[order]

    @staticmethod
    def _greedy(x: np.ndarray, what: str) -> int:
        i = int(np.argmax(x))  # first NaN if any, else first maximum
        _check_max(float(x[i]), lambda: i, what)
        return i

    def distribution(self, logits) -> tuple[np.ndarray, np.ndarray]:
        """(ids ascending, probabilities summing to 1): the tokens pick() can return for these
        logits with the current history and constraint, and their chances. Greedy: ([argmax],
        [1.0]). Changes nothing (no history, no random draw, the constraint not advanced)."""
        raw = self._as_logits(logits)
        x, chosen = self._choose(raw)
        if self.temperature == 0.0:
            return np.array([chosen], np.int64), np.ones(1)
        ids, e = chosen
        if ids is None:
            ids = np.arange(x.size)
        pos = e > 0
        ids, e = ids[pos], e[pos]
        return ids.astype(np.int64), e / e.sum()

    def _unmasked_pick(self, x: np.ndarray) -> int | None:
        """The token from the penalised logits x without the constraint's mask, when the
        constraint allows it; else None (the caller masks and picks again). Exact: greedy, the
        argmax is the masked argmax whenever it is allowed; sampled with no truncation (top_k,
        top_p, min_p off), a rejected draw is followed by a draw from the masked distribution,
        so token x comes out with p(x) + (1 - A) p(x) / A = p(x) / A, A the allowed mass --
        the masked distribution. Truncated sampling depends on the mask (top_k among the allowed
        tokens): not here."""
        if self.temperature == 0.0:
            token = int(np.argmax(x))
            if not math.isfinite(float(x[token])):
                return None  # the masked path reports it (or masks it out)
        elif self.top_k == 0 and self.top_p == 1.0 and self.min_p == 0.0:
            lmax = float(x.max())
            if not math.isfinite(lmax):
                return None
            with np.errstate(over="ignore"):
                token = _draw(self._exp(x, lmax, self.temperature), self.rng.random())
        else:
            return None
        return token if self.constraint.allows(token) else None

    def _choose(self, raw: np.ndarray, x: np.ndarray | None = None):
        """(penalised logits, ids or None, weights) for temperature > 0, or (x, token) greedy.
        x: the penalised logits when already computed."""
        x = self._penalize(raw) if x is None else x
        what = "logits" if x is raw else "logits after the penalties"
        if self.constraint is not None:
            x = self.constraint.apply(x, self._buffer("constrained", raw.size, raw.dtype))
            what = f"{what} allowed by the {self.constraint.kind} constraint"
        try:
            if self.temperature == 0.0:
                return x, self._greedy(x, what)
            # a temperature near 0 sends (x - max) / t to -inf: weight 0, the limit it stands for
            with np.errstate(over="ignore"):
                return x, self._weights(x, what)
        except ColibriError:
            if x is not raw:  # the model's own logits at fault: say so
                _check_max(float(raw.max()), lambda: int(np.argmax(raw)), "logits")
            raise

    def pick(self, logits) -> Pick:
        """logits float32 [vocab] -> Pick(token, logprob, top); records the token in the history."""
        raw = self._as_logits(logits)
        token = None
        if self.constraint is not None:  # most tokens a model picks, the grammar allows:
            x = self._penalize(raw)  # then no mask is computed or applied
            token = self._unmasked_pick(x)
        if token is None:
            x, chosen = self._choose(raw, x if self.constraint is not None else None)
            if self.temperature == 0.0:
                token = chosen
            else:
                ids, e = chosen
                j = _draw(e, self.rng.random())
                token = j if ids is None else int(ids[j])
        if self.constraint is not None:
            self.constraint.consume(token)  # the next mask is computed meanwhile
        if self._repeat or self._count:
            self._record(token)
        if self.logprobs is None:
            return Pick(token)
        rmax = float(raw.max())
        _check_max(rmax, lambda: int(np.argmax(raw)), "logits")
        log_z = math.log(float(self._exp(raw, rmax, 1.0, "logprobs").sum()))
        top = ()
        if self.logprobs:
            best = _ranked_top(raw, self.logprobs, self._buffer("mask", raw.size, np.bool_))[: self.logprobs]
            top = tuple((int(i), (float(raw[i]) - rmax) - log_z) for i in best)
        return Pick(token, (float(raw[token]) - rmax) - log_z, top)

    def __call__(self, logits) -> int:
        """logits float32 [vocab] -> the chosen token id (pick(logits).token)."""
        return self.pick(logits).token

    def describe(self) -> str:
        """One short line of the non-default settings, e.g. "temperature 0.7, top_k 20, seed 1"."""
        if self.temperature == 0.0:
            parts = ["greedy"]
        else:
            parts = [f"temperature {_fmt(self.temperature)}"]
            if self.top_k:
                parts.append(f"top_k {self.top_k}")
            if self.top_p < 1.0:
                parts.append(f"top_p {_fmt(self.top_p)}")
            if self.min_p > 0.0:
                parts.append(f"min_p {_fmt(self.min_p)}")
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if v != (1.0 if name == "repetition_penalty" else 0.0):
                parts.append(f"{name} {_fmt(v)}")
        if self.temperature != 0.0:  # the seed decides a sampled output: always shown
            parts.append(f"seed {self.seed}")
        if self.logprobs is not None:
            parts.append(f"logprobs {self.logprobs}")
        if self._bias.size:
            parts.append(f"logit_bias on {self._bias.size} ids")
        if self.constraint is not None:
            parts.append(self.constraint.kind)
        return ", ".join(parts)

    def __repr__(self) -> str:
        return f"Sampler({self.describe()})"
