"""The prefix store (load(cache_ram_mb=, kv_store=), colibri.kvstore): KV cache blocks of earlier
prompts restored into whichever place a later prompt lands in.

The contract: a prompt that restores a stored prefix gives the bits a model without the store
gives (logits, greedy and seeded tokens) for every architecture and KV cache format; only an
exact token prefix is restored (never past the first differing token, never on a hash
collision); the store stays under its budget; on disk it survives a restart and a damaged or
foreign file is skipped with a warning, never loaded.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import colibri
from colibri import kvstore
from colibri.batching import Batch
from conftest import CASES, ENV

B = kvstore.BLOCK_TOKENS


def _prompts(m, seed: int = 0):
    """(a, b, a_next): a conversation's prompt, another one, and the first one's next turn (a plus
    new tokens), lengths within the model's context."""
    vocab = m.config.vocab_size
    rng = np.random.default_rng(seed)
    n = min(3 * B + 9, m.n_ctx // 3)
    a, b = rng.integers(0, vocab, n).tolist(), rng.integers(0, vocab, n).tolist()
    return a, b, a + rng.integers(0, vocab, 21).tolist()


def _header(path) -> dict:
    """The JSON header of a block file."""
    raw = path.read_bytes()
    _, size = kvstore._HEADER.unpack_from(raw)
    return json.loads(raw[kvstore._HEADER.size : kvstore._HEADER.size + size])


def _gen(m, ids, **kw):
    tokens = list(m.generate(ids, max_new_tokens=6, **kw))
    return tokens, m.last_generation.reused_tokens, m.last_logits


@pytest.mark.parametrize("kv_cache", ["f32", "f16", "q8"])
@pytest.mark.parametrize("case", CASES)
def test_a_conversation_evicted_by_another_resumes_from_the_store_with_the_same_bits(converted, case, kv_cache):
    """One place: conversation a, then b takes the place, then a's next turn restores a's stored
    blocks (sliding-window rings, MLA's latent, q8 rows included): its tokens and last logits are
    those of a model without a store that runs the whole prompt."""
    path = converted(case)
    plain = colibri.load(path, threads=2, kv_cache=kv_cache)
    a, b, a_next = _prompts(plain)
    want = _gen(plain, a_next, reuse_prefix=False)
    m = colibri.load(path, threads=2, kv_cache=kv_cache, cache_ram_mb=64)
    _gen(m, a)
    _gen(m, b)
    tokens, reused, logits = _gen(m, a_next)
    assert reused == len(a) // B * B, "a's full blocks are restored"
    assert tokens == want[0]
    np.testing.assert_array_equal(logits, want[2])
    st = m.prefix_store_stats()
    assert st["prefix_store_hits"] == 1 and st["prefix_store_restored_tokens"] == reused
    m.close()


@pytest.mark.parametrize("case", CASES)
def test_seeded_sampling_after_a_restore_is_unchanged(converted, case):
    path = converted(case, "int8")
    plain = colibri.load(path, threads=2)
    a, b, a_next = _prompts(plain, seed=1)
    kw = dict(temperature=0.9, top_p=0.95, seed=11)
    want = _gen(plain, a_next, reuse_prefix=False, **kw)
    m = colibri.load(path, threads=2, cache_ram_mb=64, kv_cache="f32")
    _gen(m, a, **kw)
    _gen(m, b, **kw)
    got = _gen(m, a_next, **kw)
    assert got[1] > 0 and got[0] == want[0]
    np.testing.assert_array_equal(got[2], want[2])


@pytest.mark.parametrize("case", ["qwen3moe_a", "gpt_oss_a"])
def test_places_share_the_store_in_a_batch(converted, case):
    """Two places: a conversation, then two others that take both places; then a prompt sharing
    the first one's system prompt, and the first one's next turn, both restored from the store
    into whichever place they land in; every sequence's tokens are generate()'s alone."""
    path = converted(case)
    alone = colibri.load(path, threads=2)
    vocab = alone.config.vocab_size
    rng = np.random.default_rng(5)
    system = rng.integers(0, vocab, 2 * B + 3).tolist()
    first, second = system + [1, 2, 3], system + [4, 5]
    others = [rng.integers(0, vocab, 2 * B).tolist() for _ in range(2)]
    m = colibri.load(path, threads=2, parallel=2, cache_ram_mb=64)
    with Batch(m) as batch:
        a = batch.add(first, 4)
        while batch.running:
            batch.step()
        occupy = [batch.add(p, 3) for p in others]  # both places now hold other prompts
        while batch.running:
            batch.step()
        shared = batch.add(second, 4)
        while batch.running:
            batch.step()
        nxt_prompt = first + a.record.tokens + [7, 8]
        nxt = batch.add(nxt_prompt, 5)
        while batch.running:
            batch.step()
    assert shared.record.reused_tokens == 2 * B
    assert nxt.record.reused_tokens >= 2 * B
    runs = [(a, first, 4), (shared, second, 4), (nxt, nxt_prompt, 5)] + [(o, p, 3) for o, p in zip(occupy, others)]
    for seq, prompt, n in runs:
        assert seq.record.tokens == list(alone.generate(prompt, n, reuse_prefix=False))


@pytest.mark.parametrize("case", ["qwen3moe_a", "gemma4_a"])
def test_a_system_prompt_shared_by_requests_arriving_together_is_computed_once(converted, case):
    """Four places, four prompts with one system prompt added at once: the first runs it, the
    others wait for it to complete and start from its stored blocks; each one's tokens are
    generate()'s alone, and the engine ran the system prompt once."""
    path = converted(case)
    alone = colibri.load(path, threads=2)
    vocab = alone.config.vocab_size
    rng = np.random.default_rng(8)
    system = rng.integers(0, vocab, 3 * B + 7).tolist()
    prompts = [system + rng.integers(0, vocab, 5 + i).tolist() for i in range(4)]
    m = colibri.load(path, threads=2, parallel=4, cache_ram_mb=64)
    fed = []
    real_step = m._step
    m._step = lambda tokens, *a, **k: (fed.append(len(tokens)), real_step(tokens, *a, **k))[1]
    with Batch(m, step_tokens=64) as batch:
        seqs = [batch.add(p, 3) for p in prompts]
        while batch.running:
            batch.step()
    reused = [s.record.reused_tokens for s in seqs]
    assert reused[0] == 0 and all(n >= 3 * B for n in reused[1:])
    assert sum(fed) == sum(len(p) for p in prompts) - sum(reused) + 2 * len(seqs)  # + 2 decoded tokens each
    for seq, p in zip(seqs, prompts):
        assert seq.record.tokens == list(alone.generate(p, 3, reuse_prefix=False))


@pytest.fixture(scope="module")
def qwen_pair(converted):
    path = converted("qwen3moe_a")
    return colibri.load(path, threads=2), colibri.load(path, threads=2, cache_ram_mb=64)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, 3 * B + 5), st.integers(1, 40), st.integers(0, 2**31 - 1))
def test_only_an_exact_token_prefix_is_restored(qwen_pair, shared, tail, seed):
    """A prompt that shares its first `shared` tokens with a stored one restores at most those
    (whole blocks of them), and its logits are those of running it whole."""
    plain, m = qwen_pair
    vocab = m.config.vocab_size
    rng = np.random.default_rng(seed)
    stored = rng.integers(0, vocab, 3 * B + 10).tolist()
    list(m.generate(stored, 1))
    prompt = stored[:shared] + rng.integers(0, vocab, tail).tolist()
    if shared < len(stored) and prompt[shared : shared + 1] == stored[shared : shared + 1]:
        prompt[shared] = (prompt[shared] + 1) % vocab  # the first token after the shared part differs
    list(m.generate(rng.integers(0, vocab, 5).tolist(), 1))  # the place now holds something else
    list(m.generate(prompt, 1))
    assert m.last_generation.reused_tokens <= min(shared, len(prompt) - 1)
    assert m.last_generation.reused_tokens % B == 0
    np.testing.assert_array_equal(m.last_logits, plain.forward(prompt)[-1])


def test_a_hash_collision_never_restores_another_prompt(converted, monkeypatch):
    """Every block named alike (a hash that always collides): the tokens are compared, so a
    different prompt restores nothing and runs whole."""
    monkeypatch.setattr(kvstore, "block_name", lambda parent, tokens: b"same name".ljust(16, b"\0"))
    path = converted("qwen3moe_a")
    plain = colibri.load(path, threads=2)
    a, b, _ = _prompts(plain, seed=2)
    m = colibri.load(path, threads=2, cache_ram_mb=64)
    _gen(m, a)
    tokens, reused, logits = _gen(m, b)
    assert reused == 0
    np.testing.assert_array_equal(logits, _gen(plain, b, reuse_prefix=False)[2])


def test_the_store_stays_under_its_budget(converted):
    """A budget of five blocks: after many prompts the store holds at most five, the evicted ones
    counted, and the most recent prompt is still restored."""
    path = converted("qwen3moe_a")
    m = colibri.load(path, threads=2, cache_ram_mb=1)
    block_bytes = m.prefix_store.block_bytes
    m.close()
    budget_mb = 5 * block_bytes / 2**20
    m = colibri.load(path, threads=2, cache_ram_mb=budget_mb)
    rng = np.random.default_rng(9)
    vocab = m.config.vocab_size
    prompts = [rng.integers(0, vocab, 2 * B + 1).tolist() for _ in range(6)]
    for p in prompts:
        list(m.generate(p, 1))
        assert m.prefix_store.bytes <= m.prefix_store.budget
    st = m.prefix_store_stats()
    assert st["prefix_store_evicted_blocks"] >= 6 * 2 - 5 and st["prefix_store_bytes"] <= 5 * block_bytes
    list(m.generate(rng.integers(0, vocab, 5).tolist(), 1))
    list(m.generate(prompts[-1] + [1], 1))
    assert m.last_generation.reused_tokens == 2 * B


def test_the_store_survives_a_restart_and_skips_damaged_or_foreign_files(converted, tmp_path, caplog):
    path = converted("qwen3moe_a")
    plain = colibri.load(path, threads=2)
    a, _, a_next = _prompts(plain, seed=4)
    store = tmp_path / "store"
    m = colibri.load(path, threads=2, kv_store=store)
    _gen(m, a)
    m.close()  # its files are written
    files = sorted(store.rglob("*" + kvstore.FILE_SUFFIX))
    assert len(files) == len(a) // B and not list(store.rglob("*.tmp"))
    m = colibri.load(path, threads=2, kv_store=store)
    tokens, reused, logits = _gen(m, a_next)
    assert reused == len(a) // B * B
    np.testing.assert_array_equal(logits, _gen(plain, a_next, reuse_prefix=False)[2])
    m.close()

    # a flipped byte in the second block's file: skipped with one warning naming it; the first
    # block is still restored, nothing after the damaged one
    second = next(f for f in store.rglob("*" + kvstore.FILE_SUFFIX) if _header(f)["start"] == B)
    raw = bytearray(second.read_bytes())
    raw[-100] ^= 0xFF
    second.write_bytes(bytes(raw))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="colibri"):
        m = colibri.load(path, threads=2, kv_store=store)
    warned = [r.getMessage() for r in caplog.records if "KV store" in r.getMessage()]
    assert len(warned) == 1 and second.name in warned[0] and "checksum" in warned[0]
    tokens, reused, logits = _gen(m, a_next)
    assert reused == B
    np.testing.assert_array_equal(logits, _gen(plain, a_next, reuse_prefix=False)[2])
    m.close()

    # a file of another KV cache format copied into this model's directory: foreign, not loaded
    q8 = colibri.load(path, threads=2, kv_store=tmp_path / "q8", kv_cache="q8")
    _gen(q8, a)
    q8.close()
    foreign = next((tmp_path / "q8").rglob("*" + kvstore.FILE_SUFFIX))
    target = next(store.iterdir()) / foreign.name
    target.write_bytes(foreign.read_bytes())
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="colibri"):
        colibri.load(path, threads=2, kv_store=store).close()
    assert any(foreign.name in r.getMessage() and "another model" in r.getMessage() for r in caplog.records)


def test_another_model_finds_none_of_the_store(converted, tmp_path):
    store = tmp_path / "store"
    m = colibri.load(converted("qwen3moe_a"), threads=2, kv_store=store)
    a, _, _ = _prompts(m)
    _gen(m, a)
    m.close()
    other = colibri.load(converted("qwen3moe_b"), threads=2, kv_store=store)
    assert other.prefix_store.bytes == 0
    ids = np.asarray(a) % other.config.vocab_size
    list(other.generate(ids.tolist(), 1))
    assert other.last_generation.reused_tokens == 0
    other.close()
    assert len(list(store.iterdir())) == 2  # a directory per identity


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(cache_ram_mb=-1), "cache_ram_mb must be 'auto' or a number of megabytes"),
        (dict(cache_ram_mb="lots"), "cache_ram_mb must be 'auto' or a number of megabytes"),
        (dict(cache_ram_mb=True), "cache_ram_mb must be 'auto' or a number of megabytes"),
        (dict(kv_store=""), "kv_store must be a directory path"),
        (dict(kv_store="somewhere", cache_ram_mb=0), "kv_store somewhere needs a prefix store: cache_ram_mb is 0"),
    ],
)
def test_bad_store_options_are_clear_errors(converted, kw, message):
    with pytest.raises(colibri.ColibriError, match=message):
        colibri.load(converted("qwen3moe_a"), threads=2, **kw)


def test_a_store_path_that_is_a_file_is_a_clear_error(converted, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(colibri.ColibriError, match=f"kv_store {f} is not a directory"):
        colibri.load(converted("qwen3moe_a"), threads=2, kv_store=f)


def test_no_store_by_default_and_zero_turns_it_off(converted):
    path = converted("qwen3moe_a")
    assert colibri.load(path, threads=2).prefix_store is None
    assert colibri.load(path, threads=2, cache_ram_mb=0).prefix_store is None
    assert colibri.load(path, threads=2, cache_ram_mb="auto").prefix_store is not None


def test_run_keeps_a_prompt_across_processes_with_kv_store(converted, tmp_path):
    """`run --kv-store DIR --stats`: the second process restores the first one's prompt."""
    path = converted("qwen3moe_a")
    ids = ",".join(str(i % 200 + 3) for i in range(2 * B + 5))
    cmd = [sys.executable, "-m", "colibri", "run", "--model-dir", str(path), "--tokens", ids, "--max-new-tokens", "2"]
    cmd += ["--ids", "--threads", "1", "--kv-store", str(tmp_path / "store"), "--stats"]
    runs = [subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr
    assert runs[0].stdout == runs[1].stdout
    assert "0 prompt tokens restored" in runs[0].stderr
    assert f"{2 * B} prompt tokens restored (1 hits" in runs[1].stderr, runs[1].stderr


def test_serve_refuses_a_kv_store_without_a_store_at_once(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "colibri", "serve", "--cache-ram", "0", "--kv-store", str(tmp_path)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        r.returncode == 2 and r.stderr.strip() == f"error: --kv-store {tmp_path} needs a prefix store: --cache-ram is 0"
    )


def _refusing_open(directory, errno_, refusals):
    """A stand-in for kvstore's `open` that refuses (OSError errno_) to write under `directory`
    while refusals[0] > 0 (counting down; None: always): a read-only or full disk, as root too."""
    real = open

    def fake(path, mode="r", *args, **kwargs):
        if "w" in mode and str(path).startswith(str(directory)) and (refusals[0] is None or refusals[0] > 0):
            if refusals[0] is not None:
                refusals[0] -= 1
            raise OSError(errno_, os.strerror(errno_), str(path))
        return real(path, mode, *args, **kwargs)

    return fake


def _store_lines(caplog) -> list:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV store")]


def test_a_read_only_store_directory_is_said_at_start_and_the_ram_store_goes_on(
    converted, tmp_path, monkeypatch, caplog
):
    path = converted("qwen3moe_a")
    store = tmp_path / "store"
    monkeypatch.setattr(kvstore, "open", _refusing_open(store, errno.EROFS, [None]), raising=False)
    with caplog.at_level(logging.WARNING, logger="colibri"):
        m = colibri.load(path, threads=2, kv_store=store)
        lines = _store_lines(caplog)
        assert len(lines) == 1 and "is not writable (Read-only file system)" in lines[0], lines
        a, b, a_next = _prompts(m)
        _gen(m, a)
        _gen(m, b)  # a's place taken: its next turn comes from the RAM store
        assert _gen(m, a_next)[1] == len(a) // B * B
        m.close()
    assert _store_lines(caplog) == lines  # the failed writes said nothing more
    assert m.prefix_store_stats()["prefix_store_write_errors"] == 2 * (len(a) // B)
    assert not list(store.rglob("*" + kvstore.FILE_SUFFIX)) and not list(store.rglob("*.tmp"))


def test_a_full_disk_is_said_once_and_again_when_it_takes_blocks(converted, tmp_path, monkeypatch, caplog):
    path = converted("qwen3moe_a")
    store = tmp_path / "store"
    refusals = [0]
    monkeypatch.setattr(kvstore, "open", _refusing_open(store, errno.ENOSPC, refusals), raising=False)
    m = colibri.load(path, threads=2, kv_store=store)
    a, b, _ = _prompts(m)
    refusals[0] = len(a) // B  # a's blocks find the disk full; b's find room again
    with caplog.at_level(logging.WARNING, logger="colibri"):
        _gen(m, a)
        _gen(m, b)
        m.close()
    lines = _store_lines(caplog)
    assert len(lines) == 2 and "No space left on device" in lines[0] and "again" in lines[1], lines
    assert m.prefix_store_stats()["prefix_store_write_errors"] == len(a) // B
    assert len(list(store.rglob("*" + kvstore.FILE_SUFFIX))) == len(b) // B


def test_a_store_directory_that_cannot_be_made_keeps_the_blocks_in_ram(converted, tmp_path, monkeypatch, caplog):
    def refused(self, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    monkeypatch.setattr(kvstore.Path, "mkdir", refused)
    with caplog.at_level(logging.WARNING, logger="colibri"):
        m = colibri.load(converted("qwen3moe_a"), threads=2, kv_store=tmp_path / "ro")
    lines = _store_lines(caplog)
    assert len(lines) == 1 and "cannot create" in lines[0] and "RAM only" in lines[0], lines
    assert m.prefix_store is not None and m.prefix_store.directory is None
    a, _, a_next = _prompts(m)
    _gen(m, a)
    assert _gen(m, a_next)[1] > 0
    m.close()
