/* out[M, n_out] = x[M, K] @ W^T for bf16 x and W with fp32 accumulation and bf16 out, on CPUs with AVX512-BF16.
 *
 * A bf16 worker uses it where a start-up timing finds it faster than oneDNN's packed GEMM (gpu_worker/bf16_gemm.py;
 * bench/bf16_gemm.py compares the two per shape). A version with a mixed batch's LoRA expand fused in measured no
 * faster than the LoRA kernel after it (branch experiment/fused-lora-gemm; docs/performance.md).
 *
 * W is packed once into panels of NR = 48 output columns in the "VNNI" pair layout vdpbf16ps reads:
 *     wp[N_pad / 48][K / 2][48][2]   (element [p][q][c][h] = W[48 p + c][2 q + h]; zero columns past n_out)
 * Register block (Goto/BLIS: K. Goto and R. van de Geijn, "Anatomy of high-performance matrix multiplication", TOMS
 * 2008): 8 rows x 48 columns = 24 zmm accumulators; per pair of inputs, 3 weight vectors, 8 broadcasts of one row's
 * (x[m, k], x[m, k + 1]) pair and 24 vdpbf16ps. A panel (48 x K bf16: 55 KB at K = 576) stays in L2 while every
 * block of rows passes over it, so W is read from memory once per call. Threads: OpenMP over panels (torch's
 * libgomp, one pool).
 */
#include "loom_cpu.h"

#define NR 48

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define HAVE_GEMM 1

/* rows [0, MRV) of x (row stride xs) times panel wp (K / 2 pairs) into out columns [0, cw) of rows of stride os;
 * MRV is a compile-time constant so the accumulators stay in registers */
#define DEFINE_TILE(MRV)                                                                                        \
    static void tile##MRV(const uint16_t* x, int64_t xs, int64_t K, const uint16_t* wp, uint16_t* out,          \
                          int64_t os, int64_t cw) {                                                             \
        __m512 acc[MRV][3];                                                                                     \
        for (int i = 0; i < MRV; i++) acc[i][0] = acc[i][1] = acc[i][2] = _mm512_setzero_ps();                  \
        for (int64_t q = 0; q < K / 2; q++) {                                                                   \
            const uint16_t* w = wp + q * NR * 2;                                                                \
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 32),    \
                           w2 = (__m512bh)_mm512_loadu_si512(w + 64);                                           \
            for (int i = 0; i < MRV; i++) {                                                                     \
                int32_t pair;                                                                                   \
                memcpy(&pair, x + i * xs + 2 * q, 4);                                                           \
                const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);                                          \
                acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xb, w0);                                                \
                acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xb, w1);                                                \
                acc[i][2] = _mm512_dpbf16_ps(acc[i][2], xb, w2);                                                \
            }                                                                                                   \
        }                                                                                                       \
        for (int i = 0; i < MRV; i++)                                                                           \
            for (int j = 0; j < 3; j++) {                                                                       \
                const int64_t c0 = 16 * j, n = cw - c0 < 16 ? cw - c0 : 16;                                     \
                if (n <= 0) break;                                                                              \
                const __m256i h = (__m256i)_mm512_cvtneps_pbh(acc[i][j]);                                       \
                _mm256_mask_storeu_epi16(out + i * os + c0, (__mmask16)((1u << n) - 1), h);                     \
            }                                                                                                   \
    }
DEFINE_TILE(8)
DEFINE_TILE(4)
DEFINE_TILE(2)
DEFINE_TILE(1)
#else
#define HAVE_GEMM 0
#endif

/* The entry point: one block of int64 (gpu_worker.native_build.arg_block):
 *   [0] M, [1] K (even), [2] n_out, [3] x (bf16, row stride [4] elements), [5] wp (the packed panels of
 *   ceil(n_out / 48) * 48 columns), [6] out (bf16, row stride [7] elements).
 * Returns 0 = done, 1 = bad arguments (K odd or not positive), 3 = not built with AVX512-BF16. */
int loom_bf16_gemm(const int64_t* a) {
#if HAVE_GEMM
    const int64_t M = a[0], K = a[1], n_out = a[2], xs = a[4], os = a[7];
    const uint16_t* x = (const uint16_t*)a[3];
    const uint16_t* wp = (const uint16_t*)a[5];
    uint16_t* out = (uint16_t*)a[6];
    if (K <= 0 || K % 2 || M < 0 || n_out < 0) return 1;
    const int64_t np = (n_out + NR - 1) / NR;
#ifdef _OPENMP
#pragma omp parallel for schedule(static)
#endif
    for (int64_t p = 0; p < np; p++) {
        const uint16_t* w = wp + p * K * NR;
        const int64_t cw = n_out - p * NR < NR ? n_out - p * NR : NR;
        uint16_t* o = out + p * NR;
        int64_t m = 0;
        for (; m + 8 <= M; m += 8) tile8(x + m * xs, xs, K, w, o + m * os, os, cw);
        if (M - m >= 4) tile4(x + m * xs, xs, K, w, o + m * os, os, cw), m += 4;
        if (M - m >= 2) tile2(x + m * xs, xs, K, w, o + m * os, os, cw), m += 2;
        if (M - m >= 1) tile1(x + m * xs, xs, K, w, o + m * os, os, cw);
    }
    return 0;
#else
    (void)a;
    return 3;
#endif
}
