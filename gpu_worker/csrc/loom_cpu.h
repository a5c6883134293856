/* Helpers shared by Loom's C kernels: bf16 <-> fp32 scalars and 16-lane vectors, and AMX set-up (Sapphire Rapids
 * and later). */
#ifndef LOOM_CPU_H
#define LOOM_CPU_H
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
    i32x16 nan = (i32x16)((u & 0x7fffffffu) > 0x7f800000u);
    r = (r & ~(u32x16)nan) | (((u >> 16) | 0x40u) & (u32x16)nan);
    u16x16 h = __builtin_convertvector(r, u16x16);
    memcpy(p, &h, sizeof h);
}

static inline float hsum(v16 v) {
    float s = 0.f;
    for (int i = 0; i < VW; i++) s += v[i];
    return s;
}

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
