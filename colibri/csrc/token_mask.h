/* token_mask.h — a grammar's token mask laid over the logits (constrained decoding).
 *
 * The mask is llguidance's bitmask: bit (i & 31) of 32-bit word i >> 5 is set where token i is
 * allowed. out[i] = logits[i] where it is set (the same value, bit for bit) and -inf elsewhere,
 * in one branch-free pass (a select through an all-ones / all-zeros word per lane: a random mask
 * would defeat a branch, and NumPy's masked copy branches per element). The bit test is written
 * against a table of single bits so that the 32 lanes of a word vectorize with SSE2 alone.
 */
#ifndef COLIBRI_TOKEN_MASK_H
#define COLIBRI_TOKEN_MASK_H

#include <stdint.h>
#include <string.h>

#define CB_NEG_INF_BITS 0xFF800000u    /* float -inf */

static const uint32_t cb_single_bits[32] = {
    1u << 0, 1u << 1, 1u << 2, 1u << 3, 1u << 4, 1u << 5, 1u << 6, 1u << 7,
    1u << 8, 1u << 9, 1u << 10, 1u << 11, 1u << 12, 1u << 13, 1u << 14, 1u << 15,
    1u << 16, 1u << 17, 1u << 18, 1u << 19, 1u << 20, 1u << 21, 1u << 22, 1u << 23,
    1u << 24, 1u << 25, 1u << 26, 1u << 27, 1u << 28, 1u << 29, 1u << 30, 1u << 31};

/* logits [n], bits [ceil(n / 32)] -> out [n] (out may not alias logits). */
static inline void cb_mask_logits(const float *logits, const uint32_t *bits, float *out, int64_t n) {
    int64_t full = n / 32;
    for (int64_t w = 0; w < full; w++) {
        uint32_t word = bits[w];
        uint32_t src[32], lanes[32];
        memcpy(src, logits + 32 * w, sizeof src);
        for (int j = 0; j < 32; j++) {
            uint32_t keep = (word & cb_single_bits[j]) ? 0xFFFFFFFFu : 0u;
            lanes[j] = (src[j] & keep) | (CB_NEG_INF_BITS & ~keep);
        }
        memcpy(out + 32 * w, lanes, sizeof lanes);
    }
    for (int64_t i = 32 * full; i < n; i++) {
        uint32_t v;
        memcpy(&v, logits + i, sizeof v);
        v = ((bits[i >> 5] >> (i & 31)) & 1u) ? v : CB_NEG_INF_BITS;
        memcpy(out + i, &v, sizeof v);
    }
}

#endif
