"""PrefixStore: the KV cache of finished and evicted sequences, shared by every place, found by
exact token prefix, kept under a byte budget and, with a directory, on disk across restarts.

Design
------
A sequence's KV cache is cut into blocks of BLOCK_TOKENS positions. A block is named by a hash of
its parent's name and its own tokens (vLLM's scheme), so one name stands for a whole prefix: the
lookup of a prompt hashes its full blocks in order and stops at the first name the store lacks,
and every block found is compared token for token with the prompt, so a hash collision can never
restore another conversation (llama.cpp's issue 27148: restore on an exact token prefix only). A
block holds every layer's rows for its positions ([n_kv_heads, BLOCK_TOKENS, row] of each KV
array, in the cache's own elements: f32, f16, q8 bytes or multi-head latent attention's latent),
copied out of a place when it finishes a prompt or a generation and copied into whichever place a
later prompt lands in. A restore is a copy: the store never holds a place.

Sliding-window layers keep a ring of kv_ring rows: position p is row p % kv_ring until p + kv_ring
overwrites it. RingRows follows which position each ring row of each sequence holds (the Model
tells it after every engine call), so a block saved after its ring rows were overwritten keeps
only the full-context layers' rows (`ring_ok` False), and a restore of n tokens, which writes the
window positions n - window .. n - 1 of each ring (all a token at n and after attends to), stops
at the longest matched n whose window comes from ring_ok blocks.

Budget: the blocks are dropped least recently used first. A lookup or a save touches a chain from
leaf to root, so a parent is always more recent than its children; a dropped block takes its
descendants with it all the same (they could no longer be reached). With a directory every block
is also a file (written and removed by a thread of its own, in order; atomically: a temporary
file renamed; checksummed) under a subdirectory named by the model's identity: its config.json's
digest, the KV cache's element format and what else decides the cache's bits (the kernel tier,
bf16 products, the softmax). At start the newest files are read back within the budget; a
damaged or foreign file is skipped with one warning, never loaded.
"""

from __future__ import annotations

import atexit
import collections
import hashlib
import json
import logging
import os
import queue
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import ColibriError

logger = logging.getLogger("colibri")

BLOCK_TOKENS = 64  # positions a block: what a lookup can miss at a prompt's end, at most
FILE_MAGIC = b"CBKVBLK1"  # a block file's first bytes; the layout version is in the magic
FILE_SUFFIX = ".kvb"
_HEADER = struct.Struct("<8sI")
# the counters (PrefixStore.stats): prompts that restored a stored prefix longer than their place
# held, prompts that found none, tokens restored, blocks stored and evicted, block files the
# directory did not take (full, read-only)
COUNTERS = ("hits", "misses", "restored_tokens", "stored_blocks", "evicted_blocks", "write_errors")
STAT_NAMES = (
    "budget_bytes",
    "bytes",
) + COUNTERS  # Model.prefix_store_stats()' keys, less "prefix_store_"  # magic, bytes of the JSON header that follows
MAX_HEADER_BYTES = 1 << 20  # a block file's header beyond this is damaged


@dataclass(frozen=True)
class CacheArray:
    """One of the engine's KV cache arrays: a layer's keys, its values, or an MLA layer's latent."""

    array: np.ndarray  # [n_seq, n_kv_heads, kv_ring, row] in the cache's element type
    ring: int | None  # a sliding layer's kv_ring (rows it keeps); None: every position has its row
    window: int = 0  # that layer's sliding window: a token at q attends to positions q - window + 1 .. q


class RingRows:
    """Which position each row of each sequence's sliding-window rings holds: rings {kv_ring:
    window} (the model's sliding layers'; one ring size per window), n_seq sequences."""

    def __init__(self, rings: dict, n_seq: int):
        self.windows = dict(rings)
        self.rows = {ring: np.full((n_seq, ring), -1, np.int64) for ring in rings}  # -1: no position yet

    def wrote(self, seqs, positions) -> None:
        """The rows of `positions` (int [n]) of sequences `seqs` (int [n], or one int) now hold them."""
        positions = np.asarray(positions, np.int64)
        for ring, rows in self.rows.items():
            rows[seqs, positions % ring] = positions

    def holds(self, seq: int, start: int, stop: int) -> bool:
        """Whether every ring of sequence seq holds positions start .. stop - 1."""
        positions = np.arange(max(start, 0), stop)
        return all((rows[seq, positions % ring] == positions).all() for ring, rows in self.rows.items())

    def resumable(self, seq: int, n: int) -> bool:
        """Whether sequence seq can go on after its first n positions: each ring holds the window
        before position n (what the token at n attends to besides itself)."""
        return all(
            (rows[seq, (p := np.arange(max(0, n - self.windows[ring]), n)) % ring] == p).all()
            for ring, rows in self.rows.items()
        )


class _Block:
    """BLOCK_TOKENS positions of one prefix: its tokens and every cache array's rows for them."""

    __slots__ = ("name", "parent", "start", "tokens", "data", "ring_ok", "children")

    def __init__(self, name: bytes, parent: bytes | None, start: int, tokens: np.ndarray, data: np.ndarray, ring_ok):
        self.name, self.parent, self.start = name, parent, start
        self.tokens = tokens  # int32 [BLOCK_TOKENS]
        self.data = data  # uint8 [bytes a block]: each array's [n_kv_heads, BLOCK_TOKENS, row] in turn
        self.ring_ok = ring_ok  # the sliding layers' rows are there too
        self.children = set()  # names of the blocks that continue this one


def block_name(parent: bytes | None, tokens: np.ndarray) -> bytes:
    """The name of the block holding `tokens` (int32 [BLOCK_TOKENS]) after the prefix `parent` names."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(np.ascontiguousarray(tokens, "<i4").tobytes())
    return h.digest()


class PrefixStore:
    """The store of one Model's KV cache (see the module's design). `budget`: bytes of blocks it
    keeps at most; `identity`: a string naming what decides the cache's bits; `directory`: where
    it mirrors its blocks (None: RAM only)."""

    def __init__(self, arrays: list, rings: RingRows, budget: int, identity: str, directory=None):
        if budget < 0:
            raise ColibriError(f"the prefix store's budget must be at least 0 bytes, got {budget}")
        self.arrays = arrays
        self.budget = int(budget)
        self.identity = identity
        # each array's part of a block: (offset, shape [n_kv_heads, BLOCK_TOKENS, row], dtype)
        self.parts, offset = [], 0
        for a in arrays:
            shape = (a.array.shape[1], BLOCK_TOKENS, a.array.shape[3])
            self.parts.append((offset, shape, a.array.dtype))
            offset += int(np.prod(shape)) * a.array.dtype.itemsize
        self.block_bytes = offset
        self.layout = [[list(shape), np.dtype(dtype).str] for _, shape, dtype in self.parts]
        self.rings = rings  # the Model's: which positions the sequences' rings hold
        self.blocks = collections.OrderedDict()  # name -> _Block, least recently used first
        self.bytes = 0
        self.stats = dict.fromkeys(COUNTERS, 0)
        self.directory = None
        self._writer = None
        if directory is not None:
            self.directory = Path(directory) / hashlib.sha256(identity.encode()).hexdigest()[:24]
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
            except OSError as e:  # a read-only or full disk: the RAM store goes on, said once
                logger.warning(
                    "KV store: cannot create %s (%s): the prefix store keeps its blocks in RAM only",
                    self.directory,
                    e.strerror or e,
                )
                self.directory = None
                return
            self._load_files()
            self._writer = _Writer(self)
            atexit.register(self.close)  # the queued files are written before the interpreter exits

    # -- what the Model tells it and asks ---------------------------------------------------------

    def restore(self, seq: int, tokens: np.ndarray, have: int) -> int:
        """Make sequence seq's cache hold the longest stored prefix of `tokens` (at most all but
        the last token, whose logits are needed) when it is longer than the `have` tokens seq
        already holds; returns the tokens it holds now (`have` when the store has nothing
        longer)."""
        chain = self._match(tokens, (len(tokens) - 1) // BLOCK_TOKENS)
        k = len(chain)
        while k and (k * BLOCK_TOKENS <= have or not self._ring_complete(chain, k)):
            k -= 1
        if k * BLOCK_TOKENS <= have:
            self.stats["misses"] += 1
            return have
        n = k * BLOCK_TOKENS
        self._touch(chain[:k])
        for a, (offset, shape, dtype) in zip(self.arrays, self.parts):
            first = have if a.ring is None else max(0, n - a.window)
            for b in chain[first // BLOCK_TOKENS : k]:
                rows = _view(b.data, offset, shape, dtype)
                lo = max(first - b.start, 0)
                positions = np.arange(b.start + lo, b.start + BLOCK_TOKENS)
                if a.ring is None:
                    a.array[seq, :, positions[0] : positions[-1] + 1, :] = rows[:, lo:, :]
                else:
                    a.array[seq][:, positions % a.ring, :] = rows[:, lo:, :]
        for ring, window in self.rings.windows.items():
            positions = np.arange(max(0, n - window), n)
            self.rings.rows[ring][seq, positions % ring] = positions
        self.stats["hits"] += 1
        self.stats["restored_tokens"] += n - have
        return n

    def save(self, seq: int, held) -> None:
        """Keep the full blocks of what sequence seq's cache holds (`held`: its tokens at positions
        0..), those the store lacks copied out of the cache; a block kept without its sliding
        layers' rows gets them when the cache still has them."""
        held = np.asarray(held, np.int32)
        chain, parent = [], None
        for i in range(len(held) // BLOCK_TOKENS):
            start = i * BLOCK_TOKENS
            tokens = held[start : start + BLOCK_TOKENS]
            name = block_name(parent, tokens)
            b = self.blocks.get(name)
            if b is not None and not np.array_equal(b.tokens, tokens):
                break  # a hash collision: this prefix is not stored, and nothing after it
            ring_ok = self.rings.holds(seq, start, start + BLOCK_TOKENS)
            if b is None:
                if self.block_bytes > self.budget:
                    break
                b = _Block(name, parent, start, tokens.copy(), np.zeros(self.block_bytes, np.uint8), ring_ok)
                self._copy_out(seq, b, b.data, rings=ring_ok)
                self._add(b)
            elif ring_ok and not b.ring_ok:
                data = b.data.copy()  # a new array: the writer thread may be reading the old one
                self._copy_out(seq, b, data, rings=True, full=False)
                b.data, b.ring_ok = data, True  # in this order: see _encode
                self._persist(b)
            chain.append(b)
            parent = name
        self._touch(chain)
        self._evict()

    def close(self) -> None:
        """Write what is queued for the directory and stop its thread. Idempotent."""
        if self._writer is not None:
            self._writer.stop()
            self._writer = None
            atexit.unregister(self.close)

    # -- inside -------------------------------------------------------------------------------------

    def _match(self, tokens: np.ndarray, most: int) -> list:
        """The stored blocks of `tokens`' first `most` full blocks, in order, up to the first missing."""
        chain, parent = [], None
        for i in range(most):
            piece = tokens[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS]
            b = self.blocks.get(block_name(parent, piece))
            if b is None or not np.array_equal(b.tokens, piece):
                break
            chain.append(b)
            parent = b.name
        return chain

    def _ring_complete(self, chain: list, k: int) -> bool:
        """Whether chain[:k]'s blocks hold every ring's window before position k blocks."""
        n = k * BLOCK_TOKENS
        return all(b.ring_ok for w in self.rings.windows.values() for b in chain[max(0, n - w) // BLOCK_TOKENS : k])

    def _copy_out(self, seq: int, b: _Block, data: np.ndarray, rings: bool, full: bool = True) -> None:
        """Sequence seq's rows for b's positions into `data` (b's layout): the full-context arrays'
        (`full`) and the rings' (`rings`)."""
        positions = np.arange(b.start, b.start + BLOCK_TOKENS)
        for a, (offset, shape, dtype) in zip(self.arrays, self.parts):
            rows = _view(data, offset, shape, dtype)
            if a.ring is None and full:
                rows[...] = a.array[seq, :, b.start : b.start + BLOCK_TOKENS, :]
            elif a.ring is not None and rings:
                rows[...] = a.array[seq][:, positions % a.ring, :]

    def _add(self, b: _Block) -> None:
        self.blocks[b.name] = b
        self.bytes += self.block_bytes
        self.stats["stored_blocks"] += 1
        if b.parent is not None and b.parent in self.blocks:
            self.blocks[b.parent].children.add(b.name)
        self._persist(b)

    def _touch(self, chain: list) -> None:
        for b in reversed(chain):  # leaf first: the root ends the most recent
            self.blocks.move_to_end(b.name)

    def _evict(self) -> None:
        while self.bytes > self.budget and self.blocks:
            self._drop(next(iter(self.blocks)))

    def _drop(self, name: bytes) -> None:
        """Drop block `name` and every block after it (a stack, not recursion: chains are long)."""
        root = self.blocks.get(name)
        parent = self.blocks.get(root.parent) if root.parent is not None else None
        if parent is not None:
            parent.children.discard(name)
        todo = [name]
        while todo:
            b = self.blocks.pop(todo.pop(), None)
            if b is None:
                continue
            todo.extend(b.children)
            self.bytes -= self.block_bytes
            self.stats["evicted_blocks"] += 1
            if self._writer is not None:
                self._writer.put(("remove", b.name))

    def _persist(self, b: _Block) -> None:
        if self._writer is not None:
            self._writer.put(("write", b))

    # -- the directory ------------------------------------------------------------------------------

    def _path(self, name: bytes) -> Path:
        return self.directory / (name.hex() + FILE_SUFFIX)

    def _encode(self, b: _Block) -> bytes:
        """The file of block b (on the writer's thread). ring_ok is read before data: an upgrade
        swaps in a filled array before it sets ring_ok, so a file never claims rows it lacks."""
        ring_ok = bool(b.ring_ok)
        body = b.tokens.astype("<i4").tobytes() + b.data.tobytes()
        header = {
            "identity": self.identity,
            "layout": self.layout,
            "block_tokens": BLOCK_TOKENS,
            "parent": None if b.parent is None else b.parent.hex(),
            "start": b.start,
            "ring_ok": ring_ok,
            "sha256": hashlib.sha256(body).hexdigest(),
        }
        text = json.dumps(header, sort_keys=True).encode()
        return _HEADER.pack(FILE_MAGIC, len(text)) + text + body

    def _decode(self, path: Path) -> _Block:
        """The block in `path`; ValueError saying why it is not one of this store's."""
        raw = path.read_bytes()
        if len(raw) < _HEADER.size:
            raise ValueError("shorter than a block file's header")
        magic, size = _HEADER.unpack_from(raw)
        if magic != FILE_MAGIC:
            raise ValueError("not a Colibri KV block file (or another version of one)")
        if size > MAX_HEADER_BYTES or _HEADER.size + size > len(raw):
            raise ValueError("its header is damaged")
        try:
            h = json.loads(raw[_HEADER.size : _HEADER.size + size])
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ValueError("its header is not JSON") from None
        if not isinstance(h, dict):
            raise ValueError("its header is not a JSON object")
        if h.get("identity") != self.identity or h.get("layout") != self.layout:
            raise ValueError("it was written for another model, KV cache format or kernel tier")
        if h.get("block_tokens") != BLOCK_TOKENS:
            raise ValueError(f"its blocks hold {h.get('block_tokens')!r} tokens, not {BLOCK_TOKENS}")
        body = raw[_HEADER.size + size :]
        if len(body) != 4 * BLOCK_TOKENS + self.block_bytes or hashlib.sha256(body).hexdigest() != h.get("sha256"):
            raise ValueError("its checksum does not match its contents (damaged or truncated)")
        start, parent = h.get("start"), h.get("parent")
        try:
            parent = None if parent is None else bytes.fromhex(parent)
        except (TypeError, ValueError):
            raise ValueError("its parent is not a block name") from None
        if type(start) is not int or start < 0 or start % BLOCK_TOKENS or (start == 0) != (parent is None):
            raise ValueError("its position does not fit its parent")
        tokens = np.frombuffer(body[: 4 * BLOCK_TOKENS], "<i4").astype(np.int32)
        name = block_name(parent, tokens)
        if path.name != name.hex() + FILE_SUFFIX:
            raise ValueError("its name does not match its tokens")
        data = np.frombuffer(body[4 * BLOCK_TOKENS :], np.uint8).copy()
        return _Block(name, parent, start, tokens, data, bool(h.get("ring_ok")))

    def _load_files(self) -> None:
        """Read the directory's blocks back, newest first within the budget; skip (one warning
        each) what is damaged or foreign, and drop the blocks whose prefix was not kept."""
        found = []
        for path in self.directory.iterdir():
            if path.suffix != FILE_SUFFIX or not path.is_file():
                continue
            try:
                found.append((path.stat().st_mtime, path))
            except OSError:
                continue
        found.sort(reverse=True)
        kept = {}
        for _, path in found:
            if (len(kept) + 1) * self.block_bytes > self.budget:
                _remove(path)  # beyond the budget: the store mirrors what it keeps
                continue
            try:
                b = self._decode(path)
            except (OSError, ValueError) as e:
                logger.warning("KV store: skipping %s: %s", path, e)
                continue
            kept[b.name] = b
        reachable = {}
        for b in sorted(kept.values(), key=lambda b: b.start):  # parents before their children
            if b.parent is None or b.parent in reachable:
                reachable[b.name] = b
            else:
                _remove(self._path(b.name))
        for b in sorted(reachable.values(), key=lambda b: -b.start):  # leaves least recent
            self.blocks[b.name] = b
            self.bytes += self.block_bytes
            if b.parent is not None:
                reachable[b.parent].children.add(b.name)


def _view(data: np.ndarray, offset: int, shape: tuple, dtype) -> np.ndarray:
    count = int(np.prod(shape))
    return data[offset : offset + count * np.dtype(dtype).itemsize].view(dtype).reshape(shape)


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


class _Writer:
    """The thread that mirrors the store on disk: ("write", block) and ("remove", name) in order."""

    def __init__(self, store: PrefixStore):
        self.store = store
        self.jobs = queue.SimpleQueue()
        self.failing = False  # the last write failed (and that was said): the next success is said
        self._probe()
        self.thread = threading.Thread(target=self._run, name="colibri-kv-store", daemon=True)
        self.thread.start()

    def _probe(self) -> None:
        """A read-only directory is said at start, in one line, not at the first block."""
        probe = self.store.directory / f".probe.{os.getpid()}.tmp"
        try:
            with open(probe, "wb") as f:
                f.write(b"colibri")
        except OSError as e:
            self.failing = True
            logger.warning(
                "KV store: %s is not writable (%s): its blocks are read back, new ones are kept in RAM only",
                self.store.directory,
                e.strerror or e,
            )
        finally:
            _remove(probe)

    def put(self, job) -> None:
        self.jobs.put(job)

    def stop(self) -> None:
        self.jobs.put(None)
        self.thread.join()

    def _run(self) -> None:
        store = self.store
        while True:
            job = self.jobs.get()
            if job is None:
                return
            kind, what = job
            if kind == "remove":
                _remove(store._path(what))
                continue
            path = store._path(what.name)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            try:
                with open(tmp, "wb") as f:
                    f.write(store._encode(what))
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except OSError as e:
                _remove(tmp)
                store.stats["write_errors"] += 1
                if not self.failing:  # a full or read-only disk: said once, the RAM store goes on
                    logger.warning(
                        "KV store: cannot write %s: %s (the prefix store goes on in RAM; "
                        "colibri_prefix_store_write_errors counts the blocks not written)",
                        path,
                        e.strerror or e,
                    )
                    self.failing = True
                continue
            if self.failing:
                logger.warning("KV store: writing to %s again", store.directory)
                self.failing = False


AUTO_SHARE = 4  # "auto": a quarter of the memory the plan leaves free ...
AUTO_MAX = 8 << 30  # ... at most llama-server's --cache-ram default
MB = 1 << 20


def checked_budget(value, name: str = "cache_ram_mb"):
    """load()'s cache_ram_mb: None (no store), "auto" or megabytes >= 0 (0: no store) -> None,
    "auto" or bytes."""
    if value is None or value == "auto":
        return value
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float, np.integer, np.floating))
        or not (0 <= value < 1e12)
    ):
        raise ColibriError(f"{name} must be 'auto' or a number of megabytes >= 0 (0: no prefix store), got {value!r}")
    return int(float(value) * MB) or None


def auto_budget(plan, available: int | None) -> int:
    """The "auto" budget: a quarter of what the memory plan leaves free once the whole model and
    the fixed parts are counted, at most AUTO_MAX; 0 when the experts already take what the
    limit leaves (a model larger than the memory: an explicit cache_ram_mb is planned instead)."""
    if plan.limit is None:
        free = available or 0
    elif plan.budget is not None:
        return 0
    else:
        free = plan.limit - plan.fixed - plan.experts
    return max(0, min(AUTO_MAX, free // AUTO_SHARE))
