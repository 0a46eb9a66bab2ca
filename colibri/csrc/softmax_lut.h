/* softmax_lut.h — the routing softmax lookup table of the original design.
 *
 * Domain: z = logit - max(logits), clamped to [-CB_LUT_RANGE, 0].
 * Step:   CB_LUT_RANGE / (CB_LUT_SIZE - 1) = 8 / 65535 ~= 1.22e-4 in z.
 * Value:  cb_softmax_lut[i] = round(255 * exp(-i * step)), a uint8: exp(z) ~= table / 255.
 *         Every z below ln(0.5 / 255) ~= -6.23 maps to 0, so the range 8 loses nothing.
 * Error:  |table[i(z)] / 255 - exp(z)| <= CB_LUT_DELTA = 0.5 / 255 + step / 2 ~= 0.00202 for
 *         any finite z <= 0 (rounding of the value, plus half a step of z times exp's slope <= 1).
 *         The largest logit maps to exactly 255, so a routing weight p = e_j / sum(e) computed
 *         from the table errs by at most (n + 1) * CB_LUT_DELTA, where n is the number of
 *         terms in the sum: k when the weights are renormalised over the chosen experts
 *         (Mixtral, norm_topk_prob), all experts otherwise. tests/test_routing.py checks it.
 * The table is built once by cb_init_softmax_lut() at import and never changes (64 KiB).
 */
#ifndef COLIBRI_SOFTMAX_LUT_H
#define COLIBRI_SOFTMAX_LUT_H

#include <math.h>
#include <stdint.h>

#define CB_LUT_SIZE 65536
#define CB_LUT_RANGE 8.0f
#define CB_LUT_DELTA (0.5f / 255.0f + 0.5f * CB_LUT_RANGE / (CB_LUT_SIZE - 1))

static uint8_t cb_softmax_lut[CB_LUT_SIZE];

static void cb_init_softmax_lut(void) {
    for (int i = 0; i < CB_LUT_SIZE; i++) {
        double z = -(double)i * CB_LUT_RANGE / (CB_LUT_SIZE - 1);
        cb_softmax_lut[i] = (uint8_t)lrint(255.0 * exp(z));
    }
}

/* exp(z) for z <= 0 from the table, as a float in [0, 1]. */
static inline float cb_lut_exp(float z) {
    float t = -z * ((CB_LUT_SIZE - 1) / CB_LUT_RANGE) + 0.5f;
    int i = t >= (float)(CB_LUT_SIZE - 1) ? CB_LUT_SIZE - 1 : (int)t;
    return (float)cb_softmax_lut[i] * (1.0f / 255.0f);
}

#endif /* COLIBRI_SOFTMAX_LUT_H */
