# The contract with the top-k router (csrc/routing.h), compiled once, into this module: routing.h's
# softmax table is state, filled at import; other modules call `route` below, never cb_route.

cdef extern from "api.h" nogil:
    int CB_MAX_TOP_K          # the most experts a token may choose

# logits [n_experts] -> the top-k experts (chosen [k]) and their weights [k]; -1 if a logit is not finite
cdef int route(const float *logits, int n_experts, int k, int norm_topk_prob, int use_lut,
               int *chosen, float *weights) noexcept nogil

# the sigmoid router (GLM-4.5, DeepSeek-V3): bias [n_experts] or NULL steers the choice, the
# weights are the unbiased sigmoid scores (routing.h cb_route_sigmoid)
cdef int route_sigmoid(const float *logits, const float *bias, int n_experts, int k, int n_group, int topk_group,
                       int norm_topk_prob, float scaling, int *chosen, float *weights) noexcept nogil
