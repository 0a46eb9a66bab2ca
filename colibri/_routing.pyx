# cython: language_level=3
"""The router of Colibri: softmax over the router logits, then the top-k experts (routing.h).

The weights come from the float softmax (exact) or from a lookup table of exponentials over a
clamped logit range (the original design's LUT, `use_lut`); each architecture's variant is a
flag: renormalised over the chosen experts (`norm_topk_prob`) or not. The table is filled here
once, at import; the layer loop calls `route` (declared in _routing.pxd).
"""

cdef extern from "routing.h" nogil:
    float CB_LUT_DELTA        # worst-case error of one table exponential (softmax_lut.h)
    void cb_init_softmax_lut()
    int cb_route(const float *logits, int n_experts, int k, int norm_topk_prob, int use_lut,
                 int *chosen, float *weights)
    int cb_route_sigmoid(const float *logits, const float *bias, int n_experts, int k, int n_group,
                         int topk_group, int norm_topk_prob, float scaling, int *chosen, float *weights)


cb_init_softmax_lut()
LUT_DELTA = CB_LUT_DELTA        # worst-case error of one table exponential (softmax_lut.h)
MAX_TOP_K = CB_MAX_TOP_K


cdef int route(const float *logits, int n_experts, int k, int norm_topk_prob, int use_lut,
               int *chosen, float *weights) noexcept nogil:
    return cb_route(logits, n_experts, k, norm_topk_prob, use_lut, chosen, weights)


cdef int route_sigmoid(const float *logits, const float *bias, int n_experts, int k, int n_group, int topk_group,
                       int norm_topk_prob, float scaling, int *chosen, float *weights) noexcept nogil:
    return cb_route_sigmoid(logits, bias, n_experts, k, n_group, topk_group, norm_topk_prob, scaling, chosen, weights)
