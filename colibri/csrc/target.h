/* target.h — what the compiler is building for: x86 or not (CB_X86), the instruction sets of each
 * tier's functions (per-function target attributes), and the forced inlining of specialised
 * kernel bodies. Compile-time facts only: what the CPU running the build has is cpu.h's question.
 */
#ifndef COLIBRI_TARGET_H
#define COLIBRI_TARGET_H

/* The instruction sets of each tier's functions (per-function target attributes: one build runs
 * on any x86-64 CPU, and dispatch.h picks the tier at import). MSVC needs no attribute. */
#if defined(__GNUC__) || defined(__clang__)
#define CB_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define CB_TARGET_AVXVNNI __attribute__((target("avx2,fma,f16c,avxvnni")))
#define CB_TARGET_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")))
#define CB_TARGET_AVX512_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#define CB_TARGET_AVX512_BF16 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#else
#define CB_TARGET_AVX2
#define CB_TARGET_AVXVNNI
#define CB_TARGET_AVX512
#define CB_TARGET_AVX512_VNNI
#define CB_TARGET_AVX512_BF16
#endif

/* A kernel body specialised by constant arguments must be inlined into each caller. */
#if defined(_MSC_VER)
#define CB_ALWAYS_INLINE __forceinline
#else
#define CB_ALWAYS_INLINE inline __attribute__((always_inline))
#endif

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__) || defined(_M_IX86)
#define CB_X86 1
#else
#define CB_X86 0
#endif

/* A variable each thread has its own of. */
#if defined(_MSC_VER)
#define CB_THREAD_LOCAL __declspec(thread)
#else
#define CB_THREAD_LOCAL __thread
#endif

#endif /* COLIBRI_TARGET_H */
