// Hot loops are compiled twice, for the x86-64 baseline (SSE2) and for AVX2, and glibc's ifunc
// resolver picks the clone that the CPU supports when the library loads. The clones execute the
// same IEEE operations in the same lane order (no FMA: -ffp-contract=off, and "avx2" does not
// enable it), so their results are bit-identical; only the vector width differs.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#define SP_SIMD_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define SP_SIMD_CLONES
#endif
