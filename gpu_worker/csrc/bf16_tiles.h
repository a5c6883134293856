/* The register tiles of Loom's bf16 GEMM (csrc/bf16_gemm.c), shared with the LoRA kernel (csrc/lora_sgmv.c), whose
 * fused entry computes a projection's base GEMM in the same threads as its LoRA shrink (loom_lora_sgmv_gemm).
 *
 * W is packed once into panels of NR = 48 output columns in the "VNNI" pair layout vdpbf16ps reads:
 *     wp[N_pad / 48][K / 2][48][2]   (element [p][q][c][h] = W[48 p + c][2 q + h]; zero columns past n_out)
 * Register block (Goto/BLIS: K. Goto and R. van de Geijn, "Anatomy of high-performance matrix multiplication", TOMS
 * 2008): 8 rows x 48 columns = 24 zmm accumulators; per pair of inputs, 3 weight vectors, 8 broadcasts of one row's
 * (x[m, k], x[m, k + 1]) pair and 24 vdpbf16ps. A panel (48 x K bf16: 55 KB at K = 576) stays in L2 while every
 * block of rows passes over it, so W is read from memory once per call.
 */
#ifndef LOOM_BF16_TILES_H
#define LOOM_BF16_TILES_H
#include "loom_cpu.h"

#define NR 48

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define HAVE_GEMM 1

/* Cache lines another job of the same thread will read soon (the LoRA shrink's A rows): the tiles prefetch one
 * into L2 every other pair of inputs, so that memory-bound reads proceed under the GEMM's arithmetic, spread
 * thinly enough not to stall it (a burst of hundreds of prefetches fills the load queue) */
typedef struct {
    const char* const* line;
    int64_t n, i;
} pf_list;

/* rows [0, MRV) of x (row stride xs) times panel wp (K / 2 pairs) into out columns [0, cw) of rows of stride os;
 * MRV is a compile-time constant so the accumulators stay in registers; the PF versions prefetch pf's lines on
 * the way (the others never look at pf) */
#define DEFINE_TILE(MRV, NAME, PF)                                                                              \
    static void NAME(const uint16_t* x, int64_t xs, int64_t K, const uint16_t* wp, uint16_t* out, int64_t os,   \
                     int64_t cw, pf_list* pf) {                                                                 \
        __m512 acc[MRV][3];                                                                                     \
        for (int i = 0; i < MRV; i++) acc[i][0] = acc[i][1] = acc[i][2] = _mm512_setzero_ps();                  \
        for (int64_t q = 0; q < K / 2; q++) {                                                                   \
            if (PF && !(q & 1) && pf->i < pf->n) __builtin_prefetch(pf->line[pf->i++], 0, 2);                  \
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
DEFINE_TILE(8, tile8, 0)
DEFINE_TILE(4, tile4, 0)
DEFINE_TILE(2, tile2, 0)
DEFINE_TILE(1, tile1, 0)
DEFINE_TILE(8, tile8pf, 1)
DEFINE_TILE(4, tile4pf, 1)
DEFINE_TILE(2, tile2pf, 1)
DEFINE_TILE(1, tile1pf, 1)

/* out columns of panel p (all M rows) = x @ W^T there; with pf, its lines are prefetched on the way */
static inline void gemm_panel(int64_t p, int64_t M, int64_t K, int64_t n_out, const uint16_t* x, int64_t xs,
                              const uint16_t* wp, uint16_t* out, int64_t os, pf_list* pf) {
    const uint16_t* w = wp + p * K * NR;
    const int64_t cw = n_out - p * NR < NR ? n_out - p * NR : NR;
    uint16_t* o = out + p * NR;
    /* blocks of 8 rows, then one of 4, 2 and 1 as the rows left need, on the tiles t8 .. t1 */
#define PANEL_ROWS(t8, t4, t2, t1)                                                                              \
    do {                                                                                                        \
        int64_t m = 0;                                                                                          \
        for (; m + 8 <= M; m += 8) t8(x + m * xs, xs, K, w, o + m * os, os, cw, pf);                            \
        if (M - m >= 4) t4(x + m * xs, xs, K, w, o + m * os, os, cw, pf), m += 4;                               \
        if (M - m >= 2) t2(x + m * xs, xs, K, w, o + m * os, os, cw, pf), m += 2;                               \
        if (M - m >= 1) t1(x + m * xs, xs, K, w, o + m * os, os, cw, pf);                                       \
    } while (0)
    if (!pf) {
        PANEL_ROWS(tile8, tile4, tile2, tile1);
        return;
    }
    PANEL_ROWS(tile8pf, tile4pf, tile2pf, tile1pf);
#undef PANEL_ROWS
    while (pf->i < pf->n) __builtin_prefetch(pf->line[pf->i++], 0, 2); /* what the tiles left */
}
#else
#define HAVE_GEMM 0
#endif
#endif
