/* The AMX GEMM shared by Loom's quantised-weight kernels (csrc/int4_batch.c, csrc/q8_linear.c): a kernel supplies
 * build(), which dequantises one 64-row block of its weight format into bf16 B tiles, and amx_gemm() multiplies
 * batches of x against them.
 *
 * B tiles, per 64-row block: bt [K / 32][8][16 pairs][16 rows][2] bf16: for each group of 32 inputs, the tiles of
 * the four 16-row quarters, first the fp32 weight's top 16 bits (hi), then the top 16 bits of what is left (lo =
 * w - hi, exact in fp32); hi + lo holds w to 16 bits, so the products are within 2^-16 of the fp32 weight's.
 * tiles (amx_config(6)): 0-3: C, 16 rows of x by 16 outputs (fp32); 4: 16 rows of x by 32 inputs (bf16);
 * 5: 16 input pairs by 16 outputs (bf16 pairs). Threads: OpenMP over the 64-row blocks of W.
 * Include after loom_cpu.h; it defines HAVE_AMX (1 where AMX bf16, AVX512-BF16 and AVX512BW are compiled in).
 */
#ifndef LOOM_AMX_GEMM_H
#define LOOM_AMX_GEMM_H
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#endif
#include <stdlib.h>
#if HAVE_AMX

/* w[h][s]: fp32 weights of inputs 2p + h (h = 0, 1) for the 16 rows of quarter s of a 64-row block, group g, into
 * the hi and lo B tiles at bt. A VNNI pair dword is (w[2p+1] bits & top) | (w[2p] bits >> 16): vpternlogd does the
 * select (0xCA: top ? w[2p+1] : w[2p] >> 16, bitwise). hi and lo are truncations (lo is exact before its own). */
static inline void pack_pairs(__m512 w[2][4], int64_t g, int p, uint16_t* bt) {
    const __m512i top = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int s = 0; s < 4; s++) {
        __m512i w0 = _mm512_castps_si512(w[0][s]), w1 = _mm512_castps_si512(w[1][s]);
        __m512i h0 = _mm512_and_si512(w0, top), h1 = _mm512_and_si512(w1, top);
        __m512i l0 = _mm512_castps_si512(_mm512_sub_ps(w[0][s], _mm512_castsi512_ps(h0)));
        __m512i l1 = _mm512_castps_si512(_mm512_sub_ps(w[1][s], _mm512_castsi512_ps(h1)));
        __m512i hi = _mm512_ternarylogic_epi32(top, w1, _mm512_srli_epi32(w0, 16), 0xCA);
        __m512i lo = _mm512_ternarylogic_epi32(top, l1, _mm512_srli_epi32(l0, 16), 0xCA);
        _mm512_storeu_si512(bt + ((g * 8 + s) * 16 + p) * 32, hi);
        _mm512_storeu_si512(bt + ((g * 8 + 4 + s) * 16 + p) * 32, lo);
    }
}

/* tile ops of quarter s (tile s) for one group: C_s += x . hi_s + x . lo_s, B tiles at b (tiles 4: x, 5: B) */
#define HI_LO(s)                             \
    _tile_loadd(5, b + (s) * 512, 64);       \
    _tile_dpbf16ps(s, 4, 5);                 \
    _tile_loadd(5, b + (4 + (s)) * 512, 64); \
    _tile_dpbf16ps(s, 4, 5)

static __thread void *bt_buf, *xb_buf;
static __thread size_t bt_cap, xb_cap;

/* dequantise 64-row block nb of a weight (w, s: the format's arrays) over all K into bt (see the top of the file) */
typedef void (*amx_build_fn)(const void* w, const void* s, int64_t nb, int64_t K, int64_t N_pad, uint16_t* bt);

/* out[M, n_out] = x[M, K] @ W^T with W's 64-row blocks made by build (x row stride x_stride elements, bf16 if x_bf16
 * else fp32; out row stride out_stride, bf16 if out_bf16 else fp32). N_pad % 64 == 0, K % 32 == 0, n_out <= N_pad.
 * Returns 0 = done, 2 = out of memory, 3 = the OS refused AMX. */
static int amx_gemm(int64_t M, int64_t N_pad, int64_t K, const void* x, int64_t x_stride, int x_bf16, void* out,
                    int64_t out_stride, int out_bf16, int64_t n_out, amx_build_fn build, const void* w,
                    const void* s) {
    if (!amx_enable()) return 3;
    const int64_t Mp = (M + 15) / 16 * 16, G = K / 32;
    uint16_t* xb = thread_buffer(&xb_buf, &xb_cap, (size_t)(Mp * K * 2)); /* x as bf16, rows past M zero */
    if (!xb) return 2;
    for (int64_t i = 0; i < M; i++)
        for (int64_t k = 0; k < K; k++)
            xb[i * K + k] = x_bf16 ? ((const uint16_t*)x)[i * x_stride + k] : f32_to_bf16(((const float*)x)[i * x_stride + k]);
    memset(xb + M * K, 0, (size_t)((Mp - M) * K * 2));
    int failed = 0;
#pragma omp parallel
    {
        uint16_t* bt = thread_buffer(&bt_buf, &bt_cap, (size_t)(G * 8 * 512 * 2));
        float cb[16 * 64] __attribute__((aligned(64)));
        if (bt) amx_config(6);
        /* every thread reaches the worksharing loop, also one whose buffers failed */
#pragma omp for schedule(static)
            for (int64_t nb = 0; nb < N_pad / 64; nb++) {
                if (!bt) {
#pragma omp atomic write
                    failed = 1;
                    continue;
                }
                if (nb * 64 >= n_out) continue;
                build(w, s, nb, K, N_pad, bt);
                for (int64_t m0 = 0; m0 < Mp; m0 += 16) {
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    for (int64_t g = 0; g < G; g++) {
                        const uint16_t* b = bt + g * 8 * 512;
                        _tile_loadd(4, xb + m0 * K + g * 32, K * 2);
                        HI_LO(0);
                        HI_LO(1);
                        HI_LO(2);
                        HI_LO(3);
                    }
                    _tile_stored(0, cb, 256);
                    _tile_stored(1, cb + 16, 256);
                    _tile_stored(2, cb + 32, 256);
                    _tile_stored(3, cb + 48, 256);
                    int64_t rows = M - m0 < 16 ? M - m0 : 16, cols = n_out - nb * 64 < 64 ? n_out - nb * 64 : 64;
                    for (int64_t r = 0; r < rows; r++)
                        for (int64_t c = 0; c < cols; c++) {
                            float v = cb[r * 64 + c];
                            if (out_bf16)
                                ((uint16_t*)out)[(m0 + r) * out_stride + nb * 64 + c] = f32_to_bf16(v);
                            else
                                ((float*)out)[(m0 + r) * out_stride + nb * 64 + c] = v;
                        }
                }
            }
        if (bt) _tile_release();
    }
    return failed ? 2 : 0;
}
#endif
#endif
