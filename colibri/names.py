"""The names a user chooses by, each list defined once.

Storage formats, layouts, and the run options that pick among fixed choices. The CLI reads them
without importing numpy or the compiled modules (a fast --help), and the modules that map them
to the C side's codes build their tables from them, in the C enums' order: _kernels.DTYPE_CODES,
LAYOUT_CODES, KV_CODES; _engine.PREFETCH_CODES, EVICTION_CODES.
"""

DISTRIBUTION = "colibri-moe"  # the name on PyPI (`colibri` there is another project); `import colibri`
FORMATS = ("f32", "f16", "bf16", "int8", "int4", "mxfp4", "nl4", "int6")  # csrc/kernels_scalar.h CB_F32 .. CB_INT6
LAYOUTS = ("rows", "transposed", "interleaved")  # CB_ROWS, CB_TRANSPOSED, CB_INTERLEAVED
KV_CACHE_TYPES = ("f32", "f16", "q8")  # load(kv_cache=): CB_KV_F32, CB_KV_F16, CB_KV_Q8
PREFETCH_MODES = ("none", "routed", "predict")  # load(prefetch=): the layer loop's PREFETCH_*
EVICTION_POLICIES = ("lru", "lfu")  # load(eviction=): CB_EVICT_LRU, CB_EVICT_LFU
DEFAULT_EVICTION = "lfu"  # chosen by tools/bench/routing_cache.py on trained routing
# load(bf16_products=): "f32" the exact products, "bf16" the activations rounded to bf16 for
# AVX512_BF16's vdpbf16ps, "auto" bf16 where the CPU has it (colibri.model)
BF16_PRODUCTS = ("auto", "bf16", "f32")
# load(prefill_chunk=) / --prefill-chunk: prompt tokens the engine runs together by default; bounds
# the prefill scratch (about 40 KB a token for a 1024-wide model with 3584-wide experts)
DEFAULT_PREFILL_CHUNK = 128
MAX_PARALLEL = 64  # load(parallel=) / serve --parallel: sequences decoded together at most
# batching.Batch(step_tokens=) / serve --step-tokens: tokens one pass runs at most. A prompt's
# chunk shares each pass with the decoding sequences, so a smaller step bounds their gaps (P99) and
# a larger one amortises the weights' reads; 32 keeps both (docs/performance.md, serving)
DEFAULT_STEP_TOKENS = 32
