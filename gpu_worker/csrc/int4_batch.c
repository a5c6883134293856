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
#include "loom_cpu.h"

#include "amx_gemm.h"
#include "fma_gemm.h"
#include "group_dot.h"
#include "int4_gemv.h"

#if HAVE_AMX
/* Dequantise the 64-row block nb of W over all K into the hi/lo B tiles bt of amx_gemm.h */
static void build_b(const void* packed_, const void* sz_, int64_t nb, int64_t K, int64_t N_pad, uint16_t* bt) {
    const uint8_t* packed = packed_;
    const uint16_t* sz = sz_;
    const int64_t G = K / 32;
    const __m512 lut = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7); /* q - 8, exact */
    const __m512i lo4 = _mm512_set1_epi32(15);
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
            pack_pairs(w, g, p, bt);
        }
    }
}
#endif

/* Entry point. x [M, K] (row stride x_stride elements; bf16 if x_bf16 else fp32), out [M, n_out] (row stride
 * out_stride; bf16 if out_bf16 else fp32), n_out <= N_pad. Returns 0 = done, 1 = bad arguments (N_pad not a
 * multiple of 64, K not of 32), 2 = out of memory, 3 = no AMX (not built in, or the OS refused it). */
int loom_int4_amx(int64_t M, int64_t N_pad, int64_t K, const void* x, int64_t x_stride, int x_bf16, void* out,
                  int64_t out_stride, int out_bf16, int64_t n_out, const uint8_t* packed, const uint16_t* sz) {
#if HAVE_AMX
    if (N_pad % 64 || K % 32 || K <= 0 || M < 0 || n_out > N_pad) return 1;
    if (M == 0 || n_out == 0) return 0;
    return amx_gemm(M, N_pad, K, x, x_stride, x_bf16, out, out_stride, out_bf16, n_out, build_b, packed, sz);
#else
    (void)M, (void)N_pad, (void)K, (void)x, (void)x_stride, (void)x_bf16, (void)out, (void)out_stride, (void)out_bf16;
    (void)n_out, (void)packed, (void)sz;
    return 3;
#endif
}

#if HAVE_DPBF16
/* The codes of rows [32 h, 32 h + 32) of the 64-row block nb of W in group_dot.h's pair layout bq (q - 8, exact in
 * bf16). Each input's 32 bytes hold rows j (low nibbles) and 32 + j (high nibbles): half h takes one nibble of every
 * byte. */
#if defined(__AVX512VBMI__)
/* The two inputs of a pair are adjacent, so one 64-byte load holds both: the half's nibbles are shifted down and
 * masked, one byte permutation (vpermb) orders them as (input 2p, input 2p + 1) per row, and two 16-entry table
 * lookups (vpshufb) give each nibble its bf16 code's low and high byte, which unpacking interleaves into words; the
 * permutation is chosen so that unpacking within 128-bit lanes leaves rows 0..15 in the first vector and 16..31 in
 * the second. 10 instructions per pair of inputs, against 14 for the word-wise way below. */
static void build_code_pairs(const uint8_t* packed, int64_t nb, int h, int64_t K, uint32_t* bq) {
    /* bf16 of q - 8 for q = 0..15: low bytes, high bytes (each table repeated in the four 128-bit lanes) */
    static const uint8_t code_lo[16] = {0x00, 0xe0, 0xc0, 0xa0, 0x80, 0x40, 0x00, 0x80,
                                        0x00, 0x80, 0x00, 0x40, 0x80, 0xa0, 0xc0, 0xe0};
    static const uint8_t code_hi[16] = {0xc1, 0xc0, 0xc0, 0xc0, 0xc0, 0xc0, 0xc0, 0xbf,
                                        0x00, 0x3f, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40};
    const __m512i lut_lo = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)code_lo));
    const __m512i lut_hi = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)code_hi));
    /* byte 16 L + 2 i + e <- row 4 L + i (i < 4) or 12 + 4 L + i (i >= 4) of input 2p + e */
    static const uint8_t row_order[64] = {0,  32, 1,  33, 2,  34, 3,  35, 16, 48, 17, 49, 18, 50, 19, 51,
                                          4,  36, 5,  37, 6,  38, 7,  39, 20, 52, 21, 53, 22, 54, 23, 55,
                                          8,  40, 9,  41, 10, 42, 11, 43, 24, 56, 25, 57, 26, 58, 27, 59,
                                          12, 44, 13, 45, 14, 46, 15, 47, 28, 60, 29, 61, 30, 62, 31, 63};
    const __m512i nib = _mm512_set1_epi8(15), order = _mm512_loadu_si512(row_order);
    for (int64_t p = 0; p < K / 2; p++) {
        __m512i v = _mm512_loadu_si512(packed + (nb * K + 2 * p) * 32);
        if (h) v = _mm512_srli_epi16(v, 4);
        const __m512i m = _mm512_permutexvar_epi8(order, _mm512_and_si512(v, nib));
        const __m512i lo = _mm512_shuffle_epi8(lut_lo, m), hi = _mm512_shuffle_epi8(lut_hi, m);
        _mm512_storeu_si512(bq + p * 32, _mm512_unpacklo_epi8(lo, hi));      /* rows 0..15 */
        _mm512_storeu_si512(bq + p * 32 + 16, _mm512_unpackhi_epi8(lo, hi)); /* rows 16..31 */
    }
}
#else
/* Without AVX512-VBMI (Cooper Lake): the two inputs of a pair are widened to 16-bit words, interleaved word by word
 * (vpermt2w), and each nibble becomes its bf16 code by a table lookup (vpermw). */
static void build_code_pairs(const uint8_t* packed, int64_t nb, int h, int64_t K, uint32_t* bq) {
    static const uint16_t bf16_code[32] = {0xc100, 0xc0e0, 0xc0c0, 0xc0a0, 0xc080, 0xc040, 0xc000, 0xbf80,
                                           0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0}; /* q-8 */
    const __m512i lut = _mm512_loadu_si512(bf16_code), nib = _mm512_set1_epi16(15);
    __m512i lo_idx, hi_idx; /* word i of a pair vector: byte i / 2 (+ 16 for hi) of input i % 2 (B = second input) */
    {
        uint16_t a[32], b[32];
        for (int i = 0; i < 32; i++) a[i] = (uint16_t)(i / 2 + (i % 2) * 32), b[i] = (uint16_t)(a[i] + 16);
        lo_idx = _mm512_loadu_si512(a), hi_idx = _mm512_loadu_si512(b);
    }
    const __m128i shift = _mm_cvtsi32_si128(4 * h);
    for (int64_t p = 0; p < K / 2; p++) {
        const uint8_t* src = packed + (nb * K + 2 * p) * 32;
        const __m512i a = _mm512_srl_epi16(_mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)src)), shift);
        const __m512i b = _mm512_srl_epi16(_mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(src + 32))), shift);
        const __m512i v0 = _mm512_permutex2var_epi16(a, lo_idx, b), v1 = _mm512_permutex2var_epi16(a, hi_idx, b);
        _mm512_storeu_si512(bq + p * 32, _mm512_permutexvar_epi16(_mm512_and_si512(v0, nib), lut));      /* 0..15 */
        _mm512_storeu_si512(bq + p * 32 + 16, _mm512_permutexvar_epi16(_mm512_and_si512(v1, nib), lut)); /* ..31 */
    }
}
#endif

/* Rows [32 h, 32 h + 32) of the 64-row block nb of W as group_dot.h's codes bq, scales sc and zeros zr */
static void build_codes(const void* packed, const void* sz_, int64_t nb, int h, int64_t K, int64_t N_pad,
                        uint32_t* bq, float* sc, float* zr) {
    const uint16_t* sz = sz_;
    build_code_pairs(packed, nb, h, K, bq);
    for (int64_t g = 0; g < K / 32; g++)
        for (int s = 0; s < 2; s++) { /* (scale, zero) bf16 pairs of 16 rows -> two fp32 vectors */
            __m512i v = _mm512_loadu_si512(sz + ((g * N_pad) + nb * 64 + 32 * h + 16 * s) * 2);
            _mm512_storeu_ps(sc + g * 32 + 16 * s, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
            _mm512_storeu_ps(zr + g * 32 + 16 * s,
                             _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u))));
        }
}
#endif

/* loom_int4_amx's contract on AVX512-BF16 dot products instead of AMX (group_dot.h): for CPUs without AMX.
 * Returns 0 = done, 1 = bad arguments, 2 = out of memory, 3 = not built in (no AVX512-BF16). */
int loom_int4_dot(int64_t M, int64_t N_pad, int64_t K, const void* x, int64_t x_stride, int x_bf16, void* out,
                  int64_t out_stride, int out_bf16, int64_t n_out, const uint8_t* packed, const uint16_t* sz) {
#if HAVE_DPBF16
    if (N_pad % 64 || K % 32 || K <= 0 || M < 0 || n_out > N_pad) return 1;
    if (M == 0 || n_out == 0) return 0;
    return dot_gemm(M, N_pad, K, x, x_stride, x_bf16, out, out_stride, out_bf16, n_out, build_codes, packed, sz, 1);
#else
    (void)M, (void)N_pad, (void)K, (void)x, (void)x_stride, (void)x_bf16, (void)out, (void)out_stride, (void)out_bf16;
    (void)n_out, (void)packed, (void)sz;
    return 3;
#endif
}

#if HAVE_FMA_GEMM
/* Group g of the 32-row half u = 2 nb + h of W as fp32 weights T [32 inputs][32 rows] for fma_gemm.h, w = (q - 8) *
 * scale + zero. PyTorch packs 4-bit weights by its CPU capability: in 64-row blocks on AVX-512 (above), in 32-row
 * blocks on AVX2, where each input's 16 bytes hold rows j (low nibbles) and 16 + j (high nibbles) of the block. */
static inline __attribute__((always_inline)) void build_int4_fma(const void* packed_, const void* sz_, int64_t nb,
                                                                 int h, int64_t g, int64_t K, int64_t N_pad, float* T,
                                                                 const int block) {
    const uint8_t* packed = packed_;
    const uint32_t* sz = sz_; /* (scale, zero) bf16 pairs, one 32-bit word per (group, row) */
    const int64_t u = 2 * nb + h;
    __m256 sc[4], zr[4];
    for (int s = 0; s < 4; s++) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(sz + g * N_pad + u * 32 + 8 * s));
        sc[s] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        zr[s] = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)));
    }
    const __m256i m15 = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
    for (int k = 0; k < 32; k++) {
        for (int s = 0; s < 4; s++) { /* rows 8 s .. 8 s + 8 of the half */
            const uint8_t* src;
            int hi;
            if (block == 64) /* byte j of the 64-row block: rows j and 32 + j */
                src = packed + (nb * K + g * 32 + k) * 32 + 8 * s, hi = h;
            else /* byte j of the 32-row block u: rows j and 16 + j */
                src = packed + (u * K + g * 32 + k) * 16 + 8 * (s % 2), hi = s / 2;
            __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)src));
            b = hi ? _mm256_srli_epi32(b, 4) : _mm256_and_si256(b, m15);
            const __m256 q = _mm256_cvtepi32_ps(_mm256_sub_epi32(b, eight)); /* q - 8, exact */
            _mm256_storeu_ps(T + k * 32 + 8 * s, _mm256_fmadd_ps(q, sc[s], zr[s]));
        }
    }
}

static void build_int4_fma64(const void* w, const void* s, int64_t nb, int h, int64_t g, int64_t K, int64_t N_pad,
                             float* T) {
    build_int4_fma(w, s, nb, h, g, K, N_pad, T, 64);
}

static void build_int4_fma32(const void* w, const void* s, int64_t nb, int h, int64_t g, int64_t K, int64_t N_pad,
                             float* T) {
    build_int4_fma(w, s, nb, h, g, K, N_pad, T, 32);
}
#endif

/* loom_int4_amx's contract on AVX2 fp32 FMAs (fma_gemm.h), for CPUs with neither AMX nor AVX512-BF16, over PyTorch's
 * 64-row (fma64) or 32-row (fma32) packing. Returns 0 = done, 1 = bad arguments, 2 = out of memory, 3 = not built
 * in (no AVX2 and FMA). */
static int int4_fma(int64_t M, int64_t N_pad, int64_t K, const void* x, int64_t x_stride, int x_bf16, void* out,
                    int64_t out_stride, int out_bf16, int64_t n_out, const uint8_t* packed, const uint16_t* sz,
                    int block) {
#if HAVE_FMA_GEMM
    if (N_pad % 64 || K % 32 || K <= 0 || M < 0 || n_out > N_pad) return 1;
    if (M == 0 || n_out == 0) return 0;
    return fma_gemm(M, N_pad, K, x, x_stride, x_bf16, out, out_stride, out_bf16, n_out,
                    block == 64 ? build_int4_fma64 : build_int4_fma32, packed, sz);
#else
    (void)M, (void)N_pad, (void)K, (void)x, (void)x_stride, (void)x_bf16, (void)out, (void)out_stride, (void)out_bf16;
    (void)n_out, (void)packed, (void)sz, (void)block;
    return 3;
#endif
}

int loom_int4_fma64(int64_t M, int64_t N_pad, int64_t K, const void* x, int64_t x_stride, int x_bf16, void* out,
                    int64_t out_stride, int out_bf16, int64_t n_out, const uint8_t* packed, const uint16_t* sz) {
    return int4_fma(M, N_pad, K, x, x_stride, x_bf16, out, out_stride, out_bf16, n_out, packed, sz, 64);
}

int loom_int4_fma32(int64_t M, int64_t N_pad, int64_t K, const void* x, int64_t x_stride, int x_bf16, void* out,
                    int64_t out_stride, int out_bf16, int64_t n_out, const uint8_t* packed, const uint16_t* sz) {
    return int4_fma(M, N_pad, K, x, x_stride, x_bf16, out, out_stride, out_bf16, n_out, packed, sz, 32);
}

/* A few rows of x (csrc/int4_gemv.h): loom_int4_gemv512 on AVX-512 over 64-row packing, loom_int4_gemv_avx2_32 / _64
 * on AVX2 and FMA over 32- or 64-row packing. Any M (it pays below the batch kernels' crossover). Returns 0 = done,
 * 1 = bad arguments, 2 = out of memory, 3 = not built in. */
#define GEMV_ARGS                                                                                                     \
    int64_t M, int64_t N_pad, int64_t K, const void *x, int64_t x_stride, int x_bf16, void *out, int64_t out_stride, \
        int out_bf16, int64_t n_out, const uint8_t *packed, const uint16_t *sz
#define GEMV_CHECK                                                    \
    if (N_pad % 64 || K % 32 || K <= 0 || M < 0 || n_out > N_pad) return 1; \
    if (M == 0 || n_out == 0) return 0;

int loom_int4_gemv512(GEMV_ARGS) {
#if HAVE_GEMV512
    GEMV_CHECK
    return gemv_drive(M, N_pad, K, x, x_stride, x_bf16, out, out_stride, out_bf16, n_out, packed, sz, gemv512_unit, 64);
#else
    (void)M, (void)N_pad, (void)K, (void)x, (void)x_stride, (void)x_bf16, (void)out, (void)out_stride, (void)out_bf16;
    (void)n_out, (void)packed, (void)sz;
    return 3;
#endif
}

static int int4_gemv_avx2(GEMV_ARGS, int block) {
#if HAVE_GEMV_AVX2
    GEMV_CHECK
    return gemv_drive(M, N_pad, K, x, x_stride, x_bf16, out, out_stride, out_bf16, n_out, packed, sz, gemv_avx2_unit,
                      block);
#else
    (void)M, (void)N_pad, (void)K, (void)x, (void)x_stride, (void)x_bf16, (void)out, (void)out_stride, (void)out_bf16;
    (void)n_out, (void)packed, (void)sz, (void)block;
    return 3;
#endif
}

int loom_int4_gemv_avx2_32(GEMV_ARGS) {
    return int4_gemv_avx2(M, N_pad, K, x, x_stride, x_bf16, out, out_stride, out_bf16, n_out, packed, sz, 32);
}

int loom_int4_gemv_avx2_64(GEMV_ARGS) {
    return int4_gemv_avx2(M, N_pad, K, x, x_stride, x_bf16, out, out_stride, out_bf16, n_out, packed, sz, 64);
}
