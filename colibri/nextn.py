"""Drafts from a checkpoint's own multi-token-prediction (MTP) layer (DeepSeek-V3, GLM-4.5).

Design
------
convert keeps the checkpoint's first next-token-prediction layer as a one-layer model directory,
`nextn/` inside the model's (modeldir.NEXTN_DIR, config.nextn_block). `NextnBlock` maps it and
builds an Engine for it whose embedding and head are the main model's, with its own KV cache (one
sequence, the main model's context). At position p the block reads the token at p + 1 and the
main model's hidden state at p (after the final norm: Engine.run's hidden_out), and its logits
guess the token at p + 2:

    x_p = eh_proj([enorm(embed(t_(p+1))); hnorm(h_p)]) -> decoder layer -> shared_head.norm -> head

as vLLM's and SGLang's DeepSeek MTP modules run it. `NextnDrafter` keeps the block one position
behind the main model: every main-model call hands it the hidden states of the positions it kept
(`feed`), and it runs the block over each of them whose next token is known. A draft (`propose`)
is the argmax of the block's last logits, then, for longer drafts, the block run again on its own
guess and its own hidden state (its positions past the main model's are overwritten by the next
feed). A draft is only a guess: Model._generate verifies it, so the tokens are plain decoding's
whatever the block proposes, and a block whose head was never trained (random-weight fixtures)
only costs time. Positions the main model restored from the prefix store, or reused from an
earlier generation, are not run through the block: its attention sees what its cache held there.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from . import _engine, spec
from .errors import ColibriError
from .modeldir import NEXTN_DIR, MappedModelDir, ModelDir


def has_block(model_dir) -> bool:
    """Whether a model directory carries a multi-token-prediction block."""
    return (Path(model_dir) / NEXTN_DIR / "config.json").is_file()


class NextnBlock:
    """The block of a loaded model: its mapped directory and its Engine (built from the main
    model's options: context, prefill chunk, threads, KV cache type; one sequence)."""

    def __init__(self, model):
        root = Path(model.path) / NEXTN_DIR
        self.dir = ModelDir(root)
        cfg, main = self.dir.config, model.config
        if not cfg.nextn_block or (cfg.architecture, cfg.hidden_size, cfg.vocab_size) != (
            main.architecture,
            main.hidden_size,
            main.vocab_size,
        ):
            raise ColibriError(
                f"{root}: not the multi-token-prediction block of {model.path} "
                f"(its config says {cfg.architecture}, hidden_size {cfg.hidden_size}, vocab_size {cfg.vocab_size})"
            )
        self.maps = MappedModelDir(self.dir)
        try:
            tensors = self.maps.tensor_refs()
            main_tensors = model.engine_spec.tensors
            tensors["embedding"] = main_tensors["embedding"]
            tensors["lm_head"] = main_tensors.get("lm_head", main_tensors["embedding"])
            s = model.engine_spec
            self.engine = _engine.Engine(
                spec.build(
                    cfg,
                    tensors,
                    n_ctx=s.n_ctx,
                    chunk=s.prefill_chunk,
                    threads=s.n_threads,
                    exact_softmax=not s.use_lut,
                    prefetch="none",
                    prefetch_chunk_bytes=0,
                    expert_pages={},
                    kv_cache=s.kv_cache,
                    bf16_products=s.bf16_products,
                )
            )
        except BaseException:
            self.maps.close()
            raise

    def close(self) -> None:
        self.engine.close()
        self.maps.close()


class NextnDrafter:
    """One generation's block drafts. `context`: the generation's tokens by position (the
    speculate.Drafter's list: the prompt, then each token as it is picked); `start`: the first
    position the main model computes (the positions before it were restored or reused)."""

    def __init__(self, block: NextnBlock, context: list, start: int):
        self.block, self.context = block, context
        self.engine = block.engine
        d, chunk = block.dir.config.hidden_size, block.engine.spec.prefill_chunk
        self.done = start  # the next position to run through the block
        self.pending = np.empty((chunk + 1, d), np.float32)  # main hidden states of positions done..
        self.n_pending = 0
        self.main_rows = np.empty((chunk, d), np.float32)  # a main-model call's hidden states (the caller's)
        self.logits = np.empty((1, block.dir.config.vocab_size), np.float32)  # the last run's
        self.hidden = np.empty((chunk + 1, d), np.float32)  # the block's own hidden states
        self.last = None  # the block's hidden state at its last position run, or None before any run

    def feed(self, pos: int, rows: np.ndarray) -> None:
        """The main model's hidden states [n, d] of positions pos.. (the ones it keeps), then the
        block over every pending position whose next token is known."""
        end = self.done + self.n_pending
        if not self.done <= pos <= end:
            raise ValueError(f"hidden states of position {pos} when the block waits for {self.done}..{end}")
        self.n_pending = pos - self.done  # a rolled-back position is overwritten
        for start in range(0, len(rows), len(self.pending) - 1):
            piece = rows[start : start + len(self.pending) - 1]
            self.pending[self.n_pending : self.n_pending + len(piece)] = piece
            self.n_pending += len(piece)
            self._advance()

    def _advance(self) -> None:
        """Run the block at the pending positions p with the token at p + 1 known."""
        n = min(self.n_pending, len(self.context) - 1 - self.done)
        if n < 1:
            return
        tokens = np.array(self.context[self.done + 1 : self.done + 1 + n], np.int32)
        self._run(tokens, self.done, self.pending[:n])
        self.pending[: self.n_pending - n] = self.pending[n : self.n_pending]
        self.n_pending -= n
        self.done += n

    def _run(self, tokens: np.ndarray, pos: int, hidden: np.ndarray) -> None:
        n = len(tokens)
        status, index, layer = self.engine.run(tokens, pos, self.logits, False, 0, hidden, self.hidden[:n])
        if status != _engine.STATUS_OK:
            raise ColibriError(
                f"the multi-token-prediction block in {self.block.dir.root} gave non-finite values at "
                f"position {pos + index} — its weights look damaged (run: python -m colibri verify)"
            )
        self.last = self.hidden[n - 1].copy()

    def propose(self, k: int) -> list:
        """Up to k tokens after the context's last: the block's guess at the position after the
        main model's last, then its guesses on its own guesses."""
        if self.last is None or self.done != len(self.context) - 1 or k < 1:
            return []
        draft = [int(np.argmax(self.logits[0]))]
        pos, n_ctx = self.done, self.engine.n_ctx
        while len(draft) < k and pos < n_ctx - 1:
            self._run(np.array(draft[-1:], np.int32), pos, self.last[None])
            draft.append(int(np.argmax(self.logits[0])))
            pos += 1
        return draft
