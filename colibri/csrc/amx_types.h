/* amx_types.h — the AMX step's shapes (kernels_amx.h explains the step): whether this build has
 * the tile instructions, the tiles' sizes and the packed blocks the step's body (amx_body.h) works
 * on. Types and constants only: the kernel module instantiates the body with the instructions, the
 * probes with the tile ops emulated in C (test_steps.h).
 */
#ifndef COLIBRI_AMX_TYPES_H
#define COLIBRI_AMX_TYPES_H

#include "api.h"
#include "target.h"

/* tiles: 64-bit mode only. GCC and clang write the tile instructions as inline asm (CB_NO_AMX_ASM:
 * setup.py found an assembler without them); MSVC, which has no inline asm on x86-64, takes the
 * _tile_* intrinsics of immintrin.h (its tile numbers constants, as here; CB_NO_AMX_INTRINSICS:
 * setup.py found a Visual Studio without them), as does a GCC or clang
 * build with CB_AMX_INTRINSICS and -mamx-tile -mamx-int8 -mamx-bf16 (the tests compile that). */
#if CB_X86 && defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(CB_NO_AMX_ASM)
#define CB_HAVE_AMX 1
#ifndef CB_AMX_INTRINSICS
#define CB_AMX_ASM 1
#endif
#elif CB_X86 && defined(_MSC_VER) && defined(_M_X64) && !defined(CB_NO_AMX_INTRINSICS)
#define CB_HAVE_AMX 1
#endif

#if CB_HAVE_AMX

#define CB_AMX_TOKENS 16            /* A's and C's rows: tokens a tile */

#ifndef CB_AMX_KBLOCKS
#define CB_AMX_KBLOCKS 32           /* blocks of a group pair unpacked at a time: 18 KB of B beside
                                       a token tile's 18 KB of A, in L1 */
#endif
#if CB_AMX_KBLOCKS < 1
#error "CB_AMX_KBLOCKS: at least 1"
#endif
/* The pair tile's software pipeline (amx_body.h): a block's C is stored CB_AMX_STORE_DELAY steps
 * after its product is issued and scaled CB_AMX_LOOKAHEAD steps after (STORE_DELAY <= LOOKAHEAD).
 * C goes round STORE_DELAY + 2 tiles beside A and B's four, so the next block's product never
 * waits for this one's store (one C tile for all blocks would make each product wait for the last
 * store); cbuf has LOOKAHEAD - STORE_DELAY + 1 slots. The default (0, 1) stores a block's C right
 * after its product and scales it a step later. The emulated tiles hold this body to its bits on
 * any AVX-512 CPU, and the import-time self-test holds the hardware tiles to them. */
#ifndef CB_AMX_STORE_DELAY
#define CB_AMX_STORE_DELAY 0
#endif
#ifndef CB_AMX_LOOKAHEAD
#define CB_AMX_LOOKAHEAD 1
#endif
#define CB_AMX_CTILES (CB_AMX_STORE_DELAY + 2)
#define CB_AMX_CBUFS (CB_AMX_LOOKAHEAD - CB_AMX_STORE_DELAY + 1)
#if CB_AMX_STORE_DELAY > 2 || CB_AMX_STORE_DELAY > CB_AMX_LOOKAHEAD
#error "CB_AMX_STORE_DELAY: 0 .. 2, at most CB_AMX_LOOKAHEAD"
#endif

/* ldtilecfg's 64 bytes (palette 1). */
typedef struct {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} cb_amx_config;

/* One block of a group pair, as B (signed bytes) and its 16 output scales. */
typedef struct {
    int8_t q[8][64];                /* [row c][group p * 32 + output r * 4 + i]: input 4c + i */
    float dw[16];                   /* [p * 8 + r] the weight scales */
} cb_amx_wblock;

/* One block of a tile of tokens, as A and the tokens' activation scales. */
typedef struct {
    int8_t q[CB_AMX_TOKENS][CB_QBLOCK];     /* [token][input] */
    float d[CB_AMX_TOKENS];                 /* [token] */
} cb_amx_act;

/* The scratch (amx_body.h) lays these out back to back: each keeps the next 64-byte aligned. */
CB_STATIC_ASSERT(sizeof(cb_amx_wblock) % 64 == 0 && sizeof(cb_amx_act) % 64 == 0, "AMX blocks: 64-byte multiples");

#define CB_AMX_BF16_UNITS 16            /* units c (4 inputs) a TDPBF16PS */
#ifndef CB_AMX_BF16_CHUNKS
#define CB_AMX_BF16_CHUNKS 8            /* 64-input chunks of B unpacked at a time: 16 KB a group pair, so
                                           two pairs' B stay in Sapphire Rapids' 48 KB L1 beside A */
#endif
/* Group pairs a pass: with two, each lane's products go 2 token tiles x 2 pairs (4 tile loads for 4
 * TDPBF16PS, the blocking Intel's optimization manual gives for AMX); with one, 2 token tiles x 1
 * pair (6 loads for 4). Between ranges of chunks each C tile goes to memory and back (2 more tile
 * moves for 8 chunks' 8 products). tools/bench/amx_engine.py's variants (one pair, 16 chunks:
 * bf16-pairs1; two pairs of 16 chunks, 64 KB of B: bf16-chunks16) are the alternatives to time
 * this one against. */
#ifndef CB_AMX_BF16_PAIRS
#define CB_AMX_BF16_PAIRS 2
#endif
#if CB_AMX_BF16_PAIRS < 1 || CB_AMX_BF16_PAIRS > 2 || CB_AMX_BF16_CHUNKS < 1
#error "CB_AMX_BF16_PAIRS: 1 or 2; CB_AMX_BF16_CHUNKS: at least 1"
#endif

/* One chunk of 64 inputs of a group pair as B, both lanes (2 KB). */
typedef struct {
    uint16_t q[2][CB_AMX_BF16_UNITS][32];       /* [lane p][unit c][output n * 2 + j] */
} cb_amx_bf16_w;

/* One chunk of 64 inputs of a tile of tokens as A, both lanes (2 KB). */
typedef struct {
    uint16_t q[2][CB_AMX_TOKENS][32];           /* [lane p][token][unit c * 2 + j] */
} cb_amx_bf16_a;

#else
#define CB_HAVE_AMX 0
#endif /* CB_HAVE_AMX */
#endif /* COLIBRI_AMX_TYPES_H */
