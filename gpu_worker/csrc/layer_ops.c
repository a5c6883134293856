/* A decoder layer's small operations fused for CPU tensors: residual add + RMSNorm, rotary embedding + KV-cache
 * write, SiLU(gate) * up.
 *
 * At one decode row these are ~85 us per layer through PyTorch on a 2-core CPU (RMSNorm alone is ~8 tensor ops,
 * ~21 us), a fifth of the step, for work that takes a few microseconds: the time is per-op dispatch. One C call
 * each does the same arithmetic in the same order of roundings as the PyTorch code in gpu_worker/model.py (HF
 * Llama's): in bf16 every intermediate PyTorch rounds to bf16 is rounded here too; sums of squares and the
 * transcendental functions may differ from PyTorch's by an fp32 ulp.
 * Plain C (GCC/Clang vector extensions), compiled on the serving machine with -march=native; OpenMP over rows
 * when a call has enough of them to pay for the threads (torch's libgomp, one pool).
 */
#include "loom_cpu.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#define PAR_MIN 32768 /* elements from which a call runs its rows on several threads */

/* each lane rounded to bf16 (round to nearest even, NaN stays NaN) and kept as fp32 */
static inline v16 bf16r(v16 f) {
    u32x16 u;
    memcpy(&u, &f, sizeof u);
    u32x16 r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    i32x16 nan = (i32x16)(u & 0x7fffffffu) > 0x7f800000; /* signed: AVX2 has no unsigned compare */
    r = (r & ~(u32x16)nan) | ((u | 0x400000u) & (u32x16)nan);
    memcpy(&f, &r, sizeof f);
    return f;
}

/* a = {rows, n, x, xs, delta, ds, w, h, hs, bf16}: for each row, x += delta (delta 0: no add; in bf16 the sum is
 * rounded to bf16), then h = w * bf16(x * rsqrt(mean(x^2) + eps)) (the normalised row rounded to the activation
 * dtype before the weight multiplies it, as HF Llama's RMSNorm). x, delta, h: [rows][n] at row strides xs, ds, hs
 * (elements); w [n]; all bf16 (bf16 = 1) or fp32. x is updated in place. Returns 0, or -1 if n % 16. */
int loom_add_rms_norm(const int64_t* a, float eps) {
    const int64_t rows = a[0], n = a[1], xs = a[3], ds = a[5], hs = a[8];
    char* x = (char*)a[2];
    const char *delta = (const char*)a[4], *w = (const char*)a[6];
    char* h = (char*)a[7];
    const int bf16 = (int)a[9];
    const int64_t esz = bf16 ? 2 : 4;
    if (n % VW) return -1;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (rows * n >= PAR_MIN)
#endif
    for (int64_t r = 0; r < rows; r++) {
        char* xr = x + r * xs * esz;
        const char* dr = delta ? delta + r * ds * esz : 0;
        char* hr = h + r * hs * esz;
        v16 s0 = (v16){0}, s1 = (v16){0};
        int64_t c = 0;
        for (; c < n; c += VW) {
            v16 t = ldx(xr, c, bf16);
            if (dr) {
                t += ldx(dr, c, bf16);
                if (bf16) t = bf16r(t);
                stx(xr, c, t, bf16);
            }
            if ((c / VW) & 1)
                s1 += t * t;
            else
                s0 += t * t;
        }
        const float inv = 1.f / sqrtf(hsum(s0 + s1) / (float)n + eps);
        for (c = 0; c < n; c += VW) {
            v16 y = ldx(xr, c, bf16) * inv;
            if (bf16) y = bf16r(y);
            stx(hr, c, y * ldx(w, c, bf16), bf16);
        }
    }
    return 0;
}

/* a = {T, nq, nkv, d, qkv, qs, cos, sin, kc, vc, slots, bf16}: rotary embedding of the q and k heads of each token's
 * fused qkv row (row stride qs elements; heads of d values: nq of q, nkv of k, nkv of v) in place:
 *     x[j] <- x[j] * cos[t][j] + x[(j + d/2) % d] * sin[t][j]
 * with sin signed (-sin on the first half: the HF rotate_half form), cos and sin [T][d] contiguous; in bf16 both
 * products and the sum are rounded to bf16 as PyTorch's bf16 ops do. Then, unless slots is 0, the token's k and
 * v heads are written to row slots[t] of the paged caches kc and vc ([slots][nkv][d] contiguous). Returns 0, or
 * -1 if d % 32 (the two halves must be whole vectors). */
int loom_rope_store(const int64_t* a) {
    const int64_t T = a[0], nq = a[1], nkv = a[2], d = a[3], qs = a[5];
    char* qkv = (char*)a[4];
    const char *cosp = (const char*)a[6], *sinp = (const char*)a[7];
    char *kc = (char*)a[8], *vc = (char*)a[9];
    const int64_t* slots = (const int64_t*)a[10];
    const int bf16 = (int)a[11];
    const int64_t esz = bf16 ? 2 : 4, half = d / 2;
    if (d % (2 * VW) || d > 512) return -1;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (T * (nq + 2 * nkv) * d >= PAR_MIN)
#endif
    for (int64_t t = 0; t < T; t++) {
        char* row = qkv + t * qs * esz;
        const char *ct = cosp + t * d * esz, *sn = sinp + t * d * esz;
        for (int64_t hd = 0; hd < nq + nkv; hd++) {
            char* x = row + hd * d * esz;
            v16 in[32];
            for (int64_t c = 0; c < d; c += VW) in[c / VW] = ldx(x, c, bf16);
            for (int64_t c = 0; c < d; c += VW) {
                v16 p = in[c / VW] * ldx(ct, c, bf16), q = in[((c + half) % d) / VW] * ldx(sn, c, bf16);
                if (bf16) p = bf16r(p), q = bf16r(q);
                stx(x, c, p + q, bf16);
            }
        }
        if (slots) {
            const int64_t kv_bytes = nkv * d * esz;
            memcpy(kc + slots[t] * kv_bytes, row + nq * d * esz, kv_bytes);
            memcpy(vc + slots[t] * kv_bytes, row + (nq + nkv) * d * esz, kv_bytes);
        }
    }
    return 0;
}

/* a = {rows, f, gu, gs, out, os, bf16}: out[r][j] = silu(gate[r][j]) * up[r][j], where gu's row r holds gate then
 * up (f values each, row stride gs) and silu(x) = x / (1 + e^-x); in bf16 silu is rounded to bf16 before the
 * product, as PyTorch's F.silu(gate) * up. Returns 0, or -1 if f % 16. */
int loom_silu_mul(const int64_t* a) {
    const int64_t rows = a[0], f = a[1], gs = a[3], os = a[5];
    const char* gu = (const char*)a[2];
    char* out = (char*)a[4];
    const int bf16 = (int)a[6];
    const int64_t esz = bf16 ? 2 : 4;
    if (f % VW) return -1;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (rows * f >= PAR_MIN)
#endif
    for (int64_t r = 0; r < rows; r++) {
        const char* g = gu + r * gs * esz;
        char* o = out + r * os * esz;
        for (int64_t c = 0; c < f; c += VW) {
            v16 x = ldx(g, c, bf16);
            v16 s = x / (1.f + vexp(-x));
            if (bf16) s = bf16r(s);
            stx(o, c, s * ldx(g, f + c, bf16), bf16);
        }
    }
    return 0;
}
