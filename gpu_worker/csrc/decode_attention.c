/* Decode attention on the CPU: one new query token per row, attending to that row's KV history.
 *
 * For row g, KV head h and each of its rep = nq / nkv query heads (query head h * rep + i, as SDPA's enable_gqa):
 *     out[g, h * rep + i] = sum_{j < len[g]} softmax_j(scale * q . k_j) v_j
 * One work item is a (row, KV head): its K and V are read once for all rep query heads. The softmax runs over
 * blocks of BK keys with a running maximum and sum (the online softmax of Milakov & Gimelshein, arXiv 1805.02867,
 * as FlashAttention and flash-decoding use it), so any history length needs only fixed scratch. Accumulation is
 * fp32 throughout, the probabilities stay fp32 for P.V; q, k, v and out are all bf16 or all fp32.
 * Why not torch: SDPA's CPU kernel costs 30-70 us per call for one query row, and ~1 ms per layer for 32 rows of
 * ~256 positions on a 2-core CPU, several times the time to stream K and V once, which is all this needs.
 * Plain C (GCC/Clang vector extensions; AVX2 intrinsics where those compile badly on 256-bit registers, see
 * decode_attention_item.h), compiled on the serving machine with -march=native.
 * Threads: OpenMP over the work items (torch's libgomp, one pool).
 */
#include "loom_cpu.h"
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_BF16_DOT 1 /* bf16 q . k as 32 products per vdpbf16ps (exact products, fp32 sums), no conversion */
#else
#define HAVE_BF16_DOT 0
#endif

#if !HAVE_BF16_DOT && defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
#define SCORES_AVX2 1 /* scores on 8-lane vectors (see decode_attention_item.h) */
#else
#define SCORES_AVX2 0
#endif
#define BK 64     /* keys per softmax block */
#define MAXD 256  /* head_dim: a multiple of 16 up to this */
#define MAXREP 16 /* query heads per KV head */
#define CH 512    /* longest history one work item attends (longer: split into equal chunks) */

/* This thread's scratch for split rows' partial states, grown as needed and kept (one call per layer per step) */
static __thread float* scratch;
static __thread int64_t scratch_n;
static float* scratch_for(int64_t n) {
    if (n > scratch_n) {
        free(scratch);
        scratch_n = 0;
        if (posix_memalign((void**)&scratch, 64, sizeof(float) * n)) return scratch = 0;
        scratch_n = n;
    }
    return scratch;
}


/* 16 vectors -> one whose lane j is the sum of v[j]'s lanes: a transpose-and-add tree of 4 levels (15 pairs of
 * shuffles) instead of 16 horizontal sums; the tree leaves lanes in bit-reversed order, put back by one shuffle. */
static inline v16 reduce16(const v16* v) {
    const i32x16 l1a = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const i32x16 l1b = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const i32x16 l2a = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
    const i32x16 l2b = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
    const i32x16 l3a = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
    const i32x16 l3b = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
    const i32x16 l4a = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
    const i32x16 l4b = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
    const i32x16 bitrev = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
    v16 t[8], u[4], w[2];
    for (int m = 0; m < 8; m++)
        t[m] = __builtin_shuffle(v[2 * m], v[2 * m + 1], l1a) + __builtin_shuffle(v[2 * m], v[2 * m + 1], l1b);
    for (int m = 0; m < 4; m++)
        u[m] = __builtin_shuffle(t[2 * m], t[2 * m + 1], l2a) + __builtin_shuffle(t[2 * m], t[2 * m + 1], l2b);
    for (int m = 0; m < 2; m++)
        w[m] = __builtin_shuffle(u[2 * m], u[2 * m + 1], l3a) + __builtin_shuffle(u[2 * m], u[2 * m + 1], l3b);
    v16 z = __builtin_shuffle(w[0], w[1], l4a) + __builtin_shuffle(w[0], w[1], l4b);
    return __builtin_shuffle(z, bitrev);
}

/* 32 bf16 to p from fp32 even elements e and odd elements o (round to nearest even, NaN stays NaN) */
static inline void sth2(uint16_t* p, v16 e, v16 o) {
    u32x16 r[2];
    v16 f[2] = {e, o};
    for (int h = 0; h < 2; h++) {
        u32x16 u;
        memcpy(&u, &f[h], sizeof u);
        u32x16 t = u + 0x7fffu + ((u >> 16) & 1u);
        i32x16 nan = (i32x16)(u & 0x7fffffffu) > 0x7f800000; /* signed: AVX2 has no unsigned compare */
        r[h] = (t & ~(u32x16)nan) | ((u | 0x400000u) & (u32x16)nan);
    }
    u32x16 x = (r[0] >> 16) | (r[1] & 0xffff0000u);
    memcpy(p, &x, sizeof x);
}

/* One query head's output from its accumulators (C vectors; for bf16, even dims in acc[2c], odd in acc[2c + 1]) */
static inline void store_head(void* out, const v16* acc, float inv, int C, int bf) {
    if (bf)
        for (int c = 0; c < C; c += 2) sth2((uint16_t*)out + c * VW, acc[c] * inv, acc[c + 1] * inv);
    else
        for (int c = 0; c < C; c++) {
            v16 o = acc[c] * inv;
            memcpy((float*)out + c * VW, &o, sizeof o);
        }
}

/* A chunk's state for query head i of rep: its d accumulators (as held), then m[rep] and l[rep] after all heads */
static inline void store_part(float* part, int i, int rep, int d, const v16* acc, float m, float l) {
    memcpy(part + i * d, acc, sizeof(float) * d);
    part[rep * d + i] = m, part[rep * d + rep + i] = l;
}

/* One (row, KV head) work item per the shapes generated from decode_attention_item.h: the shapes of the usual
 * models (head_dim 64 or 128; 1, 2, 3, 4 or 8 query heads per KV head) have their own version, others the general. */
typedef void (*attend_fn)(const void*, int64_t, const void*, int64_t, const void*, int64_t, const int64_t*, int64_t,
                          float, void*, int64_t, int, int, int, float*, const void*, const void*, const int64_t*,
                          int64_t);
#define ATT_NAME attend_64_1_1
#define ATT_D 64
#define ATT_REP 1
#define ATT_BF 1
#define ATT_DCAP 64
#define ATT_REPCAP 1
#include "decode_attention_item.h"

#define ATT_NAME attend_64_2_1
#define ATT_D 64
#define ATT_REP 2
#define ATT_BF 1
#define ATT_DCAP 64
#define ATT_REPCAP 2
#include "decode_attention_item.h"

#define ATT_NAME attend_64_3_1
#define ATT_D 64
#define ATT_REP 3
#define ATT_BF 1
#define ATT_DCAP 64
#define ATT_REPCAP 3
#include "decode_attention_item.h"

#define ATT_NAME attend_64_4_1
#define ATT_D 64
#define ATT_REP 4
#define ATT_BF 1
#define ATT_DCAP 64
#define ATT_REPCAP 4
#include "decode_attention_item.h"

#define ATT_NAME attend_64_8_1
#define ATT_D 64
#define ATT_REP 8
#define ATT_BF 1
#define ATT_DCAP 64
#define ATT_REPCAP 8
#include "decode_attention_item.h"

#define ATT_NAME attend_64_1_0
#define ATT_D 64
#define ATT_REP 1
#define ATT_BF 0
#define ATT_DCAP 64
#define ATT_REPCAP 1
#include "decode_attention_item.h"

#define ATT_NAME attend_64_2_0
#define ATT_D 64
#define ATT_REP 2
#define ATT_BF 0
#define ATT_DCAP 64
#define ATT_REPCAP 2
#include "decode_attention_item.h"

#define ATT_NAME attend_64_3_0
#define ATT_D 64
#define ATT_REP 3
#define ATT_BF 0
#define ATT_DCAP 64
#define ATT_REPCAP 3
#include "decode_attention_item.h"

#define ATT_NAME attend_64_4_0
#define ATT_D 64
#define ATT_REP 4
#define ATT_BF 0
#define ATT_DCAP 64
#define ATT_REPCAP 4
#include "decode_attention_item.h"

#define ATT_NAME attend_64_8_0
#define ATT_D 64
#define ATT_REP 8
#define ATT_BF 0
#define ATT_DCAP 64
#define ATT_REPCAP 8
#include "decode_attention_item.h"

#define ATT_NAME attend_128_1_1
#define ATT_D 128
#define ATT_REP 1
#define ATT_BF 1
#define ATT_DCAP 128
#define ATT_REPCAP 1
#include "decode_attention_item.h"

#define ATT_NAME attend_128_2_1
#define ATT_D 128
#define ATT_REP 2
#define ATT_BF 1
#define ATT_DCAP 128
#define ATT_REPCAP 2
#include "decode_attention_item.h"

#define ATT_NAME attend_128_3_1
#define ATT_D 128
#define ATT_REP 3
#define ATT_BF 1
#define ATT_DCAP 128
#define ATT_REPCAP 3
#include "decode_attention_item.h"

#define ATT_NAME attend_128_4_1
#define ATT_D 128
#define ATT_REP 4
#define ATT_BF 1
#define ATT_DCAP 128
#define ATT_REPCAP 4
#include "decode_attention_item.h"

#define ATT_NAME attend_128_8_1
#define ATT_D 128
#define ATT_REP 8
#define ATT_BF 1
#define ATT_DCAP 128
#define ATT_REPCAP 8
#include "decode_attention_item.h"

#define ATT_NAME attend_128_1_0
#define ATT_D 128
#define ATT_REP 1
#define ATT_BF 0
#define ATT_DCAP 128
#define ATT_REPCAP 1
#include "decode_attention_item.h"

#define ATT_NAME attend_128_2_0
#define ATT_D 128
#define ATT_REP 2
#define ATT_BF 0
#define ATT_DCAP 128
#define ATT_REPCAP 2
#include "decode_attention_item.h"

#define ATT_NAME attend_128_3_0
#define ATT_D 128
#define ATT_REP 3
#define ATT_BF 0
#define ATT_DCAP 128
#define ATT_REPCAP 3
#include "decode_attention_item.h"

#define ATT_NAME attend_128_4_0
#define ATT_D 128
#define ATT_REP 4
#define ATT_BF 0
#define ATT_DCAP 128
#define ATT_REPCAP 4
#include "decode_attention_item.h"

#define ATT_NAME attend_128_8_0
#define ATT_D 128
#define ATT_REP 8
#define ATT_BF 0
#define ATT_DCAP 128
#define ATT_REPCAP 8
#include "decode_attention_item.h"

#define ATT_NAME attend_any
#define ATT_D d
#define ATT_REP rep
#define ATT_BF bf16
#define ATT_DCAP MAXD
#define ATT_REPCAP MAXREP
#include "decode_attention_item.h"

static attend_fn pick(int64_t d, int rep, int bf16) {
#define CASE(DD, RR, BB) \
    if (d == DD && rep == RR && bf16 == BB) return attend_##DD##_##RR##_##BB;
        CASE(64, 1, 1)
        CASE(64, 2, 1)
        CASE(64, 3, 1)
        CASE(64, 4, 1)
        CASE(64, 8, 1)
        CASE(64, 1, 0)
        CASE(64, 2, 0)
        CASE(64, 3, 0)
        CASE(64, 4, 0)
        CASE(64, 8, 0)
        CASE(128, 1, 1)
        CASE(128, 2, 1)
        CASE(128, 3, 1)
        CASE(128, 4, 1)
        CASE(128, 8, 1)
        CASE(128, 1, 0)
        CASE(128, 2, 0)
        CASE(128, 3, 0)
        CASE(128, 4, 0)
        CASE(128, 8, 0)
#undef CASE
    return attend_any;
}

/* Work item it = (chunk c, KV head h): the chunk's row g (start[g] <= c < start[g + 1]), first key j0 and key count;
 * a row of n keys splits into nc = start[g + 1] - start[g] chunks of equal length */
typedef struct {
    int64_t g, h, j0, cnt, nc;
} span_t;
static inline span_t span_of(int64_t it, int64_t nkv, const int64_t* start, int64_t G, const int64_t* lens, int64_t L) {
    const int64_t c = it / nkv;
    int64_t lo = 0, hi = G;
    while (hi - lo > 1) {
        const int64_t mid = (lo + hi) / 2;
        if (start[mid] <= c)
            lo = mid;
        else
            hi = mid;
    }
    const int64_t n = lens ? lens[lo] : L, nc = start[lo + 1] - start[lo], j0 = n * (c - start[lo]) / nc;
    return (span_t){lo, it % nkv, j0, n * (c - start[lo] + 1) / nc - j0, nc};
}

/* One call, its arguments as 22 int64 values in a (one ctypes argument: 23 separate ones cost ~5 us per call):
 *   a = {G, nq, nkv, d, L, q, qs0, qs1, k, ks0, ks1, ks2, v, vs0, vs1, vs2, lens, out, os0, os1, bf16, index}
 * q [G][nq][d] (strides qs0, qs1), out [G][nq][d] (strides os0, os1). Without index (0): k and v [G][nkv][L][d]
 * (strides ks0, ks1, ks2 and vs0, vs1, vs2). With index, the address of int64 [G][L]: k and v are a paged cache,
 * position j of row g being its row index[g][j] (strides ks2/vs2 between rows, ks1/vs1 between heads; ks0/vs0
 * unused), read in place. Pointers as integers, strides in elements, every last dimension contiguous. lens: address
 * of int64 [G], row g attending to its first lens[g] positions (1 <= lens[g] <= L), or 0 for all L. bf16: 1 if q,
 * k, v and out are bf16, 0 if fp32. Returns 0, or -1 for a shape it does not take (d not a multiple of 16 or over
 * MAXD (of 32 for bf16), nq not a multiple of nkv, more than MAXREP query heads per KV head, a length out of
 * range), or -2 when out of memory. Histories longer than CH keys are split into equal chunks of at most CH, each
 * its own work item, merged afterwards (flash-decoding, Dao et al. 2023): one row's few KV heads then keep every
 * thread busy, and a row's result depends only on its own length, never on the batch around it. */
int loom_decode_attention(const int64_t* a, float scale) {
    const int64_t G = a[0], nq = a[1], nkv = a[2], d = a[3], L = a[4];
    const char *q = (const char*)a[5], *k = (const char*)a[8], *v = (const char*)a[12];
    const int64_t qs0 = a[6], qs1 = a[7], ks0 = a[9], ks1 = a[10], ks2 = a[11], vs0 = a[13], vs1 = a[14], vs2 = a[15];
    const int64_t* lens = (const int64_t*)a[16];
    char* out = (char*)a[17];
    const int64_t os0 = a[18], os1 = a[19];
    const int bf16 = (int)a[20];
    const int64_t* index = (const int64_t*)a[21];
    if (d % (bf16 ? 2 * VW : VW) || d > MAXD || nkv <= 0 || nq % nkv || nq / nkv > MAXREP || L < 1) return -1;
    for (int64_t g = 0; lens && g < G; g++)
        if (lens[g] < 1 || lens[g] > L) return -1;
    const int rep = (int)(nq / nkv);
    const int64_t esz = bf16 ? 2 : 4;
    const attend_fn fn = pick(d, rep, bf16);
    /* work items: (chunk of a row, KV head), a row of n keys in ceil(n / CH) equal chunks; start[g]: row g's first */
    int64_t start_local[65];
    int64_t* start = G < 65 ? start_local : (int64_t*)malloc(sizeof(int64_t) * (G + 1));
    if (!start) return -2;
    start[0] = 0;
    for (int64_t g = 0; g < G; g++) start[g + 1] = start[g] + ((lens ? lens[g] : L) + CH - 1) / CH;
    const int64_t items = start[G] * nkv, psz = rep * d + 2 * rep;
    float* part = 0;
    if (start[G] > G && !(part = scratch_for(items * psz))) {
        if (start != start_local) free(start);
        return -2;
    }
#ifdef _OPENMP
#pragma omp parallel if (items > 1)
#endif
    {
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t it = 0; it < items; it++) {
            const int next = it + 1 < items; /* b: the item this thread most likely takes next (prefetched) */
            const span_t a = span_of(it, nkv, start, G, lens, L);
            const span_t b = span_of(next ? it + 1 : it, nkv, start, G, lens, L);
            const int64_t ra = index ? 0 : a.g, rb = index ? 0 : b.g;
            fn(q + (a.g * qs0 + a.h * rep * qs1) * esz, qs1,
               k + (ra * ks0 + a.h * ks1 + (index ? 0 : a.j0 * ks2)) * esz, ks2,
               v + (ra * vs0 + a.h * vs1 + (index ? 0 : a.j0 * vs2)) * esz, vs2, index ? index + a.g * L + a.j0 : 0,
               a.cnt, scale, out + (a.g * os0 + a.h * rep * os1) * esz, os1, (int)d, rep, bf16,
               a.nc == 1 ? 0 : part + it * psz,
               next ? k + (rb * ks0 + b.h * ks1 + (index ? 0 : b.j0 * ks2)) * esz : 0,
               v + (rb * vs0 + b.h * vs1 + (index ? 0 : b.j0 * vs2)) * esz, index ? index + b.g * L + b.j0 : 0, b.cnt);
        }
        if (part) {
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
            for (int64_t gh = 0; gh < G * nkv; gh++) { /* merge a split row's chunks (flash-decoding's reduction) */
                const int64_t g = gh / nkv, h = gh % nkv, c0 = start[g], nc = start[g + 1] - c0;
                if (nc == 1) continue;
                for (int i = 0; i < rep; i++) {
                    v16 acc[MAXD / VW];
                    float mx = -INFINITY, sum = 0.f;
                    for (int64_t c = 0; c < nc; c++) {
                        const float m = part[((c0 + c) * nkv + h) * psz + rep * d + i];
                        mx = m > mx ? m : mx;
                    }
                    for (int cc = 0; cc < d / VW; cc++) acc[cc] = (v16){0};
                    for (int64_t c = 0; c < nc; c++) {
                        const float* pc = part + ((c0 + c) * nkv + h) * psz;
                        const float w = expf(pc[rep * d + i] - mx);
                        sum += w * pc[rep * d + rep + i];
                        for (int cc = 0; cc < d / VW; cc++) acc[cc] += w * ldf(pc + i * d + cc * VW);
                    }
                    store_head(out + (g * os0 + (h * rep + i) * os1) * esz, acc, 1.f / sum, (int)(d / VW), bf16);
                }
            }
        }
    }
    if (start != start_local) free(start);
    return 0;
}
