"""Choosing the next token from logits: greedy, temperature, top-k, top-p, seeded.

Runs once per generated token in Python/numpy on a [vocab] float32 vector; the model's work is
in the engine. Temperature 0 is greedy (argmax, lowest index on ties) and ignores the rest.
"""
from __future__ import annotations

import math

import numpy as np

from .errors import ColibriError


class Sampler:
    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0):
        for name, v in (("temperature", temperature), ("top_p", top_p)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ColibriError(f"{name} must be a finite number, got {v!r}")
        if temperature < 0:
            raise ColibriError(f"temperature must be >= 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise ColibriError(f"top_p must be in (0, 1], got {top_p}")
        if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
            raise ColibriError(f"top_k must be an integer >= 0 (0: off), got {top_k!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ColibriError(f"seed must be a non-negative integer, got {seed!r}")
        self.temperature = float(temperature)
        self.top_k = int(top_k)
        self.top_p = float(top_p)
        self.rng = np.random.default_rng(int(seed))

    def __call__(self, logits: np.ndarray) -> int:
        """logits float32 [vocab] -> the chosen token id."""
        if self.temperature == 0.0:
            return int(np.argmax(logits))
        z = logits.astype(np.float64) / self.temperature
        order = np.argsort(-z, kind="stable")             # candidates, most likely first
        if 0 < self.top_k < len(order):
            order = order[:self.top_k]
        p = np.exp(z[order] - z[order[0]])
        p /= p.sum()
        if self.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(p), self.top_p) + 1)   # smallest set with mass >= top_p
            order, p = order[:keep], p[:keep] / p[:keep].sum()
        return int(order[self.rng.choice(len(order), p=p)])
