/* quantize_nl4.h — choosing nl4's scales and codes (the format: quant.h, cb_igroup_nl4).
 *
 * Per row an f32 scale s = CB_NL4_HEADROOM x the largest half-block extreme / (64 x 31); per
 * half-block of 16 weights the integer scale sub in [-31, 31] and the 16 codes of least weighted
 * error sum_c w_c (x_c - s sub v_c)^2 among 2 x (2 CB_NL4_TRIES + 1) candidates: the block's
 * signed extreme put on either end of the codebook (-64 or 56) nudged by t / 64 of it, each
 * candidate's codes refitted by weighted least squares and rounded to a multiple of s, its
 * error measured with that rounded scale (as llama.cpp's IQ4_NL search, with the scale's own
 * rounding in the error), then the chosen scale's two neighbours on the grid. The headroom
 * leaves the refitted scales room above the extreme's (a least-squares refit can want a
 * larger scale than the extreme alone gives).
 * w_c: the importance of column c (colibri.calibrate: the mean square of that input), or x_c^2.
 * The nearest code of a value comes from a table at half-unit steps: every midpoint between two
 * codebook values is a multiple of 1/2, so the table is exact but at the midpoints themselves.
 * Output: colibri.quant's rows form (quant.py): per block of 32 the two scales + 32, the 16 code
 * bytes in int4's order, then the row's f32 scale. Rows run in parallel (OpenMP).
 */
#ifndef COLIBRI_QUANTIZE_NL4_H
#define COLIBRI_QUANTIZE_NL4_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "quant.h"

#define CB_NL4_HEADROOM 1.15f
#define CB_NL4_TRIES 7
#define CB_NL4_SUB_MAX 31
#define CB_NL4_LUT_MIN (-80)                 /* the code table covers [-80, 80) in steps of 1/2 */
#define CB_NL4_LUT_SIZE 320

static uint8_t cb_nl4_nearest_lut[CB_NL4_LUT_SIZE];
static int cb_nl4_lut_ready;

static void cb_nl4_init_lut(void) {
    for (int i = 0; i < CB_NL4_LUT_SIZE; i++) {
        const float v = CB_NL4_LUT_MIN + 0.5f * (float)i + 0.25f;      /* the middle of the cell */
        int best = 0;
        for (int k = 1; k < 16; k++)
            if (fabsf(v - cb_nl4_int[k]) < fabsf(v - cb_nl4_int[best])) best = k;
        cb_nl4_nearest_lut[i] = (uint8_t)best;
    }
    cb_nl4_lut_ready = 1;
}

static inline int cb_nl4_nearest(float v) {
    float f = floorf((v - (float)CB_NL4_LUT_MIN) * 2.0f);
    int i = f < 0.0f ? 0 : f >= (float)CB_NL4_LUT_SIZE ? CB_NL4_LUT_SIZE - 1 : (int)f;
    return cb_nl4_nearest_lut[i];
}

/* Weighted error of x[16] at scale d (codes chosen nearest), the codes in q. */
static inline double cb_nl4_error(const float *x, const float *w, float d, uint8_t *q) {
    const float inv = d != 0.0f ? 1.0f / d : 0.0f;
    double err = 0.0;
    for (int i = 0; i < 16; i++) {
        q[i] = d != 0.0f ? (uint8_t)cb_nl4_nearest(x[i] * inv) : 8;
        const double e = (double)x[i] - (double)d * cb_nl4_int[q[i]];
        err += (double)w[i] * e * e;
    }
    return err;
}

/* One half-block: its sub-scale (in [-31, 31]) and codes q[16] under row scale s. */
static int cb_nl4_half(const float *x, const float *w, float s, uint8_t *q) {
    float ext = 0.0f;
    for (int i = 0; i < 16; i++) if (fabsf(x[i]) > fabsf(ext)) ext = x[i];
    double best = 0.0;
    for (int i = 0; i < 16; i++) best += (double)w[i] * x[i] * x[i];      /* sub 0: every weight 0 */
    int best_sub = 0;
    for (int i = 0; i < 16; i++) q[i] = 8;
    if (ext == 0.0f || s == 0.0f) return 0;
    const float ends[2] = {(float)cb_nl4_int[0], (float)cb_nl4_int[15]};
    uint8_t cand[16];
    for (int e = 0; e < 2; e++)
        for (int t = -CB_NL4_TRIES; t <= CB_NL4_TRIES; t++) {
            const float den = ends[e] + (float)t * fabsf(ends[e]) / 64.0f;
            const float d0 = ext / den, inv = 1.0f / d0;
            double num = 0.0, dd = 0.0;
            for (int i = 0; i < 16; i++) {
                const double v = cb_nl4_int[cb_nl4_nearest(x[i] * inv)];
                num += (double)w[i] * x[i] * v;
                dd += (double)w[i] * v * v;
            }
            if (dd <= 0.0) continue;
            double r = rint(num / dd / (double)s);
            const int sub = r < -CB_NL4_SUB_MAX ? -CB_NL4_SUB_MAX : r > CB_NL4_SUB_MAX ? CB_NL4_SUB_MAX : (int)r;
            if (sub == 0) continue;
            const double err = cb_nl4_error(x, w, (float)sub * s, cand);
            if (err < best) {
                best = err;
                best_sub = sub;
                memcpy(q, cand, 16);
            }
        }
    const int chosen = best_sub;                    /* its neighbours on the scale grid */
    for (int step = -1; chosen != 0 && step <= 1; step += 2) {
        const int sub = chosen + step;
        if (sub == 0 || sub < -CB_NL4_SUB_MAX || sub > CB_NL4_SUB_MAX) continue;
        const double err = cb_nl4_error(x, w, (float)sub * s, cand);
        if (err < best) {
            best = err;
            best_sub = sub;
            memcpy(q, cand, 16);
        }
    }
    return best_sub;
}

/* The row scale of a row whose largest magnitude is amax. */
static inline float cb_nl4_row_scale(float amax) {
    return amax * (CB_NL4_HEADROOM / (64.0f * CB_NL4_SUB_MAX));
}

/* The half-block step of the error-compensating quantizer (colibri.quant, _gptq): for each of
 * `rows` half-blocks x [rows, 16] under its row's scale s [rows], weighed by w [16] (the input
 * columns' importance), the stored six-bit scale sc [rows] (sub + CB_NL4_SCALE_BIAS) and the
 * codes [rows, 16] of least weighted error, by the search above. */
static void cb_nl4_search_halves(uint8_t *sc, uint8_t *codes, const float *x, const float *w, const float *s,
                                 int rows, int n_threads) {
    if (!cb_nl4_lut_ready) cb_nl4_init_lut();
    float wt[16];
    for (int i = 0; i < 16; i++) wt[i] = w[i] + 1e-30f;
    #pragma omp parallel for schedule(static) num_threads(n_threads > 0 ? n_threads : 1)
    for (int r = 0; r < rows; r++)
        sc[r] = (uint8_t)(cb_nl4_half(x + (size_t)r * 16, wt, s[r], codes + (size_t)r * 16) + CB_NL4_SCALE_BIAS);
}

/* out [rows, cols / 32 * 18 + 4] (the rows form) <- w [rows, cols] float32, cols % 32 == 0;
 * importance [cols] or NULL. */
static void cb_quantize_nl4(uint8_t *out, const float *w, const float *importance, int rows, int cols, int n_threads) {
    if (!cb_nl4_lut_ready) cb_nl4_init_lut();
    const int nb = cols / CB_QBLOCK;
    const size_t row_bytes = (size_t)nb * 18 + 4;
    #pragma omp parallel for schedule(dynamic, 16) num_threads(n_threads > 0 ? n_threads : 1)
    for (int r = 0; r < rows; r++) {
        const float *x = w + (size_t)r * cols;
        uint8_t *o = out + (size_t)r * row_bytes;
        float amax = 0.0f;
        for (int c = 0; c < cols; c++) amax = fabsf(x[c]) > amax ? fabsf(x[c]) : amax;
        const float s = cb_nl4_row_scale(amax);
        for (int b = 0; b < nb; b++) {
            uint8_t q[2][16];
            for (int h = 0; h < 2; h++) {
                const float *xh = x + b * CB_QBLOCK + 16 * h;
                float wt[16];
                for (int i = 0; i < 16; i++)
                    wt[i] = (importance ? importance[b * CB_QBLOCK + 16 * h + i] : xh[i] * xh[i]) + 1e-30f;
                o[b * 18 + h] = (uint8_t)(cb_nl4_half(xh, wt, s, q[h]) + CB_NL4_SCALE_BIAS);
            }
            for (int j = 0; j < 16; j++) o[b * 18 + 2 + j] = (uint8_t)(q[0][j] | (q[1][j] << 4));
        }
        memcpy(o + (size_t)nb * 18, &s, 4);
    }
}

#endif /* COLIBRI_QUANTIZE_NL4_H */
