/* routing.h — expert selection for one token of one MoE layer (float path).
 *
 * The router's logits are float. Selection is top-k on the logits: softmax is monotone, so this
 * is exact; ties go to the lowest expert index and no expert is chosen twice. The weights are the
 * softmax probabilities of the chosen experts over ALL experts, renormalised over the chosen ones
 * when `norm_topk_prob` is set (Mixtral always renormalises, which equals its top-k-then-softmax).
 * The softmax lookup table of the original design is a separate step (softmax_lut.h, later).
 */
#ifndef COLIBRI_ROUTING_H
#define COLIBRI_ROUTING_H

#include <math.h>

/* logits [n_experts] (clobbered: becomes the softmax probabilities)
 * chosen [k] expert indices, weights [k]: written in the order selected (descending probability).
 * Returns 0, or -1 when a logit is NaN or infinite (a damaged router: nothing is chosen). */
static int cb_route(float *logits, int n_experts, int k, int norm_topk_prob, int *chosen,
                    float *weights) {
    for (int e = 0; e < n_experts; e++) if (!isfinite(logits[e])) return -1;
    /* top-k on the logits themselves: two logits that differ can round to equal probabilities */
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < n_experts; e++) {
            int taken = 0;
            for (int i = 0; i < j; i++) taken |= (chosen[i] == e);
            if (!taken && (best < 0 || logits[e] > logits[best])) best = e;
        }
        chosen[j] = best;
    }
    if (cb_softmax(logits, n_experts) != 0) return -1;
    float total = 0.0f;
    for (int j = 0; j < k; j++) {
        weights[j] = logits[chosen[j]];
        total += weights[j];
    }
    if (norm_topk_prob) {
        for (int j = 0; j < k; j++) weights[j] /= total;
    }
    return 0;
}

#endif /* COLIBRI_ROUTING_H */
