/* out[M, N] = x[M, K] @ W^T for an 8-bit weight in groups of 32 along K with one scale per group (GGUF Q8_0:
 * w = d * q, q an int8), as gpu_worker/q8_linear.py packs it:
 *   qp [N_pad / 64][K][64] int8: for 64-row block nb and input k, the 64 rows' q side by side;
 *   d [K / 32][N_pad] bf16: the scale of group g of row n (bf16, so w = q * d is exact in fp32, 16 bits).
 *
 * Why: an int8 weight used to go through PyTorch's 4-bit kernel as two 4-bit halves with the input fed twice, so
 * SmolLM2's tied LM head (49,152 x 576, a third of a token's weight reads at one row) cost twice its MACs. Here:
 * - loom_q8_gemv, for a few rows: per 64-row block, each input's 64 weights are one 64-byte load, converted to
 *   fp32 and scaled (exact), then multiply-added into the rows' fp32 accumulators; no horizontal sums.
 * - loom_q8_amx, for batches on AMX: each 64-row block is dequantised once per call into the hi/lo bf16 tiles of
 *   amx_gemm.h (hi + lo is the weight exactly, as it has 16 significant bits) and multiplied 16 rows at a time.
 * - loom_q8_dot / loom_q8_fma, for batches without AMX: group_dot.h (AVX512-BF16) or fma_gemm.h (AVX2 and FMA).
 * On AVX2 the GEMV takes rows in pairs over 32-row halves (gemv_half_avx2), where the 16-lane code spilled.
 * Threads: OpenMP over the 64-row blocks (torch's libgomp, one pool).
 */
#include "loom_cpu.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#include "amx_gemm.h"
#include "fma_gemm.h"
#include "group_dot.h"

#define GEMV_MAX_ROWS 8

typedef int8_t i8x16 __attribute__((vector_size(16)));

static inline v16 ldq(const int8_t* p) { /* 16 int8 -> fp32 (exact) */
#ifdef __AVX512F__
    return (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
#else /* GCC's generic int8 -> float vector conversion is element by element: widen first */
    i8x16 q;
    memcpy(&q, p, sizeof q);
    return __builtin_convertvector(__builtin_convertvector(q, i32x16), v16);
#endif
}

/* rows m < MM of out for 64-row block nb (inlined with constant MM so the accumulators stay in registers) */
static inline __attribute__((always_inline)) void gemv_block(const float* x, int64_t K, int64_t N_pad, int64_t nb,
                                                              const int8_t* qp, const uint16_t* d, float acc[][64],
                                                              const int MM) {
    v16 a[GEMV_MAX_ROWS][4];
    for (int m = 0; m < MM; m++)
        for (int s = 0; s < 4; s++) a[m][s] = (v16){0};
    for (int64_t g = 0; g < K / 32; g++) {
        v16 dv[4];
        for (int s = 0; s < 4; s++) dv[s] = ldh(d + g * N_pad + nb * 64 + 16 * s);
        for (int64_t k = g * 32; k < g * 32 + 32; k++) {
            const int8_t* qk = qp + (nb * K + k) * 64;
            v16 w[4];
            for (int s = 0; s < 4; s++) w[s] = ldq(qk + 16 * s) * dv[s];
            for (int m = 0; m < MM; m++) {
                const float xv = x[m * K + k];
                for (int s = 0; s < 4; s++) a[m][s] += xv * w[s];
            }
        }
    }
    for (int m = 0; m < MM; m++)
        for (int s = 0; s < 4; s++) memcpy(acc[m] + 16 * s, &a[m][s], sizeof(v16));
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define GEMV_AVX2 1
/* gemv_block on AVX2 (16 ymm registers, where the generic 16-lane code above spills its accumulators): rows m0 and
 * m0 + 1 (R = 1 or 2) of x times the 32-row half h of block nb, 4 x R accumulators, each weight vector made (exact:
 * an int8 times a bf16 scale) and used at once */
static inline __attribute__((always_inline)) void gemv_half_avx2(const float* x, int64_t K, int64_t N_pad, int64_t nb,
                                                                  int h, const int8_t* qp, const uint16_t* d,
                                                                  float* acc0, float* acc1, const int R) {
    __m256 a[2][4];
    for (int r = 0; r < R; r++)
        for (int s = 0; s < 4; s++) a[r][s] = _mm256_setzero_ps();
    for (int64_t g = 0; g < K / 32; g++) {
        __m256 dv[4];
        for (int s = 0; s < 4; s++)
            dv[s] = _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(d + g * N_pad + nb * 64 + 32 * h + 8 * s))), 16));
        for (int64_t k = g * 32; k < g * 32 + 32; k++) {
            const int8_t* qk = qp + (nb * K + k) * 64 + 32 * h;
            const __m256 x0 = _mm256_broadcast_ss(x + k), x1 = _mm256_broadcast_ss(x + (R > 1 ? K : 0) + k);
            for (int s = 0; s < 4; s++) {
                const __m256 w = _mm256_mul_ps(
                    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(qk + 8 * s)))), dv[s]);
                a[0][s] = _mm256_fmadd_ps(x0, w, a[0][s]);
                if (R > 1) a[1][s] = _mm256_fmadd_ps(x1, w, a[1][s]);
            }
        }
    }
    for (int s = 0; s < 4; s++) {
        _mm256_storeu_ps(acc0 + 32 * h + 8 * s, a[0][s]);
        if (R > 1) _mm256_storeu_ps(acc1 + 32 * h + 8 * s, a[1][s]);
    }
}
#else
#define GEMV_AVX2 0
#endif

/* a = {M, N_pad, K, x, out, out_stride, out_bf16, n_out, qp, d}: x fp32 [M][K] contiguous (M <= GEMV_MAX_ROWS),
 * out [M][n_out] at row stride out_stride (bf16 if out_bf16 else fp32). Returns 0, or 1 for bad arguments (M over
 * GEMV_MAX_ROWS, N_pad not a multiple of 64, K not of 32, n_out over N_pad). */
int loom_q8_gemv(const int64_t* a) {
    const int64_t M = a[0], N_pad = a[1], K = a[2], out_stride = a[5], n_out = a[7];
    const float* x = (const float*)a[3];
    void* out = (void*)a[4];
    const int out_bf16 = (int)a[6];
    const int8_t* qp = (const int8_t*)a[8];
    const uint16_t* d = (const uint16_t*)a[9];
    if (M < 0 || M > GEMV_MAX_ROWS || N_pad % 64 || K % 32 || K <= 0 || n_out > N_pad) return 1;
    const int64_t blocks = (n_out + 63) / 64;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (blocks > 1)
#endif
    for (int64_t nb = 0; nb < blocks; nb++) {
        float acc[GEMV_MAX_ROWS][64];
#if GEMV_AVX2
        for (int64_t m = 0; m < M; m += 2) /* rows in pairs: each pair streams the block's weights once */
            for (int h = 0; h < 2; h++) {
                if (M - m > 1)
                    gemv_half_avx2(x + m * K, K, N_pad, nb, h, qp, d, acc[m], acc[m + 1], 2);
                else
                    gemv_half_avx2(x + m * K, K, N_pad, nb, h, qp, d, acc[m], acc[m], 1);
            }
#else
        switch (M) {
#define ROWS(R)                                               \
    case R:                                                   \
        gemv_block(x, K, N_pad, nb, qp, d, acc, R);           \
        break;
            ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#undef ROWS
            default:
                break;
        }
#endif
        const int64_t cols = n_out - nb * 64 < 64 ? n_out - nb * 64 : 64;
        for (int64_t m = 0; m < M; m++)
            for (int64_t c = 0; c < cols; c++) {
                if (out_bf16)
                    ((uint16_t*)out)[m * out_stride + nb * 64 + c] = f32_to_bf16(acc[m][c]);
                else
                    ((float*)out)[m * out_stride + nb * 64 + c] = acc[m][c];
            }
    }
    return 0;
}

#if HAVE_AMX
/* 64-row block nb of W as the hi/lo B tiles of amx_gemm.h */
static void build_q8(const void* qp_, const void* d_, int64_t nb, int64_t K, int64_t N_pad, uint16_t* bt) {
    const int8_t* qp = qp_;
    const uint16_t* d = d_;
    for (int64_t g = 0; g < K / 32; g++) {
        __m512 dv[4];
        for (int s = 0; s < 4; s++)
            dv[s] = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(d + g * N_pad + nb * 64 + 16 * s))), 16));
        for (int p = 0; p < 16; p++) {
            __m512 w[2][4];
            for (int h = 0; h < 2; h++) {
                const int8_t* src = qp + (nb * K + g * 32 + 2 * p + h) * 64;
                for (int s = 0; s < 4; s++)
                    w[h][s] = _mm512_mul_ps(
                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(src + 16 * s)))),
                        dv[s]);
            }
            pack_pairs(w, g, p, bt);
        }
    }
}
#endif

/* a = {M, N_pad, K, x, x_stride, x_bf16, out, out_stride, out_bf16, n_out, qp, d}: any M, on AMX (see amx_gemm).
 * Returns 0 = done, 1 = bad arguments, 2 = out of memory, 3 = no AMX (not built in, or the OS refused it). */
int loom_q8_amx(const int64_t* a) {
#if HAVE_AMX
    const int64_t M = a[0], N_pad = a[1], K = a[2], x_stride = a[4], out_stride = a[7], n_out = a[9];
    if (N_pad % 64 || K % 32 || K <= 0 || M < 0 || n_out > N_pad) return 1;
    if (M == 0 || n_out == 0) return 0;
    return amx_gemm(M, N_pad, K, (const void*)a[3], x_stride, (int)a[5], (void*)a[6], out_stride, (int)a[8], n_out,
                    build_q8, (const void*)a[10], (const void*)a[11]);
#else
    (void)a;
    return 3;
#endif
}

#if HAVE_DPBF16
/* The codes of rows [32 h, 32 h + 32) of 64-row block nb of W in group_dot.h's pair layout bq (q, exact in bf16) */
#if defined(__AVX512VBMI__)
/* One byte permutation of both inputs' 64 codes (vpermt2b) orders the half's codes as (input 2p, input 2p + 1) per
 * row; two 128-entry table lookups on |q| (vpermt2b again) give the low and high bytes of bf16(|q|), q's sign is
 * or-ed into the high byte (q = -128, whose |q| does not fit the table, is set apart), and unpacking interleaves
 * the bytes into words. The permutation is chosen so that unpacking within 128-bit lanes leaves rows 0..15 in the
 * first vector and 16..31 in the second. 12 instructions per pair of inputs, against 18 by widening to fp32. */
static uint8_t q8_lo_tab[128], q8_hi_tab[128], q8_order[2][64]; /* filled once, when the library loads */

__attribute__((constructor)) static void q8_tables(void) {
    for (int v = 0; v < 128; v++) { /* bf16(v): its low and high byte */
        float f = (float)v;
        uint32_t bits;
        memcpy(&bits, &f, 4);
        q8_lo_tab[v] = (uint8_t)(bits >> 16), q8_hi_tab[v] = (uint8_t)(bits >> 24);
    }
    /* half h: byte 16 L + 2 i + e <- row 32 h + (4 L + i (i < 4) or 12 + 4 L + i (i >= 4)) of input 2p + e */
    for (int h = 0; h < 2; h++)
        for (int L = 0; L < 4; L++)
            for (int i = 0; i < 8; i++)
                for (int e = 0; e < 2; e++)
                    q8_order[h][16 * L + 2 * i + e] = (uint8_t)(64 * e + 32 * h + (i < 4 ? 4 * L + i : 12 + 4 * L + i));
}

static void build_q8_pairs(const int8_t* qp, int64_t nb, int h, int64_t K, uint32_t* bq) {
    const __m512i order = _mm512_loadu_si512(q8_order[h]), sign = _mm512_set1_epi8((char)0x80);
    const __m512i m128 = _mm512_set1_epi8((char)0xc3);
    const __m512i lo0 = _mm512_loadu_si512(q8_lo_tab), lo1 = _mm512_loadu_si512(q8_lo_tab + 64);
    const __m512i hi0 = _mm512_loadu_si512(q8_hi_tab), hi1 = _mm512_loadu_si512(q8_hi_tab + 64);
    for (int64_t p = 0; p < K / 2; p++) {
        const int8_t* src = qp + (nb * K + 2 * p) * 64;
        const __m512i q = _mm512_permutex2var_epi8(_mm512_loadu_si512(src), order, _mm512_loadu_si512(src + 64));
        const __mmask64 min = _mm512_cmpeq_epi8_mask(q, sign); /* q = -128: bf16 0xc300 (low byte 0, as entry 0's) */
        const __m512i a = _mm512_abs_epi8(q);
        const __m512i lo = _mm512_permutex2var_epi8(lo0, a, lo1);
        __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, a, hi1), q, sign, 0xF8); /* | (q & sign) */
        hi = _mm512_mask_mov_epi8(hi, min, m128);
        _mm512_storeu_si512(bq + p * 32, _mm512_unpacklo_epi8(lo, hi));      /* rows 0..15 */
        _mm512_storeu_si512(bq + p * 32 + 16, _mm512_unpackhi_epi8(lo, hi)); /* rows 16..31 */
    }
}
#else
/* Without AVX512-VBMI (Cooper Lake): each code widened to fp32 (exact), whose top half is its bf16 */
static void build_q8_pairs(const int8_t* qp, int64_t nb, int h, int64_t K, uint32_t* bq) {
    const __m512i top = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int64_t p = 0; p < K / 2; p++) {
        const int8_t* src = qp + (nb * K + 2 * p) * 64 + 32 * h;
        for (int s = 0; s < 2; s++) { /* pair dword = code(2p + 1) bits & top | code(2p) bits >> 16 */
            __m512i a = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(src + 16 * s)))));
            __m512i b = _mm512_castps_si512(
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(src + 64 + 16 * s)))));
            _mm512_storeu_si512(bq + p * 32 + 16 * s, _mm512_ternarylogic_epi32(top, b, _mm512_srli_epi32(a, 16), 0xCA));
        }
    }
}
#endif

/* rows [32 h, 32 h + 32) of 64-row block nb of W as group_dot.h's codes and scales (Q8_0 has no zeros) */
static void build_q8_codes(const void* qp, const void* d_, int64_t nb, int h, int64_t K, int64_t N_pad, uint32_t* bq,
                           float* sc, float* zr) {
    (void)zr;
    const uint16_t* d = d_;
    build_q8_pairs(qp, nb, h, K, bq);
    for (int64_t g = 0; g < K / 32; g++)
        for (int s = 0; s < 2; s++)
            _mm512_storeu_ps(sc + g * 32 + 16 * s,
                             _mm512_castsi512_ps(_mm512_slli_epi32(
                                 _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(d + g * N_pad + nb * 64 + 32 * h + 16 * s))), 16)));
}
#endif

/* loom_q8_amx's contract on AVX512-BF16 dot products instead of AMX (group_dot.h): for CPUs without AMX.
 * Returns 0 = done, 1 = bad arguments, 2 = out of memory, 3 = not built in (no AVX512-BF16). */
int loom_q8_dot(const int64_t* a) {
#if HAVE_DPBF16
    const int64_t M = a[0], N_pad = a[1], K = a[2], x_stride = a[4], out_stride = a[7], n_out = a[9];
    if (N_pad % 64 || K % 32 || K <= 0 || M < 0 || n_out > N_pad) return 1;
    if (M == 0 || n_out == 0) return 0;
    return dot_gemm(M, N_pad, K, (const void*)a[3], x_stride, (int)a[5], (void*)a[6], out_stride, (int)a[8], n_out,
                    build_q8_codes, (const void*)a[10], (const void*)a[11], 0);
#else
    (void)a;
    return 3;
#endif
}

#if HAVE_FMA_GEMM
/* Group g of rows [32 h, 32 h + 32) of 64-row block nb of W as fp32 weights T [32 inputs][32 rows] for fma_gemm.h:
 * w = d * q, exact in fp32 (a bf16 scale times an int8) */
static void build_q8_fma(const void* qp_, const void* d_, int64_t nb, int h, int64_t g, int64_t K, int64_t N_pad,
                         float* T) {
    const int8_t* qp = qp_;
    const uint16_t* d = d_;
    __m256 sc[4];
    for (int s = 0; s < 4; s++)
        sc[s] = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(d + g * N_pad + nb * 64 + 32 * h + 8 * s))), 16));
    for (int k = 0; k < 32; k++) {
        const int8_t* src = qp + (nb * K + g * 32 + k) * 64 + 32 * h;
        for (int s = 0; s < 4; s++) {
            const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(src + 8 * s))));
            _mm256_storeu_ps(T + k * 32 + 8 * s, _mm256_mul_ps(q, sc[s]));
        }
    }
}
#endif

/* loom_q8_amx's contract on AVX2 fp32 FMAs (fma_gemm.h): for CPUs with neither AMX nor AVX512-BF16.
 * Returns 0 = done, 1 = bad arguments, 2 = out of memory, 3 = not built in (no AVX2 and FMA). */
int loom_q8_fma(const int64_t* a) {
#if HAVE_FMA_GEMM
    const int64_t M = a[0], N_pad = a[1], K = a[2], x_stride = a[4], out_stride = a[7], n_out = a[9];
    if (N_pad % 64 || K % 32 || K <= 0 || M < 0 || n_out > N_pad) return 1;
    if (M == 0 || n_out == 0) return 0;
    return fma_gemm(M, N_pad, K, (const void*)a[3], x_stride, (int)a[5], (void*)a[6], out_stride, (int)a[8], n_out,
                    build_q8_fma, (const void*)a[10], (const void*)a[11]);
#else
    (void)a;
    return 3;
#endif
}
