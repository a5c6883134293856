/* out[M, n_out] = x[M, K] @ W^T for a few rows of x (decode at batch 1 to a few) over PyTorch's CPU 4-bit layout
 * (csrc/int4_batch.c describes it), on vector FMAs.
 *
 * Why: at one row, PyTorch's _weight_int4pack_mm_for_cpu dequantises each weight to fp32 ((q - 8) * scale + zero,
 * one FMA per lane) and then multiplies it with x (a second FMA), and it was the larger half of a batch-1 decode step
 * on a 4-bit model. Here the group's scale and zero are factored out of the sum over its 32 inputs:
 *     sum_k x_k w_k = scale * sum_k x_k (q_k - 8) + zero * sum_k x_k,
 * so the inner loop turns each nibble into the fp32 value q - 8 (exact) and does one FMA per weight, and the scale
 * and zero apply once per group and row (the same form as csrc/group_dot.h). x is rounded to bf16 first, as every
 * other 4-bit path takes it, so each product x_k (q_k - 8) is exact in fp32 and the result is the fp32-dequantised
 * weight's up to fp32 summation.
 *
 * - gemv512 (AVX-512; PyTorch's 64-row blocks): per input, the 32 bytes of a 64-row block are widened to four
 *   16-lane vectors and each nibble becomes q - 8 by a 16-entry table lookup (vpermps reads an index's low 4 bits,
 *   so the low nibble needs no mask); x's rows in chunks of 4, 4 x 4 accumulators.
 * - gemv_avx2 (AVX2 and FMA; 32- or 64-row blocks): per input, 8 bytes at a time widened to 8 lanes, masked or
 *   shifted, converted (q, not q - 8: the group's term is then (zero - 8 scale) * sum x, GGUF's own minimum); rows
 *   of x in pairs, 4 x 2 accumulators in 16 ymm registers.
 * Threads: OpenMP over the weight's row blocks (torch's libgomp, one pool). Include after loom_cpu.h.
 */
#ifndef LOOM_INT4_GEMV_H
#define LOOM_INT4_GEMV_H
#include <immintrin.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#ifndef GEMV_PREFETCH
#define GEMV_PREFETCH 4096
#endif
static __thread void* gv_buf;
static __thread size_t gv_cap;

/* x [M, K] (row stride x_stride; bf16 or fp32) as bf16-rounded fp32 xf [M][K] and group sums xs [M][K / 32], in one
 * per-thread buffer; NULL when out of memory */
static float* gemv4_inputs(int64_t M, int64_t K, const void* x, int64_t x_stride, int x_bf16, float** xs) {
    const int64_t G = K / 32;
    float* xf = thread_buffer(&gv_buf, &gv_cap, (size_t)(M * (K + G)) * 4);
    if (!xf) return NULL;
    *xs = xf + M * K;
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k++) {
            float v = x_bf16 ? bf16_to_f32(((const uint16_t*)x)[m * x_stride + k]) : ((const float*)x)[m * x_stride + k];
            if (!x_bf16) v = bf16_to_f32(f32_to_bf16(v));
            xf[m * K + k] = v;
        }
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < G; g++) {
            float s = 0.f;
            for (int k = 0; k < 32; k++) s += xf[m * K + g * 32 + k];
            (*xs)[m * G + g] = s;
        }
    return xf;
}

/* rows [0, rows) of tot [M][64] into out's columns [n0, n0 + 64) that are below n_out */
static inline void gemv4_store(const float* tot, int64_t M, int64_t n0, int64_t n_out, void* out, int64_t out_stride,
                               int out_bf16) {
    const int64_t cols = n_out - n0 < 64 ? n_out - n0 : 64;
    for (int64_t m = 0; m < M; m++)
        for (int64_t c = 0; c < cols; c++) {
            if (out_bf16)
                ((uint16_t*)out)[m * out_stride + n0 + c] = f32_to_bf16(tot[m * 64 + c]);
            else
                ((float*)out)[m * out_stride + n0 + c] = tot[m * 64 + c];
        }
}

/* dst[r * ld + c] (r < M, c < 64) = rows r of xf times the 64-row block nb over groups [g0, g1) */
typedef void (*gemv_unit_fn)(const float* xf, const float* xs, int64_t M, int64_t K, int64_t N_pad, int64_t nb,
                             int64_t g0, int64_t g1, const uint8_t* packed, const uint32_t* sz, float* dst, int64_t ld,
                             int block);

static __thread void* gp_buf;
static __thread size_t gp_cap;

/* The GEMV over 64-row blocks with unit() for one block's products. Where K has an even number of groups, each block
 * sums its two halves of groups separately and adds them, always: a weight of an odd number of blocks (SmolLM2's 576
 * and 960 rows: 9 and 15) then gives two threads equal shares (each takes half of the block in the middle), and the
 * sums depend on K alone, never on the thread count or on how many blocks the weight has, so a 64-row cut of a weight
 * (a TP shard, the vocab-parallel head) computes its rows bit for bit as the whole does. Returns 0 = done, 2 = out of
 * memory. */
static int gemv_drive(int64_t M, int64_t N_pad, int64_t K, const void* x, int64_t x_stride, int x_bf16, void* out,
                      int64_t out_stride, int out_bf16, int64_t n_out, const uint8_t* packed, const uint16_t* sz,
                      gemv_unit_fn unit, int block) {
    float* xs;
    const float* xf = gemv4_inputs(M, K, x, x_stride, x_bf16, &xs);
    if (!xf) return 2;
    const int64_t blocks = (n_out + 63) / 64, G = K / 32, parts = G % 2 == 0 ? 2 : 1;
    const uint32_t* s = (const uint32_t*)sz;
    const size_t esize = out_bf16 ? 2 : 4;
    const int64_t ld = blocks * 64; /* partials [parts][M][blocks * 64] fp32 */
    float* part = thread_buffer(&gp_buf, &gp_cap, (size_t)(parts * M * ld) * 4);
    if (!part) return 2;
#pragma omp parallel if (blocks * parts > 1)
    {
#pragma omp for schedule(static)
        for (int64_t w = 0; w < parts * blocks; w++) {
            const int64_t nb = w / parts, p = w % parts;
            unit(xf, xs, M, K, N_pad, nb, p * (G / parts), (p + 1) * (G / parts), packed, s,
                 part + p * M * ld + nb * 64, ld, block);
        }
#pragma omp for schedule(static)
        for (int64_t nb = 0; nb < blocks; nb++) {
            float tot[64] __attribute__((aligned(64)));
            for (int64_t m = 0; m < M; m++) {
                const float* p0 = part + m * ld + nb * 64;
                for (int c = 0; c < 64; c++) tot[c] = parts == 2 ? p0[c] + p0[M * ld + c] : p0[c];
                gemv4_store(tot, 1, nb * 64, n_out, (char*)out + m * out_stride * esize, out_stride, out_bf16);
            }
        }
    }
    return 0;
}

#ifdef __AVX512F__
#define HAVE_GEMV512 1
/* dst[r * ld + 0..64) = rows r < R of xf times the 64-row block nb over groups [g0, g1) (R constant when inlined:
 * accumulators in registers) */
static inline __attribute__((always_inline)) void gemv512_block(const float* xf, const float* xs, int64_t K,
                                                                int64_t N_pad, int64_t nb, int64_t g0, int64_t g1,
                                                                const uint8_t* packed, const uint32_t* sz, float* dst,
                                                                int64_t ld, const int R) {
    const __m512 lut = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7); /* q - 8, exact */
    const int64_t G = K / 32;
    __m512 t[4][4];
    for (int r = 0; r < R; r++)
        for (int s = 0; s < 4; s++) t[r][s] = _mm512_setzero_ps();
    for (int64_t g = g0; g < g1; g++) {
        __m512 a[4][4];
        for (int r = 0; r < R; r++)
            for (int s = 0; s < 4; s++) a[r][s] = _mm512_setzero_ps();
        const uint8_t* src = packed + (nb * K + g * 32) * 32;
        if (g + 1 < g1)
            for (int s = 0; s < 4; s++) _mm_prefetch((const char*)(sz + (g + 1) * N_pad + nb * 64 + 16 * s), _MM_HINT_T0);
        for (int kk = 0; kk < 32; kk++, src += 32) {
            if (kk % 2 == 0) _mm_prefetch((const char*)(src + GEMV_PREFETCH), _MM_HINT_T0);
            const __m512i b0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)src));        /* rows 0..15 */
            const __m512i b1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(src + 16))); /* 16..31 */
            const __m512 w[4] = {_mm512_permutexvar_ps(b0, lut), _mm512_permutexvar_ps(b1, lut),
                                 _mm512_permutexvar_ps(_mm512_srli_epi32(b0, 4), lut),  /* rows 32..47 */
                                 _mm512_permutexvar_ps(_mm512_srli_epi32(b1, 4), lut)}; /* rows 48..63 */
            for (int r = 0; r < R; r++) {
                const __m512 xv = _mm512_set1_ps(xf[r * K + g * 32 + kk]);
                for (int s = 0; s < 4; s++) a[r][s] = _mm512_fmadd_ps(xv, w[s], a[r][s]);
            }
        }
        for (int s = 0; s < 4; s++) { /* (scale, zero) bf16 pairs of 16 rows -> two fp32 vectors */
            const __m512i v = _mm512_loadu_si512(sz + g * N_pad + nb * 64 + 16 * s);
            const __m512 sc = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
            const __m512 zr = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
            for (int r = 0; r < R; r++)
                t[r][s] = _mm512_fmadd_ps(zr, _mm512_set1_ps(xs[r * G + g]), _mm512_fmadd_ps(a[r][s], sc, t[r][s]));
        }
    }
    for (int r = 0; r < R; r++)
        for (int s = 0; s < 4; s++) _mm512_storeu_ps(dst + r * ld + 16 * s, t[r][s]);
}

/* gemv_unit_fn on AVX-512: rows in chunks of 4 */
static void gemv512_unit(const float* xf, const float* xs, int64_t M, int64_t K, int64_t N_pad, int64_t nb, int64_t g0,
                         int64_t g1, const uint8_t* packed, const uint32_t* sz, float* dst, int64_t ld, int block) {
    (void)block;
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const float *xm = xf + m0 * K, *sm = xs + m0 * (K / 32);
        float* d = dst + m0 * ld;
        switch (M - m0 < 4 ? M - m0 : 4) {
        case 1: gemv512_block(xm, sm, K, N_pad, nb, g0, g1, packed, sz, d, ld, 1); break;
        case 2: gemv512_block(xm, sm, K, N_pad, nb, g0, g1, packed, sz, d, ld, 2); break;
        case 3: gemv512_block(xm, sm, K, N_pad, nb, g0, g1, packed, sz, d, ld, 3); break;
        default: gemv512_block(xm, sm, K, N_pad, nb, g0, g1, packed, sz, d, ld, 4); break;
        }
    }
}

#else
#define HAVE_GEMV512 0
#endif

#if defined(__AVX2__) && defined(__FMA__)
#define HAVE_GEMV_AVX2 1
/* tot[r][0..32) (r < R, R = 1 or 2) = rows r of xf times the 32 rows [32 u, 32 u + 32) of W, where the packing's
 * block is 32 (16 bytes per input: rows j in low nibbles, 16 + j in high ones) or 64 (32 bytes per input: rows j and
 * 32 + j; the half u % 2 takes one nibble of each byte) */
static inline __attribute__((always_inline)) void gemv_avx2_half(const float* xf, const float* xs, int64_t K,
                                                                 int64_t N_pad, int64_t u, int64_t g0, int64_t g1,
                                                                 const uint8_t* packed, const uint32_t* sz, float* dst,
                                                                 int64_t ld, const int R, const int block) {
    const int64_t G = K / 32;
    const __m256i m15 = _mm256_set1_epi32(15);
    __m256 t[2][4];
    for (int r = 0; r < R; r++)
        for (int s = 0; s < 4; s++) t[r][s] = _mm256_setzero_ps();
    for (int64_t g = g0; g < g1; g++) {
        __m256 a[2][4];
        for (int r = 0; r < R; r++)
            for (int s = 0; s < 4; s++) a[r][s] = _mm256_setzero_ps();
        if (g + 1 < g1)
            for (int s = 0; s < 4; s += 2) _mm_prefetch((const char*)(sz + (g + 1) * N_pad + u * 32 + 8 * s), _MM_HINT_T0);
        for (int kk = 0; kk < 32; kk++) {
            const int64_t k = g * 32 + kk;
            __m256 w[4];
            if (block == 32) {
                const uint8_t* src = packed + (u * K + k) * 16;
                if (kk % 4 == 0) _mm_prefetch((const char*)(src + GEMV_PREFETCH), _MM_HINT_T0);
                const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)src));       /* rows 0..7 */
                const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(src + 8))); /* 8..15 */
                w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(b0, m15));
                w[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b1, m15));
                w[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)); /* rows 16..23 */
                w[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)); /* rows 24..31 */
            } else {
                const uint8_t* src = packed + ((u / 2) * K + k) * 32;
                if (kk % 2 == 0) _mm_prefetch((const char*)(src + GEMV_PREFETCH), _MM_HINT_T0);
                for (int s = 0; s < 4; s++) {
                    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(src + 8 * s)));
                    w[s] = _mm256_cvtepi32_ps(u % 2 ? _mm256_srli_epi32(b, 4) : _mm256_and_si256(b, m15));
                }
            }
            for (int r = 0; r < R; r++) {
                const __m256 xv = _mm256_broadcast_ss(xf + r * K + k);
                for (int s = 0; s < 4; s++) a[r][s] = _mm256_fmadd_ps(xv, w[s], a[r][s]);
            }
        }
        for (int s = 0; s < 4; s++) { /* scale, and zero - 8 scale (the term of sum x q - 8 sum x) */
            const __m256i v = _mm256_loadu_si256((const __m256i*)(sz + g * N_pad + u * 32 + 8 * s));
            const __m256 sc = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            const __m256 zr = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)));
            const __m256 zm = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), sc, zr);
            for (int r = 0; r < R; r++)
                t[r][s] = _mm256_fmadd_ps(zm, _mm256_set1_ps(xs[r * G + g]), _mm256_fmadd_ps(a[r][s], sc, t[r][s]));
        }
    }
    for (int r = 0; r < R; r++)
        for (int s = 0; s < 4; s++) _mm256_storeu_ps(dst + r * ld + 8 * s, t[r][s]);
}

/* gemv_unit_fn on AVX2: rows in pairs, each over the block's two 32-row halves */
static void gemv_avx2_unit(const float* xf, const float* xs, int64_t M, int64_t K, int64_t N_pad, int64_t nb,
                           int64_t g0, int64_t g1, const uint8_t* packed, const uint32_t* sz, float* dst, int64_t ld,
                           int block) {
    for (int64_t m0 = 0; m0 < M; m0 += 2) {
        const float *xm = xf + m0 * K, *sm = xs + m0 * (K / 32);
        const int R = M - m0 > 1 ? 2 : 1;
        for (int h = 0; h < 2; h++) {
            float* d = dst + m0 * ld + 32 * h;
            const int64_t u = 2 * nb + h;
            if (block == 32 && R == 2) gemv_avx2_half(xm, sm, K, N_pad, u, g0, g1, packed, sz, d, ld, 2, 32);
            if (block == 32 && R == 1) gemv_avx2_half(xm, sm, K, N_pad, u, g0, g1, packed, sz, d, ld, 1, 32);
            if (block == 64 && R == 2) gemv_avx2_half(xm, sm, K, N_pad, u, g0, g1, packed, sz, d, ld, 2, 64);
            if (block == 64 && R == 1) gemv_avx2_half(xm, sm, K, N_pad, u, g0, g1, packed, sz, d, ld, 1, 64);
        }
    }
}

#else
#define HAVE_GEMV_AVX2 0
#endif
#endif
