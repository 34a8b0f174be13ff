// Hot loops are compiled twice (the optimizer three times), for the x86-64 baseline (SSE2) and for AVX2, and glibc's ifunc
// resolver picks the clone that the CPU supports when the library loads. The clones execute the
// same IEEE operations in the same lane order (no FMA: -ffp-contract=off, and "avx2" does not
// enable it), so their results are bit-identical; only the vector width differs.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#define SP_SIMD_CLONES __attribute__((target_clones("avx2", "default")))
// Loops built on variable byte shuffles (__builtin_shuffle -> pshufb), which the SSE2 baseline
// lacks: an SSSE3 clone as well. Shuffles are exact, so every clone gives the same bits.
#define SP_SHUFFLE_CLONES __attribute__((target_clones("avx2", "ssse3", "default")))
#define SP_HAVE_VECTOR_SHUFFLE 1
// Streaming loops whose speed is the memory's (the host optimizer): an AVX-512 clone as well,
// for the CPUs that have it. AVX-512F brings no FMA contraction under -ffp-contract=off either.
#define SP_WIDE_SIMD_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define SP_WIDE_SIMD_CLONES
#define SP_SIMD_CLONES
#define SP_SHUFFLE_CLONES
#define SP_HAVE_VECTOR_SHUFFLE 0
#endif
