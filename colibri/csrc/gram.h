/* gram.h — the input second moments `calibrate --second-moments` collects (colibri/calibrate.py).
 *
 * g [cols, cols] float64, its upper triangle (c1 <= c2), += x^T x over the n tokens of one product,
 * x [n, ldx] float32. The tokens are transposed once into xt [cols, n] (the caller's scratch; NULL
 * when n is 1), so
 * that each entry's n products are one contiguous dot product: summed in float32 (n is at most a
 * prefill chunk), then added to g in float64, which holds the sum over the whole text. Four entries
 * of a row at a time share the loads of column c1; rows go to the OpenMP threads. A pass over g per
 * product, not per token: the cost is cols^2 / 2 multiply-adds a token, in vector registers.
 */
#ifndef COLIBRI_GRAM_H
#define COLIBRI_GRAM_H

#include <stddef.h>

/* OpenMP 4's simd reductions where the compiler has them (MSVC's OpenMP 2.0 does not): the
 * float32 sums may then be reordered into vector lanes */
#if defined(_OPENMP) && _OPENMP >= 201307
#define CB_GRAM_SIMD4 _Pragma("omp simd reduction(+:s0, s1, s2, s3)")
#define CB_GRAM_SIMD1 _Pragma("omp simd reduction(+:s)")
#else
#define CB_GRAM_SIMD4
#define CB_GRAM_SIMD1
#endif

static void cb_gram_add(double *g, const float *x, int ldx, int n, int cols, float *xt) {
    const float *src = x;                   /* one token is its own transpose: xt may be NULL */
    if (n > 1) {
        for (int t = 0; t < n; t++)
            for (int c = 0; c < cols; c++) xt[(size_t)c * n + t] = x[(size_t)t * ldx + c];
        src = xt;
    }
    #pragma omp parallel for schedule(dynamic, 8)
    for (int c1 = 0; c1 < cols; c1++) {
        const float *a = src + (size_t)c1 * n;
        double *row = g + (size_t)c1 * cols;
        int c2 = c1;
        for (; c2 + 4 <= cols; c2 += 4) {
            const float *b0 = src + (size_t)c2 * n, *b1 = b0 + n, *b2 = b1 + n, *b3 = b2 + n;
            float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
            CB_GRAM_SIMD4
            for (int t = 0; t < n; t++) {
                s0 += a[t] * b0[t];
                s1 += a[t] * b1[t];
                s2 += a[t] * b2[t];
                s3 += a[t] * b3[t];
            }
            row[c2] += s0;
            row[c2 + 1] += s1;
            row[c2 + 2] += s2;
            row[c2 + 3] += s3;
        }
        for (; c2 < cols; c2++) {
            const float *b = src + (size_t)c2 * n;
            float s = 0.0f;
            CB_GRAM_SIMD1
            for (int t = 0; t < n; t++) s += a[t] * b[t];
            row[c2] += s;
        }
    }
}

#endif /* COLIBRI_GRAM_H */
