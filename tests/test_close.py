"""Model.close() racing calls in other threads: no signal, no wrong result, clear errors after.

Each iteration loads a model, starts forward() and generate() in two threads, closes it from the
main thread at a random moment, and checks that every call either finished with the right answer
or raised the "has been closed" ColibriError (or the one-request-at-a-time refusal). A closed
Model's every public use is a ColibriError, never AttributeError or SIGSEGV. Every test runs under
an address-space headroom (conftest.address_space_headroom): a huge allocation fails the test
instead of swapping the machine.
"""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

import colibri
from colibri import ColibriError
from conftest import address_space_headroom

ITERATIONS = 100
ALLOWED = ("has been closed", "already generating")


@pytest.fixture(autouse=True)
def _headroom():
    with address_space_headroom():
        yield


@pytest.mark.parametrize(
    "options", [{}, dict(expert_cache_mb=0.02, prefetch="predict")], ids=["plain", "expert cache and its readers"]
)
def test_close_races_forward_and_generate(converted, options):
    d = converted("mixtral_a")
    ids = list(range(3, 40))
    with colibri.load(d, threads=1) as ref_model:
        want_logits = ref_model.forward(ids)
        want_tokens = list(ref_model.generate(ids[:8], max_new_tokens=6, stop_at_eos=False))
    rng = random.Random(0)
    outcomes = {"ok": 0, "closed": 0}
    for _ in range(ITERATIONS):
        m = colibri.load(d, threads=1, **options)
        errors = []

        def fwd():
            try:
                out = m.forward(ids)
                assert np.array_equal(out, want_logits)
                outcomes["ok"] += 1
            except ColibriError as e:
                assert any(a in str(e) for a in ALLOWED), e
                outcomes["closed"] += 1
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        def gen():
            try:
                got = list(m.generate(ids[:8], max_new_tokens=6, stop_at_eos=False))
                assert got == want_tokens
                outcomes["ok"] += 1
            except ColibriError as e:
                assert any(a in str(e) for a in ALLOWED), e
                outcomes["closed"] += 1
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=fwd), threading.Thread(target=gen)]
        for t in threads:
            t.start()
        time.sleep(rng.random() * 0.004)
        m.close()
        for t in threads:
            t.join(30)
            assert not t.is_alive()
        assert not errors, errors
    assert outcomes["closed"] > 0  # the race was really run


@pytest.mark.parametrize(
    "use",
    [
        lambda m: m.forward([1, 2]),
        lambda m: list(m.generate([1, 2], max_new_tokens=2)),
        lambda m: m.last_logits,
        lambda m: m.routing,
        lambda m: m.expert_counts,
        lambda m: m.memory_stats(),
    ],
)
def test_every_use_after_close_is_a_clear_error(converted, use):
    m = colibri.load(converted("mixtral_a"))
    m.close()
    with pytest.raises(ColibriError, match="has been closed"):
        use(m)


def test_a_suspended_generator_sees_the_close(converted):
    m = colibri.load(converted("mixtral_a"))
    g = m.generate([1, 2, 3], max_new_tokens=5, stop_at_eos=False)
    next(g)
    m.close()
    with pytest.raises(ColibriError, match="has been closed"):
        list(g)


class _CountingEngine:
    """Delegates to the real engine and counts its run() calls."""

    def __init__(self, engine):
        self._engine, self.calls = engine, []

    def run(self, tokens, pos, out, all_logits, *rest):
        self.calls.append((len(tokens), pos))
        return self._engine.run(tokens, pos, out, all_logits, *rest)

    def __getattr__(self, name):
        return getattr(self._engine, name)


def test_a_long_prompt_returns_to_python_after_every_chunk(converted):
    """Ctrl-C (KeyboardInterrupt) and close() act between engine calls: one per prefill chunk."""
    d = converted("mixtral_a")
    ids = list(range(3, 14))  # 11 tokens, chunks of 4
    whole = colibri.load(d).forward(ids)
    m = colibri.load(d, prefill_chunk=4)
    m._engine = spy = _CountingEngine(m._engine)
    assert np.array_equal(m.forward(ids), whole)
    assert spy.calls == [(4, 0), (4, 4), (3, 8)]
    spy.calls.clear()
    list(m.generate(ids, max_new_tokens=2, stop_at_eos=False, reuse_prefix=False))
    assert spy.calls == [(4, 0), (4, 4), (3, 8), (1, 11)]
