/* The batch GEMM of Loom's group-quantised kernels (csrc/int4_batch.c, csrc/q8_linear.c) on CPUs with AVX512-BF16
 * but no AMX (AMD Zen 4 and later, Intel Cooper Lake): exact products from vdpbf16ps on the integer codes.
 *
 * A group-quantised weight is w[n, k] = c[n, k] * scale[g, n] + zero[g, n] for the group g of 32 inputs that holds
 * k, with integer codes c (q - 8 in [-8, 7] for 4 bits, q in [-128, 127] for Q8_0). Integers that small are exact
 * in bf16, and so is each product with a bf16 input, so per row of x and group
 *     out[m, n] += scale[g, n] * (x[m, g] . c[g, n]) + zero[g, n] * sum(x[m, g])
 * multiplies the weights the blocks encode, not a rounded copy (the fp32 dequantisation's own rounding aside), at
 * one vdpbf16ps per pair of inputs plus two FMAs per group: 1.125x a bf16 GEMM's vector instructions, where
 * splitting the fp32 weight into two bf16 parts (amx_gemm.h, which AMX's spare throughput pays for) would take 2x.
 *
 * A kernel supplies build(), which writes one 32-row half of a 64-row block of its weight as
 *   bq [K / 2][32][2] bf16: the codes of inputs (2p, 2p + 1) of the 32 rows, the pair layout vdpbf16ps reads;
 *   sc, zr [K / 32][32] fp32: the groups' scales and zeros (zr unused where the format has no zero);
 * then rows of x are multiplied eight at a time against it while it sits in L2. Work is shared among threads by
 * halves, not blocks, so the model's 576-row matrices (9 blocks) split evenly over two cores. Threads: OpenMP.
 * Include after loom_cpu.h; it defines HAVE_DPBF16 (1 where AVX512-BF16 and AVX512BW are compiled in).
 */
#ifndef LOOM_GROUP_DOT_H
#define LOOM_GROUP_DOT_H
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif
#if HAVE_DPBF16
#include <immintrin.h>

/* write rows [32 h, 32 h + 32) of 64-row block nb of a weight (w, s: the format's arrays) over all K as bq, sc, zr */
typedef void (*dot_build_fn)(const void* w, const void* s, int64_t nb, int h, int64_t K, int64_t N_pad,
                             uint32_t* bq, float* sc, float* zr);

#define DOT_ROWS 8 /* rows of x per tile: each pair of weight vectors loaded serves 8 rows (16 vdpbf16ps) */

static __thread void *dq_buf, *dx_buf;
static __thread size_t dq_cap, dx_cap;

/* R rows of x (bf16 at xb, row stride xk; group sums xs [R][G]) times one built half -> cb [R][32] fp32. Inlined
 * with constant R: the R x 2 group accumulators stay in registers (with R = 8, 16 of the 32; GCC spills when the
 * running sums are kept there too, so those live in cb, touched once per group). */
static inline __attribute__((always_inline)) void dot_rows(const uint16_t* xb, int64_t xk, const float* xs, int64_t K,
                                                            const uint32_t* bq, const float* sc, const float* zr,
                                                            int zero, float* cb, const int R) {
    const int64_t G = K / 32;
    for (int r = 0; r < R; r++) {
        _mm512_storeu_ps(cb + r * 32, _mm512_setzero_ps());
        _mm512_storeu_ps(cb + r * 32 + 16, _mm512_setzero_ps());
    }
    for (int64_t g = 0; g < G; g++) {
        __m512 ga[DOT_ROWS][2]; /* this group's integer dot products, exact up to fp32 summation */
        for (int r = 0; r < R; r++) ga[r][0] = ga[r][1] = _mm512_setzero_ps();
        const uint32_t* b = bq + g * 16 * 32;
        const uint16_t* xg = xb + g * 32;
        for (int p = 0; p < 16; p++) {
            const __m512i w0 = _mm512_loadu_si512(b + p * 32);
            const __m512i w1 = _mm512_loadu_si512(b + p * 32 + 16);
            for (int r = 0; r < R; r++) {
                int32_t pair;
                memcpy(&pair, xg + r * xk + 2 * p, 4);
                const __m512i xv = _mm512_set1_epi32(pair);
                ga[r][0] = _mm512_dpbf16_ps(ga[r][0], (__m512bh)xv, (__m512bh)w0);
                ga[r][1] = _mm512_dpbf16_ps(ga[r][1], (__m512bh)xv, (__m512bh)w1);
            }
        }
        for (int c = 0; c < 2; c++) {
            const __m512 s = _mm512_loadu_ps(sc + g * 32 + 16 * c);
            const __m512 z = zero ? _mm512_loadu_ps(zr + g * 32 + 16 * c) : _mm512_setzero_ps();
            for (int r = 0; r < R; r++) {
                __m512 a = _mm512_fmadd_ps(ga[r][c], s, _mm512_loadu_ps(cb + r * 32 + 16 * c));
                if (zero) a = _mm512_fmadd_ps(_mm512_set1_ps(xs[r * G + g]), z, a);
                _mm512_storeu_ps(cb + r * 32 + 16 * c, a);
            }
        }
    }
}

/* out[M, n_out] = x[M, K] @ W^T with W's halves made by build (x row stride x_stride elements, bf16 if x_bf16 else
 * fp32, rounded to bf16 as the AMX path does; out row stride out_stride, bf16 if out_bf16 else fp32; zero: the format
 * has zeros). N_pad % 64 == 0, K % 32 == 0, n_out <= N_pad. Returns 0 = done, 2 = out of memory. */
static int dot_gemm(int64_t M, int64_t N_pad, int64_t K, const void* x, int64_t x_stride, int x_bf16, void* out,
                    int64_t out_stride, int out_bf16, int64_t n_out, dot_build_fn build, const void* w,
                    const void* s, int zero) {
    const int64_t G = K / 32;
    /* x as bf16 (read in place when it is bf16, else rounded into a buffer; row stride xk), then its group sums
     * [M][G] in fp32 (of the bf16 values: the inputs the products use) */
    const int64_t xk = x_bf16 ? x_stride : K;
    uint16_t* buf = thread_buffer(&dx_buf, &dx_cap, (size_t)((x_bf16 ? 0 : M * K * 2) + M * G * 4 + 64));
    if (!buf) return 2;
    const uint16_t* xb = x_bf16 ? (const uint16_t*)x : buf;
    float* xs = (float*)(buf + (x_bf16 ? 0 : M * K));
    for (int64_t i = 0; i < M; i++) {
        if (!x_bf16)
            for (int64_t k = 0; k < K; k += 16) sth(buf + i * K + k, ldf((const float*)x + i * x_stride + k));
        for (int64_t g = 0; g < G; g++) xs[i * G + g] = hsum(ldh(xb + i * xk + g * 32) + ldh(xb + i * xk + g * 32 + 16));
    }
    int failed = 0;
#pragma omp parallel
    {
        uint32_t* bq = thread_buffer(&dq_buf, &dq_cap, (size_t)((K / 2 * 32 + 2 * G * 32) * 4));
        float* sc = bq ? (float*)(bq + K / 2 * 32) : NULL;
        float* zr = sc ? sc + G * 32 : NULL;
        float cb[DOT_ROWS * 32] __attribute__((aligned(64)));
        /* every thread reaches the worksharing loop, also one whose buffer failed */
#pragma omp for schedule(static)
        for (int64_t u = 0; u < N_pad / 32; u++) {
            if (!bq) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            const int64_t n0 = u * 32;
            if (n0 >= n_out) continue;
            build(w, s, u / 2, (int)(u % 2), K, N_pad, bq, sc, zr);
            const int64_t cols = n_out - n0 < 32 ? n_out - n0 : 32;
            /* tiles of near-equal height (20 rows: 7, 7, 6): a short last tile has too few accumulator chains to
             * hide vdpbf16ps's latency */
            const int64_t tiles = (M + DOT_ROWS - 1) / DOT_ROWS;
            for (int64_t t = 0, m0 = 0; t < tiles; t++) {
                const int64_t rows = M / tiles + (t < M % tiles);
                const uint16_t* xr = xb + m0 * xk;
                const float* xsr = xs + m0 * G;
                switch (rows) {
#define DOT_CASE(R)                                            \
    case R:                                                    \
        dot_rows(xr, xk, xsr, K, bq, sc, zr, zero, cb, R);     \
        break;
                    DOT_CASE(1) DOT_CASE(2) DOT_CASE(3) DOT_CASE(4) DOT_CASE(5) DOT_CASE(6) DOT_CASE(7) DOT_CASE(8)
#undef DOT_CASE
                    default:
                        break;
                }
                for (int64_t r = 0; r < rows; r++) {
                    void* o = out_bf16 ? (void*)((uint16_t*)out + (m0 + r) * out_stride + n0)
                                       : (void*)((float*)out + (m0 + r) * out_stride + n0);
                    if (cols == 32) {
                        stx(o, 0, ldf(cb + r * 32), out_bf16);
                        stx(o, 16, ldf(cb + r * 32 + 16), out_bf16);
                    } else
                        for (int64_t c = 0; c < cols; c++) {
                            if (out_bf16)
                                ((uint16_t*)o)[c] = f32_to_bf16(cb[r * 32 + c]);
                            else
                                ((float*)o)[c] = cb[r * 32 + c];
                        }
                }
                m0 += rows;
            }
        }
    }
    return failed ? 2 : 0;
}
#endif
#endif
