/* The batch GEMM of Loom's group-quantised kernels (csrc/int4_batch.c, csrc/q8_linear.c) on CPUs with AVX2 and FMA
 * but neither AVX512-BF16 nor AMX (AMD Zen 1-3, Intel Haswell to Ice Lake client parts): fp32 FMAs on weights
 * dequantised to fp32 one group at a time.
 *
 * Why: there, PyTorch's 4-bit CPU kernel dequantises every weight again for every few rows of input, so a 32-row
 * decode step cost ~2.4x the fp32 model's on a Zen 3 (461 against 193 ms). Here each group of 32 inputs of a 32-row
 * half of a weight block is dequantised once per call per 60 rows of x into an L1-resident fp32 tile T [32][32]
 * (w = c * scale + zero in one rounding, as the other kernels compute it), and 6 rows of x times 16 columns are
 * multiplied against it with 12 fp32 accumulators in registers (the Goto/BLIS register-block shape for 16 ymm
 * registers: K. Goto and R. van de Geijn, "Anatomy of high-performance matrix multiplication", TOMS 2008).
 * x is rounded to bf16 (as PyTorch's kernel and the others take it) and widened exactly, so the products are the
 * fp32-dequantised weight's up to fp32 summation.
 *
 * A kernel supplies build(), which writes one group g of one 32-row half h of 64-row block nb as T[k][n] fp32
 * (k < 32 the group's inputs, n < 32 the half's rows). Work is shared among threads by halves (the model's
 * 576-row matrices are 18 of them, so two cores get equal shares). Threads: OpenMP.
 * Include after loom_cpu.h; it defines HAVE_FMA_GEMM (1 where AVX2 and FMA are compiled in).
 */
#ifndef LOOM_FMA_GEMM_H
#define LOOM_FMA_GEMM_H
#if defined(__AVX2__) && defined(__FMA__)
#define HAVE_FMA_GEMM 1
#else
#define HAVE_FMA_GEMM 0
#endif
#if HAVE_FMA_GEMM
#include <immintrin.h>

/* write group g of rows [32 h, 32 h + 32) of 64-row block nb (w, s: the format's arrays) as T [32 inputs][32 rows] */
typedef void (*fma_build_fn)(const void* w, const void* s, int64_t nb, int h, int64_t g, int64_t K, int64_t N_pad,
                             float* T);

#define FMA_MR 6  /* rows of x per register block: 6 x 2 accumulators + 2 weight vectors + 1 broadcast = 15 ymm */
#define FMA_MC 60 /* rows of x per pass over a half: its accumulators (60 x 32 fp32, 7.5 KB) and T stay in L1 */

static __thread void* fx_buf;
static __thread size_t fx_cap;

/* acc[R][32] += xg[R rows][32 inputs of the group] . T, for 16 of the 32 columns (n0 = 0 or 16); R constant when
 * inlined, so the accumulators stay in registers */
static inline __attribute__((always_inline)) void fma_block(const float* xg, const float* T, float* acc, const int R) {
    __m256 c[FMA_MR][2];
    for (int r = 0; r < R; r++) c[r][0] = _mm256_loadu_ps(acc + r * 32), c[r][1] = _mm256_loadu_ps(acc + r * 32 + 8);
    for (int k = 0; k < 32; k++) {
        const __m256 b0 = _mm256_loadu_ps(T + k * 32), b1 = _mm256_loadu_ps(T + k * 32 + 8);
        for (int r = 0; r < R; r++) {
            const __m256 a = _mm256_broadcast_ss(xg + r * 32 + k);
            c[r][0] = _mm256_fmadd_ps(a, b0, c[r][0]);
            c[r][1] = _mm256_fmadd_ps(a, b1, c[r][1]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(acc + r * 32, c[r][0]), _mm256_storeu_ps(acc + r * 32 + 8, c[r][1]);
}

/* out[M, n_out] = x[M, K] @ W^T with W's groups made by build (x row stride x_stride elements, bf16 if x_bf16 else
 * fp32; out row stride out_stride, bf16 (rounded to nearest even) if out_bf16 else fp32). N_pad % 64 == 0,
 * K % 32 == 0, n_out <= N_pad. Returns 0 = done, 2 = out of memory. */
static int fma_gemm(int64_t M, int64_t N_pad, int64_t K, const void* x, int64_t x_stride, int x_bf16, void* out,
                    int64_t out_stride, int out_bf16, int64_t n_out, fma_build_fn build, const void* w,
                    const void* s) {
    /* x as bf16 values in fp32, group-major, [K / 32][M][32], read by every thread: a block's rows of one group
     * are then one run of memory (rows K floats apart would share a few L1 sets when K is a multiple of 512) */
    const int64_t G = K / 32;
    float* xf = thread_buffer(&fx_buf, &fx_cap, (size_t)(M * K * 4));
    if (!xf) return 2;
    for (int64_t i = 0; i < M; i++)
        for (int64_t k = 0; k < K; k += 16) {
            v16 v = ldx(x, i * x_stride + k, x_bf16);
            if (!x_bf16) { /* rounded to bf16 like the other kernels' (and PyTorch's) inputs */
                uint16_t h[16];
                sth(h, v);
                v = ldh(h);
            }
            memcpy(xf + ((k / 32) * M + i) * 32 + k % 32, &v, 64);
        }
#pragma omp parallel for schedule(static)
    for (int64_t u = 0; u < N_pad / 32; u++) {
        const int64_t n0 = u * 32;
        if (n0 >= n_out) continue;
        const int64_t cols = n_out - n0 < 32 ? n_out - n0 : 32;
        float T[32 * 32] __attribute__((aligned(64)));
        float acc[FMA_MC * 32] __attribute__((aligned(64)));
        for (int64_t m0 = 0; m0 < M; m0 += FMA_MC) {
            const int64_t mc = M - m0 < FMA_MC ? M - m0 : FMA_MC;
            memset(acc, 0, (size_t)mc * 32 * 4);
            for (int64_t g = 0; g < G; g++) {
                build(w, s, u / 2, (int)(u % 2), g, K, N_pad, T);
                for (int64_t r0 = 0; r0 < mc; r0 += FMA_MR) {
                    const float* xg = xf + (g * M + m0 + r0) * 32;
                    float* a = acc + r0 * 32;
                    for (int half = 0; half < 2; half++) {
                        switch (mc - r0 < FMA_MR ? mc - r0 : FMA_MR) {
                        case 1: fma_block(xg, T + 16 * half, a + 16 * half, 1); break;
                        case 2: fma_block(xg, T + 16 * half, a + 16 * half, 2); break;
                        case 3: fma_block(xg, T + 16 * half, a + 16 * half, 3); break;
                        case 4: fma_block(xg, T + 16 * half, a + 16 * half, 4); break;
                        case 5: fma_block(xg, T + 16 * half, a + 16 * half, 5); break;
                        default: fma_block(xg, T + 16 * half, a + 16 * half, 6); break;
                        }
                    }
                }
            }
            for (int64_t r = 0; r < mc; r++) {
                const int64_t o = (m0 + r) * out_stride + n0;
                if (cols == 32) {
                    stx(out, o, ldf(acc + r * 32), out_bf16);
                    stx(out, o + 16, ldf(acc + r * 32 + 16), out_bf16);
                } else if (out_bf16) {
                    for (int64_t n = 0; n < cols; n++) ((uint16_t*)out)[o + n] = f32_to_bf16(acc[r * 32 + n]);
                } else {
                    memcpy((float*)out + o, acc + r * 32, (size_t)cols * 4);
                }
            }
        }
    }
    return 0;
}
#endif
#endif
