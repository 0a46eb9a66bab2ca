/* routing.h — expert selection for one token of one MoE layer.
 *
 * The router's logits are float. Selection is top-k on the logits themselves (softmax is
 * monotone, so this is exact): one pass with a sorted insertion buffer of k entries, ties to the
 * lowest expert index (an equal later logit never displaces an earlier one), never an expert
 * twice. The weights are softmax probabilities of the chosen experts:
 *   norm_topk_prob = 1: renormalised over the chosen k (Mixtral; equals top-k-then-softmax), so
 *                       only k exponentials are needed;
 *   norm_topk_prob = 0: over all experts (Qwen-MoE, OLMoE without renormalisation).
 * Exponentials are expf (exact mode) or the uint8 lookup table of softmax_lut.h.
 */
#ifndef COLIBRI_ROUTING_H
#define COLIBRI_ROUTING_H

#include <math.h>
#include "softmax_lut.h"

#define CB_MAX_TOP_K 64

/* logits [n_experts] (unchanged); chosen [k] expert indices and weights [k], in descending
 * logit order. Returns 0, or -1 when a logit is NaN or infinite (a damaged router: nothing is
 * chosen) or k is outside 1..min(n_experts, CB_MAX_TOP_K). */
static int cb_route(const float *logits, int n_experts, int k, int norm_topk_prob, int use_lut,
                    int *chosen, float *weights) {
    float top[CB_MAX_TOP_K];                    /* [k] the chosen logits, descending */
    int n = 0;
    if (k < 1 || k > n_experts || k > CB_MAX_TOP_K) return -1;
    top[0] = -INFINITY;                         /* (always overwritten: k >= 1 experts enter) */
    for (int e = 0; e < n_experts; e++) {
        float v = logits[e];
        if (!isfinite(v)) return -1;
        if (n == k && !(v > top[k - 1])) continue;
        int pos = n < k ? n++ : k - 1;           /* the slot v enters from, then bubbles up */
        while (pos > 0 && v > top[pos - 1]) {
            top[pos] = top[pos - 1];
            chosen[pos] = chosen[pos - 1];
            pos--;
        }
        top[pos] = v;
        chosen[pos] = e;
    }
    float mx = top[0], total = 0.0f;
    for (int j = 0; j < k; j++) {
        weights[j] = use_lut ? cb_lut_exp(top[j] - mx) : expf(top[j] - mx);
        total += weights[j];
    }
    if (!norm_topk_prob) {                       /* the denominator runs over every expert */
        total = 0.0f;
        for (int e = 0; e < n_experts; e++) total += use_lut ? cb_lut_exp(logits[e] - mx) : expf(logits[e] - mx);
    }
    float inv = 1.0f / total;
    for (int j = 0; j < k; j++) weights[j] *= inv;
    return 0;
}

#endif /* COLIBRI_ROUTING_H */
