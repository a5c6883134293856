/* Helpers shared by Loom's C kernels: bf16 <-> fp32 scalars, and AMX set-up (Sapphire Rapids and later). */
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
