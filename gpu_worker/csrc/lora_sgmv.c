/* Segmented LoRA shrink + expand for CPU tensors (Punica's SGMV idea, arXiv 2310.18547, written for CPUs).
 *
 * One call applies the LoRA of one fused projection (e.g. q|k|v) of one layer to a whole step. The step's LoRA
 * tokens are listed by slot (tok), and each segment (slot s, positions p0..p1 of tok) is worked on once, so a
 * slot's weights are read once per call however its requests interleave. For sub-module k, t = tok[p]:
 *     u[p, k, j] = x[t] . A[s, j*nmod + k]                       (shrink, j < the segment's largest rank)
 *     out[t, col_k + o] += sum_{j < rank[s][k]} u[p, k, j] * B_k[s][j, o]   (expand, at the adapter's rank)
 * Accumulation is fp32; x/out and the slot weights may each be bf16 or fp32. The code is plain C compiled on the
 * serving machine with -O3 -march=native, so the compiler uses the vector ISA the CPU has (AVX2, AVX-512;
 * GCC/Clang vector extensions with fixed widths). For bf16 x and weights it goes further where the CPU can:
 * AVX512-BF16 (vdpbf16ps) for the shrink, and AMX tiles (tdpbf16ps, 16x the MACs per instruction) for both
 * halves; AMX needs the expand weights in rank pairs ("VNNI"), which is how the pool packs bf16 slots anyway.
 * Why not torch: a step needs 120 of these small GEMM pairs, and on this CPU each torch bmm costs 100-200 us
 * of fixed overhead; a decode step's adapter math is memory-bound at best (all slots' weights are read once).
 * Threads: OpenMP when built with it (the process shares torch's already-loaded libgomp, one thread pool).
 */
#include "loom_cpu.h"
#include "bf16_tiles.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#define TB 8   /* most tokens per block: their accumulators stay in vector registers */
#define JB 16  /* shrink rows per work item */
#define MAXIN 4096
#define MAXRANK 256 /* the vdpbf16ps expand's largest rank (larger ranks take the fp32 expand) */
#define EXPAND_PF 4096 /* bytes of B prefetched ahead by the AMX expand */
#define SPF 8192 /* bytes of A prefetched ahead, into L2 (across rows: the hardware prefetcher stops at 4 KiB pages) */

/* x rows tok[0..nt) as fp32 into xf [TB][in_dim], rows nt.. zero */
static void load_x(const void* x, int x_bf16, int64_t in_dim, const int64_t* tok, int nt, float* xf) {
    memset(xf + (int64_t)nt * in_dim, 0, sizeof(float) * (TB - nt) * in_dim);
    for (int t = 0; t < nt; t++) {
        float* d = xf + (int64_t)t * in_dim;
        if (x_bf16) {
            const uint16_t* s = (const uint16_t*)x + tok[t] * in_dim;
            for (int64_t i = 0; i < in_dim; i++) d[i] = bf16_to_f32(s[i]);
        } else {
            memcpy(d, (const float*)x + tok[t] * in_dim, sizeof(float) * in_dim);
        }
    }
}

/* 16-lane vectors take two registers without AVX-512, which has 16 of them (AVX2) where AVX-512 has 32 */
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LORA_AVX2 1 /* 8-lane versions of the generic shrink and expand (dot_avx2, axpy_avx2) */
#else
#define LORA_AVX2 0
#endif

/* u[t, j] = xf[t] . w for NT tokens (one slot row w, fp32, in_dim long); NT is a compile-time constant so the
 * NT accumulators are registers */
#define DEFINE_DOT(NT)                                                                                         \
    static inline void dot##NT(const float* xf, const float* w, int64_t in_dim, float* u, int64_t u_stride,   \
                               int nt) {                                                                       \
        v16 acc[NT];                                                                                           \
        for (int t = 0; t < NT; t++) acc[t] = (v16){0};                                                        \
        int64_t i = 0;                                                                                         \
        for (; i + VW <= in_dim; i += VW) {                                                                    \
            v16 wv = ldf(w + i);                                                                               \
            for (int t = 0; t < NT; t++) acc[t] += ldf(xf + t * in_dim + i) * wv;                              \
        }                                                                                                      \
        for (int t = 0; t < nt; t++) {                                                                         \
            float s = hsum(acc[t]);                                                                            \
            for (int64_t r = i; r < in_dim; r++) s += xf[t * in_dim + r] * w[r];                               \
            u[t * u_stride] = s;                                                                               \
        }                                                                                                      \
    }
DEFINE_DOT(1)
DEFINE_DOT(2)
DEFINE_DOT(4)
DEFINE_DOT(8)

#if LORA_AVX2
/* dotNT on AVX2 (see axpy_avx2 below for why): up to 4 tokens at a time, two ymm accumulators each */
static void dot_avx2(const float* xf, const float* w, int64_t in_dim, float* u, int64_t u_stride, int nt) {
    for (int t0 = 0; t0 < nt; t0 += 4) {
        const int n = nt - t0 < 4 ? nt - t0 : 4;
        __m256 acc[4][2];
        for (int t = 0; t < 4; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 16 <= in_dim; i += 16) {
            const __m256 w0 = _mm256_loadu_ps(w + i), w1 = _mm256_loadu_ps(w + i + 8);
            for (int t = 0; t < n; t++) {
                const float* xt = xf + (int64_t)(t0 + t) * in_dim + i;
                acc[t][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xt), w0, acc[t][0]);
                acc[t][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xt + 8), w1, acc[t][1]);
            }
        }
        for (int t = 0; t < n; t++) {
            float v[8];
            _mm256_storeu_ps(v, _mm256_add_ps(acc[t][0], acc[t][1]));
            float s = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
            for (int64_t k = i; k < in_dim; k++) s += xf[(int64_t)(t0 + t) * in_dim + k] * w[k];
            u[(t0 + t) * u_stride] = s;
        }
    }
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* CPUs with AVX512-BF16 (Cooper Lake, Sapphire Rapids, Zen 4+): bf16 x and bf16 A multiply in one instruction,
 * 32 products summed in fp32 pairs (vdpbf16ps), with no conversion of either side. xh holds NT bf16 rows. */
#include <immintrin.h>
#define HAVE_BF16_DOT 1
#define DEFINE_DOTBF(NT)                                                                                        \
    static inline void dotbf##NT(const uint16_t* xh, const uint16_t* w, int64_t in_dim, float* u,               \
                                 int64_t u_stride, int nt) {                                                    \
        __m512 acc[NT];                                                                                         \
        for (int t = 0; t < NT; t++) acc[t] = _mm512_setzero_ps();                                              \
        int64_t i = 0;                                                                                          \
        for (; i + 32 <= in_dim; i += 32) {                                                                     \
            __builtin_prefetch((const char*)(w + i) + SPF, 0, 2);                                                     \
            __m512bh wv = (__m512bh)_mm512_loadu_si512(w + i);                                                  \
            for (int t = 0; t < NT; t++)                                                                        \
                acc[t] = _mm512_dpbf16_ps(acc[t], (__m512bh)_mm512_loadu_si512(xh + t * in_dim + i), wv);      \
        }                                                                                                       \
        if (i < in_dim) {                                                                                       \
            __mmask32 m = (__mmask32)((1ull << (in_dim - i)) - 1);                                              \
            __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(m, w + i);                                         \
            for (int t = 0; t < NT; t++)                                                                        \
                acc[t] = _mm512_dpbf16_ps(acc[t], (__m512bh)_mm512_maskz_loadu_epi16(m, xh + t * in_dim + i), wv); \
        }                                                                                                       \
        for (int t = 0; t < nt; t++) u[t * u_stride] = _mm512_reduce_add_ps(acc[t]);                            \
    }
DEFINE_DOTBF(1)
DEFINE_DOTBF(2)
DEFINE_DOTBF(4)
DEFINE_DOTBF(8)

/* lanes of 16 fp32 vectors v[0..16) summed: out[i] = sum of v[i]'s lanes, by a tree of lane shuffles and adds (45
 * instructions for 16 sums, where 16 separate reductions take ~8 each) */
static inline void hsum16(const __m512* v, float* out) {
    __m512 s[8], t[4], q[2];
    for (int i = 0; i < 8; i++) /* 128-bit lanes 0+2 and 1+3 of v[2i] (low half) and of v[2i+1] (high half) */
        s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xee));
    for (int i = 0; i < 4; i++) /* lane L of t[i]: the 4 partial sums of v[4i + L] */
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xdd));
    for (int i = 0; i < 2; i++) /* per lane: (t[2i].0 + .2, t[2i+1].0 + .2, t[2i].1 + .3, t[2i+1].1 + .3) */
        q[i] = _mm512_add_ps(_mm512_unpacklo_ps(t[2 * i], t[2 * i + 1]), _mm512_unpackhi_ps(t[2 * i], t[2 * i + 1]));
    /* element 4L + m: the sum of t[m]'s lane L, i.e. of v[4m + L] */
    __m512 r = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(q[0]), _mm512_castps_pd(q[1]))),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(q[0]), _mm512_castps_pd(q[1]))));
    float f[16] __attribute__((aligned(64)));
    _mm512_store_ps(f, r);
    for (int i = 0; i < 16; i++) out[i] = f[4 * (i % 4) + i / 4];
}

/* u[t, j] and u[t, j'] (rows w0, w1 of A) for 3 <= NT <= 8 tokens: each x vector loaded serves both rows, and the 16
 * sums are reduced together (hsum16) instead of one by one; NT is the block's exact token count (a block of 7
 * padded to 8 spent an eighth of its arithmetic on a zero row) */
#define DEFINE_DOTBF2X(NT)                                                                                         \
    static inline void dotbf2x##NT(const uint16_t* xh, const uint16_t* w0, const uint16_t* w1, int64_t in_dim,    \
                                   float* u0, float* u1, int64_t u_stride) {                                       \
        __m512 acc[16];                                                                                            \
        for (int t = 0; t < 16; t++) acc[t] = _mm512_setzero_ps();                                                 \
        int64_t i = 0;                                                                                             \
        for (; i + 32 <= in_dim; i += 32) {                                                                        \
            __builtin_prefetch((const char*)(w0 + i) + SPF, 0, 2);                                                 \
            __builtin_prefetch((const char*)(w1 + i) + SPF, 0, 2);                                                 \
            const __m512bh a0 = (__m512bh)_mm512_loadu_si512(w0 + i), a1 = (__m512bh)_mm512_loadu_si512(w1 + i);  \
            for (int t = 0; t < NT; t++) {                                                                         \
                const __m512bh xv = (__m512bh)_mm512_loadu_si512(xh + t * in_dim + i);                            \
                acc[t] = _mm512_dpbf16_ps(acc[t], xv, a0);                                                         \
                acc[8 + t] = _mm512_dpbf16_ps(acc[8 + t], xv, a1);                                                 \
            }                                                                                                      \
        }                                                                                                          \
        if (i < in_dim) {                                                                                          \
            const __mmask32 m = (__mmask32)((1ull << (in_dim - i)) - 1);                                           \
            const __m512bh a0 = (__m512bh)_mm512_maskz_loadu_epi16(m, w0 + i);                                    \
            const __m512bh a1 = (__m512bh)_mm512_maskz_loadu_epi16(m, w1 + i);                                     \
            for (int t = 0; t < NT; t++) {                                                                         \
                const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, xh + t * in_dim + i);                    \
                acc[t] = _mm512_dpbf16_ps(acc[t], xv, a0);                                                         \
                acc[8 + t] = _mm512_dpbf16_ps(acc[8 + t], xv, a1);                                                 \
            }                                                                                                      \
        }                                                                                                          \
        float s[16];                                                                                               \
        hsum16(acc, s);                                                                                            \
        for (int t = 0; t < NT; t++) u0[t * u_stride] = s[t], u1[t * u_stride] = s[8 + t];                         \
    }
DEFINE_DOTBF2X(3)
DEFINE_DOTBF2X(4)
DEFINE_DOTBF2X(5)
DEFINE_DOTBF2X(6)
DEFINE_DOTBF2X(7)
DEFINE_DOTBF2X(8)
typedef void (*dotbf2x_fn)(const uint16_t*, const uint16_t*, const uint16_t*, int64_t, float*, float*, int64_t);
static const dotbf2x_fn DOTBF2X[TB + 1] = {0, 0, 0, dotbf2x3, dotbf2x4, dotbf2x5, dotbf2x6, dotbf2x7, dotbf2x8};
#else
#define HAVE_BF16_DOT 0
#endif

/* This thread's share [lo, hi) of items 0..total-1: contiguous runs, as OpenMP's static schedule, walked in
 * order so each thread finds an item's segment incrementally instead of scanning from the first segment */
static inline void thread_range(int64_t total, int64_t* lo, int64_t* hi) {
#ifdef _OPENMP
    int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
#else
    int64_t nt = 1, id = 0;
#endif
    int64_t base = total / nt, extra = total % nt;
    *lo = id * base + (id < extra ? id : extra);
    *hi = *lo + base + (id < extra ? 1 : 0);
}

/* the largest rank slot s has in any sub-module of this projection (0: no weights) */
static inline int64_t seg_rmax(int64_t s, const int32_t* ranks, int64_t nmod) {
    int64_t rmax = 0;
    for (int64_t k = 0; k < nmod; k++)
        if (ranks[s * nmod + k] > rmax) rmax = ranks[s * nmod + k];
    return rmax;
}

/* the relative cost of one expand item (a column block at rank r): its rank pairs, plus the fixed part of an item
 * (accumulators, the read-add-write of 8 tokens' outputs) as about 8 pairs */
static inline int64_t item_weight(int64_t r) { return (r + 1) / 2 + 8; }

/* shrink work items of segment g on the vector path: token blocks x blocks of JB rows (0: no weights) */
static inline int64_t shrink_items(const int64_t* seg, int64_t g, const int32_t* ranks, int64_t nmod) {
    int64_t rows = seg_rmax(seg[3 * g], ranks, nmod) * nmod;
    return (seg[3 * g + 2] - seg[3 * g + 1] + TB - 1) / TB * ((rows + JB - 1) / JB);
}

#if HAVE_BF16_DOT && defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* Intel AMX (Sapphire Rapids and later): one tdpbf16ps multiplies a 16 x 32 bf16 tile by a 32 x 16 one into 16 x 16
 * fp32, 16x the MACs of a vector instruction. The shrink maps onto it without repacking A: the A operand is 16 rows
 * of the slot's A (32 inputs each, read in place with the row stride), the B operand a block of 16 tokens' x in
 * the "VNNI" pair layout, built once per token block. Linux hands out AMX state only on request (arch_prctl). */
#define HAVE_AMX 1
#define TBA 16 /* tokens per AMX block */
/* tiles (amx_config(3)): 0: C 16 x 16 fp32, 1: 16 rows of A x 32 bf16, 2: 16 pairs x 16 tokens */

/* x rows tok[0..nt) (bf16) as xv[in_dim / 32][16 pairs][TBA tokens] of 32-bit (k, k+1) pairs; tokens nt.. zero.
 * Each 16 x 16 block of pairs is transposed in registers (4 rounds of unpack/shuffle). */
static void load_xv(const void* x, int64_t in_dim, const int64_t* tok, int nt, uint32_t* xv) {
    int64_t q = in_dim / 2;
    for (int64_t kc = 0; kc < in_dim / 32; kc++) {
        __m512i r[16], t1[16];
        for (int t = 0; t < 16; t++)
            r[t] = t < nt ? _mm512_loadu_si512((const uint32_t*)x + tok[t] * q + kc * 16) : _mm512_setzero_si512();
        for (int i = 0; i < 16; i += 2) { /* pairs of rows: interleave 32-bit lanes */
            t1[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
            t1[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
        }
        for (int i = 0; i < 16; i += 4) { /* then 64-bit lanes of rows i..i+3 */
            r[i] = _mm512_unpacklo_epi64(t1[i], t1[i + 2]);
            r[i + 1] = _mm512_unpackhi_epi64(t1[i], t1[i + 2]);
            r[i + 2] = _mm512_unpacklo_epi64(t1[i + 1], t1[i + 3]);
            r[i + 3] = _mm512_unpackhi_epi64(t1[i + 1], t1[i + 3]);
        }
        /* r[4g + c] now holds, in 128-bit lane L, column 4L + c of rows 4g..4g+3; gather the lanes */
        for (int c = 0; c < 4; c++) {
            __m512i a0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88), a1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xdd);
            __m512i b0 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88), b1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xdd);
            /* a0: lanes {L0 of r[c], L2 of r[c], L0 of r[4+c], L2 of r[4+c]} ... combine to columns c, 4+c, 8+c, 12+c */
            __m512i c0 = _mm512_shuffle_i32x4(a0, b0, 0x88), c2 = _mm512_shuffle_i32x4(a0, b0, 0xdd);
            __m512i c1 = _mm512_shuffle_i32x4(a1, b1, 0x88), c3 = _mm512_shuffle_i32x4(a1, b1, 0xdd);
            uint32_t* dst = xv + kc * 256;
            _mm512_storeu_si512(dst + (0 + c) * TBA, c0);
            _mm512_storeu_si512(dst + (4 + c) * TBA, c1);
            _mm512_storeu_si512(dst + (8 + c) * TBA, c2);
            _mm512_storeu_si512(dst + (12 + c) * TBA, c3);
        }
    }
}

/* AMX shrink work items of segment g: token blocks x 16-row tiles */
static inline int64_t seg_items(const int64_t* seg, int64_t g, const int32_t* ranks, int64_t nmod) {
    int64_t rows = seg_rmax(seg[3 * g], ranks, nmod) * nmod;
    return (seg[3 * g + 2] - seg[3 * g + 1] + TBA - 1) / TBA * ((rows + 15) / 16);
}

/* Tiles of the LoRA kernel (palette 1): 0-4 full 16 rows x 64 bytes (shrink: 0 C, 1 A, 2 x pairs; expand: 0/3 C,
 * 1 u, 2/4 B), and 5 (A) / 6 (C) of 8 rows, for a shrink's last 8 or fewer rows: a rank-12 sub-module pair has 24
 * rows, and a full tile for the last 8 would read 8 rows of the next layer's weights for nothing. */
static inline void amx_config_lora(void) {
    tilecfg_t c;
    memset(&c, 0, sizeof c);
    c.palette_id = 1;
    for (int i = 0; i < 7; i++) c.colsb[i] = 64, c.rows[i] = i < 5 ? 16 : 8;
    _tile_loadconfig(&c);
}

/* u[p0 + t, j] for rows j0..j1 of one slot's A (16-row tiles, the last one 8 rows when 8 or fewer are left; rows up to
 * the tile's end must exist) */
static void shrink_amx(const uint32_t* xv, int nt, const uint16_t* a, int64_t in_dim, int64_t j0, int64_t j1, float* u,
                       int64_t u_stride, int64_t p0, int64_t nmod) {
    int64_t rc = u_stride / nmod;
    float cbuf[16 * TBA];
    for (int64_t jb = j0; jb < j1; jb += 16) {
        if (j1 - jb <= 8) {
            _tile_zero(6);
            for (int64_t kc = 0; kc < in_dim / 32; kc++) {
                _tile_loadd(5, a + jb * in_dim + kc * 32, in_dim * 2);
                _tile_loadd(2, xv + kc * 256, 64);
                _tile_dpbf16ps(6, 5, 2);
            }
            _tile_stored(6, cbuf, 64);
        } else {
            _tile_zero(0);
            for (int64_t kc = 0; kc < in_dim / 32; kc++) {
                _tile_loadd(1, a + jb * in_dim + kc * 32, in_dim * 2);
                _tile_loadd(2, xv + kc * 256, 64);
                _tile_dpbf16ps(0, 1, 2);
            }
            _tile_stored(0, cbuf, 64);
        }
        int64_t jn = j1 - jb < 16 ? j1 - jb : 16;
        for (int64_t jj = 0; jj < jn; jj++)
            for (int t = 0; t < nt; t++) u[(p0 + t) * u_stride + (jb + jj) % nmod * rc + (jb + jj) / nmod] = cbuf[jj * TBA + t];
    }
}
#else
#define HAVE_AMX 0
#endif

/* x rows tok[0..nt) as raw bf16 into xh [TB][in_dim], rows nt.. zero */
static void load_xh(const void* x, int64_t in_dim, const int64_t* tok, int nt, uint16_t* xh) {
    memset(xh + (int64_t)nt * in_dim, 0, sizeof(uint16_t) * (TB - nt) * in_dim);
    for (int t = 0; t < nt; t++) memcpy(xh + (int64_t)t * in_dim, (const uint16_t*)x + tok[t] * in_dim, 2 * in_dim);
}

/* u[p, j0..j1) for positions p0..p0+nt of one slot matrix a (rows of in_dim); xf holds the block's x rows in fp32,
 * or in bf16 when bf16dot (x and A both bf16 on a CPU with HAVE_BF16_DOT) */
static void shrink_block(const float* xf, int nt, const void* a, int w_bf16, int64_t in_dim, int64_t j0, int64_t j1,
                         float* u, int64_t u_stride, int64_t p0, int bf16dot, int64_t nmod) {
    int64_t rc = u_stride / nmod; /* u is module-major: rank j of sub-module k of position p at p * u_stride + k * rc + j */
#if HAVE_BF16_DOT
    if (bf16dot) {
        const uint16_t* xh = (const uint16_t*)xf;
        int64_t j = j0;
        if (nt > 2) /* rows in pairs: half the x loads, and the sums reduced 16 at a time */
            for (; j + 1 < j1; j += 2) {
                const uint16_t* w0 = (const uint16_t*)a + j * in_dim;
                DOTBF2X[nt](xh, w0, w0 + in_dim, in_dim, u + p0 * u_stride + j % nmod * rc + j / nmod,
                            u + p0 * u_stride + (j + 1) % nmod * rc + (j + 1) / nmod, u_stride);
            }
        for (; j < j1; j++) {
            const uint16_t* w = (const uint16_t*)a + j * in_dim;
            float* uj = u + p0 * u_stride + j % nmod * rc + j / nmod;
            if (nt > 4) dotbf8(xh, w, in_dim, uj, u_stride, nt);
            else if (nt > 2) dotbf4(xh, w, in_dim, uj, u_stride, nt);
            else if (nt > 1) dotbf2(xh, w, in_dim, uj, u_stride, nt);
            else dotbf1(xh, w, in_dim, uj, u_stride, nt);
        }
        return;
    }
#else
    (void)bf16dot;
#endif
    float wrow[MAXIN];
    for (int64_t j = j0; j < j1; j++) {
        const float* w;
        if (w_bf16) {
            const uint16_t* s = (const uint16_t*)a + j * in_dim;
            int64_t i = 0;
            for (; i + VW <= in_dim; i += VW) {
                __builtin_prefetch((const char*)(s + i) + SPF);
                v16 f = ldh(s + i);
                memcpy(wrow + i, &f, sizeof f);
            }
            for (; i < in_dim; i++) wrow[i] = bf16_to_f32(s[i]);
            w = wrow;
        } else {
            w = (const float*)a + j * in_dim;
        }
        float* uj = u + p0 * u_stride + j % nmod * rc + j / nmod;
        /* a block of nt tokens runs the next power-of-two kernel on zero-padded rows of xf: one pass over w */
#if LORA_AVX2
        dot_avx2(xf, w, in_dim, uj, u_stride, nt);
        continue;
#endif
        if (nt > 4) dot8(xf, w, in_dim, uj, u_stride, nt);
        else if (nt > 2) dot4(xf, w, in_dim, uj, u_stride, nt);
        else if (nt > 1) dot2(xf, w, in_dim, uj, u_stride, nt);
        else dot1(xf, w, in_dim, uj, u_stride, nt);
    }
}

#define BC (2 * VW) /* columns per block of B */
#define PF 64 /* rank pairs of a B block prefetched ahead, into L2 (may run past the block: prefetches never fault) */

/* out[off .. off+ow) += (lo|hi)[..ow) in out's dtype */
static inline void store_add(void* out, int64_t off, int out_bf16, v16 lo, v16 hi, int64_t ow) {
    if (ow == BC) {
        if (out_bf16) {
            uint16_t* o = (uint16_t*)out + off;
            sth(o, ldh(o) + lo), sth(o + VW, ldh(o + VW) + hi);
        } else {
            float* o = (float*)out + off;
            v16 s0 = ldf(o) + lo, s1 = ldf(o + VW) + hi;
            memcpy(o, &s0, sizeof s0), memcpy(o + VW, &s1, sizeof s1);
        }
        return;
    }
    for (int64_t v = 0; v < ow; v++) {
        float d = v < VW ? lo[v] : hi[v - VW];
        if (out_bf16) {
            uint16_t* o = (uint16_t*)out + off + v;
            *o = f32_to_bf16(bf16_to_f32(*o) + d);
        } else {
            ((float*)out)[off + v] += d;
        }
    }
}

/* out[t, col + c*BC ..) += sum_j uk[t, j] * B[j, c*BC ..) for NT tokens, storing the first ow <= BC columns. blk is
 * one column block of B, contiguous so a block streams from memory in order: fp32 j-major [r][BC]; bf16 in rank
 * pairs [(r + 1) / 2][BC][2] ("VNNI", the layout AMX reads), where one 32-bit lane holds B[j][c] in its low half
 * and B[j+1][c] in its high half, so a shift and a mask make both fp32 (an odd r's last pair has a zero high half). */
#define DEFINE_AXPY(NT)                                                                                           \
    static inline void axpy##NT(const float* uk, int64_t u_stride, int64_t r, const void* blk, int w_bf16,       \
                                void* out, const int64_t* offs, int out_bf16, int nt, int64_t ow) {               \
        v16 lo[NT], hi[NT];                                                                                       \
        for (int t = 0; t < NT; t++) lo[t] = hi[t] = (v16){0};                                                    \
        if (w_bf16) {                                                                                             \
            for (int64_t j = 0; j < r; j += 2) {                                                                  \
                const uint32_t* br = (const uint32_t*)blk + (j / 2) * BC;                                         \
                __builtin_prefetch(br + PF * BC);                                                                 \
                u32x16 w0, w1;                                                                                    \
                memcpy(&w0, br, sizeof w0), memcpy(&w1, br + VW, sizeof w1);                                      \
                u32x16 e0 = w0 << 16, o0 = w0 & 0xffff0000u, e1 = w1 << 16, o1 = w1 & 0xffff0000u;               \
                v16 be0, bo0, be1, bo1;                                                                           \
                memcpy(&be0, &e0, 64), memcpy(&bo0, &o0, 64), memcpy(&be1, &e1, 64), memcpy(&bo1, &o1, 64);       \
                for (int t = 0; t < NT; t++) {                                                                    \
                    float ue = uk[t * u_stride + j], uo = j + 1 < r ? uk[t * u_stride + j + 1] : 0.f;             \
                    lo[t] += ue * be0 + uo * bo0, hi[t] += ue * be1 + uo * bo1;                                   \
                }                                                                                                 \
            }                                                                                                     \
        } else {                                                                                                  \
            for (int64_t j = 0; j < r; j++) {                                                                     \
                const float* br = (const float*)blk + j * BC;                                                     \
                __builtin_prefetch(br + PF * BC);                                                                 \
                v16 b0 = ldf(br), b1 = ldf(br + VW);                                                              \
                for (int t = 0; t < NT; t++) {                                                                    \
                    float uj = uk[t * u_stride + j];                                                              \
                    lo[t] += uj * b0, hi[t] += uj * b1;                                                           \
                }                                                                                                 \
            }                                                                                                     \
        }                                                                                                         \
        for (int t = 0; t < nt; t++) store_add(out, offs[t], out_bf16, lo[t], hi[t], ow);                         \
    }

DEFINE_AXPY(1)
DEFINE_AXPY(2)
DEFINE_AXPY(4)
DEFINE_AXPY(8)

#if LORA_AVX2
/* The generic expand on AVX2: axpyNT's 16-lane accumulators, two ymm each, stayed on the stack even for NT = 2
 * (GCC lowers the 16-lane type after deciding what lives in registers), 6x slower than PyTorch. Here each token's
 * 32 columns are 4 ymm accumulators; B's block (at most 64 ranks x 128 bytes) is read from L1 for each token. */
static void axpy_avx2(const float* uk, int64_t u_stride, int64_t r, const void* blk, int w_bf16, void* out,
                      const int64_t* offs, int out_bf16, int nt, int64_t ow) {
    const __m256i hi_mask = _mm256_set1_epi32((int)0xffff0000u);
    for (int t = 0; t < nt; t++) {
        const float* ut = uk + t * u_stride;
        __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        if (w_bf16) {
            for (int64_t j = 0; j < r; j += 2) {
                const uint32_t* br = (const uint32_t*)blk + (j / 2) * BC;
                if (t == 0) __builtin_prefetch(br + PF * BC);
                const __m256 ue = _mm256_set1_ps(ut[j]), uo = _mm256_set1_ps(j + 1 < r ? ut[j + 1] : 0.f);
                for (int q = 0; q < 4; q++) {
                    const __m256i w = _mm256_loadu_si256((const __m256i*)(br + 8 * q));
                    a[q] = _mm256_fmadd_ps(ue, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)), a[q]);
                    a[q] = _mm256_fmadd_ps(uo, _mm256_castsi256_ps(_mm256_and_si256(w, hi_mask)), a[q]);
                }
            }
        } else {
            for (int64_t j = 0; j < r; j++) {
                const float* br = (const float*)blk + j * BC;
                if (t == 0) __builtin_prefetch(br + PF * BC);
                const __m256 uj = _mm256_set1_ps(ut[j]);
                for (int q = 0; q < 4; q++) a[q] = _mm256_fmadd_ps(uj, _mm256_loadu_ps(br + 8 * q), a[q]);
            }
        }
        /* not store_add: its 16-lane arguments cost 129 -> 184 us (fp32) a call here, the same lowering as above */
        float sum[BC];
        for (int q = 0; q < 4; q++) _mm256_storeu_ps(sum + 8 * q, a[q]);
        for (int64_t v = 0; v < ow; v++) {
            if (out_bf16) {
                uint16_t* o = (uint16_t*)out + offs[t] + v;
                *o = f32_to_bf16(bf16_to_f32(*o) + sum[v]);
            } else {
                ((float*)out)[offs[t] + v] += sum[v];
            }
        }
    }
}
#endif

#if HAVE_BF16_DOT
/* The expand of bf16 B on vdpbf16ps (CPUs with AVX512-BF16 but no AMX): B's rank pairs are already the pair layout
 * the instruction reads, and each token's u[:r] is rounded to bf16 pairs once per (segment, sub-module, token block)
 * by u_to_bf16 (as the AMX expand rounds its u tiles), so one instruction does a rank pair for 16 columns: half the
 * instructions of fp32 FMAs on converted B, and no conversion of B. */
#define UBW (MAXRANK + 32) /* bf16 values per token row of ub */

/* ub[t][0 .. r rounded up to 32) = u[t, :r] as bf16 (zero past r) for t < nt (rows u_stride apart) */
static void u_to_bf16(const float* uk, int64_t u_stride, int64_t r, int nt, uint16_t* ub) {
    for (int t = 0; t < nt; t++)
        for (int64_t j0 = 0; j0 < r; j0 += 32) {
            __mmask16 m0 = (__mmask16)(r - j0 >= 16 ? 0xffff : (1u << (r - j0)) - 1);
            __mmask16 m1 = (__mmask16)(r - j0 >= 32 ? 0xffff : r - j0 <= 16 ? 0 : (1u << (r - j0 - 16)) - 1);
            __m512bh h = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(m1, uk + t * u_stride + j0 + 16),
                                             _mm512_maskz_loadu_ps(m0, uk + t * u_stride + j0));
            memcpy(ub + t * UBW + j0, &h, 64);
        }
}

/* o[0..32) += lo|hi, o bf16 (vcvtneps2bf16: round to nearest even, as sth) */
static inline void add_bf16_32(uint16_t* o, __m512 lo, __m512 hi) {
    __m512 a = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void*)o)), 16));
    __m512 b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void*)(o + VW))), 16));
    __m256bh ha = _mm512_cvtneps_pbh(_mm512_add_ps(a, lo)), hb = _mm512_cvtneps_pbh(_mm512_add_ps(b, hi));
    memcpy(o, &ha, 32), memcpy(o + VW, &hb, 32);
}

/* out[offs[t] ..) += ub[t][:r] @ blk for NT tokens (the block's exact count: expand_block_bf passes nt == NT) */
#define DEFINE_AXPYBF(NT)                                                                                         \
    static inline void axpybf##NT(const uint16_t* ub, int64_t r, const uint32_t* blk, void* out,                  \
                                  const int64_t* offs, int out_bf16, int nt, int64_t ow) {                         \
        __m512 lo[NT], hi[NT];                                                                                    \
        for (int t = 0; t < NT; t++) lo[t] = hi[t] = _mm512_setzero_ps();                                          \
        for (int64_t j = 0; j < r; j += 2) {                                                                      \
            const uint32_t* br = blk + (j / 2) * BC;                                                              \
            __builtin_prefetch(br + PF * BC, 0, 2), __builtin_prefetch(br + PF * BC + VW, 0, 2);                  \
            const __m512i b0 = _mm512_loadu_si512(br), b1 = _mm512_loadu_si512(br + VW);                          \
            for (int t = 0; t < NT; t++) {                                                                        \
                int32_t pair;                                                                                     \
                memcpy(&pair, ub + t * UBW + j, 4);                                                               \
                const __m512i uv = _mm512_set1_epi32(pair);                                                       \
                lo[t] = _mm512_dpbf16_ps(lo[t], (__m512bh)uv, (__m512bh)b0);                                      \
                hi[t] = _mm512_dpbf16_ps(hi[t], (__m512bh)uv, (__m512bh)b1);                                      \
            }                                                                                                     \
        }                                                                                                         \
        for (int t = 0; t < nt; t++) {                                                                            \
            if (out_bf16 && ow == BC) {                                                                           \
                add_bf16_32((uint16_t*)out + offs[t], lo[t], hi[t]);                                              \
                continue;                                                                                         \
            }                                                                                                     \
            v16 l, h;                                                                                             \
            memcpy(&l, &lo[t], 64), memcpy(&h, &hi[t], 64);                                                       \
            store_add(out, offs[t], out_bf16, l, h, ow);                                                          \
        }                                                                                                         \
    }
DEFINE_AXPYBF(1)
DEFINE_AXPYBF(2)
DEFINE_AXPYBF(3)
DEFINE_AXPYBF(4)
DEFINE_AXPYBF(5)
DEFINE_AXPYBF(6)
DEFINE_AXPYBF(7)
DEFINE_AXPYBF(8)
typedef void (*axpybf_fn)(const uint16_t*, int64_t, const uint32_t*, void*, const int64_t*, int, int, int64_t);
static const axpybf_fn AXPYBF[TB + 1] = {0, axpybf1, axpybf2, axpybf3, axpybf4, axpybf5, axpybf6, axpybf7, axpybf8};

/* the vdpbf16ps expand of one column block: out rows tok[p0..p0+nt), columns col + o0 .. */
static void expand_block_bf(const uint16_t* ub, int64_t r, const uint32_t* blk, int64_t out_k, int64_t o0, int nt,
                            int64_t p0, const int64_t* tok, void* out, int64_t out_stride, int64_t col) {
    int64_t offs[TB];
    for (int t = 0; t < nt; t++) offs[t] = tok[p0 + t] * out_stride + col + o0;
    int64_t ow = out_k - o0 < BC ? out_k - o0 : BC;
    /* the block's exact token count (a block of 7 padded to 8 spent an eighth of its arithmetic on nothing) */
    AXPYBF[nt](ub, r, blk, out, offs, 1, nt, ow);
}
#endif

/* elements of one column block of B at rank r (bf16: whole rank pairs) */
static inline int64_t blk_elems(int64_t r, int w_bf16) { return (w_bf16 ? (r + 1) / 2 * 2 : r) * BC; }

/* out rows tok[p0..p0+nt), columns col + o0 .. (one column block) */
static void expand_block(const float* u, int64_t u_stride, int64_t nmod, int64_t k, int64_t r, const void* blk,
                         int w_bf16, int64_t out_k, int64_t o0, int nt, int64_t p0, const int64_t* tok, void* out,
                         int64_t out_stride, int out_bf16, int64_t col) {
    const float* uk = u + p0 * u_stride + k * (u_stride / nmod);
    int64_t offs[TB];
    for (int t = 0; t < nt; t++) offs[t] = tok[p0 + t] * out_stride + col + o0;
    int64_t ow = out_k - o0 < BC ? out_k - o0 : BC;
    /* nt <= TB tokens run the next power-of-two kernel: rows past the block read other positions' u (or the
     * zeroed padding rows after the last one) and are never stored */
#if LORA_AVX2
    axpy_avx2(uk, u_stride, r, blk, w_bf16, out, offs, out_bf16, nt, ow);
    return;
#endif
    if (nt > 4) axpy8(uk, u_stride, r, blk, w_bf16, out, offs, out_bf16, nt, ow);
    else if (nt > 2) axpy4(uk, u_stride, r, blk, w_bf16, out, offs, out_bf16, nt, ow);
    else if (nt > 1) axpy2(uk, u_stride, r, blk, w_bf16, out, offs, out_bf16, nt, ow);
    else axpy1(uk, u_stride, r, blk, w_bf16, out, offs, out_bf16, nt, ow);
}

#if HAVE_AMX
/* AMX expand work items of segment g: per sub-module with weights, token blocks x 16-column tiles */
static inline int64_t expand_items(const int64_t* seg, int64_t g, const int32_t* ranks, int64_t nmod,
                                   const int64_t* out_k) {
    int64_t s = seg[3 * g], ntb = (seg[3 * g + 2] - seg[3 * g + 1] + TBA - 1) / TBA, n = 0;
    for (int64_t k = 0; k < nmod; k++)
        if (ranks[s * nmod + k]) n += ntb * ((out_k[k] + BC - 1) / BC);
    return n;
}

/* uk[t, :r] for t < nt as bf16 AMX tiles ut[ceil(r / 32)][TBA][32], zero past r and past nt (built once per
 * token block and sub-module, then used for all its column tiles) */
static void build_ut(const float* uk, int64_t u_stride, int64_t r, int nt, uint16_t* ut) {
    for (int64_t j0 = 0; j0 < r; j0 += 32) {
        __mmask16 m0 = (__mmask16)(r - j0 >= 16 ? 0xffff : (1u << (r - j0)) - 1);
        __mmask16 m1 = (__mmask16)(r - j0 >= 32 ? 0xffff : r - j0 <= 16 ? 0 : (1u << (r - j0 - 16)) - 1);
        for (int t = 0; t < TBA; t++) {
            __m512 lo = t < nt ? _mm512_maskz_loadu_ps(m0, uk + t * u_stride + j0) : _mm512_setzero_ps();
            __m512 hi = t < nt ? _mm512_maskz_loadu_ps(m1, uk + t * u_stride + j0 + 16) : _mm512_setzero_ps();
            __m512bh h = _mm512_cvtne2ps_pbh(hi, lo);
            memcpy(ut + (j0 / 32) * TBA * 32 + t * 32, &h, 64);
        }
    }
}

/* out[tok[t], col .. col + ow) += u_t[:r] @ B[:r, 32 columns] for t < nt: one column block of B in rank pairs,
 * 16 pairs (32 ranks) per tile and two tiles side by side (columns 0-15 and 16-31 of each 128-byte pair row) into
 * C tiles 0 and 3, so each line of the block is read by one item. Rows past the rank's pairs read the next block's
 * weights or the zero pad and meet zeros in the u tile. The block EXPAND_PF bytes ahead is prefetched into L2:
 * consecutive items of a thread walk a slot's blocks in order, and without it each item waits on memory. */
static void expand_amx(const uint16_t* ut, int64_t r, const uint16_t* b, int nt, const int64_t* tok, void* out,
                       int64_t out_stride, int out_bf16, int64_t col, int64_t ow) {
    float cbuf[TBA * BC] __attribute__((aligned(64)));
    const char* pf = (const char*)b + EXPAND_PF;
    for (int64_t q = 0; q < (r + 1) / 2 * 2; q++) __builtin_prefetch(pf + q * 64, 0, 2);
    _tile_zero(0);
    _tile_zero(3);
    for (int64_t j0 = 0; j0 < r; j0 += 32) {
        _tile_loadd(1, ut + (j0 / 32) * TBA * 32, 64);
        _tile_loadd(2, b + (j0 / 2) * 2 * BC, 2 * BC * 2);
        _tile_loadd(4, b + (j0 / 2) * 2 * BC + 2 * VW, 2 * BC * 2);
        _tile_dpbf16ps(0, 1, 2);
        _tile_dpbf16ps(3, 1, 4);
    }
    _tile_stored(0, cbuf, BC * 4);
    _tile_stored(3, cbuf + VW, BC * 4);
    for (int t = 0; t < nt; t++) {
        const int64_t off = tok[t] * out_stride + col;
        const __m512 lo = _mm512_load_ps(cbuf + t * BC), hi = _mm512_load_ps(cbuf + t * BC + VW);
        if (out_bf16 && ow == BC) {
            add_bf16_32((uint16_t*)out + off, lo, hi);
            continue;
        }
        v16 l, h;
        memcpy(&l, &lo, 64), memcpy(&h, &hi, 64);
        store_add(out, off, out_bf16, l, h, ow);
    }
}
#endif

/* A thread's walk over its shrink items: segment g, its item count n, the item's index rest within it */
typedef struct {
    int64_t g, n, rest;
} sg_walk;

#define PF_LINES 4096 /* most lines listed for one panel's prefetches (256 KB of A) */

/* Shrink item rest of segment g (on the vector path: token block x block of JB rows of A): its token block, and
 * the rows [*j0, *j1) of its slot's A it reads */
static inline int64_t shrink_item(const int64_t* seg, int64_t g, int64_t rest, const int32_t* ranks, int64_t nmod,
                                  int64_t* j0, int64_t* j1) {
    const int64_t rows = seg_rmax(seg[3 * g], ranks, nmod) * nmod, nj = (rows + JB - 1) / JB;
    *j0 = rest % nj * JB;
    *j1 = *j0 + JB < rows ? *j0 + JB : rows;
    return rest / nj;
}

/* The cache lines of the A rows of the next count shrink items from w (a copy: the caller's walk stays), into
 * line[0..PF_LINES); returns how many (rows of row_bytes each) */
static int64_t item_lines(sg_walk w, int64_t count, const int64_t* seg, const int32_t* ranks, int64_t nmod,
                          const int64_t* a_tab, int64_t row_bytes, const char** line) {
    int64_t n = 0, j0, j1;
    for (int64_t c = 0; c < count; c++, w.rest++) {
        while (w.rest >= w.n) w.rest -= w.n, w.n = shrink_items(seg, ++w.g, ranks, nmod);
        shrink_item(seg, w.g, w.rest, ranks, nmod, &j0, &j1);
        const char* a = (const char*)a_tab[seg[3 * w.g]] + j0 * row_bytes;
        for (int64_t b = 0; b < (j1 - j0) * row_bytes && n < PF_LINES; b += 64) line[n++] = a + b;
    }
    return n;
}

/* Returns 0, or -1 when in_dim is over the kernel's row buffers (the caller then uses its torch path).
 * tok: the LoRA tokens' rows of x/out, grouped by slot; seg: nseg x (slot, p0, p1), positions into tok.
 * ranks: [slots, nmod] int32 of this layer (0 = the slot has no weights there).
 * Each slot's weights are found through two address tables, so they may live in one arena (S-LoRA's unified
 * paging) or in each adapter's own host buffers (read in place):
 * a_tab[s]: the slot's shrink rows [rows, in_dim], row j * nmod + k = rank j of sub-module k, zero past each
 * sub-module's rank; 16 readable rows must follow its last one (AMX's whole tiles read them and discard the result).
 * b_tab[s * nmod + k]: sub-module k's expand weights, packed at rank r = ranks[s][k] in column blocks of 32 (zero
 * past out_k[k]): fp32 [blocks][r][32], bf16 [blocks][ceil(r / 2)][32][2], followed by readable finite values
 * (AMX's tiles read past the last rank pair and multiply them by zero u).
 * u: fp32 scratch [len(tok) + 8][u_stride >= largest rank * nmod], module-major rows, rows past len(tok) zero.
 * gj: NULL, or the projection's base GEMM (Loom's bf16 GEMM, bf16_tiles.h) of the same x into out, computed by the
 * same threads before the expand, its panels interleaved with the shrink (see loom_lora_sgmv_gemm). */
typedef struct {
    int64_t M, n_out;
    const uint16_t* wp;
} gemm_job;

static int lora_sgmv(int64_t in_dim, const void* x, int x_bf16, void* out, int64_t out_stride, int out_bf16,
                     const int64_t* tok, int64_t nseg, const int64_t* seg, const int64_t* a_tab, const int64_t* b_tab,
                     int w_bf16, int64_t nmod, const int32_t* ranks,
                     const int64_t* out_k, const int64_t* col_k, float* u, int64_t u_stride, const gemm_job* gj) {
    if (in_dim > MAXIN) return -1;
    if (nseg == 0 && !gj) return 0; /* no adapter rows: skip the threads' fork and join */
    const int64_t esz = w_bf16 ? 2 : 4;
    const int bf16dot = HAVE_BF16_DOT && x_bf16 && w_bf16;
#if HAVE_AMX
    /* AMX for the shrink when A's buffer has whole 16-row tiles (the pool pads it) and inputs are 32-aligned */
    const int amx = bf16dot && in_dim % 32 == 0 && amx_enable() && !gj;
#endif
#ifdef _OPENMP
#pragma omp parallel
#endif
    {
        float xf[TB * MAXIN];
        int64_t xf_p0 = -1, xf_nt = 0; /* the token block xf holds (static schedules hand a thread runs of one block) */
#if HAVE_AMX
        if (amx) amx_config_lora();
        if (amx) {
            /* shrink: work items = (segment, block of TBA tokens, 16-row tile), numbered across all segments so the
             * threads split the whole step evenly (a segment alone may be one tile); xf holds the block's xv */
            int64_t total = 0, lo, hi, g = 0, rest, n = seg_items(seg, 0, ranks, nmod);
            for (int64_t q = 0; q < nseg; q++) total += seg_items(seg, q, ranks, nmod);
            thread_range(total, &lo, &hi);
            rest = lo;
            for (int64_t it = lo; it < hi; it++, rest++) {
                while (rest >= n) rest -= n, n = seg_items(seg, ++g, ranks, nmod);
                int64_t s = seg[3 * g], p0 = seg[3 * g + 1], p1 = seg[3 * g + 2];
                int64_t rows = seg_rmax(s, ranks, nmod) * nmod, nj = (rows + 15) / 16;
                int64_t pa = p0 + rest / nj * TBA, jb = rest % nj * 16;
                int nt = (int)((p1 - pa) < TBA ? (p1 - pa) : TBA);
                if (pa != xf_p0 || nt != xf_nt) load_xv(x, in_dim, tok + pa, nt, (uint32_t*)xf), xf_p0 = pa, xf_nt = nt;
                const uint16_t* a = (const uint16_t*)a_tab[s];
                shrink_amx((const uint32_t*)xf, nt, a, in_dim, jb, jb + 16 < rows ? jb + 16 : rows, u, u_stride, pa, nmod);
            }
        } else
#endif
        {
            /* shrink: work items = (segment, token block, block of JB rows), numbered across all segments so the
             * threads split the step evenly (split per segment, a segment of one or three row blocks gave one
             * thread twice the other's rows); each thread walks its run in order */
            int64_t total = 0, lo, hi, g = 0, n = 0;
            for (int64_t q = 0; q < nseg; q++) total += shrink_items(seg, q, ranks, nmod);
            thread_range(total, &lo, &hi);
            int64_t rest = lo;
            if (lo < hi) n = shrink_items(seg, 0, ranks, nmod);
            /* with a GEMM job, this thread's panels [plo, phi) go between its shrink items: after panel i, the items
             * up to its (i + 1)-th share, whose A rows were prefetched while the panel computed (the GEMM is bound
             * by arithmetic, the shrink by memory: interleaved, the A reads overlap the GEMM) */
            int64_t plo = 0, phi = 0;
#if HAVE_GEMM
            if (gj) thread_range((gj->n_out + NR - 1) / NR, &plo, &phi);
#endif
            const int64_t npan = phi - plo;
            int64_t it = lo;
            for (int64_t pi = 0; it < hi || pi < npan; pi++) {
                int64_t stop = hi;
#if HAVE_GEMM
                if (pi < npan) {
                    stop = lo + (hi - lo) * (pi + 1) / npan;
                    const char* lines[PF_LINES];
                    const sg_walk w = {g, n, rest};
                    pf_list pf = {lines, item_lines(w, stop - it, seg, ranks, nmod, a_tab, in_dim * esz, lines), 0};
                    gemm_panel(plo + pi, gj->M, in_dim, gj->n_out, (const uint16_t*)x, in_dim, gj->wp, (uint16_t*)out,
                               out_stride, &pf);
                }
#endif
                for (; it < stop; it++, rest++) {
                    while (rest >= n) rest -= n, n = shrink_items(seg, ++g, ranks, nmod);
                    int64_t s = seg[3 * g], p1 = seg[3 * g + 2], j0, j1;
                    int64_t pa = seg[3 * g + 1] + shrink_item(seg, g, rest, ranks, nmod, &j0, &j1) * TB;
                    int nt = (int)((p1 - pa) < TB ? (p1 - pa) : TB);
                    if (pa != xf_p0 || nt != xf_nt) {
                        if (bf16dot) load_xh(x, in_dim, tok + pa, nt, (uint16_t*)xf);
                        else load_x(x, x_bf16, in_dim, tok + pa, nt, xf);
                        xf_p0 = pa, xf_nt = nt;
                    }
                    shrink_block(xf, nt, (const char*)a_tab[s], w_bf16, in_dim, j0, j1, u, u_stride, pa, bf16dot, nmod);
                }
            }
        }
#ifdef _OPENMP
#pragma omp barrier
#endif
#if HAVE_AMX
        if (amx) {
            /* expand: work items = (segment, sub-module, block of TBA tokens, 16 output columns), across segments;
             * xf (free after the shrink) holds the u tiles of the item's token block and sub-module */
            int64_t total = 0, ut_g = -1, ut_k = -1, ut_p = -1, lo, hi, g = 0, rest;
            int64_t n = expand_items(seg, 0, ranks, nmod, out_k);
            for (int64_t q = 0; q < nseg; q++) total += expand_items(seg, q, ranks, nmod, out_k);
            thread_range(total, &lo, &hi);
            rest = lo;
            for (int64_t it = lo; it < hi; it++, rest++) {
                while (rest >= n) rest -= n, n = expand_items(seg, ++g, ranks, nmod, out_k);
                int64_t s = seg[3 * g], p0 = seg[3 * g + 1], p1 = seg[3 * g + 2], k = 0, kr = rest;
                int64_t ntb = (p1 - p0 + TBA - 1) / TBA;
                for (;; k++) {
                    int64_t nk = ranks[s * nmod + k] ? ntb * ((out_k[k] + BC - 1) / BC) : 0;
                    if (kr < nk) break;
                    kr -= nk;
                }
                int64_t r = ranks[s * nmod + k], nct = (out_k[k] + BC - 1) / BC;
                int64_t pa = p0 + kr / nct * TBA, ct = kr % nct;
                int nt = (int)((p1 - pa) < TBA ? (p1 - pa) : TBA);
                const uint16_t* b = (const uint16_t*)b_tab[s * nmod + k] + ct * blk_elems(r, 1);
                if (g != ut_g || k != ut_k || pa != ut_p) {
                    build_ut(u + pa * u_stride + k * (u_stride / nmod), u_stride, r, nt, (uint16_t*)xf);
                    ut_g = g, ut_k = k, ut_p = pa;
                }
                expand_amx((const uint16_t*)xf, r, b, nt, tok + pa, out, out_stride, out_bf16, col_k[k] + ct * BC,
                           out_k[k] - ct * BC < BC ? out_k[k] - ct * BC : BC);
            }
            _tile_release();
        } else
#endif
        {
            /* expand: work items = (segment, sub-module, token block, column chunk); each owns its out cells */
#if HAVE_BF16_DOT
            uint16_t ub[TB * UBW] __attribute__((aligned(64)));
            int64_t ub_g = -1, ub_k = -1, ub_p = -1;
#endif
            /* the threads split the step's expand items by weight (an item costs its rank pairs plus a fixed part),
             * across segments: each takes the items whose start falls in its share of the total, so a thread reads
             * whole sub-modules' expand weights as one stream where the per-segment split gave each thread half of
             * every one (on a 2-core Zen 4, a 64-row step's LoRA over 8 adapters took 7.4-7.8 ms, now 6.3-6.5) */
            int64_t wsum = 0, wlo, whi;
            for (int64_t g = 0; g < nseg; g++)
                for (int64_t k = 0; k < nmod; k++) {
                    int64_t s = seg[3 * g], r = ranks[s * nmod + k];
                    if (r) wsum += (seg[3 * g + 2] - seg[3 * g + 1] + TB - 1) / TB * ((out_k[k] + BC - 1) / BC) * item_weight(r);
                }
            thread_range(wsum, &wlo, &whi);
            int64_t wpos = 0; /* weight before the current (segment, sub-module) */
            for (int64_t g = 0; g < nseg && wpos < whi; g++) {
                int64_t s = seg[3 * g], p0 = seg[3 * g + 1], p1 = seg[3 * g + 2];
                int64_t ntb = (p1 - p0 + TB - 1) / TB;
                for (int64_t k = 0; k < nmod && wpos < whi; k++) {
                    int64_t r = ranks[s * nmod + k];
                    if (!r) continue;
                    int64_t nc = (out_k[k] + BC - 1) / BC, w = item_weight(r), cnt = ntb * nc;
                    /* items i with wpos + i * w in [wlo, whi) */
                    int64_t i0 = wlo > wpos ? (wlo - wpos + w - 1) / w : 0, i1 = (whi - wpos + w - 1) / w;
                    if (i1 > cnt) i1 = cnt;
                    wpos += cnt * w;
                    const char* b = (const char*)b_tab[s * nmod + k];
#if HAVE_BF16_DOT
                    const int bfx = w_bf16 && out_bf16 && r <= MAXRANK; /* a bf16 model: u in bf16 loses nothing */
#endif
                    for (int64_t it = i0; it < i1; it++) {
                        int64_t tb = it / nc, c = it % nc;
                        int64_t pa = p0 + tb * TB;
                        int nt = (int)((p1 - pa) < TB ? (p1 - pa) : TB);
#if HAVE_BF16_DOT
                        if (bfx) {
                            if (g != ub_g || k != ub_k || pa != ub_p) { /* each thread converts its blocks' u once */
                                u_to_bf16(u + pa * u_stride + k * (u_stride / nmod), u_stride, r, nt, ub);
                                ub_g = g, ub_k = k, ub_p = pa;
                            }
                            expand_block_bf(ub, r, (const uint32_t*)(b + c * blk_elems(r, 1) * esz), out_k[k], c * BC,
                                            nt, pa, tok, out, out_stride, col_k[k]);
                            continue;
                        }
#endif
                        expand_block(u, u_stride, nmod, k, r, b + c * blk_elems(r, w_bf16) * esz, w_bf16, out_k[k], c * BC, nt, pa, tok, out, out_stride,
                                     out_bf16, col_k[k]);
                    }
                }
            }
        }
    }
    return 0;
}

/* The entry point. Its one argument is a call's block of 11 int64 (pointers and flags as integers):
 *   [0] x, [1] x_bf16, [2] out, [3] out_stride, [4] out_bf16   (this call's activations)
 *   [5] the (layer, fused projection)'s constant block: in_dim, a_tab, b_tab, w_bf16, nmod, ranks, out_k, col_k
 *   [6] tok, [7] nseg, [8] seg, [9] u, [10] u_stride           (the step's tokens, segments and scratch)
 * ctypes spends ~5 us converting 18 separate arguments, and a step makes 120 calls; with the constant parts kept in
 * blocks written once, a call writes six values (lora_kernel.SgmvStep). */
int loom_lora_sgmv(const int64_t* a) {
    const int64_t* l = (const int64_t*)a[5];
    return lora_sgmv(l[0], (const void*)a[0], (int)a[1], (void*)a[2], a[3], (int)a[4], (const int64_t*)a[6], a[7],
                     (const int64_t*)a[8], (const int64_t*)l[1], (const int64_t*)l[2], (int)l[3], l[4],
                     (const int32_t*)l[5], (const int64_t*)l[6], (const int64_t*)l[7], (float*)a[9], a[10], NULL);
}

/* The projection's base GEMM and its LoRA in one call: out = x @ W^T (Loom's bf16 GEMM over W's packed panels, as
 * loom_bf16_gemm computes it), then out += the LoRA deltas as loom_lora_sgmv adds them, so the result is the same
 * as those two calls one after the other, bit for bit. What changes is the order: each thread computes its share
 * of the GEMM's panels between its shrink items, prefetching the next items' A rows while a panel computes, so the
 * shrink's reads of the adapters (half their bytes), bound by memory, overlap the GEMM's arithmetic instead of
 * following it; the expand follows both, after one barrier (issue 10).
 * The block: loom_lora_sgmv's 11 values (x and out bf16, x rows contiguous: out_stride elements for out), then
 *   [11] M (rows of x and out), [12] n_out (out's columns), [13] wp (W packed as bf16_gemm.pack_weight, K = in_dim).
 * Returns 0, -1 as loom_lora_sgmv, 1 for arguments the GEMM cannot take (x or out not bf16, K odd), 3 where the
 * kernel was built without AVX512-BF16. Never uses AMX (the GEMM's tiles are vdpbf16ps). */
int loom_lora_sgmv_gemm(const int64_t* a) {
#if HAVE_GEMM
    const int64_t* l = (const int64_t*)a[5];
    const gemm_job gj = {a[11], a[12], (const uint16_t*)a[13]};
    if (!a[1] || !a[4] || l[0] % 2 || l[0] <= 0 || gj.M < 0 || gj.n_out < 0) return 1;
    return lora_sgmv(l[0], (const void*)a[0], (int)a[1], (void*)a[2], a[3], (int)a[4], (const int64_t*)a[6], a[7],
                     (const int64_t*)a[8], (const int64_t*)l[1], (const int64_t*)l[2], (int)l[3], l[4],
                     (const int32_t*)l[5], (const int64_t*)l[6], (const int64_t*)l[7], (float*)a[9], a[10], &gj);
#else
    (void)a;
    return 3;
#endif
}
