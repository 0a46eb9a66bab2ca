# The C the probes call (csrc/probes.h: the machine's ceilings for the benchmarks' rooflines);
# the kernels themselves come through colibri._kernels' entry points.

from libc.stdint cimport uint64_t

cdef extern from "probes.h" nogil:
    uint64_t cb_read_bytes(const void *p, size_t n, int n_threads)
    double cb_peak_fma_avx2(long long iters, int n_threads)
    double cb_peak_fma_avx512(long long iters, int n_threads)
    double cb_peak_int8_avx2(long long iters, int n_threads)
    double cb_peak_bf16_avx512(long long iters, int n_threads)
    double cb_peak_vnni_avx512(long long iters, int n_threads)
