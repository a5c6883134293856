/* out[M, N] = x[M, K] @ W^T for PyTorch's CPU 4-bit weight layout (the one _convert_weight_to_int4pack_for_cpu
 * writes and _weight_int4pack_mm_for_cpu reads), on Intel AMX, for batches of rows.
 *
 * Layout read (N_pad a multiple of 64, K of 32, groups of 32 along K):
 *   packed [N_pad / 64][K][32] bytes: byte j of (block nb, input k) holds q[nb*64 + j][k] in its low nibble and
 *       q[nb*64 + 32 + j][k] in its high nibble;
 *   sz [K / 32][N_pad][2] bf16: (scale, zero) per group and row, w = (q - 8) * scale + zero.
 *
 * Why: PyTorch's kernel dequantises every weight for every 4 rows of x and multiplies with vector FMAs, so its cost
 * grows with the batch (at 32 rows it is 2x slower than a bf16 GEMM here). This kernel dequantises each 64-row block
 * of W once per call into bf16 tiles in the "VNNI" pair layout, the fp32 weight split in two bf16 parts (hi = its top
 * 16 bits, lo = those of the rest, so hi + lo keeps 16 bits: the products are within 2^-16 of PyTorch's fp32
 * dequantisation, not rounded like a bf16 weight), then multiplies 16 rows of x at a time with tdpbf16ps
 * (16 x 16 x 32 MACs per instruction) against both parts, accumulating in fp32 over all of K. At one row PyTorch's kernel stays faster, so the caller picks by
 * batch size. Threads: OpenMP over the 64-row blocks of W (torch's libgomp, one pool).
 */
#include <stdlib.h>

#include "loom_cpu.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_AMX 1
/* tiles (amx_config(6)): 0-3: C, 16 rows of x by 16 outputs (fp32); 4: 16 rows of x by 32 inputs (bf16);
 * 5: 16 input pairs by 16 outputs (bf16 pairs) */

/* Dequantise the 64-row block nb of W over all K into bt [G][8][16 pairs][16 rows][2] bf16: for each group, the
 * B tiles (pairs of inputs 2p, 2p + 1 side by side per output row) of the four 16-row quarters, first the weight's
 * top 16 bits (hi), then the top 16 bits of what is left (lo = w - hi, exact in fp32); hi + lo holds w to 16 bits. */
static void build_b(const uint8_t* packed, const uint16_t* sz, int64_t nb, int64_t K, int64_t N_pad, uint16_t* bt) {
    const int64_t G = K / 32;
    const __m512 lut = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7); /* q - 8, exact */
    const __m512i lo4 = _mm512_set1_epi32(15);
    const __m512i top = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int64_t g = 0; g < G; g++) {
        __m512 sc[4], zr[4];
        for (int s = 0; s < 4; s++) { /* rows nb*64 + 16s .. + 16: (scale, zero) bf16 pairs -> two fp32 vectors */
            __m512i v = _mm512_loadu_si512(sz + ((g * N_pad) + nb * 64 + 16 * s) * 2);
            sc[s] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
            zr[s] = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
        }
        for (int p = 0; p < 16; p++) {
            __m512 w[2][4]; /* [input 2p or 2p + 1][quarter] */
            for (int h = 0; h < 2; h++) {
                const uint8_t* src = packed + (nb * K + g * 32 + 2 * p + h) * 32;
                __m512i b0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)src));        /* rows j = 0..15 */
                __m512i b1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(src + 16))); /* rows 16..31 */
                __m512i q[4] = {_mm512_and_si512(b0, lo4), _mm512_and_si512(b1, lo4), _mm512_srli_epi32(b0, 4),
                                _mm512_srli_epi32(b1, 4)};
                for (int s = 0; s < 4; s++) w[h][s] = _mm512_fmadd_ps(_mm512_permutexvar_ps(q[s], lut), sc[s], zr[s]);
            }
            for (int s = 0; s < 4; s++) {
                /* hi = the top 16 bits of each fp32 weight (a bf16, truncated), lo = the exact rest, truncated to
                 * bf16 too: hi + lo keeps 16 of the weight's 24 bits. A VNNI pair dword is (w[2p+1] bits & top) |
                 * (w[2p] bits >> 16); vpternlogd does the select (0xCA: top ? w[2p+1] : w[2p] >> 16, bitwise). */
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
    }
}
/* tile ops of quarter s (tile s) for one group: C_s += x . hi_s + x . lo_s, B tiles at b (tiles 4: x, 5: B) */
#define HI_LO(s)                             \
    _tile_loadd(5, b + (s) * 512, 64);       \
    _tile_dpbf16ps(s, 4, 5);                 \
    _tile_loadd(5, b + (4 + (s)) * 512, 64); \
    _tile_dpbf16ps(s, 4, 5)

/* A buffer of at least n bytes kept per thread across calls (OpenMP's threads persist): the B tiles of a 64-row
 * block are up to 400 KB, and a fresh malloc that large is an mmap with page faults on every call. */
static void* thread_buffer(void** buf, size_t* cap, size_t n) {
    if (*cap < n) {
        free(*buf);
        *buf = aligned_alloc(64, (n + 63) / 64 * 64);
        *cap = *buf ? n : 0;
    }
    return *buf;
}
static __thread void *bt_buf, *xb_buf;
static __thread size_t bt_cap, xb_cap;
#else
#define HAVE_AMX 0
#endif

/* Entry point. x [M, K] (row stride x_stride elements; bf16 if x_bf16 else fp32), out [M, n_out] (row stride
 * out_stride; bf16 if out_bf16 else fp32), n_out <= N_pad. Returns 0 = done, 1 = bad arguments (N_pad not a
 * multiple of 64, K not of 32), 2 = out of memory, 3 = no AMX (not built in, or the OS refused it). */
int loom_int4_amx(int64_t M, int64_t N_pad, int64_t K, const void* x, int64_t x_stride, int x_bf16, void* out,
                  int64_t out_stride, int out_bf16, int64_t n_out, const uint8_t* packed, const uint16_t* sz) {
#if HAVE_AMX
    if (N_pad % 64 || K % 32 || K <= 0 || M < 0 || n_out > N_pad) return 1;
    if (M == 0 || n_out == 0) return 0;
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
                build_b(packed, sz, nb, K, N_pad, bt);
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
#else
    (void)M, (void)N_pad, (void)K, (void)x, (void)x_stride, (void)x_bf16, (void)out, (void)out_stride, (void)out_bf16;
    (void)n_out, (void)packed, (void)sz;
    return 3;
#endif
}
