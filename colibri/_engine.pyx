# cython: language_level=3
"""The layer loop of Colibri: the model over n tokens, written once (decode is n = 1).

Design
------
`Engine` holds raw pointers into the mapped weight files (never copies of them), the KV cache and
one scratch arena, all sized once from the config. `Engine.run()` pushes tokens through
`forward()` without the GIL, a prefill chunk at a time (decode is a chunk of one token);
`forward()` is the whole model in one screen, over n tokens:

    embed -> for each layer: attn_norm, attention, residual, ffn_norm, MoE or dense FFN, residual
          -> final_norm -> lm_head

Every block is written once for n tokens: every weight is read once per chunk, and since no
kernel's arithmetic depends on n, a prompt gives exactly the logits of decoding it token by token.
Architectures differ only by flags in `Hyper` and by which per-layer pointers are NULL (biases,
q/k norms, shared expert, Gemma's extra norms and scales, gpt-oss's sinks and expert biases): one
parameterised block, no per-architecture code paths — except the attention of multi-head latent
attention layers (DeepSeek-V3, `attention_mla`), whose KV cache holds the latent and whose
up-projections are absorbed into the query and the output. Attention geometry is per layer (Gemma 4's global layers have
their own head_dim, key/value heads and RoPE); a sliding-window layer's KV cache is a ring of
window + prefill chunk rows, so it holds only what that layer can still attend to. The MoE block
runs the experts in ascending index, each over the tokens routed to it, in waves that share a
parallel region (decode: the top-k and the shared expert in one). Kernels are the C functions of
csrc/, reached through _kernels' entry points (the tier chosen at import) and the router through
_routing's; this module compiles only its own C: the expert cache, the OS hints and the input
statistics' Gram matrices (_engine.pxd). A
non-zero status (non-finite router logits or logits: a damaged model) is turned into an exception
by the Python layer. Under a memory budget (or a prefetch mode) the MoE block tells the expert
cache (csrc/expert_cache.h) which experts it uses and expects; a prefill under a budget then runs
one expert per wave, the next one's read queued before the current one's product. The structs
(Mat, FFN, Layer, Hyper, Scratch) are declared in _engine.pxd.

Files, by job: _engine_layers.pxi is the layer loop (forward and its blocks, per token, no GIL);
_engine_setup.pxi the set-up (the arena's and KV cache's layouts, the Engine that allocates them
and fills the per-layer tables once); _engine_cache_probe.pxi the expert cache alone, for the
tests. This file holds the codes they share.
"""

from libc.stdint cimport uintptr_t, int32_t, int64_t, uint8_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memset, memcpy
from libc.math cimport expf, sqrtf
cimport cython
from cython.parallel cimport prange

cimport colibri._kernels as kernels
cimport colibri._routing as routing
from colibri._kernels cimport (cb_act_q8, cb_matjob, CB_F32, CB_INT8, CB_INT4, CB_MXFP4, CB_NL4, CB_INT6, CB_BF16,
                               CB_TRANSPOSED, CB_INTERLEAVED, CB_ACT_SWIGLU_CLAMPED, cb_row_stride, cb_kv_row_bytes)

import numpy as np

from colibri.errors import ColibriError

from colibri import names
from colibri._kernels import ACT_ARRAYS, DTYPE_CODES, KV_CODES, LAYOUT_CODES, act_specs
from colibri._os import arena, zeros     # every buffer of the engine comes from the OS layer (alloc_aligned)

# Step status codes, read by model.py.
cpdef enum:
    STATUS_OK = 0
    STATUS_BAD_ROUTER = 1
    STATUS_BAD_LOGITS = 2
    STATUS_BAD_HIDDEN = 3

# expert prefetching through the expert cache's readers (PREFETCH_CODES names them)
cpdef enum:
    PREFETCH_NONE = 0         # experts are read by the loop's page faults
    PREFETCH_ROUTED = 1       # a chosen expert that is not resident is also read by the readers, in one request
    # ... and the next layer's likely experts (its router on this hidden state) one layer early
    PREFETCH_PREDICT = 2

# prediction counters, Engine.prefetch_stats[PF_*]
cpdef enum:
    PF_PREDICTED = 0          # experts predicted for the next layer
    PF_PREDICT_HITS = 1       # of which the next layer really chose
    PF_SKIPPED = 2            # expert uses skip_missed left out
    PF_REROUTED = 3           # expert uses cache_routing chose instead of the router's own
    PF_N = 4

# q/k norm modes (QK_NORM_CODES names them)
cpdef enum:
    QK_NORM_NONE = 0
    QK_NORM_PER_HEAD = 1     # Qwen3-MoE: RMSNorm over each head's head_dim values
    QK_NORM_WHOLE = 2        # OLMoE: RMSNorm over the whole projected q (k) vector

PREFETCH_CODES = dict(zip(names.PREFETCH_MODES, (PREFETCH_NONE, PREFETCH_ROUTED, PREFETCH_PREDICT)))
QK_NORM_CODES = {"none": QK_NORM_NONE, "per_head": QK_NORM_PER_HEAD, "whole": QK_NORM_WHOLE}
# _os.EngineAdvice kinds
ADVICE_CODES = {"none": CB_ADVICE_NONE, "madvise": CB_ADVICE_MADVISE, "win32": CB_ADVICE_WIN32}
EVICTION_CODES = dict(zip(names.EVICTION_POLICIES, (CB_EVICT_LRU, CB_EVICT_LFU)))      # the expert cache's policies
# the expert cache's counters, Engine.cache_stats[CACHE_STATS[name]] (csrc/expert_cache.h)
CACHE_STATS = {"hits": CB_CS_HITS, "misses": CB_CS_MISSES, "prefetches": CB_CS_PREFETCHES,
               "prefetch_hits": CB_CS_PREFETCH_HITS, "evictions": CB_CS_EVICTIONS, "wasted_prefetches": CB_CS_WASTED,
               "over_budget": CB_CS_OVER_BUDGET, "read_calls": CB_CS_READ_CALLS, "read_bytes": CB_CS_READ_BYTES,
               "drops": CB_CS_DROPS, "advice_failures": CB_CS_FAILURES}

# the layer loop (forward and its blocks), then the Engine that sets it up, then the cache's test probe
include "_engine_layers.pxi"
include "_engine_setup.pxi"
include "_engine_cache_probe.pxi"
