/* Helpers shared by Loom's C kernels: bf16 <-> fp32 scalars, 16-lane vectors (loads, stores, e^x), and AMX set-up (Sapphire Rapids
 * and later). */
#ifndef LOOM_CPU_H
#define LOOM_CPU_H
#include <math.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                           /* round to nearest even */
    return (uint16_t)(u >> 16);
}

/* A buffer of at least n bytes kept per thread across calls (OpenMP's threads persist): the B tiles of a 64-row
 * block are up to 400 KB, and a fresh malloc that large is an mmap with page faults on every call. */
static inline void* thread_buffer(void** buf, size_t* cap, size_t n) {
    if (*cap < n) {
        free(*buf);
        *buf = aligned_alloc(64, (n + 63) / 64 * 64);
        *cap = *buf ? n : 0;
    }
    return *buf;
}
#define VW 16 /* fp32 lanes per vector (GCC/Clang vector extensions: AVX-512 = one register, AVX2 = two) */

typedef float v16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

static inline v16 ldf(const float* p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline v16 ldh(const uint16_t* p) { /* 16 bf16 -> fp32 (a bf16 is the top half of an fp32) */
    u16x16 h;
    memcpy(&h, p, sizeof h);
    u32x16 w = __builtin_convertvector(h, u32x16) << 16;
    v16 f;
    memcpy(&f, &w, sizeof f);
    return f;
}

static inline void sth(uint16_t* p, v16 f) { /* 16 fp32 -> bf16, round to nearest even, NaN stays NaN */
    u32x16 u;
    memcpy(&u, &f, sizeof u);
    u32x16 r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    i32x16 nan = (i32x16)(u & 0x7fffffffu) > 0x7f800000; /* signed: AVX2 has no unsigned compare */
    r = (r & ~(u32x16)nan) | (((u >> 16) | 0x40u) & (u32x16)nan);
    u16x16 h = __builtin_convertvector(r, u16x16);
    memcpy(p, &h, sizeof h);
}

static inline float hsum(v16 v) {
    float s = 0.f;
    for (int i = 0; i < VW; i++) s += v[i];
    return s;
}

static inline v16 ldx(const void* p, int64_t off, int bf16) { /* 16 bf16 or fp32 values as fp32 */
    return bf16 ? ldh((const uint16_t*)p + off) : ldf((const float*)p + off);
}

static inline void stx(void* p, int64_t off, v16 v, int bf16) { /* 16 values stored as bf16 (rounded) or fp32 */
    if (bf16)
        sth((uint16_t*)p + off, v);
    else
        memcpy((float*)p + off, &v, sizeof v);
}

/* e^x per lane over the whole fp32 range: 0 below -87.3 (where e^x leaves the normal floats), inf above 88.7;
 * Cody-Waite reduction to r in [-ln2/2, ln2/2], a degree-7 Taylor polynomial (relative error < 1e-8 before
 * rounding), times 2^n: within an ulp or two of expf. With AVX2 but not AVX-512 the same steps run on two 8-lane
 * halves in intrinsics: GCC turns float comparisons of a 16-lane vector into scalar code on 256-bit registers. */
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
static inline __m256 vexp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f), hi = _mm256_set1_ps(88.7f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ), over = _mm256_cmp_ps(x, hi, _CMP_GT_OQ);
    x = _mm256_min_ps(hi, _mm256_max_ps(lo, x)); /* a NaN stays NaN (the second operand wins) */
    const __m256 big = _mm256_set1_ps(12582912.f);
    const __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), big), big);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
    __m256 p = _mm256_set1_ps(1.f / 5040.f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    return _mm256_blendv_ps(_mm256_andnot_ps(under, y), _mm256_set1_ps(INFINITY), over);
}

static inline v16 vexp(v16 x) {
    __m256 h[2];
    memcpy(h, &x, sizeof x);
    h[0] = vexp8(h[0]), h[1] = vexp8(h[1]);
    memcpy(&x, h, sizeof x);
    return x;
}

/* lane-wise max(a, b) (b where either is NaN) */
static inline v16 vmax(v16 a, v16 b) {
    __m256 x[2], y[2];
    memcpy(x, &a, sizeof a), memcpy(y, &b, sizeof b);
    x[0] = _mm256_max_ps(x[0], y[0]), x[1] = _mm256_max_ps(x[1], y[1]);
    memcpy(&a, x, sizeof a);
    return a;
}
#else
static inline v16 vexp(v16 x) {
    const v16 lo = (v16){0} - 87.3f, hi = (v16){0} + 88.7f;
    i32x16 under = x < lo, over = x > hi;
    x = (v16)(((i32x16)x & ~(under | over)) | ((i32x16)lo & under) | ((i32x16)hi & over));
    v16 n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
    v16 r = x - n * 0.693145751953125f;
    r = r - n * 1.428606765330187045e-06f;
    v16 p = (v16){0} + 1.f / 5040.f;
    p = p * r + 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    i32x16 e = (__builtin_convertvector(n, i32x16) + 127) << 23;
    v16 y = p * (v16)e;
    const v16 inf = (v16){0} + INFINITY;
    return (v16)((((i32x16)y & ~under) & ~over) | ((i32x16)inf & over));
}

/* lane-wise max(a, b) (b where either is NaN) */
static inline v16 vmax(v16 a, v16 b) { return (v16)(((i32x16)a & (a > b)) | ((i32x16)b & ~(a > b))); }
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tilecfg_t;

static int amx_state; /* 0: not asked yet, 1: granted, -1: refused */

/* Linux hands out AMX state only on request (arch_prctl); 1 if this process may use the tiles */
static inline int amx_enable(void) {
    if (amx_state == 0) amx_state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) ? -1 : 1;
    return amx_state == 1;
}

/* this thread's tiles 0..n-1 as full 16 rows x 64 bytes (palette 1) */
static inline void amx_config(int n) {
    tilecfg_t c;
    memset(&c, 0, sizeof c);
    c.palette_id = 1;
    for (int i = 0; i < n; i++) c.colsb[i] = 64, c.rows[i] = 16;
    _tile_loadconfig(&c);
}
#endif
#endif
