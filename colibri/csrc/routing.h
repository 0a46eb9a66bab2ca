/* routing.h — expert selection for one token of one MoE layer.
 *
 * The router's logits are float. Selection (softmax routers) is top-k on the logits themselves (softmax is
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
#include "api.h"
#include "softmax_lut.h"


/* Offer value v of expert e to the top-k buffer (top [k] descending, chosen [k], n entries so
 * far): it enters if there is room or it beats the last; an equal value never displaces. */
static inline void cb_topk_offer(float *top, int *chosen, int *n, int k, float v, int e) {
    if (*n == k && !(v > top[k - 1])) return;
    int pos = *n < k ? (*n)++ : k - 1;           /* the slot v enters from, then bubbles up */
    while (pos > 0 && v > top[pos - 1]) {
        top[pos] = top[pos - 1];
        chosen[pos] = chosen[pos - 1];
        pos--;
    }
    top[pos] = v;
    chosen[pos] = e;
}

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
        if (!isfinite(logits[e])) return -1;
        cb_topk_offer(top, chosen, &n, k, logits[e], e);
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

/* The sigmoid router of GLM-4.5 / DeepSeek-V3, as transformers computes it:
 *   score[e]  = sigmoid(logits[e]);  choice[e] = score[e] + bias[e] (bias NULL: 0)
 *   groups: n_experts / n_group experts each; a group's worth = the sum of its two best choice
 *   values (one expert per group: that one); the topk_group best groups stay, ties to the lower
 *   group; top-k of choice within them, ties to the lower expert index
 *   weights[j] = score of the chosen (no bias), divided by their sum + 1e-20 with norm_topk_prob,
 *   times scaling.
 * chosen [k] / weights [k] in descending choice order. 0, or -1 on a non-finite logit or k,
 * n_group, topk_group out of range. */
static int cb_route_sigmoid(const float *logits, const float *bias, int n_experts, int k, int n_group,
                            int topk_group, int norm_topk_prob, float scaling, int *chosen, float *weights) {
    float top[CB_MAX_TOP_K];
    float worth[CB_MAX_TOP_K];                   /* [n_group] <= CB_MAX_TOP_K groups */
    unsigned char keep[CB_MAX_TOP_K];
    int per = n_group > 0 ? n_experts / n_group : 0, n = 0;
    if (k < 1 || k > n_experts || k > CB_MAX_TOP_K || n_group < 1 || n_group > CB_MAX_TOP_K
            || n_experts % n_group || topk_group < 1 || topk_group > n_group || topk_group * per < k)
        return -1;
    for (int e = 0; e < n_experts; e++)
        if (!isfinite(logits[e])) return -1;
    #define CB_CHOICE(e) (1.0f / (1.0f + expf(-logits[e])) + (bias ? bias[e] : 0.0f))
    for (int g = 0; g < n_group; g++) {
        float a = -INFINITY, b = -INFINITY;       /* the two best of the group */
        for (int e = g * per; e < (g + 1) * per; e++) {
            float v = CB_CHOICE(e);
            if (v > a) { b = a; a = v; } else if (v > b) b = v;
        }
        worth[g] = per > 1 ? a + b : a;
        keep[g] = 0;
    }
    for (int r = 0; r < topk_group; r++) {        /* the best remaining group, ties to the lower */
        int best = -1;
        for (int g = 0; g < n_group; g++)
            if (!keep[g] && (best < 0 || worth[g] > worth[best])) best = g;
        keep[best] = 1;
    }
    top[0] = -INFINITY;
    for (int e = 0; e < n_experts; e++)
        if (keep[e / per]) cb_topk_offer(top, chosen, &n, k, CB_CHOICE(e), e);
    #undef CB_CHOICE
    float total = 0.0f;
    for (int j = 0; j < k; j++) {
        weights[j] = 1.0f / (1.0f + expf(-logits[chosen[j]]));
        total += weights[j];
    }
    if (norm_topk_prob) {
        float denominator = total + 1e-20f;
        for (int j = 0; j < k; j++) weights[j] /= denominator;
    }
    for (int j = 0; j < k; j++) weights[j] *= scaling;
    return 0;
}

#endif /* COLIBRI_ROUTING_H */
